"""``kdagen regenerate`` end to end on the simulated GPU (nothing measured): a missing table is
tuned, checked and summarised; a fresh one is left alone byte for byte; a stale one is
re-tuned from the stored studies. And the workflow that runs it passes actionlint."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kdagen.doctor import SERVED, UNSERVED
from kdagen.regenerate import SUMMARY, regenerate
from kdagen.tune import TuneOptions

FINGERPRINT = "simulated-h200-sm90-132sm"
WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "regenerate.yml"


def options(tmp_path: Path) -> TuneOptions:
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text("workloads:\n  - {name: tiny, heads: 12, window: 1, batches: [1, 64]}\n")
    return TuneOptions(spaces=("commit.yaml",), workloads=workloads, exhaustive=True,
                       out=tmp_path / "gen", rounds=2, timeout_s=5.0, simulate={})  # fmt: skip


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_missing_then_fresh_then_stale(tmp_path: Path) -> None:
    opts = options(tmp_path)
    folder = tmp_path / "gen" / FINGERPRINT
    first = regenerate(opts, echo=lambda line: None)
    assert first.before.code == UNSERVED and first.before.missing
    assert first.tuned is not None and first.after is not None and first.after.code == SERVED
    assert first.checks and not first.failed
    summary = (folder / SUMMARY).read_text()
    assert f"# Regenerated dispatch table for {FINGERPRINT}" in summary
    assert "no dispatch table for this GPU" in summary and "exit 0: nothing to re-tune" in summary
    assert f"{len(first.checks)} winners, 0 failed" in summary

    before = snapshot(folder)
    again = regenerate(opts, echo=lambda line: None)
    assert again.before.code == SERVED and again.tuned is None
    assert snapshot(folder) == before  # left alone, byte for byte

    table = json.loads((folder / "dispatch.json").read_text())
    table["render_hashes"]["commit"] = "0" * 16
    (folder / "dispatch.json").write_text(json.dumps(table))
    stale = regenerate(opts, echo=lambda line: None)
    assert stale.before.code == UNSERVED and "commit" in stale.before.stale
    assert stale.after is not None and stale.after.code == SERVED
    assert json.loads((folder / "dispatch.json").read_text())["render_hashes"]["commit"] != "0" * 16


def test_refresh_re_times_only_the_leaders_after_a_kernel_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kdagen regenerate --refresh`` after an edit that changes every commit kernel: the table
    is served again, each study timed again only its leaders (fewer than its candidates)."""
    from kdagen import render as krender

    opts = options(tmp_path)
    folder = tmp_path / "gen" / FINGERPRINT
    regenerate(opts, echo=lambda line: None)
    original = krender.render
    monkeypatch.setattr(krender, "render", lambda v: original(v) + "EDITED = 1\n")
    opts.refresh = True
    done = regenerate(opts, echo=lambda line: None)
    assert done.before.code == UNSERVED and "commit" in done.before.stale
    assert done.after is not None and done.after.code == SERVED and not done.failed
    winners = json.loads((folder / "winners.json").read_text())
    assert winners and all(w.get("refreshed") and w["trials"] < w["candidates"] for w in winners)


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint not installed")
def test_the_workflow_passes_actionlint() -> None:
    done = subprocess.run(["actionlint", str(WORKFLOW)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

"""``kdagen doctor`` and the same-architecture table fallback, without a GPU: a temporary
generated/ holding the shipped H200 table, fingerprints given on the command line."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kdagen.cli import app
from kdagen.doctor import diagnose
from kdagen.serve import dispatch
from kdagen.serve.resources import data_dir
from kdagen.space import DEFAULT_SPACES

H200 = "nvidia-h200-sm90-132sm"
H100 = "nvidia-h100-80gb-hbm3-sm90-132sm"
runner = CliRunner()


@pytest.fixture
def generated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "generated"
    (root / H200).mkdir(parents=True)
    shutil.copy(data_dir("generated") / H200 / "dispatch.json", root / H200 / "dispatch.json")
    monkeypatch.setenv("KDAGEN_GENERATED", str(root))
    dispatch.reset()
    yield root
    dispatch.reset()


@pytest.fixture
def workloads(tmp_path: Path) -> Path:
    """Studies the shipped table holds: H12 Q8 at the four single-request buckets (verify, and
    commit in its general build and the one without prefix caching)."""
    path = tmp_path / "workloads.yaml"
    path.write_text("workloads:\n  - {name: k3, heads: 12, window: 8, slot_dtype: int32, conv: false, "
                    "batches: [1, 8, 64, 512]}\n")  # fmt: skip
    return path


def doctor(fingerprint: str, workloads: Path, *spaces: str) -> tuple[int, str]:
    args = ["doctor", "--fingerprint", fingerprint, "--workloads", str(workloads)]
    for space in spaces or ("commit.yaml", "verify_sm90.yaml"):
        args += ["--space", space]
    result = runner.invoke(app, args)
    return result.exit_code, result.output


def test_own_fresh_table_with_every_study_tuned_exits_0(generated: Path, workloads: Path) -> None:
    path = generated / H200 / "dispatch.json"
    data = json.loads(path.read_text())
    if data.pop("carried", None):  # a carried kernel asks for a re-tune (tests/test_carry.py)
        path.write_text(json.dumps(data))
    code, out = doctor(H200, workloads)
    assert code == 0, out
    assert f"{H200}: served by {generated / H200} (its own table" in out
    assert "12 studies of the workloads: 12 tuned, 0 fall back" in out


def test_the_shipped_workloads_over_every_shipped_space_need_only_the_wide_commits(
    generated: Path,
) -> None:
    """What `kdagen regenerate` decides on: a space added without workloads of its own (e.g.
    the tree commit, which serves conv trees only) must not turn the table incomplete. The
    commit after 16 tokens (commit_wide.yaml, shipped before its H200 tune) is what the H200
    table lacks: the 16-token workloads' 40 commit studies, and nothing else."""
    args = ["doctor", "--fingerprint", H200, "--workloads", "workloads.yaml"]
    for space in DEFAULT_SPACES:
        args += ["--space", space]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "40 fall back" in result.output, result.output
    assert "exit 1: served, but: 40 studies fall back (tune them)" in result.output
    assert "... and 20 more" in result.output  # the first 20 listed; --all lists every one
    listed = runner.invoke(app, [*args, "--all"]).output
    assert "more" not in listed and len(re.findall(r"\n    commit-\S+ b\d+: ", listed)) == 40
    found = diagnose(H200, "workloads.yaml", DEFAULT_SPACES, generated)
    assert len(found.fallbacks) == 40
    for key, _, why in found.fallbacks:
        assert re.fullmatch(r"commit-h\d+-q16-.*i32", key) and why.startswith("the built-in choice")


def test_untuned_buckets_and_keys_are_listed_and_exit_1(generated: Path, tmp_path: Path) -> None:
    path = tmp_path / "more.yaml"
    path.write_text("workloads:\n  - {name: odd, heads: 12, window: 3, slot_dtype: int32, conv: false, "
                    "batches: [1]}\n  - {name: k3, heads: 12, window: 8, slot_dtype: int32, conv: false, "
                    "batches: [100]}\n")  # fmt: skip
    code, out = doctor(H200, path)
    assert code == 1, out
    assert "verify-h12-q3-i32 b1: the per-GPU default for verify" in out
    assert "verify-h12-q8-i32 b100: nearest tuned bucket 64" in out


def test_a_winner_outside_the_tables_space_falls_back(generated: Path, workloads: Path) -> None:
    """The run-time replaces a winner its table's space does not hold (one warpgroup at 2
    CTAs an SM is not a point of verify_sm90.yaml) with the nearest point: not tuned."""
    path = generated / H200 / "dispatch.json"
    table = json.loads(path.read_text())
    outside = "verify-h12-q8-i32-sm90_wgmma-t128-r1-c264-s1-pdl"
    entry = next(e for e in table["entries"]["verify-h12-q8-i32"] if e["batch"] == 1)
    entry["variant"], entry["tuning"]["ctas"] = outside, 264
    path.write_text(json.dumps(table))
    code, out = doctor(H200, workloads)
    assert code == 1, out
    assert f"verify-h12-q8-i32 b1: a winner outside the table's space ({outside})" in out
    assert "12 studies of the workloads: 11 tuned, 1 fall back" in out


def test_same_architecture_gpu_borrows_the_table(generated: Path, workloads: Path) -> None:
    code, out = doctor(H100, workloads)
    assert code == 1, out
    assert f"{H100}: served by {generated / H200} (borrowed from {H200}" in out
    assert "exit 1: served, but: another GPU's table (`kdagen tune` on this GPU" in out
    assert dispatch.table_folder_for(H100) == (generated / H200, H200)
    # The run-time lookup does the same, with one warning naming the table.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KDAGEN_FINGERPRINT", H100)
            assert dispatch._table_folder(None) == generated / H200
            assert dispatch._table_folder(None) == generated / H200
    borrowed = [w for w in seen if "using nvidia-h200-sm90-132sm's" in str(w.message)]
    assert len(borrowed) == 1


def test_no_table_for_the_architecture_or_a_stale_one_exits_3(generated: Path,
                                                              workloads: Path) -> None:  # fmt: skip
    code, out = doctor("nvidia-b200-sm100-148sm", workloads, "verify_sm100.yaml")
    assert code == 3 and "no dispatch table for this GPU or its architecture" in out
    path = generated / H200 / "dispatch.json"
    table = json.loads(path.read_text())
    table["render_hashes"]["commit"] = "0" * 16
    path.write_text(json.dumps(table))
    code, out = doctor(H200, workloads)
    assert code == 3, out
    assert "commit: STALE, refused at run time: the commit kernels it measured changed" in out
    assert "exit 3: re-tune: `kdagen tune` (`--refresh`: each study whose kernels" in out


def test_doctor_without_a_gpu_or_fingerprint_says_what_to_pass() -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2 and "pass --fingerprint" in result.output

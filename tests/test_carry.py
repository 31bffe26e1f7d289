"""``kdagen carry``: a table whose measured kernels changed is refused until carried; carried,
it serves its choices with one warning, `doctor` reports it, and only a render change with
evidence, under the same DSL and with every measured variant still there, is carried. CPU
only: the change is simulated by the render hash the table recorded."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from tables import serve_tables_from
from typer.testing import CliRunner

from kdagen.carry import CarryError, carry
from kdagen.cli import app
from kdagen.doctor import FALLS_BACK, diagnose
from kdagen.serve import dispatch
from kdagen.serve.dispatch import StaleTableError, check_fresh, load_table
from kdagen.serve.resources import data_dir
from kdagen.serve.variant import Variant

H200 = "nvidia-h200-sm90-132sm"
OLD = "0" * 16  # the render hash of the kernels "before the change"
runner = CliRunner()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the shipped H200 table whose verify timings were "measured on another
    render": stale for verify, as after a change to its kernels."""
    root = tmp_path / "generated"
    (root / H200).mkdir(parents=True)
    data = json.loads((data_dir("generated") / H200 / "dispatch.json").read_text())
    data["render_hashes"]["verify"] = OLD
    data.pop("carried", None)  # whatever the shipped table carries: these tests carry anew
    (root / H200 / "dispatch.json").write_text(json.dumps(data))
    serve_tables_from(monkeypatch, root, H200)
    yield root / H200
    dispatch.reset()


@pytest.fixture
def evidence(tmp_path: Path) -> Path:
    path = tmp_path / "ab.txt"
    path.write_text("batch A us B us B/A\n1 3.07 3.10 1.010\n")
    return path


def verify_choice() -> Variant:
    contract = {"heads": 12, "window": 8, "slot_dtype": "int32"}
    base = Variant(kernel="verify", **contract)
    return dispatch.choose("verify", base.contract, 64, lambda: base)


def test_a_carried_table_serves_its_choices_with_one_warning(folder: Path, evidence: Path) -> None:
    with pytest.raises(StaleTableError, match="the verify kernels it measured changed"):
        verify_choice()
    table = carry(folder, "verify", "the rows cut to their tensors", evidence)
    assert table.carried["verify"] == {
        "from_render_hash": OLD, "reason": "the rows cut to their tensors",
        "evidence": evidence.as_posix()}  # fmt: skip
    reread = load_table(folder)
    assert reread is not None and reread.carried == table.carried
    check_fresh(reread, "verify", str(folder))  # fresh against this checkout's renders
    dispatch.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = verify_choice()
        verify_choice()
    [entry] = [e for e in reread.entries["verify-h12-q8-i32"] if e.batch == 64]
    assert chosen.name == entry.variant  # the table's choice, not the heuristic
    said = [str(w.message) for w in caught if "measured before" in str(w.message)]
    assert said == [
        "kdagen dispatch: verify: the table's timings were measured before the rows cut to "
        "their tensors; its choices stand until this GPU is re-tuned"
    ]


def test_doctor_reports_a_carried_kernel_and_asks_for_a_re_tune(
    folder: Path, evidence: Path
) -> None:
    assert diagnose(H200, root=folder.parent).stale  # before: refused
    carry(folder, "verify", "the rows cut to their tensors", evidence)
    found = diagnose(H200, root=folder.parent)
    found.fallbacks.clear()  # the commit after 16 tokens' studies: not what is tested here
    assert not found.stale and found.code == FALLS_BACK
    assert any(line == f"  verify: carried: timings measured before the rows cut to their "
               f"tensors (its cost: {evidence.as_posix()}); re-tune to re-time"
               for line in found.lines())  # fmt: skip
    assert found.lines()[-1] == "exit 1: served, but: verify carried (a re-tune re-times it)"


def test_a_second_carry_keeps_the_render_the_timings_were_measured_on(
    folder: Path, evidence: Path
) -> None:
    carry(folder, "verify", "fix one", evidence)
    data = json.loads((folder / "dispatch.json").read_text())
    data["render_hashes"]["verify"] = "1" * 16  # another change since
    (folder / "dispatch.json").write_text(json.dumps(data))
    table = carry(folder, "verify", "fix two", evidence)
    assert table.carried["verify"]["from_render_hash"] == OLD
    assert table.carried["verify"]["reason"] == "fix one; fix two"


def test_only_a_render_change_with_evidence_is_carried(
    folder: Path, evidence: Path, tmp_path: Path
) -> None:
    with pytest.raises(CarryError, match="no such file"):
        carry(folder, "verify", "a fix", tmp_path / "missing.txt")
    with pytest.raises(CarryError, match="--reason is empty"):
        carry(folder, "verify", "  ", evidence)
    with pytest.raises(CarryError, match="render as they did: fresh"):
        carry(folder, "commit", "a fix", evidence)  # its kernels did not change
    with pytest.raises(CarryError, match="has no sm100 entries"):
        carry(folder, "sm100", "a fix", evidence)
    data = json.loads((folder / "dispatch.json").read_text())
    dsl = dict(data, dsl_version="0.0.0")
    (folder / "dispatch.json").write_text(json.dumps(dsl))
    with pytest.raises(CarryError, match="another compiler is a re-tune"):
        carry(folder, "verify", "a fix", evidence)
    gone = dict(data, measured={**data["measured"], "verify": ["verify-h12-q8-i32-nonsense"]})
    (folder / "dispatch.json").write_text(json.dumps(gone))
    with pytest.raises(CarryError, match="a measured verify variant no longer exists"):
        carry(folder, "verify", "a fix", evidence)
    assert load_table(folder).carried == {}  # nothing written by a refusal


def test_the_cli_carries_and_names_what_it_refuses(folder: Path, evidence: Path) -> None:
    args = ["carry", "--kernel", "verify", "--reason", "a fix", "--evidence", str(evidence)]
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.output
    assert f"verify carried from render {OLD}" in done.output
    again = runner.invoke(app, [*args[:-1], str(evidence.parent / "none.txt")])
    assert again.exit_code == 2 and "no such file" in again.output

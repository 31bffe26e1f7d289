"""Search-space expansion, constraints and workloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen.space import Space, SpaceError, load_workloads


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_shipped_commit_space_expands_with_its_constraint() -> None:
    expansion = Space.load("commit.yaml").expand()
    # 6 head counts x 4 windows x 2 slot dtypes x 2 gates x 2 builds x 12 tuning points x 2
    # update path counts; each gate keeps its model's head counts (3 of 6 for kda, 4 for
    # softplus), 11 of 12 tuning points fit, the build without prefix caching ships at int32
    # slots only, and 8 update paths only there at Q = 8.
    assert expansion.points == 4608
    kept = (3 + 4) * 4 * 2 * 11 + (3 + 4) * 4 * 11 + (3 + 4) * 11
    assert len(expansion.variants) == kept == 1001
    assert sum(expansion.removed.values()) == 4608 - kept
    counted = {(v.window, v.prefix_caching) for v in expansion.variants if v.fold_paths == 8}
    assert counted == {(8, False)}
    lean = {(v.gate, v.slot_dtype) for v in expansion.variants if not v.prefix_caching}
    assert lean == {("kda", "int32"), ("softplus", "int32")}
    by_gate = {g: {v.heads for v in expansion.variants if v.gate == g} for g in ("kda", "softplus")}
    assert by_gate == {"kda": {12, 32, 96}, "softplus": {4, 8, 16, 32}}
    assert all(v.kernel == "commit" for v in expansion.variants)
    assert len({v.name for v in expansion.variants}) == len(expansion.variants)


def test_constraints_and_invalid_points_are_counted_separately(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
kernel: commit
contract: {heads: [4], window: [2]}
tuning: {threads: [128, 512], vec: [4, 8], row_split: [8]}
constraints:
  - {name: 16-byte accesses only, expr: vec == 8}
""",
    )
    expansion = Space.load(path).expand()
    names = [v.name for v in expansion.variants]
    assert names == ["commit-h4-q2-i32-bulk-t128-v8-r8-pdl"]
    assert expansion.removed["16-byte accesses only"] == 2
    invalid = [k for k in expansion.removed if k.startswith("invalid:")]
    assert len(invalid) == 1 and "row_split=8" in invalid[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kernel: decode\n", "'kernel' must be"),
        ("kernel: commit\ntuning: {warps: [4]}\n", "tuning.warps is not a tuning field"),
        ("kernel: commit\ncontract: {threads: [4]}\n", "contract.threads is not a contract field"),
        ("kernel: commit\nconstraints: ['thread < 4']\n", "unknown name(s) ['thread']"),
        ("kernel: commit\nconstraints: ['threads <']\n", "is not an expression"),
        ("kernel: commit\nextra: 1\n", "unknown top-level key"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_bad_space_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SpaceError) as err:
        Space.load(_write(tmp_path, text))
    assert message in str(err.value)


def test_missing_space_file() -> None:
    with pytest.raises(SpaceError, match="space file no-such-space.yaml not found") as err:
        Space.load("no-such-space.yaml")
    assert "commit_ring.yaml" in str(err.value) and "workloads.yaml" not in str(err.value)
    with pytest.raises(SpaceError, match="workloads file nope not found.*: workloads.yaml"):
        load_workloads("nope")


def test_a_shipped_space_or_workloads_file_may_be_named_without_yaml() -> None:
    assert Space.load("commit_ring").expand().variants == (
        Space.load("commit_ring.yaml").expand().variants)  # fmt: skip
    assert load_workloads("workloads_quick") == load_workloads("workloads_quick.yaml")


def test_shipped_workloads_cover_the_tuning_targets() -> None:
    workloads = load_workloads()
    heads = {w.contract["heads"] for w in workloads}
    windows = {w.contract["window"] for w in workloads}
    assert {12, 32, 96} <= heads and {1, 2, 4, 8} <= windows
    assert any(w.contract.get("conv") for w in workloads)
    assert all(min(w.batches) >= 1 for w in workloads)


def test_bad_workload_entry(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("workloads:\n  - {name: x, heads: 12, colour: red, batches: [1]}\n")
    with pytest.raises(SpaceError, match="unknown contract field"):
        load_workloads(path)

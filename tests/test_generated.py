"""The committed dispatch tables in generated/: fresh against the kernels and DSL of this
checkout (a stale table is refused at run time, so a change to a kernel it measured must
come with a re-tune), and covering every shipped workload's contract keys at every batch bucket, with
winners that are variants of the shipped spaces. CPU only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdagen.serve.dispatch import check_fresh, load_table
from kdagen.space import Space
from kdagen.tune import plan_studies, space_points

GENERATED = Path(__file__).resolve().parents[1] / "generated"
TABLES = sorted(p.parent for p in GENERATED.glob("*/dispatch.json"))
SPACES = {
    "commit": "commit.yaml",
    "commit_ring": "commit_ring.yaml",
    "verify": "verify_sm90.yaml",
    "tree": "verify_tree_sm90.yaml",
    "wide": "verify_wide_sm90.yaml",
}


def test_the_h200_table_is_committed() -> None:
    assert GENERATED / "nvidia-h200-sm90-132sm" in TABLES


@pytest.mark.parametrize("folder", TABLES, ids=[p.name for p in TABLES])
def test_table_is_fresh_for_this_checkout(folder: Path) -> None:
    """What the run-time checks: the kernels each table measured render as they did."""
    table = load_table(folder)
    assert table is not None
    for kernel in sorted(table.kernels()):
        assert table.render_hashes.get(kernel), f"{folder.name}: no render hash for {kernel}"
        check_fresh(table, kernel, folder.name)  # raises StaleTableError, naming the change


@pytest.mark.parametrize("folder", TABLES, ids=[p.name for p in TABLES])
def test_table_covers_the_shipped_workloads_with_shipped_variants(folder: Path) -> None:
    table = load_table(folder)
    assert table is not None
    shipped = {v.name for s in SPACES.values() for v in Space.load(s).expand().variants}
    plans, _ = plan_studies(list(SPACES.values()), "workloads.yaml", "sm_90a")
    assert plans
    for plan in plans:
        rows = {e.batch: e for e in table.entries.get(plan.key, [])}
        assert set(plan.batches) <= set(rows), (plan.key, sorted(rows))
        for entry in rows.values():
            chosen = plan.candidates[0].replace(**entry.tuning)
            assert chosen.name in shipped, (plan.key, entry.batch, chosen.name)
            assert chosen.name == entry.variant


@pytest.mark.parametrize("folder", TABLES, ids=[p.name for p in TABLES])
def test_table_records_the_shipped_space_its_lookup_stays_in(folder: Path) -> None:
    """The run-time keeps every choice inside ``table.space``, which must be the shipped
    spaces (what `kdagen check` verifies): a space edit needs a re-tune, like a kernel edit."""
    table = load_table(folder)
    assert table is not None
    arch = str(table.device.get("arch"))
    assert table.space == space_points(list(SPACES.values()), arch)


def test_the_h200_table_sends_commits_without_block_tables_to_the_lean_build_it_tuned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ModelCommit`` on the H200 with the shipped table: a commit without block tables takes
    the build without prefix caching where the table tuned its key (Kimi-K3 at int32 slots),
    the general build elsewhere (Kimi-Linear's gate, int64 slots) and with block tables."""
    from kdagen.serve import dispatch
    from kdagen.serve.model_commit import ModelCommit

    def model(heads: int, lower_bound: float | None) -> ModelCommit:
        return ModelCommit(
            [torch.zeros(2, heads, 128, 128, dtype=torch.bfloat16)],
            [torch.zeros(2, heads, 8, 128)], [torch.zeros(2, heads, 8, 256, dtype=torch.bfloat16)],
            [torch.zeros(heads)], [torch.zeros(heads * 128)], lower_bound=lower_bound,
            require_cuda=False,
        )  # fmt: skip

    monkeypatch.setenv("KDAGEN_FINGERPRINT", "nvidia-h200-sm90-132sm")
    dispatch.reset()
    try:
        table = load_table(GENERATED / "nvidia-h200-sm90-132sm")
        assert table is not None
        batch = 4096  # one layer here: the bucket of Kimi-K3's 69 layers at B = 59
        k3 = model(12, -5.0)
        lean = k3.variant_for(batch)
        assert not lean.prefix_caching
        rows = {e.batch: e.variant for e in table.entries["commit-h12-q8-noprefix-i32"]}
        assert lean.name == rows[batch]
        assert k3.variant_for(batch, block_tables=True).prefix_caching
        assert k3.variant_for(64, torch.int64).prefix_caching
        kimi_linear = model(32, None).variant_for(batch)  # the softplus gate's lean key, tuned
        assert not kimi_linear.prefix_caching and kimi_linear.gate == "softplus"
    finally:
        dispatch.reset()

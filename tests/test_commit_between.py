"""The commit between the shipped windows (search_spaces/commit_between.yaml: 3, 5, 6, 7 and 9
to 15 tokens, chains and the tree commit): its space against the shipped commit spaces' keys
and the built-in choice, and GPU-less compiles of its heaviest variants for both archs
without a stack frame."""

from __future__ import annotations

from pathlib import Path

import pytest
from frames import compile_without_frame

from kdagen.serve.runtime import default_commit_variant
from kdagen.serve.variant import Variant
from kdagen.space import DEFAULT_SPACES, Space

WINDOWS = (3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15)
# The most registers on sm_90a (160: the softplus gate at Q 15, t128 r2), a tree commit, the
# build without prefix caching, int64 slots.
SAMPLE = (
    "commit-h32-q15-softplus-i32-bulk-t128-v4-r2-pdl",
    "commit-h32-q15-softplus-tree-i64-bulk-t128-v4-r2-pdl",
    "commit-h12-q3-noprefix-i32-bulk-t128-v4-r4-pdl",
    "commit-h4-q9-softplus-i64-bulk-t256-v4-r1-pdl",
)


def _keys(space: str, window: int) -> set[str]:
    return {v.contract_key for v in Space.load(space).expand().variants if v.window == window}


def test_space_holds_the_shipped_commit_keys_between_their_windows() -> None:
    between = Space.load("commit_between.yaml").expand().variants
    assert "commit_between.yaml" in DEFAULT_SPACES  # shipped: every variant passed `kdagen check`
    assert {v.window for v in between} == set(WINDOWS) and {v.fold_paths for v in between} == {1}
    at4 = _keys("commit.yaml", 4) | _keys("commit_tree.yaml", 4)
    keys = {v.contract_key for v in between}
    assert keys == {k.replace("-q4-", f"-q{q}-") for k in at4 for q in WINDOWS}
    assert all(Variant.parse(v.name) == v for v in between)


def test_its_points_are_the_built_in_choices_at_every_batch() -> None:
    """Untuned, these keys run only the run-time's built-in choice, so the space holds exactly
    the choices it makes over every batch."""
    between = Space.load("commit_between.yaml").expand().variants
    chosen = {
        default_commit_variant(
            v.heads, v.window, v.slot_dtype, batch, v.gate, v.tree, v.prefix_caching
        ).name  # fmt: skip
        for v in between
        for batch in (*range(1, 129), 512, 4096)  # its thresholds: batch x heads 128, 384
    }
    assert chosen == {v.name for v in between}


@pytest.mark.parametrize("name", SAMPLE)
def test_compiles_for_both_archs_without_a_frame(name: str, cache: Path) -> None:
    for record in compile_without_frame(Variant.parse(name), cache):
        assert record.registers is not None and record.registers <= 255

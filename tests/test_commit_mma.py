"""The commit that folds on the tensor cores (path bulk_mma): its space, its variant rules and
GPU-less compiles for both archs (what sm_90a executes: one MMA pair per 8-column tile and token
step, 16-byte shared loads and global stores, no local memory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from frames import sm90_sass_without_frame

from kdagen.serve.variant import Variant, VariantError
from kdagen.space import DEFAULT_SPACES, Space

# Every tuning point, both builds, both gates, every window (16: a tree's), both slot dtypes.
SAMPLE = (
    "commit-h12-q8-noprefix-i32-bulk_mma-t128-r1-pdl",
    "commit-h12-q8-noprefix-i32-bulk_mma-t256-r4-pdl",
    "commit-h12-q8-i32-bulk_mma-t256-r1-pdl",
    "commit-h32-q1-softplus-i64-bulk_mma-t128-r2-pdl",
    "commit-h96-q4-i64-bulk_mma-t256-r2-pdl",
    "commit-h4-q2-softplus-noprefix-i32-bulk_mma-t128-r4-pdl",
    "commit-h12-q16-tree-i32-bulk_mma-t256-r1-pdl",
)


def test_space_holds_every_commit_key_at_each_tuning_point() -> None:
    mma = Space.load("commit_mma.yaml").expand().variants
    assert "commit_mma.yaml" not in DEFAULT_SPACES  # not shipped before the H200 has timed it
    shipped = {v.contract_key for v in Space.load("commit.yaml").expand().variants}
    assert {v.contract_key for v in mma} == shipped
    assert len(mma) == 6 * len(shipped) and all(v.path == "bulk_mma" for v in mma)
    assert all(Variant.parse(v.name) == v for v in mma)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"threads": 512}, "threads=512"), ({"vec": 4}, "vec=4"), ({"fold_paths": 8}, "fold_paths=8"),
     ({"threads": 256, "row_split": 8}, "row_split=8")],
)  # fmt: skip
def test_rules_name_the_field(fields: dict, named: str) -> None:
    with pytest.raises(VariantError, match=named):
        Variant(kernel="commit", heads=12, window=8, path="bulk_mma", **fields)


@pytest.mark.parametrize("name", SAMPLE)
def test_compiles_for_both_archs_without_a_frame(name: str, cache: Path) -> None:
    variant = Variant.parse(name)
    sass = sm90_sass_without_frame(variant, cache)
    warps = variant.threads // 32
    tiles_per_warp = 128 // variant.row_split // 16 // (warps // 4)
    token_steps = (variant.window + 7) // 8
    # hi and lo factors, 4 column tiles, every row tile of the warp (boundary fold: twice)
    folds = 2 if variant.prefix_caching else 1
    mmas = len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass))
    assert mmas == folds * tiles_per_warp * 4 * 2 * token_steps
    stores = len(re.findall(r"\bSTG\.E\.128\b", sass))
    assert stores >= folds * tiles_per_warp * 2
    assert re.search(r"\bLDS\.128\b", sass) and not re.search(r"\b(LDL|STL)\b", sass)

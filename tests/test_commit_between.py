"""The commit between commit.yaml's windows (search_spaces/commit_between.yaml: 3, 5, 6 and 7
tokens): its space against commit.yaml's keys, and GPU-less compiles of its heaviest variants
for both archs without a stack frame."""

from __future__ import annotations

from pathlib import Path

import pytest
from frames import compile_without_frame

from kdagen.serve.runtime import default_commit_variant
from kdagen.serve.variant import Variant
from kdagen.space import DEFAULT_SPACES, Space

WINDOWS = (3, 5, 6, 7)
# The most registers on sm_90a (134, int64 slots at 8 bf16 a thread and one CTA a head, Q 7),
# and the other builds and gates at other tuning points.
SAMPLE = (
    "commit-h32-q7-i64-bulk-t128-v8-r1-pdl",
    "commit-h12-q3-noprefix-i32-bulk-t128-v4-r4-pdl",
    "commit-h16-q5-softplus-noprefix-i32-bulk-t256-v8-r2-pdl",
    "commit-h4-q6-softplus-i64-bulk-t256-v4-r1-pdl",
)


def test_space_holds_commit_yaml_keys_between_its_windows() -> None:
    between = Space.load("commit_between.yaml").expand().variants
    assert "commit_between.yaml" not in DEFAULT_SPACES  # shipped once a GPU has checked it
    assert {v.window for v in between} == set(WINDOWS) and {v.fold_paths for v in between} == {1}
    at4 = {v.contract_key for v in Space.load("commit.yaml").expand().variants if v.window == 4}
    keys = {v.contract_key for v in between}
    assert keys == {k.replace("-q4-", f"-q{q}-") for k in at4 for q in WINDOWS}
    assert all(Variant.parse(v.name) == v for v in between)


def test_the_built_in_choice_is_a_point_of_the_space() -> None:
    """Untuned, these keys run the run-time's built-in choice at every batch (as the commit
    after 16 tokens does), so each choice must be one of the points a check covers."""
    names = {v.name for v in Space.load("commit_between.yaml").expand().variants}
    for variant in Space.load("commit_between.yaml").expand().variants:
        for batch in (1, 8, 20, 64, 512, 4096):
            chosen = default_commit_variant(variant.heads, variant.window, variant.slot_dtype,
                                            batch, variant.gate, False, variant.prefix_caching)  # fmt: skip
            assert chosen.name in names, chosen.name


@pytest.mark.parametrize("name", SAMPLE)
def test_compiles_for_both_archs_without_a_frame(name: str, cache: Path) -> None:
    for record in compile_without_frame(Variant.parse(name), cache):
        assert record.registers is not None and record.registers <= 255

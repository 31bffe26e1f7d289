"""The commit past 8 tokens (search_spaces/commit_wide.yaml): its space against commit.yaml's
keys, and GPU-less compiles of its heaviest variants for both archs without a stack frame."""

from __future__ import annotations

from pathlib import Path

import pytest
from frames import compile_without_frame

from kdagen.serve.variant import Variant
from kdagen.space import DEFAULT_SPACES, Space

# The most registers on sm_90a (255, H 32 int64 at 8 bf16 a thread and one CTA a head), and the
# other builds and gates at other tuning points.
SAMPLE = (
    "commit-h32-q16-i64-bulk-t128-v8-r1-pdl",
    "commit-h12-q16-noprefix-i32-bulk-t128-v4-r4-pdl",
    "commit-h16-q16-softplus-noprefix-i32-bulk-t256-v8-r2-pdl",
)


def test_space_holds_commit_yaml_keys_at_16_tokens() -> None:
    wide = Space.load("commit_wide.yaml").expand().variants
    assert "commit_wide.yaml" in DEFAULT_SPACES  # checked; its keys untuned (built-in choice)
    assert {v.window for v in wide} == {16} and {v.fold_paths for v in wide} == {1}
    at8 = {v.contract_key.replace("-q8-", "-q16-") for v in Space.load("commit.yaml").expand().variants
           if v.window == 8}  # fmt: skip
    assert {v.contract_key for v in wide} == at8
    assert all(Variant.parse(v.name) == v for v in wide)


@pytest.mark.parametrize("name", SAMPLE)
def test_compiles_for_both_archs_without_a_frame(name: str, cache: Path) -> None:
    for record in compile_without_frame(Variant.parse(name), cache):
        assert record.registers is not None and record.registers <= 255

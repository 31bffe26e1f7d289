"""The commit that stages its state rows through a ring (path bulk_ring): its space, its
variant rules and GPU-less compiles for both archs; the point of the path, a whole head per
128-thread CTA at 7 CTAs an SM (a Kimi-K3 step at batch 1 in one wave), checked from the
compiled registers and shared memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from frames import resident_ctas, sm90_sass_without_frame

from kdagen import compile as kcompile
from kdagen.serve.variant import Variant, VariantError
from kdagen.space import DEFAULT_SPACES, Space


def test_space_is_the_model_step_build_of_every_model_key() -> None:
    ring = Space.load("commit_ring.yaml").expand().variants
    assert "commit_ring.yaml" in DEFAULT_SPACES
    shipped = {
        v.contract_key
        for v in Space.load("commit.yaml").expand().variants
        if v.window == 8 and not v.prefix_caching
    }
    assert {v.contract_key for v in ring} == shipped
    assert all(v.path == "bulk_ring" and Variant.parse(v.name) == v for v in ring)
    assert "commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl" in {v.name for v in ring}


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"prefix_caching": True}, "prefix_caching=True"),
     ({"threads": 256, "vec": 8, "row_split": 4}, "needs at least 4")],
)  # fmt: skip
def test_rules_name_the_field(fields: dict, named: str) -> None:
    base = {"prefix_caching": False} | fields
    with pytest.raises(VariantError, match=named):
        Variant(kernel="commit", heads=12, window=8, path="bulk_ring", **base)


@pytest.mark.parametrize(
    "name",
    [
        "commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl",
        "commit-h32-q8-softplus-noprefix-i32-bulk_ring-t256-v8-r2-pdl",
    ],
)
def test_compiles_for_both_archs_without_a_frame(name: str, cache: Path) -> None:
    variant = Variant.parse(name)
    sass = sm90_sass_without_frame(variant, cache)
    # Half the pieces at the start, the rest as the ring frees their buffers; corr and kg rows.
    assert len(re.findall(r"\bUBLKCP\b", sass)) >= 4, "bulk copies"
    assert not re.search(r"\b(LDL|STL)\b", sass)


def test_a_whole_head_fits_seven_ctas_an_sm(cache: Path) -> None:
    """At H 12, Q 8 the ring's 128-thread, whole-head commit holds half its rows in shared
    memory, so 7 CTAs share an SM (828 CTAs of a 69-layer step at batch 1 in one wave of
    924); the bulk path's best batch-1 point holds 4."""
    ring = Variant.parse("commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl")
    bulk = Variant.parse("commit-h12-q8-noprefix-i32-bulk-t256-v4-r1-f8-pdl")

    def resident(variant: Variant) -> int:
        record = kcompile.compile_variant(variant, "sm_90a", cache)
        assert record.ok, record.error
        return resident_ctas(record, variant.threads)

    assert resident(ring) >= 7
    assert resident(bulk) == 4

"""The covering CI compiles (kdagen/coverage.py): every value pair of branching fields that
occurs among a (kernel, path) group's variants is in it, and every value of a constant field;
no template branch reads a constant field; with the branches past pairs it reaches every line
shape of the shipped renders; it is far smaller than the shipped spaces, does not depend on the
input order, and stays small when the spaces grow."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from dataclasses import fields

import pytest

from kdagen.coverage import CONSTANT_FIELDS, line_shapes, pairwise_cover
from kdagen.render import render, template_flags
from kdagen.serve.variant import CONTRACT_FIELDS, Variant
from kdagen.space import default_variants

SHIPPED = default_variants()


def _groups(variants: list[Variant]) -> dict[tuple[str, str], list[Variant]]:
    out: dict[tuple[str, str], list[Variant]] = defaultdict(list)
    for v in variants:
        out[(v.kernel, v.path)].append(v)
    return out


def _pairs(group: list[Variant], a: str, b: str) -> set[tuple]:
    return {(getattr(v, a), getattr(v, b)) for v in group}


def _read_fields(group: list[Variant]) -> list[str]:
    """The fields the group's template reads, in the dataclass's field order."""
    read = set(CONTRACT_FIELDS) | set(group[0].spec.tuning)
    return [f.name for f in fields(Variant) if f.name in read]


def _field_pairs(group: list[Variant]) -> list[tuple[str, str]]:
    """Pairs of the branching fields the group's template reads."""
    names = [name for name in _read_fields(group) if name not in CONSTANT_FIELDS]
    return list(itertools.combinations(names, 2))


def _assert_pairwise(variants: list[Variant], cover: list[Variant]) -> None:
    chosen = _groups(cover)
    for key, group in _groups(variants).items():
        for a, b in _field_pairs(group):
            missing = _pairs(group, a, b) - _pairs(chosen[key], a, b)
            assert not missing, (key, a, b, sorted(missing, key=repr)[:3])
        for name in set(_read_fields(group)) & CONSTANT_FIELDS:
            missing = _pairs(group, name, name) - _pairs(chosen[key], name, name)
            assert not missing, (key, name, sorted(missing)[:3])


def _lower_bound(group: list[Variant]) -> int:
    """Each variant holds one value pair of two given fields and one value of a constant
    field: a covering needs at least as many variants as the most varied field pair has pairs,
    or a constant field values."""
    constants = set(_read_fields(group)) & CONSTANT_FIELDS
    return max([len(_pairs(group, a, b)) for a, b in _field_pairs(group)]
               + [len(_pairs(group, name, name)) for name in constants])  # fmt: skip


def _builds(variants: list[Variant]) -> int:
    return sum(len(v.spec.archs) for v in variants)


def test_the_shipped_covering_holds_every_pair_and_is_small() -> None:
    cover = pairwise_cover(SHIPPED)
    print(f"\nshipped: {len(SHIPPED)} variants, {_builds(SHIPPED)} builds; "
          f"covering: {len(cover)} variants, {_builds(cover)} builds")  # fmt: skip
    _assert_pairwise(SHIPPED, cover)
    assert set(cover) <= set(SHIPPED) and len(cover) == len(set(cover))
    assert _builds(cover) * 10 < _builds(SHIPPED)


def test_no_template_branch_reads_the_head_count() -> None:
    """Each covered variant rendered again with 7 heads (a count no space ships, so that no
    branch can single it out) differs from its own render only in the constant's line, once
    the name and the docstring's contract are read back: which is why a constant field
    (kdagen.coverage.CONSTANT_FIELDS) needs each value compiled once, not in pairs."""
    assert {"heads"} == CONSTANT_FIELDS
    for variant in pairwise_cover(SHIPPED):
        sibling = variant.replace(heads=7)
        text = render(sibling).replace(sibling.name, variant.name)
        text = text.replace("heads=7,", f"heads={variant.heads},")
        lines = set(render(variant).splitlines()) ^ set(text.splitlines())
        assert lines == {f"H = {variant.heads}  # heads", "H = 7  # heads"}, variant.name


def test_the_compiled_covering_reaches_every_line_shape_of_the_renders(covered) -> None:
    """CI's covering (tests/conftest.py) holds every line a shipped render holds, numbers
    aside: the pairs and the branches past them. Among those, the Hopper conv trees of 2-4
    tokens' convolution over root paths, whose condition spans three fields."""
    reached = set().union(*map(line_shapes, covered))
    shipped: set[str] = set().union(*map(line_shapes, SHIPPED))
    assert shipped <= reached, sorted(shipped - reached)[:5]
    assert any("conv_silu_tree(hist, raw, taps, links, lean=False)" in shape for shape in reached)


def test_the_covering_pairs_the_template_flags() -> None:
    """Every pair of template flags that a shipped variant sets is set by a covered one: the
    device helpers' branches on derived switches, which no render line shows (found by
    tracing the helpers' lines through the compiles: the conv trees' lags from records with
    bf16 taps, the staged lags with fp32 taps)."""

    def flag_pairs(variants: list[Variant]) -> set[tuple]:
        return {pair for v in variants
                for pair in itertools.combinations(sorted(template_flags(v).items()), 2)}  # fmt: skip

    cover = pairwise_cover(SHIPPED)
    missing = flag_pairs(SHIPPED) - flag_pairs(cover)
    assert not missing, sorted(missing)[:3]
    reached = flag_pairs(cover)
    assert (("conv_f32", False), ("record_conv", True)) in reached
    assert (("conv_f32", True), ("staged_conv", True)) in reached


def test_line_shapes_leave_out_numbers_and_the_docstring_names() -> None:
    variant = Variant(kernel="commit", heads=12, window=8, threads=128, vec=8, row_split=1)
    shapes = line_shapes(variant)
    assert "H = #  # heads" in shapes
    assert not [s for s in shapes if "commit-h" in s or s.startswith("Contract:")]
    assert shapes == line_shapes(variant.replace(heads=96))


def test_the_covering_is_near_its_lower_bound_per_path() -> None:
    """Greedy stays within 1.5x of the fields' bound on the shipped spaces (measured: commit
    50 / 48 and 6 / 6, verify 45 / 32 and 38 / 32: the template flags' pairs and the spaces'
    constraints take the rest): the covering grows with the two largest value lists of
    branching fields, not their product."""
    chosen = _groups(pairwise_cover(SHIPPED))
    for key, group in _groups(SHIPPED).items():
        assert len(chosen[key]) <= 1.5 * _lower_bound(group), key


def test_the_covering_does_not_depend_on_the_input_order() -> None:
    shuffled = list(SHIPPED)
    random.Random(7).shuffle(shuffled)
    cover = pairwise_cover(SHIPPED)
    assert pairwise_cover(shuffled) == cover
    assert pairwise_cover(SHIPPED[::-1] + SHIPPED[:10]) == cover
    assert [v.name for v in cover] == sorted(v.name for v in cover)


def test_a_rare_pair_is_covered() -> None:
    """Q = 8 and a row split of 4 each occur often, together once: only a pairwise covering
    (not one of single values) must take that variant."""
    rare = Variant(kernel="commit", heads=96, window=8, slot_dtype="int64", threads=256, vec=4,
                   row_split=4)  # fmt: skip
    commit = [v for v in SHIPPED if v.kernel == "commit" and (v.window, v.row_split) != (8, 4)]
    cover = pairwise_cover([*commit, rare])
    assert rare in cover
    _assert_pairwise([*commit, rare], cover)


def test_required_variants_are_kept_and_the_rest_still_covered() -> None:
    required = [SHIPPED[-1], Variant(kernel="commit", heads=7, window=3)]  # one not shipped
    cover = pairwise_cover(SHIPPED, required=required)
    assert set(required) <= set(cover)
    _assert_pairwise(SHIPPED, cover)


@pytest.mark.parametrize("heads", [(20,), (6, 20, 24, 40, 48, 64, 128)])
def test_growing_spaces_keep_the_covering_small(heads: tuple[int, ...]) -> None:
    """More head counts (none of them shipped) multiply every key of 12 heads. The covering
    grows with the largest pair of branching value lists (window x row split), not with the
    space: each new head count is compiled once."""
    grown = SHIPPED + [v.replace(heads=h) for v in SHIPPED if v.heads == 12 for h in heads]
    cover = pairwise_cover(grown)
    print(f"\nheads +{heads}: {len(grown)} variants, {_builds(grown)} builds; "
          f"covering: {len(cover)} variants, {_builds(cover)} builds")  # fmt: skip
    _assert_pairwise(grown, cover)
    assert set(heads) <= {v.heads for v in cover}
    assert len(cover) <= len(pairwise_cover(SHIPPED)) + 2 * len(heads)
    chosen = _groups(cover)
    for key, group in _groups(grown).items():
        assert len(chosen[key]) <= 1.5 * _lower_bound(group), key

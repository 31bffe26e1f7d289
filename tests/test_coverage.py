"""The pairwise covering CI compiles (kdagen/coverage.py): every value pair that occurs among a
(kernel, path) group's variants is in it, it is far smaller than the shipped spaces, it does
not depend on the input order, and it stays small when the spaces grow."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from dataclasses import fields

import pytest

from kdagen.coverage import pairwise_cover
from kdagen.serve import variant as variant_module
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


def _field_pairs(group: list[Variant]) -> list[tuple[str, str]]:
    """Pairs of the fields the group's template reads, from the dataclass's field list."""
    read = set(CONTRACT_FIELDS) | set(group[0].spec.tuning)
    names = [f.name for f in fields(Variant) if f.name in read]
    return list(itertools.combinations(names, 2))


def _assert_pairwise(variants: list[Variant], cover: list[Variant]) -> None:
    chosen = _groups(cover)
    for key, group in _groups(variants).items():
        for a, b in _field_pairs(group):
            missing = _pairs(group, a, b) - _pairs(chosen[key], a, b)
            assert not missing, (key, a, b, sorted(missing, key=repr)[:3])


def _lower_bound(group: list[Variant]) -> int:
    """Each variant holds one value pair of two given fields: a covering needs at least as
    many variants as the most varied field pair has pairs."""
    return max(len(_pairs(group, a, b)) for a, b in _field_pairs(group))


def _builds(variants: list[Variant]) -> int:
    return sum(len(v.spec.archs) for v in variants)


def test_the_shipped_covering_holds_every_pair_and_is_small() -> None:
    cover = pairwise_cover(SHIPPED)
    print(f"\nshipped: {len(SHIPPED)} variants, {_builds(SHIPPED)} builds; "
          f"covering: {len(cover)} variants, {_builds(cover)} builds")  # fmt: skip
    _assert_pairwise(SHIPPED, cover)
    assert set(cover) <= set(SHIPPED) and len(cover) == len(set(cover))
    assert _builds(cover) * 10 < _builds(SHIPPED)


def test_the_covering_is_near_its_lower_bound_per_path() -> None:
    """Greedy stays within 1.25x of the bound on the shipped spaces (measured: 15/12, 27/24,
    24/24): the covering grows with the two largest value lists, not their product."""
    chosen = _groups(pairwise_cover(SHIPPED))
    for key, group in _groups(SHIPPED).items():
        assert len(chosen[key]) <= 1.25 * _lower_bound(group), key


def test_the_covering_does_not_depend_on_the_input_order() -> None:
    shuffled = list(SHIPPED)
    random.Random(7).shuffle(shuffled)
    cover = pairwise_cover(SHIPPED)
    assert pairwise_cover(shuffled) == cover
    assert pairwise_cover(SHIPPED[::-1] + SHIPPED[:10]) == cover
    assert [v.name for v in cover] == sorted(v.name for v in cover)


def test_a_rare_pair_is_covered() -> None:
    """H = 96 and Q = 8 each occur often, together once: only a pairwise covering (not one of
    single values) must take that variant."""
    rare = Variant(kernel="commit", heads=96, window=8, slot_dtype="int64", threads=256, vec=4)
    commit = [v for v in SHIPPED if v.kernel == "commit" and (v.heads, v.window) != (96, 8)]
    cover = pairwise_cover([*commit, rare])
    assert rare in cover
    _assert_pairwise([*commit, rare], cover)


def test_required_variants_are_kept_and_the_rest_still_covered() -> None:
    required = [SHIPPED[-1], Variant(kernel="commit", heads=7, window=3)]  # one not shipped
    cover = pairwise_cover(SHIPPED, required=required)
    assert set(required) <= set(cover)
    _assert_pairwise(SHIPPED, cover)


@pytest.mark.parametrize("heads", [(), (4, 8, 16)])
def test_growing_spaces_keep_the_covering_small(
    monkeypatch: pytest.MonkeyPatch, heads: tuple[int, ...]
) -> None:
    """A second gate doubles every verify and commit key (simulated: the field's choices are
    patched for this test only); more head counts multiply them again. The covering grows
    with the largest pair of value lists (heads x window), not with the space."""
    monkeypatch.setitem(variant_module._CHOICES, "gate", ("kda", "softplus"))
    # (the softplus gate stops at 8 tokens)
    grown = SHIPPED + [v.replace(gate="softplus") for v in SHIPPED if v.window <= 8]
    grown += [v.replace(heads=h) for v in grown if v.heads == 12 for h in heads]
    cover = pairwise_cover(grown)
    print(f"\ngate x2, heads +{heads}: {len(grown)} variants, {_builds(grown)} builds; "
          f"covering: {len(cover)} variants, {_builds(cover)} builds")  # fmt: skip
    _assert_pairwise(grown, cover)
    assert {v.gate for v in cover} == {"kda", "softplus"}
    chosen = _groups(cover)
    for key, group in _groups(grown).items():
        assert len(chosen[key]) <= 1.25 * _lower_bound(group), key

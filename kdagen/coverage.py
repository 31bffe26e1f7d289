"""A covering of a variant list: few variants that still reach every template branch.

A template's branches depend on one field (conv, the slot dtype, PDL) or on the interaction
of two (conv x layout, threads x window, row_split x stages, the tap dtype x window in the
register budget). Compiling a subset in which every pair of values that occurs among a
(kernel, path) group's variants occurs at least once therefore compiles every branch and every
two-field interaction, at a size that grows with the product of the two largest value lists
instead of the product of all. A field the templates only print as a constant (the head count:
``H = 12``) opens no branch, so each of its values is compiled once, not once for every value
of every other field. The render's derived switches (``render.template_flags``: lags from
records, fp32 taps) are paired too, since the device helpers branch on them where no render
line shows it. A branch whose condition spans three fields or more (the Hopper conv trees of
2-4 tokens: tree, conv and window) can still be missed by pairs, so ``branch_cover`` adds a
variant for every line shape of the renders that the pairs leave out
(``scripts/helper_reach.py`` lists the helper lines its compiles never run). CI compiles that
subset; ``kdagen check`` on the GPU host compiles and checks every variant.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from kdagen.render import render, template_flags
from kdagen.serve.variant import CONTRACT_FIELDS, Variant

_NUMBER = re.compile(r"\d+")
Value = tuple[str, Any]  # (field, value)
Pair = tuple[Value, Value]

# Fields no template branch reads: a render differs from its sibling's only in the constant's
# line and the docstring's contract (tests/test_coverage.py renders such siblings).
CONSTANT_FIELDS = frozenset({"heads"})


def template_fields(variant: Variant) -> tuple[str, ...]:
    """The fields its path's template reads: the contract and the path's tuning fields."""
    return CONTRACT_FIELDS + variant.spec.tuning


def value_pairs(variant: Variant) -> frozenset[Pair]:
    """Every pair of (field, value) of the template's branching fields, in field order, each
    constant field's value paired with itself (it must occur once, with anything), and every
    pair of the template's flags (``render.template_flags``: the helpers' branches on derived
    switches, such as the conv trees' lags from records with bf16 taps)."""
    values = [(name, getattr(variant, name)) for name in template_fields(variant)]
    branching = [value for value in values if value[0] not in CONSTANT_FIELDS]
    constants = [(value, value) for value in values if value[0] in CONSTANT_FIELDS]
    flags = sorted(template_flags(variant).items())
    return frozenset([*itertools.combinations(branching, 2), *constants,
                      *itertools.combinations(flags, 2)])  # fmt: skip


def pairwise_cover(variants: Iterable[Variant], required: Iterable[Variant] = ()) -> list[Variant]:
    """``required`` plus a greedy pick from ``variants`` that covers, per (kernel, path), every
    value pair (``value_pairs``) occurring among the group's variants; sorted by name.

    Greedy: repeatedly the variant covering the most uncovered pairs, the first by name on a
    tie, so the result depends only on the set of variants, not on their order.
    """
    picked = set(required)
    groups: dict[tuple[str, str], list[Variant]] = defaultdict(list)
    for v in sorted(set(variants) | picked, key=_order):
        groups[(v.kernel, v.path)].append(v)
    for group in groups.values():
        picked.update(_greedy(group, picked))
    return sorted(picked, key=_order)


def line_shapes(variant: Variant) -> frozenset[str]:
    """What the template's branches wrote for ``variant``: its render's lines with every
    number as ``#``, less the docstring lines that name the variant and its contract."""
    lines = (line.strip() for line in render(variant).splitlines())
    return frozenset(_NUMBER.sub("#", line) for line in lines
                     if variant.name not in line and not line.startswith("Contract:"))  # fmt: skip


def branch_cover(variants: Iterable[Variant], required: Iterable[Variant] = ()) -> list[Variant]:
    """``pairwise_cover`` plus, greedily, variants whose renders hold the line shapes
    (``line_shapes``) that no render of the pairwise covering holds; sorted by name. Renders
    every variant once (a few seconds for the shipped spaces)."""
    ordered = sorted(set(variants), key=_order)
    picked = set(pairwise_cover(ordered, required))
    reached = set().union(*map(line_shapes, picked))
    missing = {v: line_shapes(v) - reached for v in ordered if v not in picked}
    missing = {v: shapes for v, shapes in missing.items() if shapes}
    uncovered = set().union(*missing.values())
    while uncovered:
        best = max(missing, key=lambda v: len(missing[v] & uncovered))  # the first on a tie
        picked.add(best)
        uncovered -= missing[best]
    return sorted(picked, key=_order)


def _greedy(group: list[Variant], picked: set[Variant]) -> list[Variant]:
    """Variants of ``group`` (in ``_order``) that cover the pairs ``picked`` leaves uncovered:
    greedy picks, then the picks whose pairs the others hold dropped, latest first."""
    pairs = {v: value_pairs(v) for v in group}
    uncovered = set().union(*pairs.values())
    for v in picked & pairs.keys():
        uncovered -= pairs[v]
    needed = set(uncovered)
    chosen: list[Variant] = []
    while uncovered:
        best = max(group, key=lambda v: len(pairs[v] & uncovered))  # max keeps the first
        chosen.append(best)
        uncovered -= pairs[best]
    for v in reversed(list(chosen)):
        others = set().union(*(pairs[u] for u in chosen if u is not v))
        if needed <= others:
            chosen.remove(v)
    return chosen


def _order(variant: Variant) -> tuple[str, str]:
    """By name; the repr (every field) decides between variants that share a name."""
    return variant.name, repr(variant)

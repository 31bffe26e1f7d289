"""The check's host-side planning (CPU): shards of whole contracts, resuming a cut check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdagen.check import (
    CaseResult,
    check_cost,
    check_verdicts,
    result_records,
    shard_by_contract,
)
from kdagen.serve.variant import Variant
from kdagen.space import Space


@pytest.mark.parametrize("count", [1, 4, 14])
def test_shards_split_whole_contracts_evenly_and_keep_them_together(count: int) -> None:
    variants = Space.load("verify_sm90.yaml").expand().variants
    shards = [shard_by_contract(variants, i, count) for i in range(count)]
    names = [v.name for s in shards for v in s]
    assert sorted(names) == sorted(v.name for v in variants)  # each variant once
    owners = {v.contract_key: i for i, s in enumerate(shards) for v in s}
    assert all(owners[v.contract_key] == i for i, s in enumerate(shards) for v in s)
    for s in shards:  # a contract's tuning points back to back: the case cache holds one
        keys = [v.contract_key for v in s]
        assert keys == sorted(keys)
    # Balanced by estimated check time (an H 96 verify costs several H 12 ones): no shard
    # more than the costliest contract over the least loaded one.
    costs = {k: sum(check_cost(v) for v in variants if v.contract_key == k) for k in owners}
    loads = [sum(check_cost(v) for v in s) for s in shards]
    assert max(loads) - min(loads) <= max(costs.values()) + 1e-9


def test_a_check_costs_more_with_more_heads_and_cases() -> None:
    def cost(name: str) -> float:
        return check_cost(Variant.parse(name))

    h12, h96 = (f"verify-h{h}-q8-i32-sm90_wgmma-t128-r1-c396-s1-pdl" for h in (12, 96))
    assert cost(h96) > 2 * cost(h12)
    softplus = "verify-h32-q8-softplus-i32-sm90_wgmma-t128-r1-c396-s1-pdl"
    assert cost(softplus) > cost("verify-h32-q8-i32-sm90_wgmma-t128-r1-c396-s1-pdl")
    assert cost("commit-h96-q8-i32-bulk-t128-v4-r2-pdl") < cost(h12) / 10


def _case(name: str, max_rel: float) -> CaseResult:
    return CaseResult(name, "single", 0.0, max_rel, 0.0, untouched_ok=True, deterministic=True)


def test_a_resumed_check_skips_what_passed_at_the_same_render_only(tmp_path: Path) -> None:
    good, bad = "commit-h12-q8-i32-bulk-t128-v4-r2-pdl", "commit-h12-q8-i32-bulk-t128-v4-r4-pdl"
    records = result_records(Variant.parse(good), "aaaa", [_case(good, 0.0), _case(good, 1e-3)])
    records += result_records(Variant.parse(bad), "bbbb", [_case(bad, 0.0), _case(bad, 1.0)])
    first = tmp_path / "first.json"
    first.write_text(json.dumps(records))
    # one failing case fails the variant
    assert check_verdicts([first]) == {(good, "aaaa"): True, (bad, "bbbb"): False}
    # A variant that failed once at a render is run again, whatever later runs said (their
    # inputs may have missed the bug); an old file without digests resumes nothing.
    second = tmp_path / "second.json"
    second.write_text(json.dumps(result_records(Variant.parse(bad), "bbbb", [_case(bad, 0.0)])))
    assert check_verdicts([first, second])[(bad, "bbbb")] is False
    assert check_verdicts([second]) == {(bad, "bbbb"): True}
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps([{**_case(good, 0.0).__dict__}]))
    assert check_verdicts([legacy]) == {}

"""The check's host-side planning (CPU): shards of whole contracts, resuming a cut check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kdagen import reference
from kdagen.cases import CHECK_CASES, make_commit_inputs, pool_of
from kdagen.check import (
    CaseResult,
    check_cost,
    check_verdicts,
    compare_commit,
    result_records,
    shard_by_contract,
    touched_mask,
)
from kdagen.check_verify import VerifyCaseResult, _compare, _snapshot, expected_outputs
from kdagen.serve.variant import Variant
from kdagen.space import Space
from kdagen.testing import make_verify_inputs, verify_write_masks, write_as_kernel


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


def _as_reference(inputs: dict, ref: dict) -> dict:
    """``inputs`` after a kernel that computes exactly the reference: a copy, so each test
    below can spoil one output."""
    done = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    write_as_kernel(done, ref)
    return done


def _spoil_verify(name: str, done: dict, ref: dict) -> None:
    mask = verify_write_masks(ref)[name] if name != "untouched" else None
    if name == "out":  # 1 % off: rel-L2 past 3e-3
        done["out"][mask] = (done["out"][mask].float() * 1.01).to(done["out"].dtype)
    elif name == "corr":  # 3e-4 off: past 1e-4
        done["corr"][mask] *= 1 + 3e-4
    elif name == "kg":  # one bit of one element
        flat = done["kg"][mask]
        flat[0] = (flat[0].view(torch.int16) ^ 1).view(torch.bfloat16)
        done["kg"][mask] = flat
    elif name == "conv_state":
        done["conv_state"].view(-1)[0] += 1
    else:  # a row the contract does not let verify write (past a short window)
        keep = ~verify_write_masks(ref)["corr"]
        assert keep.any()
        done["corr"][keep] = 0.5


@pytest.mark.parametrize("spoiled", ["out", "corr", "kg", "conv_state", "untouched"])
def test_the_verify_verdict_fails_each_kind_of_error(spoiled: str) -> None:
    """The figures behind ``kdagen check``'s verdict on the CPU: the reference's own values
    pass; each kind of error the contract bounds fails them."""
    inputs = make_verify_inputs(5, 2, 4, conv=True, seed=9)
    start, ref = _snapshot(inputs), expected_outputs(inputs)
    good = VerifyCaseResult("v", "c")
    _compare(good, _as_reference(inputs, ref), ref, start)
    assert good.passed, good.summary()
    done = _as_reference(inputs, ref)
    _spoil_verify(spoiled, done, ref)
    bad = VerifyCaseResult("v", "c")
    _compare(bad, done, ref, start)
    assert not bad.passed, (spoiled, bad.summary())


@pytest.mark.parametrize("spoiled", [None, "state", "untouched", "padding"])
def test_the_commit_verdict_fails_each_kind_of_error(spoiled: str | None) -> None:
    args = make_commit_inputs(CHECK_CASES[2], 2, 4, device="cpu")  # nulls and zero counts
    before = pool_of(args.state).clone()
    expected = args.state.double()
    reference.commit(args.with_(state=expected), compute_dtype=torch.float64)
    touched = touched_mask(args)
    assert touched.any() and not touched.all()
    args.state[touched] = expected[touched].to(args.state.dtype)  # the kernel, as it stores
    if spoiled == "state":  # 2 % off
        args.state[touched] = (expected[touched] * 1.02).to(args.state.dtype)
    elif spoiled == "untouched":
        args.state[~touched] += 1
    elif spoiled == "padding":
        pool_of(args.state)[:, -1] += 1
    result = CaseResult("c", "edges", 0.0, 0.0, 0.0, True, True)
    compare_commit(result, args.state, expected, before, touched)
    assert result.passed == (spoiled is None), (spoiled, result.summary())

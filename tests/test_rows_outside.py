"""The `rows-outside` check case (render.VERIFY_ROW_BOUNDS): index values outside their tensors
stand for the contract values the kernels cut them to, and a write past ``out`` fails it."""

from __future__ import annotations

import pytest
import torch

from kdagen import reference
from kdagen.check_verify import VerifyCaseResult, _compare, _snapshot, expected_outputs
from kdagen.testing import (
    OUT_GUARD_ROWS,
    bits,
    clone_inputs,
    in_contract,
    make_verify_inputs,
    verify_args,
    with_rows_outside,
    write_as_kernel,
)

B, H, Q = 8, 2, 4


def _inputs(**options):
    return make_verify_inputs(B, H, Q, conv=True, ragged=False, nulls=False, seed=3, **options)


def test_rows_outside_stand_for_the_contract_inputs_the_kernels_cut_them_to() -> None:
    inputs = _inputs()
    bad = with_rows_outside(inputs)
    rows = int(inputs["query_start"][B - 2])
    starts = bad["query_start"].tolist()
    assert starts[0] == -7 and starts[B - 2] > rows and starts[B] < starts[B - 1]
    assert bad["raw_g"].shape[0] == bad["out"].shape[0] == rows
    assert bad["accepted"][:4].tolist() == [0, Q + 1, 1000, -3]
    fixed = in_contract(bad)
    assert fixed["query_start"].tolist() == [*inputs["query_start"][: B - 1].tolist(), rows, rows]
    assert fixed["accepted"][:4].tolist() == [1, Q, Q, 1]
    assert torch.equal(fixed["accepted"][4:], inputs["accepted"][4:])
    # Inside the contract nothing moves.
    same = in_contract(inputs)
    assert torch.equal(same["query_start"], inputs["query_start"])
    assert torch.equal(same["accepted"], inputs["accepted"])
    # A window longer than Q is cut to Q tokens: its last rows are nobody's, no contract value.
    long = dict(inputs, query_start=inputs["query_start"].clone())
    long["query_start"][1] -= 2
    with pytest.raises(ValueError, match="not one query_start"):
        in_contract(long)


def test_the_cut_windows_compute_what_the_kept_requests_compute_in_the_contract() -> None:
    """The reference of the cut values equals the reference of the same requests with the two
    dropped ones empty and the bad counts clamped: the case asks nothing outside the contract."""
    inputs = _inputs(tree=True)
    bad = with_rows_outside(inputs)
    ref = expected_outputs(bad)
    # The contract's values written out here, not by in_contract (what expected_outputs uses).
    rows = int(inputs["query_start"][B - 2])
    plain = clone_inputs(bad)
    plain["query_start"] = torch.tensor([*inputs["query_start"][: B - 1].tolist(), rows, rows],
                                        dtype=bad["query_start"].dtype)  # fmt: skip
    plain["accepted"][:4] = torch.tensor([1, Q, Q, 1], dtype=plain["accepted"].dtype)
    for name in ("out", "corr"):
        plain[name] = torch.zeros(plain[name].shape, dtype=torch.float64)
    reference.verify(verify_args(plain), compute_dtype=torch.float64)
    for name in ("out", "corr", "kg", "conv_state"):
        assert torch.equal(bits(ref[name]), bits(plain[name])), name
    assert ref["query_start"].tolist()[-3:] == [bad["raw_g"].shape[0]] * 3


def test_the_rows_outside_case_fails_a_write_past_out() -> None:
    bad = with_rows_outside(_inputs())
    start = _snapshot(bad)
    ref = expected_outputs(bad)
    write_as_kernel(bad, ref)  # a kernel that computes exactly the reference
    result = VerifyCaseResult("v", "rows-outside")
    _compare(result, bad, ref, start)
    assert result.untouched_ok and result.kg_exact and result.conv_exact, result.summary()
    # The rows a kernel that took the bad starts as they are would write first: -7, T + 4.
    for guard, row in (("out_guard_before", OUT_GUARD_ROWS - 7), ("out_guard_after", 4)):
        poked = dict(bad)
        poked[guard] = bad[guard].clone()
        poked[guard][row, 5] = 1.0
        failed = VerifyCaseResult("v", "rows-outside")
        _compare(failed, poked, ref, start)
        assert not failed.untouched_ok, guard


def test_every_verify_runs_the_rows_outside_case_once_its_kernels_cut_rows(monkeypatch) -> None:
    from kdagen import render
    from kdagen.check_verify import cases_for
    from kdagen.serve.variant import Variant

    variant = Variant.parse("verify-h12-q8-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c396-s1-pdl")
    monkeypatch.setattr(render, "VERIFY_ROW_BOUNDS", False)
    assert "rows-outside" not in {case.name for case in cases_for(variant)}
    monkeypatch.setattr(render, "VERIFY_ROW_BOUNDS", True)
    assert "rows-outside" in {case.name for case in cases_for(variant)}

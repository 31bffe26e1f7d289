"""CPU tests of kdagen.emulate: the sm100 arithmetic against the fp64 reference.

The bounds are ``emulate.EXPECTED_ERROR``, the numbers the first Blackwell run is judged by, so
these tests are what backs them: the fp32 / hi-lo algorithm itself must sit inside them with
margin on every case here (ragged windows, null slots, both conv layouts and tap dtypes).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import Tensor

from kdagen import emulate, reference
from kdagen.testing import (
    bits,
    clone_inputs,
    is_poisoned,
    make_verify_inputs,
    poison_,
    untouched_mask,
    verify_args,
    verify_write_masks,
)

BOUNDS = emulate.expected_error()
F64 = torch.float64


def _case(Q: int, H: int, **kw: Any) -> Any:
    name = f"Q{Q}-H{H}" + "".join(f"-{k}={v}".replace("torch.", "") for k, v in sorted(kw.items()))
    return pytest.param({"Q": Q, "H": H, **kw}, id=name)


CASES = [
    _case(1, 2),
    _case(2, 3, null_slot=-1),
    _case(5, 2, slot_dtype=torch.int64),
    _case(8, 3),
    _case(8, 2, ragged=False, nulls=False),
    _case(1, 3, conv=True),
    _case(2, 2, conv=True, conv_dim_first=True, null_slot=-1),
    _case(5, 3, conv=True, conv_w_dtype=torch.float32),
    _case(8, 2, conv=True, conv_dim_first=True, conv_w_dtype=torch.float32),
    _case(8, 3, conv=True, null_slot=-1, seed=4),
    # Slots outside the pool (past its end, -3 above a null slot below it): padding.
    _case(6, 2, outside=True),
    _case(7, 2, conv=True, null_slot=-4, outside=True, seed=5),
    # No decay (gates ~ 0): the state term keeps its full weight, the hardest case for corr.
    _case(8, 3, raw_g=-30.0),
    _case(5, 2, conv=True, conv_w_dtype=torch.float32, raw_g=-30.0),
    # Kimi-Linear's unbounded softplus gate: realistic gates, gates whose window log decays
    # reach -1000 and beyond, and every token forgetting everything before it.
    _case(8, 3, lower_bound=None),
    _case(5, 2, lower_bound=None, conv=True),
    _case(8, 3, lower_bound=None, gate_logits=(200.0, 100.0)),
    _case(7, 2, lower_bound=None, gate_logits=(200.0, 100.0), conv=True, conv_dim_first=True),
    _case(8, 2, lower_bound=None, gate_logits=(0.0, 1e4), conv=True),
    _case(1, 2, lower_bound=None, gate_logits=(200.0, 100.0)),
]


def _inputs(params: dict[str, Any]) -> dict[str, Any]:
    params = dict(params)
    fill = params.pop("raw_g", None)
    logits = params.pop("gate_logits", None)
    inputs = make_verify_inputs(B=params.pop("B", 7), **params)
    if fill is not None:
        inputs["raw_g"].fill_(fill)
    if logits is not None:  # (std, mean) instead of N(0, 1)
        gen = torch.Generator().manual_seed(1)
        drawn = torch.randn(inputs["raw_g"].shape, generator=gen) * logits[0] + logits[1]
        inputs["raw_g"].copy_(drawn)
    return inputs


def _reference(inputs: dict[str, Any]) -> dict[str, Any]:
    """The fp64 reference on a copy, with fp64 (poisoned) out / corr to keep it unrounded."""
    ref = clone_inputs(inputs)
    ref["out"] = poison_(torch.empty(inputs["out"].shape, dtype=F64))
    ref["corr"] = poison_(torch.empty(inputs["corr"].shape, dtype=F64))
    reference.verify(verify_args(ref), compute_dtype=F64)
    return ref


def _emulate(inputs: dict[str, Any], lo_half: bool = True) -> dict[str, Any]:
    """The emulation on a copy; ``lo_half=False`` zeroes the probes' low halves (bf16 probes
    alone), to show what the split buys."""
    emu = clone_inputs(inputs)
    split = emulate._bf16_split
    if not lo_half:
        emulate._bf16_split = lambda x: (split(x)[0], torch.zeros_like(split(x)[1]))
    try:
        emulate.verify_like_sm100(verify_args(emu))
    finally:
        emulate._bf16_split = split
    return emu


def _errors(emu: dict[str, Any], ref: dict[str, Any], masks: dict[str, Tensor]) -> dict[str, float]:
    out = emulate.relative_errors(emu["out"][masks["out"]], ref["out"][masks["out"]])
    corr = emulate.relative_errors(emu["corr"][masks["corr"]], ref["corr"][masks["corr"]])
    errors = {f"out_{k}": v for k, v in out.items()} | {f"corr_{k}": v for k, v in corr.items()}
    return {k: v for k, v in errors.items() if k in BOUNDS}  # out has no max_rms bound


def _assert_within_bounds(errors: dict[str, float]) -> None:
    over = {k: (v, BOUNDS[k]) for k, v in errors.items() if not v <= BOUNDS[k]}
    assert not over, f"over the bound (measured, bound): {over}"


# --------------------------------------------------------------------------- against fp64


@pytest.mark.parametrize("params", CASES)
def test_matches_fp64_reference(params: dict[str, Any]) -> None:
    inputs = _inputs(params)
    ref, emu = _reference(inputs), _emulate(inputs)
    masks = verify_write_masks(inputs)
    assert masks["out"].any() and masks["corr"].any()
    _assert_within_bounds(_errors(emu, ref, masks))
    assert torch.equal(bits(emu["kg"]), bits(ref["kg"]))  # poison included
    if inputs["conv_state"] is not None:
        assert torch.equal(bits(emu["conv_state"]), bits(ref["conv_state"]))


@pytest.mark.parametrize("params", CASES)
def test_writes_only_the_allowed_elements(params: dict[str, Any]) -> None:
    inputs = _inputs(params)
    emu = _emulate(inputs)
    masks = verify_write_masks(inputs)
    for name in ("out", "corr", "kg"):
        assert is_poisoned(emu[name])[~masks[name]].all(), name
        assert not is_poisoned(emu[name])[masks[name]].any(), name
    assert untouched_mask(inputs["state_pool"], emu["state_pool"]).all()
    if inputs["conv_state"] is not None:
        kept = untouched_mask(inputs["conv_state"], emu["conv_state"])
        assert kept[~masks["conv_state"]].all()
    starts, slots = inputs["query_start"].tolist(), inputs["slots"].tolist()
    lowest, slot_count = max(inputs["null_slot"], -1), inputs["state"].shape[0]
    for b, slot in enumerate(slots):
        if not lowest < slot < slot_count:  # padding: +0.0 outputs, not -0.0
            assert (bits(emu["out"][starts[b] : starts[b + 1]]) == 0).all()


def test_empty_windows_write_nothing() -> None:
    inputs = make_verify_inputs(B=4, H=2, Q=4, conv=True)
    inputs["query_start"].zero_()
    emu = _emulate(inputs)
    for name in ("out", "corr", "kg"):
        assert is_poisoned(emu[name]).all(), name
    assert torch.equal(bits(emu["conv_state"]), bits(inputs["conv_state"]))


def test_same_arguments_as_reference() -> None:
    ref = inspect.signature(reference.verify).parameters
    emu = inspect.signature(emulate.verify_like_sm100).parameters
    expected = [(n, p.kind) for n, p in ref.items() if n != "compute_dtype"]
    assert [(n, p.kind) for n, p in emu.items()] == expected


# --------------------------------------------------------------------------- why the pieces


def test_hi_lo_split_matters() -> None:
    """bf16 probes alone lose ~2^-9 of every projection term; the low half brings it back."""
    inputs = _inputs({"Q": 8, "H": 2, "conv": True, "raw_g": -30.0})
    ref = _reference(inputs)
    masks = verify_write_masks(inputs)
    both = _errors(_emulate(inputs), ref, masks)
    hi_only = _errors(_emulate(inputs, lo_half=False), ref, masks)
    assert hi_only["corr_max_rel"] > 1e-3 > BOUNDS["corr_max_rel"] >= both["corr_max_rel"]
    assert hi_only["corr_rel_l2"] > 100 * both["corr_rel_l2"]
    assert hi_only["corr_rel_l2"] > BOUNDS["corr_rel_l2"]


def test_fp32_finite_at_full_decay() -> None:
    """Q = 8 with every gate at lower_bound = -5: |G| reaches 40 and exp(-G) ~ 2e17 stays inside
    fp32, so the closed form (exp(-G_i) k_i . exp(G_t) k_t) is still finite and accurate."""
    inputs = _inputs({"Q": 8, "H": 3, "lower_bound": -5.0, "raw_g": 30.0, "ragged": False})
    heads = inputs["a_log"].shape[0]
    g_raw = inputs["raw_g"].view(-1, 8, heads, 128).transpose(1, 2)  # full windows: [B, H, Q, K]
    logs, _ = emulate._log_decay(g_raw, inputs["a_log"], inputs["dt_bias"], -5.0)
    assert logs.min() < -39.99 and torch.exp(-logs).isfinite().all()
    ref, emu = _reference(inputs), _emulate(inputs)
    masks = verify_write_masks(inputs)
    for name in ("out", "corr"):
        assert emu[name][masks[name]].isfinite().all(), name
    _assert_within_bounds(_errors(emu, ref, masks))


def test_softplus_window_decays_past_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the softplus gate the window's log decay goes far past what exp(-G) can hold in
    fp32; the floor under each token's log decay and the coupling's rebase to token MID keep
    every factor within exp(+-64) and the outputs within the bounds. Without the floor the
    same inputs give non-finite or wrong outputs, so the cases above test it."""
    params = {"Q": 8, "H": 3, "lower_bound": None, "gate_logits": (200.0, 100.0), "ragged": False}
    inputs = _inputs(params)
    g_raw = inputs["raw_g"].view(-1, 8, 3, 128)  # full windows: [B, Q, H, K]
    exact = reference.gate(g_raw, inputs["a_log"], inputs["dt_bias"], None, F64)
    assert exact.sum(dim=1).min() < -1000  # the window's log decay, per channel
    ref, masks = _reference(inputs), verify_write_masks(inputs)
    _assert_within_bounds(_errors(_emulate(inputs), ref, masks))

    monkeypatch.setattr(emulate, "softplus_gate_floor", lambda window: float("inf"))
    unbounded = _emulate(inputs)
    errors = _errors(unbounded, ref, masks)
    finite = all(unbounded[n][masks[n]].isfinite().all() for n in ("out", "corr"))
    assert not finite or any(v > BOUNDS[k] for k, v in errors.items())


def test_warp_sum_order() -> None:
    """The reduction tree is the kernel's fold-in-half butterfly, then ``(w0 + w1) + (w2 + w3)``:
    each pair of 2^-24 below survives only if the tree adds the pair before adding it to 1."""
    tiny = 2.0**-24  # half an fp32 ulp of 1: 1 + tiny rounds (ties to even) back to 1

    def total(*where: int) -> float:
        x = torch.zeros(128, dtype=torch.float32)
        x[0] = 1.0
        x[list(where)] = tiny
        return float(emulate._warp_sum(x))

    assert total(1, 17) == 1.0 + 2 * tiny  # lanes l and l^16 first
    assert total(1, 2) == 1.0  # not neighbours first
    assert total(64, 96) == 1.0 + 2 * tiny  # warps 2 and 3 pair up
    assert total(32, 64) == 1.0  # warp 1 meets warp 0 first

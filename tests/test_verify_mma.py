"""The small-CTA Hopper verify (path sm90_mma) on the CPU: its space, its variant rules, its
arithmetic emulated against the fp64 reference, and its compiled resources (four CTAs an SM).
tests/test_gpu_verify_mma.py runs the kernel itself through ``kdagen check``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kdagen import compile as kcompile
from kdagen import emulate, emulate_mma, reference
from kdagen.check_verify import MAX_RMS
from kdagen.sass import disassemble, find_nvdisasm
from kdagen.serve.variant import Variant, VariantError
from kdagen.space import DEFAULT_SPACES, Space
from kdagen.testing import (
    bits,
    clone_inputs,
    make_verify_inputs,
    poison_,
    verify_args,
    verify_write_masks,
)

# ``kdagen check``'s bounds, corr's tightened to a few times what this arithmetic measures on
# the cases below (rel-L2 <= 4e-6, element <= 3e-5 of the rms), so a change to it that costs
# accuracy fails here before a GPU runs it.
BOUNDS = {"out_rel_l2": 3e-3, "out_max_rel": 8e-3, "corr_rel_l2": 1e-5, "corr_max_rms": 6e-5}
SM_SHARED = 232448  # bytes of shared memory an SM gives its CTAs (each also reserves 1 KiB)


def test_the_space_is_not_shipped_and_holds_only_small_cta_chains() -> None:
    variants = Space.load("verify_mma_sm90.yaml").expand().variants
    assert "verify_mma_sm90.yaml" not in DEFAULT_SPACES  # not before a GPU has checked it
    assert len(variants) == 72
    assert {v.path for v in variants} == {"sm90_mma"} and {v.tree for v in variants} == {
        False,
        True,
    }
    assert {v.window for v in variants} == {9, 12, 16} and {v.ctas for v in variants} == {396, 528}
    assert not any(v.conv or v.gate != "kda" for v in variants)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"gate": "softplus"}, "gate="), ({"conv": True}, "conv="), ({"ctas": 264}, "ctas=264")],
)
def test_the_variant_rules_name_what_the_path_cannot_compute(change: dict, field: str) -> None:
    base = {"kernel": "verify", "heads": 12, "window": 16, "path": "sm90_mma", "ctas": 528}
    with pytest.raises(VariantError, match=field):
        Variant(**(base | change))
    name = Variant(**base).name
    assert name == "verify-h12-q16-i32-sm90_mma-c528-pdl" and Variant.parse(name).ctas == 528


def _case(Q: int, **kw: Any) -> Any:
    return pytest.param({"Q": Q, **kw}, id=f"Q{Q}" + "".join(f"-{k}={v}" for k, v in kw.items()))


CASES = [
    _case(16),
    _case(12, null_slot=-1),
    _case(9, slot_dtype=torch.int64),
    _case(16, outside=True, seed=3),
    _case(16, raw_g=-30.0),  # no decay: the state term at full weight
    _case(16, lower_bound=-8.0, raw_g=30.0),  # the steepest decay the contract allows at Q 16
    _case(4),  # a short window: the kernel pads its MMA rows to 16
    _case(16, tree=True),  # token trees: G along root paths, couplings on them
    _case(9, tree=True, slot_dtype=torch.int64, outside=True, seed=2),
    _case(16, tree=True, lower_bound=-8.0, raw_g=30.0),
]


def _inputs(params: dict[str, Any]) -> dict[str, Any]:
    params = dict(params)
    fill = params.pop("raw_g", None)
    inputs = make_verify_inputs(B=params.pop("B", 6), H=2, **params)
    if fill is not None:
        inputs["raw_g"].fill_(fill)
    return inputs


@pytest.mark.parametrize("params", CASES)
def test_the_regrouped_arithmetic_matches_the_fp64_reference(params: dict[str, Any]) -> None:
    inputs = _inputs(params)
    ref = clone_inputs(inputs)
    ref["out"] = poison_(torch.empty(inputs["out"].shape, dtype=torch.float64))
    ref["corr"] = poison_(torch.empty(inputs["corr"].shape, dtype=torch.float64))
    reference.verify(verify_args(ref), compute_dtype=torch.float64)
    emu = clone_inputs(inputs)
    emulate_mma.verify_like_sm90_mma(verify_args(emu))
    masks = verify_write_masks(inputs)
    assert masks["out"].any() and masks["corr"].any()
    errors = {}
    for name in ("out", "corr"):
        got = emulate.relative_errors(emu[name][masks[name]], ref[name][masks[name]])
        errors |= {f"{name}_{k}": v for k, v in got.items() if f"{name}_{k}" in BOUNDS}
    over = {k: (v, BOUNDS[k]) for k, v in errors.items() if not v <= BOUNDS[k]}
    assert not over, f"over the bound (measured, bound): {over}"
    assert torch.equal(bits(emu["kg"]), bits(ref["kg"]))


def test_the_hi_lo_operands_are_what_keeps_corr_within_the_contract(monkeypatch) -> None:
    """With the left operands in one bf16 pass (lo halves zeroed) the corrections leave the
    contract's element bound: the split is not decoration."""
    inputs = _inputs({"Q": 16, "raw_g": -30.0})
    ref = clone_inputs(inputs)
    reference.verify(verify_args(ref), compute_dtype=torch.float64)
    split = emulate_mma._bf16_split
    monkeypatch.setattr(emulate_mma, "_bf16_split", lambda x: (split(x)[0], 0 * split(x)[1]))
    emu = clone_inputs(inputs)
    emulate_mma.verify_like_sm90_mma(verify_args(emu))
    mask = verify_write_masks(inputs)["corr"]
    got = emulate.relative_errors(emu["corr"][mask], ref["corr"][mask])
    assert got["max_rms"] > MAX_RMS["corr"], got  # the contract's own element bound


def test_the_emulation_refuses_what_the_kernel_does_not_compute() -> None:
    inputs = make_verify_inputs(B=2, H=2, Q=4, lower_bound=None)
    with pytest.raises(ValueError, match="bounded gate"):
        emulate_mma.verify_like_sm90_mma(verify_args(inputs))


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q16-i32-sm90_mma-c528-pdl",
        "verify-h96-q9-i64-sm90_mma-c396-nopdl",
        "verify-h12-q16-tree-i32-sm90_mma-c528-pdl",
    ],
)
def test_the_small_cta_kernel_fits_its_ctas_an_sm(name: str, tmp_path: Path) -> None:
    """Registers capped for ctas / 132 CTAs an SM, no stack, shared memory for four; warp
    MMAs and cp.async, no warpgroup MMA or TMA."""
    variant = Variant.parse(name)
    record = kcompile.compile_variant(variant, "sm_90a", tmp_path)
    assert record.ok, record.error
    resident = variant.ctas // 132
    assert resident * 128 * record.registers <= 65536 and record.frame_bytes == 0
    assert 4 * (record.smem_bytes + 1024) <= SM_SHARED
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    cubin = kcompile.variant_dir(variant, tmp_path) / "sm_90a" / "kernel.cubin"
    sass = disassemble(cubin)
    assert "HMMA.16816.F32.BF16" in sass and "LDSM" in sass and "LDGSTS" in sass
    assert "HGMMA" not in sass and "UTMALDG" not in sass

"""CPU tests of kdagen.emulate_tree: the tree kernel's arithmetic against the fp64 tree reference.

Two claims: a chain's parents give the chain emulation's bits (the tree kernel is a strict
extension of the shipped one), and every tree shape, window up to 16 and gate lands within the
issue's accuracy targets against ``kdagen.tree.verify_tree``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_emulate import _inputs
from torch import Tensor

from kdagen import emulate, emulate_tree, tree
from kdagen.serve.validate import KdaInputError
from kdagen.testing import (
    bits,
    clone_inputs,
    is_poisoned,
    poison_,
    random_parents,
    verify_args,
    verify_write_masks,
)

F64 = torch.float64
# Issue 31's targets for kernels against fp64 (rel L2 over the written elements), plus the GPU
# check's element-wise corr bound.
TARGETS = {"out_rel_l2": 3e-3, "corr_rel_l2": 1e-4, "corr_max_rms": 1e-4}

GATES = {
    "kda": {},
    "kda-full": {"raw_g": 30.0, "ragged": False},  # every gate at -5: G down to -5 x depth
    "kda-none": {"raw_g": -30.0},  # no decay: the state term at full weight
    "kda10-full": {"lower_bound": -10.0, "raw_g": 30.0},  # span 160 at Q = 16, the limit
    "kda8-full": {"lower_bound": -8.0, "raw_g": 30.0},  # 128 at Q = 16: the wide kernels' limit
    "softplus": {"lower_bound": None},
    "softplus-forget": {"lower_bound": None, "gate_logits": (200.0, 100.0)},
    "softplus-1e4": {"lower_bound": None, "gate_logits": (0.0, 1e4)},
    # G crosses -128 inside a 16-token window on about a fifth of the channels (the bands' edge)
    "softplus-edge": {"lower_bound": None, "gate_logits": (8.0, 8.0)},
}
SHAPES = ("random", "chain", "star", "two-branches")


def tree_parents(qlen: list[int], shape: str, seed: int) -> Tensor:
    """``parents [T]`` int32 of one shape for every request."""
    if shape == "random":
        return random_parents(qlen, torch.Generator().manual_seed(seed))
    rows: list[int] = []
    for n in qlen:
        for t in range(n):
            parent = {"chain": t - 1, "star": 0, "two-branches": max(0, t - 2)}[shape]
            rows.append(-1 if t == 0 else parent)
    return torch.tensor(rows, dtype=torch.int32)


def _reference(inputs: dict[str, Any], parents: Tensor) -> dict[str, Any]:
    ref = clone_inputs(inputs)
    ref["out"] = poison_(torch.empty(inputs["out"].shape, dtype=F64))
    ref["corr"] = poison_(torch.empty(inputs["corr"].shape, dtype=F64))
    tree.verify_tree(verify_args(ref), parents)
    return ref


def _emulate(inputs: dict[str, Any], parents: Tensor, **kw: Any) -> dict[str, Any]:
    emu = clone_inputs(inputs)
    emulate_tree.verify_tree_like_sm100(verify_args(emu), parents, **kw)
    return emu


def tree_errors(emu: dict[str, Any], ref: dict[str, Any], masks: dict[str, Tensor]) -> dict:
    out = emulate.relative_errors(emu["out"][masks["out"]], ref["out"][masks["out"]])
    corr = emulate.relative_errors(emu["corr"][masks["corr"]], ref["corr"][masks["corr"]])
    errors = {f"out_{k}": v for k, v in out.items()} | {f"corr_{k}": v for k, v in corr.items()}
    return {k: errors[k] for k in TARGETS}


# --------------------------------------------------------------------------- chains


CHAIN_CASES = [
    {"Q": 1, "H": 2},
    {"Q": 5, "H": 2, "null_slot": -1},
    {"Q": 8, "H": 3},
    {"Q": 8, "H": 2, "ragged": False, "nulls": False},
    {"Q": 8, "H": 3, "raw_g": -30.0},
    {"Q": 8, "H": 3, "lower_bound": -9.0, "raw_g": 30.0},  # the contract's 72 at Q = 8
    {"Q": 8, "H": 3, "lower_bound": None},
    {"Q": 3, "H": 2, "lower_bound": None, "gate_logits": (200.0, 100.0)},
    {"Q": 8, "H": 3, "lower_bound": None, "gate_logits": (200.0, 100.0)},
    {"Q": 8, "H": 2, "lower_bound": None, "gate_logits": (0.0, 1e4)},
]


@pytest.mark.parametrize(
    "params", CHAIN_CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items())
)
def test_chain_parents_give_the_chain_emulation_bits(params: dict[str, Any]) -> None:
    inputs = _inputs(params)
    chain = _emulate(inputs, tree_parents(inputs["qlen"], "chain", 0))
    want = clone_inputs(inputs)
    emulate.verify_like_sm100(verify_args(want))
    for name in ("out", "corr", "kg"):
        assert torch.equal(bits(chain[name]), bits(want[name])), name  # poison included


# --------------------------------------------------------------------------- against fp64


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("window", [4, 8, 16])
def test_matches_fp64_tree_reference(window: int, gate: str, shape: str) -> None:
    seed = window + len(gate) + len(shape)
    inputs = _inputs({"Q": window, "H": 2, "B": 6, "seed": seed, **GATES[gate]})
    parents = tree_parents(inputs["qlen"], shape, seed)
    ref, emu = _reference(inputs, parents), _emulate(inputs, parents)
    masks = verify_write_masks(inputs)
    assert masks["out"].any() and masks["corr"].any()
    errors = tree_errors(emu, ref, masks)
    over = {k: (v, TARGETS[k]) for k, v in errors.items() if not v <= TARGETS[k]}
    assert not over, f"over the target (measured, target): {over}"
    assert torch.equal(bits(emu["kg"]), bits(ref["kg"]))


# The kernels that take the couplings relative to the constant -Q floor / 2: the Hopper and
# Blackwell softplus tree kernels (their paths share no middle token), and past Q = 8 every
# window (chains too, both archs) with the bounded gate's floor |lower_bound|, up to the
# contract's deepest log decay there (-8 x 16). The emulation computes as the Blackwell kernel
# does (per-thread fp32, bf16 hi/lo probes), so for its wide windows this is the error a
# Blackwell run should reach.
SHIFTED = [
    (window, gate) for window in (2, 5, 8) for gate in GATES if gate.startswith("softplus")
] + [(window, gate) for window in (9, 12, 16) for gate in ("kda", "kda-full", "kda8-full")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("window", "gate"), SHIFTED)
def test_the_shifted_kernels_constant_reference_meets_the_targets(
    window: int, gate: str, shape: str
) -> None:
    """As accurate as the clamped reference, gates that forget everything included."""
    seed = 3 * window + len(gate) + len(shape)
    inputs = _inputs({"Q": window, "H": 2, "B": 6, "seed": seed, **GATES[gate]})
    parents = tree_parents(inputs["qlen"], shape, seed)
    ref, emu = _reference(inputs, parents), _emulate(inputs, parents, shifted=True)
    errors = tree_errors(emu, ref, verify_write_masks(inputs))
    over = {k: (v, TARGETS[k]) for k, v in errors.items() if not v <= TARGETS[k]}
    assert not over, f"over the target (measured, target): {over}"


# The Hopper softplus kernels past Q = 8: floor 16 per token and the couplings in two bands of
# log decay (emulate_tree.banded_couplings), with the MMAs' bf16 hi / lo operands.
BANDED = [(window, gate) for window in (9, 12, 16) for gate in GATES if gate.startswith("softplus")]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("window", "gate"), BANDED)
def test_the_banded_couplings_meet_the_targets(
    window: int, gate: str, shape: str, arch: str
) -> None:
    """Also where gates forget everything (log decays to -256) and where a root path crosses
    from the near band into the far one; each arch's arithmetic (Hopper: two MMA passes of
    bf16 hi / lo operands; Blackwell: fp32 products, a far token's near ancestors moved)."""
    seed = 5 * window + len(gate) + len(shape)
    inputs = _inputs({"Q": window, "H": 2, "B": 6, "seed": seed, **GATES[gate]})
    parents = tree_parents(inputs["qlen"], shape, seed)
    ref, emu = _reference(inputs, parents), _emulate(inputs, parents, banded=arch)
    masks = verify_write_masks(inputs)
    errors = tree_errors(emu, ref, masks)
    over = {k: (v, TARGETS[k]) for k, v in errors.items() if not v <= TARGETS[k]}
    assert not over, f"over the target (measured, target): {over}"
    out = emulate.relative_errors(emu["out"][masks["out"]], ref["out"][masks["out"]])
    assert out["max_rel"] <= 8e-3  # the GPU check's element-wise bound on out


def test_the_far_band_carries_what_the_near_one_cannot() -> None:
    """Q = 16, gates that forget: with floor 16 a path's log decays reach -256; the near band
    alone (one reference) overflows, the two bands hold the targets (the test above)."""
    inputs = _inputs({"Q": 16, "H": 2, "B": 6, "lower_bound": None, "gate_logits": (0.0, 1e4)})
    parents = tree_parents(inputs["qlen"], "chain", 0)
    masks = verify_write_masks(inputs)
    one = _emulate(inputs, parents, softplus_floor=emulate_tree.BANDED_FLOOR)
    assert not one["out"][masks["out"]].isfinite().all()
    for arch in ("sm90", "sm100"):
        banded = _emulate(inputs, parents, banded=arch)
        assert banded["out"][masks["out"]].isfinite().all(), arch


def test_the_bounded_gates_constant_reference_is_for_wide_windows() -> None:
    inputs = _inputs({"Q": 8, "H": 2})
    with pytest.raises(KdaInputError, match="`shifted`"):
        _emulate(inputs, tree_parents(inputs["qlen"], "random", 1), shifted=True)


def test_writes_only_the_allowed_elements() -> None:
    inputs = _inputs({"Q": 16, "H": 2, "lower_bound": None})
    emu = _emulate(inputs, tree_parents(inputs["qlen"], "random", 3))
    masks = verify_write_masks(inputs)
    for name in ("out", "corr", "kg"):
        assert is_poisoned(emu[name])[~masks[name]].all(), name
        assert not is_poisoned(emu[name])[masks[name]].any(), name
    assert torch.equal(bits(emu["state_pool"]), bits(inputs["state_pool"]))


# --------------------------------------------------------------------------- the pieces


def test_ancestor_bits_are_the_ancestor_table() -> None:
    gen = torch.Generator().manual_seed(7)
    parents = random_parents([16] * 20, gen).long().view(20, 16)
    table = emulate_tree.ancestor_matrix(emulate_tree.ancestor_bits(parents))
    assert torch.equal(table, tree.ancestor_table(parents))
    assert emulate_tree.ancestor_bits(parents).max() < 2**16


def test_the_q16_range_needs_the_tree_floor() -> None:
    """Q = 16, softplus gates that forget within the window: the chain kernels' floor formula
    (8 per token) keeps every factor in range but drops weights up to exp(-8), past the
    element-wise corr bound; a floor of 16 (the Q = 8 kernels') lets a deep path's log decays
    span more than the rebase holds and the outputs go non-finite. The tree floor (10) sits
    within the targets (the test above)."""
    inputs = _inputs({"Q": 16, "H": 2, "B": 6, "lower_bound": None, "gate_logits": (0.0, 1e4)})
    parents = tree_parents(inputs["qlen"], "chain", 0)
    ref, masks = _reference(inputs, parents), verify_write_masks(inputs)
    assert emulate_tree.tree_softplus_floor(16) == 10.0
    coarse = tree_errors(_emulate(inputs, parents, softplus_floor=8.0), ref, masks)
    assert coarse["corr_max_rms"] > TARGETS["corr_max_rms"]
    wide = _emulate(inputs, parents, softplus_floor=16.0)
    assert not wide["out"][masks["out"]].isfinite().all()


def test_refusals() -> None:
    conv = _inputs({"Q": 4, "H": 2, "conv": True})
    with pytest.raises(KdaInputError, match="convolution"):
        _emulate(conv, tree_parents(conv["qlen"], "random", 0))
    long = _inputs({"Q": 17, "H": 1})
    with pytest.raises(KdaInputError, match="1..16"):
        _emulate(long, tree_parents(long["qlen"], "random", 0))
    narrow = _inputs({"Q": 8, "H": 1, "lower_bound": None})
    with pytest.raises(KdaInputError, match="`banded`"):
        _emulate(narrow, tree_parents(narrow["qlen"], "random", 0), banded="sm90")
    strong = _inputs({"Q": 16, "H": 1, "lower_bound": -10.5})
    with pytest.raises(KdaInputError, match="lower_bound"):
        _emulate(strong, tree_parents(strong["qlen"], "random", 0))
    bad = _inputs({"Q": 4, "H": 1, "ragged": False})
    parents = tree_parents(bad["qlen"], "random", 0)
    parents[1] = 1
    with pytest.raises(KdaInputError, match="parents"):
        _emulate(bad, parents)

"""Token trees on a GPU (issue 31): a speculative loop of the Hopper tree verify and the path
commit against the fp64 tree reference. ``kdagen check --space verify_tree_sm90.yaml`` checks
every tree variant's cases."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_marks import HOPPER
from test_tree import random_paths

from kdagen import reference, tree
from kdagen.serve.model_commit import ModelCommit
from kdagen.serve.runtime import commit, run_verify
from kdagen.testing import (
    bits,
    clone_inputs,
    commit_args,
    make_verify_inputs,
    random_parents,
    verify_args,
    verify_write_masks,
)

pytestmark = HOPPER

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
H, B = 4, 12


def _softplus_gates(raw_g: torch.Tensor) -> None:
    """Raw gates ~ N(8, 8^2) under the softplus gate: per-channel log decays from ~0 to the
    floor of 16 a token, so a 16-token path crosses the wide kernel's band edge (G = -128)."""
    raw_g.mul_(8.0).add_(8.0)


@pytest.mark.parametrize(
    ("Q", "conv", "gate"),
    [(8, False, "kda"), (16, False, "kda"), (8, True, "kda"), (16, True, "kda"),
     (16, False, "softplus"), (16, True, "softplus")],
)  # fmt: skip
def test_speculative_loop_on_trees(Q: int, conv: bool, gate: str) -> None:
    """20 steps: a random tree per window (padding requests among them), the kernels' tree
    verify, a random accepted root path per request, the path commit; the same loop on the
    fp64 tree reference. Outputs every step and the state at the end agree. With the fused
    conv, every token convolves over its root path, the commit (``ModelCommit``, one layer)
    moves the path's last three tokens into the history rows (the next verify reads them
    with ``accepted = 1``), and the conv state equals the reference's bit for bit each step.
    The softplus gate at Q = 16 runs the wide kernel's two bands of couplings."""
    gen = torch.Generator().manual_seed(SEED)
    lower_bound = None if gate == "softplus" else -5.0
    inputs = make_verify_inputs(B, H, Q, device="cuda", seed=SEED, ragged=False, tree=True,
                                conv=conv, lower_bound=lower_bound)  # fmt: skip
    if gate == "softplus":
        _softplus_gates(inputs["raw_g"])
    ref = clone_inputs(inputs)
    ref["state"] = ref["state"].double()
    if conv:
        model = ModelCommit([inputs["state"]], [inputs["corr"]], [inputs["kg"]],
                            [inputs["a_log"]], [inputs["dt_bias"]],
                            lower_bound=inputs["lower_bound"], conv_states=[inputs["conv_state"]])  # fmt: skip
    for step in range(20):
        if step:  # a fresh tree and activations, the same pool and slots
            fresh = make_verify_inputs(B, H, Q, device="cuda", seed=SEED + step, ragged=False,
                                       tree=True)  # fmt: skip
            if gate == "softplus":
                _softplus_gates(fresh["raw_g"])
            for key in ("qkv", "raw_g", "raw_beta", "parents"):
                inputs[key].copy_(fresh[key])
                ref[key].copy_(fresh[key])
        run_verify(verify_args(inputs))
        reference.verify(verify_args(ref), compute_dtype=torch.float64)
        path, accepted = (t.cuda() for t in random_paths(ref, ref["parents"], gen))
        if conv:
            model.commit(inputs["slots"], accepted, path=path)
            tree.commit_path(commit_args(ref, accepted), path, conv_state=ref["conv_state"],
                             compute_dtype=torch.float64)  # fmt: skip
            inputs["accepted"].fill_(1)  # the history now sits in rows 0..2
            ref["accepted"].fill_(1)
        else:
            commit(inputs["state"], inputs["corr"], inputs["kg"], inputs["a_log"],
                   inputs["dt_bias"], inputs["slots"], accepted,
                   lower_bound=inputs["lower_bound"], path=path)  # fmt: skip
            tree.commit_path(commit_args(ref, accepted), path, compute_dtype=torch.float64)
        torch.cuda.synchronize()
        got, want = inputs["out"].double(), ref["out"].double()
        assert (got - want).norm() <= 1e-2 * want.norm(), f"step {step}, seed {SEED}"
        if conv:
            assert torch.equal(bits(inputs["conv_state"]), bits(ref["conv_state"])), (
                f"conv state, step {step}, seed {SEED}"
            )
    got, want = inputs["state"].double(), ref["state"]
    assert (got - want).norm() <= 1e-2 * want.norm(), f"seed {SEED}"


@pytest.mark.parametrize(
    ("Q", "ragged"),
    [(8, False), (8, True), (16, False), (16, True)],
)
def test_a_chain_given_as_a_tree_gives_the_chain_kernels_results(Q: int, ragged: bool) -> None:
    """Parents t - 1: the tree kernel's sums are the chain kernel's, in the same order (same
    tuning point), so out and corr agree to fp32 rounding and kg bit for bit."""
    tuning = f"sm90_wgmma-t128-r1-c{396 if Q <= 8 else 264}-s1-pdl"
    inputs = make_verify_inputs(16, 12, Q, device="cuda", seed=SEED, tree=True, ragged=ragged)
    chain = random_parents(inputs["qlen"], torch.Generator(), chain=True)
    inputs["parents"].copy_(chain)
    as_tree, as_chain = clone_inputs(inputs), clone_inputs(inputs)
    run_verify(verify_args(as_tree), variant=f"verify-h12-q{Q}-tree-i32-{tuning}")
    run_verify(verify_args(as_chain).with_(parents=None), variant=f"verify-h12-q{Q}-i32-{tuning}")
    torch.cuda.synchronize()
    assert torch.equal(bits(as_tree["kg"]), bits(as_chain["kg"]))
    masks = verify_write_masks(inputs)
    for key in ("out", "corr"):
        mine = masks[key].to(inputs[key].device)
        got, want = as_tree[key][mine].double(), as_chain[key][mine].double()
        assert (got - want).norm() <= 1e-6 * want.norm(), f"{key}, seed {SEED}"
        assert torch.equal(bits(as_tree[key])[~mine], bits(as_chain[key])[~mine])

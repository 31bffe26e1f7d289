"""The small-CTA Hopper verify (path sm90_mma, search_spaces/verify_mma_sm90.yaml, not yet
shipped) on a GPU: every case of ``kdagen check`` on representatives of its space (both
residencies, the three windows and head counts, both slot dtypes, chains and trees), and the
kernel against its own emulation."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_marks import HOPPER

from kdagen.check_verify import check_verify
from kdagen.emulate import relative_errors
from kdagen.emulate_mma import verify_like_sm90_mma
from kdagen.serve.runtime import run_verify
from kdagen.serve.variant import Variant
from kdagen.testing import bits, clone_inputs, make_verify_inputs, verify_args, verify_write_masks

pytestmark = HOPPER

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q16-i32-sm90_mma-c528-pdl",
        "verify-h12-q16-i32-sm90_mma-c396-pdl",
        "verify-h32-q12-i64-sm90_mma-c528-pdl",
        "verify-h96-q9-i32-sm90_mma-c528-pdl",
        "verify-h12-q16-tree-i32-sm90_mma-c528-pdl",
        "verify-h32-q9-tree-i64-sm90_mma-c396-pdl",
    ],
)
def test_the_small_cta_verify_passes_the_check(name: str) -> None:
    for result in check_verify(Variant.parse(name), SEED):
        assert result.passed, f"seed {SEED}: {result.error or result.summary()}"


@pytest.mark.parametrize(("window", "tree"), [(16, False), (9, False), (16, True)])
def test_the_small_cta_verify_matches_its_emulation(window: int, tree: bool) -> None:
    """The kernel against ``kdagen.emulate_mma`` (its own arithmetic in torch) to fp32
    rounding, far inside the check's bounds: corr within 1e-5 of its rms element by element,
    out at most one bf16 step apart, kg bit for bit. A wrong operand or fragment that the
    check's looser bounds might let through shows here."""
    name = f"verify-h12-q{window}{'-tree' if tree else ''}-i32-sm90_mma-c528-pdl"
    inputs = make_verify_inputs(B=37, H=12, Q=window, seed=SEED % 1000, device="cuda", tree=tree)
    got = clone_inputs(inputs)
    run_verify(verify_args(got), variant=name)
    want = clone_inputs(inputs)
    verify_like_sm90_mma(verify_args(want))
    torch.cuda.synchronize()
    mask = {k: m.cuda() for k, m in verify_write_masks(inputs).items() if m is not None}
    corr = relative_errors(got["corr"][mask["corr"]], want["corr"][mask["corr"]])
    assert corr["max_rms"] <= 1e-5, f"seed {SEED}: {corr}"
    out_got, out_want = got["out"][mask["out"]].float(), want["out"][mask["out"]].float()
    step = out_want.abs().clamp_min(1e-30) * 2.0**-7
    assert ((out_got - out_want).abs() <= step).all(), f"seed {SEED}"
    assert torch.equal(bits(got["kg"]), bits(want["kg"])), f"seed {SEED}"

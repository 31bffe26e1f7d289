"""The conv SiLU's fast path on a GPU, for every fp32 input: where the kernels keep the
approximate result (``kdagen.dsl.common.SILU_FAST`` says it is not in doubt), it rounds to the
same bf16 as the exact form ``x / (1 + expf(-x))``, which ``kg`` records bit-exactly.

The sweep runs the kernels' own PTX (the operand names translated to Triton's) over all 2^32
bit patterns, about two seconds on an H200."""

from __future__ import annotations

import re

import pytest
import torch

from kdagen.dsl.common import SILU_FAST, SILU_MARGIN_ULP

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
libdevice = pytest.importorskip("triton.language.extra.libdevice")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BLOCK = 4096


def triton_ptx(ptx: str) -> str:
    """The CuTe inline-PTX operands ({$w0}, {$w1}, {$r0}) as Triton's ($0, $1, $2)."""
    names = {"w0": "$0", "w1": "$1", "r0": "$2"}
    return re.sub(r"\{\$(w0|w1|r0)\}", lambda m: names[m.group(1)], ptx)


@triton.jit
def _sweep(stats, start, count, FAST: tl.constexpr, BLOCK: tl.constexpr):
    """stats: [wrong bf16 roundings kept, max ulp distance where kept, inputs with
    2^-100 <= |x| <= 16, those of them in doubt]."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < count
    x = (start + index).to(tl.uint32).to(tl.float32, bitcast=True)
    fast, doubt = tl.inline_asm_elementwise(
        FAST, "=r,=r,r", [x], dtype=(tl.float32, tl.int32), is_pure=True, pack=1
    )
    exact = libdevice.div_rn(x, 1.0 + libdevice.exp(-x))
    kept = inside & (x == x) & (doubt == 0)  # NaN in, NaN out either way
    fast_bits = fast.to(tl.int32, bitcast=True)
    exact_bits = exact.to(tl.int32, bitcast=True)
    fast_bf16 = (fast_bits + 0x7FFF + ((fast_bits >> 16) & 1)) >> 16  # round to nearest even
    exact_bf16 = (exact_bits + 0x7FFF + ((exact_bits >> 16) & 1)) >> 16
    wrong = kept & (fast_bf16 != exact_bf16)
    distance = tl.where(kept, tl.abs(fast_bits - exact_bits), 0)
    tl.atomic_add(stats + 0, tl.sum(wrong.to(tl.int32), 0))
    tl.atomic_max(stats + 1, tl.max(distance, 0))
    typical = inside & (tl.abs(x) >= 7.888609052210118e-31) & (tl.abs(x) <= 16.0)
    tl.atomic_add(stats + 2, tl.sum(typical.to(tl.int32), 0))
    tl.atomic_add(stats + 3, tl.sum((typical & (doubt != 0)).to(tl.int32), 0))


def test_fast_silu_rounds_like_the_exact_form_for_every_fp32() -> None:
    stats = torch.zeros(4, dtype=torch.int32, device="cuda")
    half = 1 << 31
    for start in (0, half):  # int32 grid indices: two halves of the bit patterns
        _sweep[(triton.cdiv(half, BLOCK),)](
            stats, start, half, FAST=triton_ptx(SILU_FAST), BLOCK=BLOCK
        )
    wrong, distance, typical, doubt = stats.tolist()
    assert wrong == 0, f"{wrong} fp32 inputs kept the fast SiLU with a different bf16 rounding"
    # The margin's premise: the fast result is within half the margin where it is kept.
    assert distance <= SILU_MARGIN_ULP // 2 + 1, distance
    # Where conv outputs live, the exact form is rare: ~2 x margin / 2^16 near midpoints.
    assert doubt < 2 * (2 * SILU_MARGIN_ULP / 65536) * typical, (doubt, typical)

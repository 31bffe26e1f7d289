"""Plain token-by-token pieces shared by the CPU oracles (independent of kdagen.reference)."""

from __future__ import annotations

import torch
from torch import Tensor


def conv_token(win: list[Tensor], taps: Tensor) -> Tensor:
    """One token of the width-4 conv + SiLU over channel vectors ``win[0..3]`` (bf16, oldest
    first), with the stock kernel's rounding: bf16 products, or fp32 fma with fp32 taps."""
    acc = torch.zeros(win[0].shape, dtype=torch.float32)
    for j in range(4):
        x, w = win[j].float(), taps[:, j].float()
        if taps.dtype == torch.bfloat16:
            acc = acc + (x * w).to(torch.bfloat16).float()
        else:
            # fp64 product (exact) + add, rounded once more to fp32: a double rounding, off
            # from a true fma only when the fp64 sum is an exact fp32 midpoint (never here).
            acc = (x.double() * w.double() + acc.double()).float()
    return (acc / (1 + torch.exp(-acc))).to(torch.bfloat16)


def conv_row(conv_state: Tensor, slot: int, row: int, dim_first: bool) -> Tensor:
    """Row ``row`` (a token) of a slot's conv state, in either layout, as ``[3HK]``."""
    return conv_state[slot, :, row] if dim_first else conv_state[slot, row]

"""A token tree's fused convolution past 8 tokens with each lag and the place of the next one
loaded together (docs/tree-semantics.md).

``tree_conv_chased`` keeps a table of parent rows beside the staged rows and takes a lag in
two shared loads (the row's bits, then its parent's row) and two address computations. Here
each staged row is one 32-bit record in this thread's bytes of shared memory: the row's bf16
bits of the current channel block in the low half, its parent row in the high half (a
token's parent token, or the newest history row at a root; a history row's older one, row
0's itself). Lag l of token t is the record l - 1 parents above t's parent: one load and
one address a lag. The parent halves are written once a unit, the bits once per channel
block. The products, sums and rounding are ``conv_silu_tree``'s, so the outputs are its bits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16, Uint32

from kdagen.dsl.common import bf16, bf16_broadcast, mul_bf16x2, pack_bf16x2, pack_f32_bf16x2
from kdagen.dsl.verify import conv_output, settle_doubts

HISTORY = 3  # records 0..2: the history, oldest first; record 3 + t: raw token t
RECORD = 4  # bytes a record; a parent is named by its record's byte offset


@cute.jit
def low_halves(lo: Uint32, hi: Uint32) -> Uint32:
    """The low halves of two records' words as one packed bf16 pair (``lo``'s low)."""
    return cute.arch.inline_ptx(
        "prmt.b32 {$w0}, {$r0}, {$r1}, 0x5410;",
        write_only_types=[Uint32],
        read_only_args=[lo, hi],
    )


@cute.jit
def record_at(scratch: Int32, offset: Int32) -> Uint32:
    """The record ``offset`` bytes past ``scratch``."""
    at = scratch + offset
    return cute.make_tensor(
        cute.make_ptr(Uint32, at, cute.AddressSpace.smem, assumed_align=4), cute.make_layout(1)
    )[0]


@cute.jit
def link_records(links: cute.Tensor, halves: cute.Tensor):
    """Each record's high half (``halves[1, r]``): its parent's byte offset."""
    halves[1, 0], halves[1, 1], halves[1, 2] = Uint16(0), Uint16(0), Uint16(RECORD)
    for t in cutlass.range_constexpr(cute.size(links)):
        parent = links[t]
        earlier = (parent >= 0) & (parent < t)
        row = Int32(cutlass.select_(earlier, parent + HISTORY, Int32(HISTORY - 1)))
        halves[1, HISTORY + t] = (row * RECORD).to(Uint16)


@cute.jit
def conv_silu_tree_records(
    hist: cute.Tensor, raw: cute.Tensor, taps: cute.Tensor, links: cute.Tensor, scratch: Int32,
    lean: cutlass.Constexpr[bool],
):  # fmt: skip
    """``conv_silu_tree`` with each lag loaded from a record that also names the next one:
    this thread's 4 (Q + 3) bytes of shared memory at ``scratch``, which no other thread
    reads or writes during the call."""
    window = raw.shape[1]
    pre = cute.make_rmem_tensor((window,), Float32)
    f32_taps = cutlass.const_expr(taps.element_type == Float32)
    as_bits = cutlass.const_expr(not (lean or f32_taps))
    hist_bits = cute.recast_tensor(hist, Uint16)
    raw_bits = cute.recast_tensor(raw, Uint16)
    rows = HISTORY + window
    halves = cute.make_tensor(
        cute.make_ptr(Uint16, scratch, cute.AddressSpace.smem, assumed_align=4),
        cute.make_layout((2, rows), stride=(1, 2)),
    )
    link_records(links, halves)
    for x in cutlass.range_constexpr(3):
        # The block's bits: written over the previous block's, which this thread has read.
        for i in cutlass.range_constexpr(HISTORY):
            halves[0, i] = hist_bits[x, i]
        for t in cutlass.range_constexpr(window):
            halves[0, HISTORY + t] = raw_bits[x, t]
        lags = [[], [], []]  # lags[l - 1][t]: the record of token t's lag l
        for t in cutlass.range_constexpr(window):
            word = record_at(scratch, Int32((HISTORY + t) * RECORD))  # token t's own record
            for lag in cutlass.range_constexpr(3):
                word = record_at(scratch, Int32(word >> 16))  # the parent its high half names
                lags[lag].append(word)
        doubts = Int32(0)
        if cutlass.const_expr(f32_taps):
            w = [taps[x, j] for j in range(4)]
            for t in cutlass.range_constexpr(window):
                acc = Float32(0)
                for j in cutlass.range_constexpr(4):  # oldest first: lag 3 - j
                    value = bf16(lags[2 - j][t], 0) if j < 3 else raw[x, t].to(Float32)
                    acc = cute.math.fma(value, w[j], acc)
                doubts = conv_output(raw, x, t, acc, pre, doubts, lean)
        else:
            w = [bf16_broadcast(taps[x, j // 2], j % 2) for j in range(4)]
            for t in cutlass.range_constexpr(0, window, 2):
                pair = cutlass.const_expr(t + 1 < window)
                products = []
                for j in cutlass.range_constexpr(3):
                    lo = lags[2 - j][t]
                    hi = lags[2 - j][t + 1] if pair else lo  # the odd window's last partner
                    if cutlass.const_expr(as_bits):
                        products.append(mul_bf16x2(low_halves(lo, hi), w[j]))
                    else:
                        products.append(mul_bf16x2(pack_f32_bf16x2(bf16(lo, 0), bf16(hi, 0)), w[j]))
                if cutlass.const_expr(as_bits):
                    own = pack_bf16x2(raw_bits[x, t], raw_bits[x, t + 1] if pair else Uint16(0))
                else:
                    own = pack_f32_bf16x2(
                        raw[x, t].to(Float32), raw[x, t + 1].to(Float32) if pair else Float32(0)
                    )
                products.append(mul_bf16x2(own, w[3]))
                for h in cutlass.range_constexpr(2 if pair else 1):
                    acc = Float32(0)
                    for j in cutlass.range_constexpr(4):
                        acc = acc + bf16(products[j], h)
                    doubts = conv_output(raw, x, t + h, acc, pre, doubts, lean)
        if cutlass.const_expr(not lean):
            settle_doubts(raw, x, pre, doubts)

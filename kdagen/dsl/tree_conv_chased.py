"""A token tree's fused convolution past 8 tokens with each lag loaded by an index chased
through shared memory (docs/tree-semantics.md).

``tree_conv.conv_silu_tree`` takes every lag by selects over the earlier tokens: 9 Q (Q - 1) / 2
selects a unit, 1080 at Q = 16. ``tree_conv_staged`` finds the three nearest ancestors by
selects into packed 4-bit indexes, which past 8 tokens need more words than the 255-register
kernels have (72-104 bytes of stack). Here each thread writes, in its own bytes of shared
memory, the table ``up`` of each staged row's parent row (a token's parent token, or the
newest history row at a root; a history row's older one), then per channel block stages the
block's history rows and raw tokens and loads lag l of token t at ``up`` applied l - 1 times to
t's parent row: 3 Q index loads and 3 Q value loads a block, no selects. The chase is
repeated per block on purpose: packing each token's three rows once and unpacking them per
block compiled to more instructions (H 12 Q 16: 6208 against 5992). The products, sums
and rounding are ``conv_silu_tree``'s, so the outputs are its bits. A separate module so no
checked conv tree kernel's digest moves.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16, Uint32

from kdagen.dsl.common import bf16, bf16_broadcast, mul_bf16x2, pack_bf16x2, pack_f32_bf16x2
from kdagen.dsl.verify import conv_output, settle_doubts

HISTORY = 3  # staged rows 0..2: the history, oldest first; row 3 + t: raw token t


@cute.jit
def parent_rows(links: cute.Tensor, scratch: Int32) -> cute.Tensor:
    """This thread's table ``up`` (Int32 at ``scratch``): row 3 + t's parent row is 3 + the
    parent where the parent is an earlier token, else 2 (the newest history row); history row
    r's is r - 1 (row 0's is itself: no lag reaches past it)."""
    window = cute.size(links)
    pointer = cute.make_ptr(Int32, scratch, cute.AddressSpace.smem, assumed_align=4)
    up = cute.make_tensor(pointer, cute.make_layout(HISTORY + window))
    up[0], up[1], up[2] = Int32(0), Int32(0), Int32(1)
    for t in cutlass.range_constexpr(window):
        parent = links[t]
        earlier = (parent >= 0) & (parent < t)
        up[HISTORY + t] = cutlass.select_(earlier, parent + HISTORY, Int32(HISTORY - 1))
    return up


@cute.jit
def conv_silu_tree_chased(
    hist: cute.Tensor, raw: cute.Tensor, taps: cute.Tensor, links: cute.Tensor, scratch: Int32,
    lean: cutlass.Constexpr[bool],
):  # fmt: skip
    """``conv_silu_tree`` with the lags loaded by chased indexes from ``scratch``: this
    thread's 6 (Q + 3) bytes of shared memory (the table, then one block's staged rows), which
    no other thread reads or writes during the call."""
    window = raw.shape[1]
    pre = cute.make_rmem_tensor((window,), Float32)
    f32_taps = cutlass.const_expr(taps.element_type == Float32)
    as_bits = cutlass.const_expr(not (lean or f32_taps))
    hist_bits = cute.recast_tensor(hist, Uint16)
    raw_bits = cute.recast_tensor(raw, Uint16)
    up = parent_rows(links, scratch)
    pointer = cute.make_ptr(
        Uint16, scratch + 4 * (HISTORY + window), cute.AddressSpace.smem, assumed_align=4
    )
    staged = cute.make_tensor(pointer, cute.make_layout(HISTORY + window))
    for x in cutlass.range_constexpr(3):
        # The block's rows: written over the previous block's, which this thread has read.
        for i in cutlass.range_constexpr(HISTORY):
            staged[i] = hist_bits[x, i]
        for t in cutlass.range_constexpr(window):
            staged[HISTORY + t] = raw_bits[x, t]
        bits = [[raw_bits[x, t] for t in range(window)], [], [], []]
        for t in cutlass.range_constexpr(window):
            row = up[HISTORY + t]
            for lag in cutlass.range_constexpr(1, 4):
                bits[lag].append(staged[row])
                if cutlass.const_expr(lag < 3):
                    row = up[row]
        if cutlass.const_expr(as_bits):
            lags = bits
        else:
            lags = [[bf16(Uint32(b), 0) for b in lag] for lag in bits]
        doubts = Int32(0)
        wins = [[lags[3 - j][t] for j in range(4)] for t in range(window)]  # oldest first
        if cutlass.const_expr(f32_taps):
            w = [taps[x, j] for j in range(4)]
            for t in cutlass.range_constexpr(window):
                acc = Float32(0)
                for j in cutlass.range_constexpr(4):
                    acc = cute.math.fma(wins[t][j], w[j], acc)
                doubts = conv_output(raw, x, t, acc, pre, doubts, lean)
        else:
            w = [bf16_broadcast(taps[x, j // 2], j % 2) for j in range(4)]
            pack = pack_bf16x2 if as_bits else pack_f32_bf16x2
            unused = Uint16(0) if as_bits else Float32(0)  # the odd window's last partner
            wins.append([unused] * 4)
            for t in cutlass.range_constexpr(0, window, 2):
                products = [mul_bf16x2(pack(wins[t][j], wins[t + 1][j]), w[j]) for j in range(4)]
                for h in cutlass.range_constexpr(min(2, window - t)):
                    acc = Float32(0)
                    for j in cutlass.range_constexpr(4):
                        acc = acc + bf16(products[j], h)
                    doubts = conv_output(raw, x, t + h, acc, pre, doubts, lean)
        if cutlass.const_expr(not lean):
            settle_doubts(raw, x, pre, doubts)

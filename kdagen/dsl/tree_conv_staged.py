"""A token tree's fused convolution with each token's lags loaded from shared memory (the
Hopper conv trees of 5 to 8 tokens; docs/tree-semantics.md).

``tree_conv.conv_silu_tree`` finds every lag by selects over the earlier tokens, per channel
block: 9 Q (Q - 1) / 2 selects a unit (252 at Q = 8). Here each thread stages its channel's
three history rows and raw tokens in its own bytes of shared memory, finds each token's three
nearest ancestors once per unit (3 Q (Q - 1) / 2 integer selects and compares, shared by the
three blocks) and loads every lag by its index: 9 Q loads. The products, sums and rounding are
``conv_silu_tree``'s, so the outputs are its bits. A separate module so the other conv tree
kernels' digests stay (an edit of tree_conv.py would move them all).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16, Uint32

from kdagen.dsl.common import bf16, bf16_broadcast, mul_bf16x2, pack_bf16x2, pack_f32_bf16x2
from kdagen.dsl.verify import conv_output, settle_doubts


@cute.jit
def ancestor_indexes(links: cute.Tensor, window: cutlass.Constexpr[int]) -> list:
    """Each token's three nearest ancestors as indexes into the staged rows: entry l - 1 holds
    lag l, token t's in bits 4t..4t+3 (Q <= 8: indexes below 11), 3 + the ancestor's position
    or 2, 1, 0 for history rows 2, 1, 0 where the root path is shorter. A parent that is not
    an earlier token makes t a root, as in ``conv_silu_tree``. Packed, three words stay live
    through the three channel blocks, where 3Q indexes spilled."""
    first, second = [], []
    packed = [Int32(0), Int32(0), Int32(0)]
    for t in cutlass.range_constexpr(window):
        parent = links[t]
        near = cutlass.select_((parent >= 0) & (parent < t), parent, Int32(-1))
        nearer, farthest = Int32(-2), Int32(-3)
        for i in cutlass.range_constexpr(t):
            hit = parent == i
            nearer = cutlass.select_(hit, first[i], nearer)
            farthest = cutlass.select_(hit, second[i], farthest)
        first.append(near)
        second.append(nearer)
        for lag, index in enumerate((near, nearer, farthest)):
            packed[lag] = packed[lag] | ((index + 3) << (4 * t))
    return packed


@cute.jit
def conv_silu_tree_staged(
    hist: cute.Tensor, raw: cute.Tensor, taps: cute.Tensor, links: cute.Tensor, scratch: Int32,
    lean: cutlass.Constexpr[bool],
):  # fmt: skip
    """``conv_silu_tree`` with the lags loaded from ``scratch``: this thread's 6 (Q + 3) bytes
    of shared memory, which no other thread reads or writes during the call."""
    window = raw.shape[1]
    pre = cute.make_rmem_tensor((window,), Float32)
    f32_taps = cutlass.const_expr(taps.element_type == Float32)
    as_bits = cutlass.const_expr(not (lean or f32_taps))
    hist_bits = cute.recast_tensor(hist, Uint16)
    raw_bits = cute.recast_tensor(raw, Uint16)
    pointer = cute.make_ptr(Uint16, scratch, cute.AddressSpace.smem, assumed_align=4)
    staged = cute.make_tensor(pointer, cute.make_layout((3, window + 3), stride=(window + 3, 1)))
    ancestors = ancestor_indexes(links, window)
    for x in cutlass.range_constexpr(3):
        for i in cutlass.range_constexpr(3):
            staged[x, i] = hist_bits[x, i]
        for t in cutlass.range_constexpr(window):
            staged[x, 3 + t] = raw_bits[x, t]
        bits = [[raw_bits[x, t] for t in range(window)]]
        for lag in cutlass.range_constexpr(3):
            bits.append([staged[x, (ancestors[lag] >> (4 * t)) & 0xF] for t in range(window)])
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

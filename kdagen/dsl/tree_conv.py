"""A token tree's fused convolution (docs/tree-semantics.md): each token convolves over its
own root path. Only the conv tree kernels import it, so an edit here leaves every other
kernel's digest (and its tuned studies) alone."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16

from kdagen.dsl.common import bf16, bf16_broadcast, mul_bf16x2, pack_bf16x2, pack_f32_bf16x2
from kdagen.dsl.verify import conv_output, settle_doubts


@cute.jit
def conv_silu_tree(
    hist: cute.Tensor, raw: cute.Tensor, taps: cute.Tensor, links: cute.Tensor,
    lean: cutlass.Constexpr[bool],
):  # fmt: skip
    """``conv_silu`` over a token tree (``links[t]``: token t's parent, anything but an
    earlier token makes t a root): token t's window is its own root path, its three nearest
    ancestors oldest first and history rows where the path is shorter
    (docs/tree-semantics.md). Lag l of token t is lag l - 1 of its parent (history row
    3 - l at a root), taken by selects over the earlier tokens: registers are not indexable.
    The products, sums and rounding are ``conv_silu``'s, token by token."""
    window = raw.shape[1]
    pre = cute.make_rmem_tensor((window,), Float32)
    f32_taps = cutlass.const_expr(taps.element_type == Float32)
    as_bits = cutlass.const_expr(not (lean or f32_taps))
    if cutlass.const_expr(as_bits):
        hist_bits = cute.recast_tensor(hist, Uint16)
        raw_bits = cute.recast_tensor(raw, Uint16)
    for x in cutlass.range_constexpr(3):
        doubts = Int32(0)
        if cutlass.const_expr(as_bits):
            rows = [hist_bits[x, i] for i in range(3)]
            lags = [[raw_bits[x, t] for t in range(window)]]
        else:
            rows = [hist[x, i].to(Float32) for i in range(3)]
            lags = [[raw[x, t].to(Float32) for t in range(window)]]
        for lag in cutlass.range_constexpr(1, 4):
            nearer = lags[-1]
            values = []
            for t in cutlass.range_constexpr(window):
                value = rows[3 - lag]
                for i in cutlass.range_constexpr(t):
                    value = cutlass.select_(links[t] == i, nearer[i], value)
                values.append(value)
            lags.append(values)
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

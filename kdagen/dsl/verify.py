"""The per-channel work both verify kernels (sm90_wgmma, sm100_tcgen05) do the same way: the
window and conv loads, the conv roll and convolution, Kimi-Linear's gate, the squared norms
and the normalised q, k. Thread c owns channel c; ``Q`` is read from the register tensors'
static shapes. ``lean`` (a Constexpr): the register-lean forms for a kernel whose registers
are not capped by its launch (sm100): the exact SiLU everywhere, no doubt bits."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint16

from kdagen.dsl.common import (
    at,
    bf16,
    bf16_broadcast,
    load_words,
    mul_bf16x2,
    pack_bf16x2,
    pack_f32_bf16x2,
    silu,
    silu_fast,
    silu_settled,
    warp_reduce_scatter,
)

K = 128  # head dim (V = K)
LOG2_E = 1.4426950408889634


@cute.jit
def load_window(
    acts: tuple, raw_g: cute.Tensor, bos: Int32, qlen: Int32, head: Int32, c: Int32,
    raw: cute.Tensor, g_raw: cute.Tensor,
):  # fmt: skip
    """Channel c of every window token's q, k, v (``acts``) into ``raw[x, t]`` and of raw g
    into ``g_raw[t]``; tokens past qlen repeat the last one (in bounds, unused)."""
    for t in cutlass.range_constexpr(raw.shape[1]):
        row = bos + cutlass.min(t, qlen - 1)
        for x in cutlass.range_constexpr(3):
            raw[x, t] = acts[x][row, head * K + c]
        g_raw[t] = raw_g[row, head * K + c]


@cute.jit
def load_conv_inputs(
    conv_state: cute.Tensor, conv_w: cute.Tensor, slot, first: Int32, head: Int32, c: Int32,
    hist: cute.Tensor, taps: cute.Tensor, dim_first: cutlass.Constexpr[bool],
):  # fmt: skip
    """Channel c of each channel block (q, k, v): its 3 history rows from row ``first`` of the
    conv state into ``hist[x, i]`` and its 4 taps into ``taps`` (fp32 taps one per element;
    bf16 taps as two packed words in one vector load)."""
    blocks = conv_w.shape[0] // 3  # H K channels per block
    for x in cutlass.range_constexpr(3):
        channel = x * blocks + head * K + c
        for i in cutlass.range_constexpr(3):
            if cutlass.const_expr(dim_first):
                hist[x, i] = conv_state[slot, channel, first + i]
            else:
                hist[x, i] = conv_state[slot, first + i, channel]
        if cutlass.const_expr(taps.element_type == Float32):
            for j in cutlass.range_constexpr(4):
                taps[x, j] = conv_w[channel, j]
        else:
            w2 = load_words(at(conv_w, channel, 0), count=2)
            taps[x, 0], taps[x, 1] = w2[0], w2[1]


@cute.jit
def roll_conv_state(
    conv_state: cute.Tensor, slot, head: Int32, c: Int32, hist: cute.Tensor,
    raw: cute.Tensor, qlen: Int32, dim_first: cutlass.Constexpr[bool],
):  # fmt: skip
    """The rolled conv state of channel c: the last 2 history rows, then the raw tokens."""
    blocks = conv_state.shape[1 if dim_first else 2] // 3
    for x in cutlass.range_constexpr(3):
        channel = x * blocks + head * K + c
        for i in cutlass.range_constexpr(2):
            if cutlass.const_expr(dim_first):
                conv_state[slot, channel, i] = hist[x, i + 1]
            else:
                conv_state[slot, i, channel] = hist[x, i + 1]
        for t in cutlass.range_constexpr(raw.shape[1]):
            if t < qlen:
                if cutlass.const_expr(dim_first):
                    conv_state[slot, channel, 2 + t] = raw[x, t]
                else:
                    conv_state[slot, 2 + t, channel] = raw[x, t]


@cute.jit
def conv_silu(
    hist: cute.Tensor, raw: cute.Tensor, taps: cute.Tensor, lean: cutlass.Constexpr[bool]
):
    """The width-4 convolution and SiLU of each channel block, in the stock kernel's order,
    over ``raw`` in place. FP32 taps: fp32 products (fma). BF16 taps: products rounded to
    bf16 (two tokens per mul.bf16x2, the same rounding), summed in fp32 from 0. The output
    rounds to bf16. Not ``lean``: each block's Q outputs take the fast SiLU with one doubt bit
    each, and one loop per block settles the doubted ones (no branch between outputs, so
    their chains overlap)."""
    window = raw.shape[1]
    pre = cute.make_rmem_tensor((window,), Float32)
    if cutlass.const_expr(taps.element_type == Float32):
        for x in cutlass.range_constexpr(3):
            doubts = Int32(0)
            w = [taps[x, j] for j in range(4)]
            win = [hist[x, i].to(Float32) for i in range(3)]
            win += [raw[x, t].to(Float32) for t in range(window)]
            for t in cutlass.range_constexpr(window):
                acc = Float32(0)
                for j in cutlass.range_constexpr(4):
                    acc = cute.math.fma(win[t + j], w[j], acc)
                doubts = conv_output(raw, x, t, acc, pre, doubts, lean)
            if cutlass.const_expr(not lean):
                settle_doubts(raw, x, pre, doubts)
    else:
        if cutlass.const_expr(not lean):
            hist_bits = cute.recast_tensor(hist, Uint16)
            raw_bits = cute.recast_tensor(raw, Uint16)
        for x in cutlass.range_constexpr(3):
            doubts = Int32(0)
            w = [bf16_broadcast(taps[x, j // 2], j % 2) for j in range(4)]
            if cutlass.const_expr(lean):
                # The window widened to fp32 and packed back in pairs (exact); the bit
                # patterns' permute costs the register-lean build a stack frame.
                win = [hist[x, i].to(Float32) for i in range(3)]
                win += [raw[x, t].to(Float32) for t in range(window)]
                win.append(Float32(0))  # the odd window's unused partner
                last = (window - 1) // 2 * 2 + 3  # the last window row an even token reads
                packed = [pack_f32_bf16x2(win[m], win[m + 1]) for m in range(last + 1)]
            else:
                # The window's bf16 bit patterns, packed in pairs as they are.
                win = [hist_bits[x, i] for i in range(3)]
                win += [raw_bits[x, t] for t in range(window)]
                win.append(Uint16(0))  # the odd window's unused partner
                last = (window - 1) // 2 * 2 + 3
                packed = [pack_bf16x2(win[m], win[m + 1]) for m in range(last + 1)]
            for t in cutlass.range_constexpr(0, window, 2):
                products = [mul_bf16x2(packed[t + j], w[j]) for j in range(4)]
                for h in cutlass.range_constexpr(min(2, window - t)):
                    acc = Float32(0)
                    for j in cutlass.range_constexpr(4):
                        acc = acc + bf16(products[j], h)
                    doubts = conv_output(raw, x, t + h, acc, pre, doubts, lean)
            if cutlass.const_expr(not lean):
                settle_doubts(raw, x, pre, doubts)


@cute.jit
def conv_output(
    raw: cute.Tensor, x: cutlass.Constexpr[int], t: cutlass.Constexpr[int], acc: Float32,
    pre: cute.Tensor, doubts: Int32, lean: cutlass.Constexpr[bool],
) -> Int32:  # fmt: skip
    """Conv output ``raw[x, t]`` from its fp32 sum: the exact SiLU (``lean``), or the fast one
    with its doubt bit set in the returned ``doubts`` and the sum kept in ``pre[t]``."""
    if cutlass.const_expr(lean):
        raw[x, t] = silu(acc).to(BFloat16)
    else:
        y, doubt = silu_fast(acc)
        raw[x, t] = y.to(BFloat16)
        pre[t] = acc
        doubts = doubts | (doubt << t)
    return doubts


@cute.jit
def settle_doubts(raw: cute.Tensor, x: cutlass.Constexpr[int], pre: cute.Tensor, doubts: Int32):
    """The exact SiLU for the doubted outputs of channel block x (a warp enters the loop for
    about one block in five), one output per pass: one copy of the exact form per block, its
    input and result moved by selects. One copy per output (24 per unit at Q = 8) was rarely
    run code that cost 7 % at B = 512."""
    window = raw.shape[1]
    while doubts != 0:
        low = doubts & (Int32(0) - doubts)  # the first doubted output
        value = pre[0]
        for t in cutlass.range_constexpr(1, window):
            value = Float32(cutlass.select_(low == (1 << t), pre[t], value))
        exact = silu_settled(value).to(BFloat16)
        for t in cutlass.range_constexpr(window):
            raw[x, t] = BFloat16(cutlass.select_(low == (1 << t), exact, raw[x, t]))
        doubts = doubts ^ low


@cute.jit
def softplus_gate(
    g: BFloat16, bias: Float32, a: Float32, floor: cutlass.Constexpr[float]
) -> Float32:
    """One token's log decay under Kimi-Linear's gate, -exp(a_log) softplus(g + dt_bias)
    (``a`` = exp(a_log)), held at -``floor``: the gate has no lower bound, and the closed
    form's factors must stay within exp(+-64)."""
    x = g.to(Float32) + bias
    soft = cute.math.log(
        Float32(1) + cute.math.exp(x, fastmath=True), fastmath=True
    )  # softplus, x itself above 20 (the models' threshold)
    return cutlass.max(-a * Float32(cutlass.select_(x > Float32(20), x, soft)), Float32(-floor))


@cute.jit
def norm_sums(qv: cute.Tensor, kv: cute.Tensor, norms: cute.Tensor, quarter: Int32, lane: Int32):
    """This warp's part of the squared norms of the tokens in ``qv``, ``kv``: reduce-scattered
    over the warp (lane l ends with sum l // stride: q^2 of token j at 2j, k^2 at 2j + 1),
    stored into ``norms[quarter, ...]`` (summed over the warps by the readers)."""
    count = qv.shape[0]
    stride = 32 // (1 << (2 * count - 1).bit_length())  # lanes per sum after the scatter
    squares = []
    for j in cutlass.range_constexpr(count):
        squares += [qv[j] * qv[j], kv[j] * kv[j]]
    squares += [Float32(0)] * (32 // stride - 2 * count)
    square_sum = warp_reduce_scatter(squares, lane)
    if (lane % stride == 0) & (lane < 2 * count * stride):
        norms[quarter, lane // stride] = square_sum


@cute.jit
def inverse_norms(norms: cute.Tensor, lane: Int32) -> Float32:
    """One inverse norm per lane, once per unit: lane 2 j holds 1 / |q_j| times K^-0.5, lane
    2 j + 1 holds 1 / |k_j| (the squared norms summed over the 4 channel quarters of
    ``norms``). ``shuffled_qk`` reads them from there: one shuffle per value instead of
    8 shared loads, 6 adds and 2 rsqrt per thread and token."""
    norm_at = cutlass.min(lane, norms.shape[1] - 1)
    norm_sq = (norms[0, norm_at] + norms[1, norm_at]) + (norms[2, norm_at] + norms[3, norm_at])
    inv_norm = cute.math.rsqrt(norm_sq + Float32(1e-6), fastmath=True)
    return inv_norm * Float32(
        cutlass.select_(norm_at % 2 == 0, Float32(K**-0.5), Float32(1))
    )  # q's scale folded in


@cute.jit
def shuffled_qk(qv: cute.Tensor, kv: cute.Tensor, inv_norm: Float32, j: cutlass.Constexpr[int]):
    """Token j's normalised (q_n, k_n) of this channel, the inverse norms shuffled from the
    lanes of ``inverse_norms``."""
    q_n = qv[j] * cute.arch.shuffle_sync(inv_norm, 2 * j)
    k_n = kv[j] * cute.arch.shuffle_sync(inv_norm, 2 * j + 1)
    return q_n, k_n


@cute.jit
def normalized_qk(qv: cute.Tensor, kv: cute.Tensor, norms: cute.Tensor, t: cutlass.Constexpr[int]):
    """Token t's normalised (q_n, k_n) of this channel from the per-warp squared norms."""
    sq = (norms[0, 2 * t] + norms[1, 2 * t]) + (norms[2, 2 * t] + norms[3, 2 * t])
    sk = (norms[0, 2 * t + 1] + norms[1, 2 * t + 1]) + (norms[2, 2 * t + 1] + norms[3, 2 * t + 1])
    q_n = qv[t] * cute.math.rsqrt(sq + Float32(1e-6), fastmath=True) * Float32(K**-0.5)
    k_n = kv[t] * cute.math.rsqrt(sk + Float32(1e-6), fastmath=True)
    return q_n, k_n

"""The softplus gate past 8 tokens (docs/tree-semantics.md): two bands of log decay.

Each token's log decay is held at -16 (as at Q = 8), so a 16-token root path reaches G = -256,
twice the span one reference keeps within exp(+-64). Per channel a token is *near* while
``exp(G - NEAR_REF) >= 2^-92`` (G >= -127.8), with its coupling factors relative to
``NEAR_REF = -64``, and *far* below that, relative to 2^-184 lower: a running product moves
into the far band by an exact power of two. A descendant is never nearer than its ancestor, so
every ancestor pair lies whole in one band's pass of the coupling MMAs: both near, or the
descendant far (a near ancestor's far-band w is at most exp(-64), and flushes only where the
true coupling is below exp(-23)). On Hopper the two passes' sums add (the helpers below), the
far pass only in a warp where some channel reaches the far band; the Blackwell kernel, whose
coupling products are per-thread fp32, takes each product's w in its token's band.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kdagen.dsl.common import ldmatrix_x4, mma_bf16_16816
from kdagen.dsl.sm90 import store_probe, store_w, w_address

GATE_FLOOR = 16.0  # each token's log decay held at -16, the Q = 8 kernels' floor
NEAR_REF = -64.0  # the near band's reference log decay
FAR_REF = NEAR_REF - 184 * math.log(2)  # the far band's, 2^-184 lower
FAR_LOG_EDGE = NEAR_REF - 92 * math.log(2)  # G below it: the far band
# Hopper's running products: exp(G - NEAR_REF) from a root's exp(64), moved by 2^184 exactly.
NEAR_ROOT = math.exp(-NEAR_REF)  # exp(G - NEAR_REF) at G = 0
DECAY_SCALE = math.exp(NEAR_REF)  # exp(G) = exp(G - NEAR_REF) x DECAY_SCALE
FAR_EDGE = 2.0**-92  # a near product below it moves to the far band
HALF_MOVE = 2.0**92  # the move's 2^184 in two exact steps (2^184 is past fp32's range)


@cute.jit
def band_step(
    parent: Float32, factor: Float32, far_bits: Int32, ancestor_mask: Int32,
    t: cutlass.Constexpr[int],
) -> tuple[Float32, Int32]:  # fmt: skip
    """Token t's factor relative to its band (its parent's ``parent`` times ``factor``) and
    ``far_bits`` with bit t set when t is far: its parent is (some bit of ``ancestor_mask``
    is), or the product just fell below ``FAR_EDGE`` and moves down by 2^184."""
    value = parent * factor
    parent_far = (far_bits & ancestor_mask) != 0
    crossing = value < Float32(FAR_EDGE)
    moved = cutlass.select_(crossing, value * Float32(HALF_MOVE) * Float32(HALF_MOVE), value)
    value = cutlass.select_(parent_far, value, moved)
    far = cutlass.select_(parent_far, Int32(1 << t), Int32(0))
    far = far | cutlass.select_(crossing, Int32(1 << t), Int32(0))
    return value, far_bits | far


@cute.jit
def store_far_band(
    nears: cute.Tensor, far_bits: Int32, qv: cute.Tensor, kv: cute.Tensor, couple_at: Int32,
    w_at: Int32,
):  # fmt: skip
    """The far band's coupling operands of this thread's channel (``qv``, ``kv``: the
    normalised q, k): a far token's probes and w, zero probes for a near token, whose
    far-band w is its near one times 2^-184."""
    window = nears.shape[0]
    for t in cutlass.range_constexpr(window):
        far = ((far_bits >> t) & 1) != 0
        near = cutlass.select_(far, nears[t], Float32(0))
        for n, value in ((t, near * kv[t]), (window + t, near * qv[t])):
            store_probe(couple_at, n, value)
        w = cute.arch.rcp_approx(nears[t])
        w = cutlass.select_(far, w, w * Float32(1 / HALF_MOVE) * Float32(1 / HALF_MOVE))
        store_w(w_at + t // 8 * 1024, t % 8, w * kv[t])


@cute.jit
def add_far_band(
    w_stage: Int32, b_base: Int32, partial: cute.Tensor, warp: Int32, lane: Int32,
    cols: cutlass.Constexpr[int],
):  # fmt: skip
    """The far band's coupling sums over this warp's 32 channels, added to the near band's in
    ``partial``: the wide kernel's mma.sync m16n8k16 (A = w, two 16-row tiles; B = the coupling
    probe tile's ``cols`` columns), each lane adding to the entries it stored."""
    quad, row8 = lane // 8, lane % 8
    a_frags = []  # tile h, k-step ks at 2 h + ks
    for h in cutlass.range_constexpr(2):
        for ks in cutlass.range_constexpr(2):
            a_row = row8 + 8 * (quad % 2)
            a_frags.append(ldmatrix_x4(w_address(w_stage + h * 1024, a_row, 2 * ks + quad // 2)))
    b_frags = []
    for nt in cutlass.range_constexpr(cols // 8):
        b_frags.append(ldmatrix_x4(b_base + nt * 1024))
    g, t4 = lane // 4, lane % 4
    sums = []
    for nt in cutlass.range_constexpr(cols // 8):
        b = b_frags[nt]
        for h in cutlass.range_constexpr(2):
            d = mma_bf16_16816(a_frags[2 * h], (b[0], b[1]), (Float32(0),) * 4)
            d = mma_bf16_16816(a_frags[2 * h + 1], (b[2], b[3]), d)
            sums.append((d[0] + d[1]) + (d[2] + d[3]))
    for nt in cutlass.range_constexpr(cols // 8):
        for h in cutlass.range_constexpr(2):
            at = (4 * nt + t4) * 16 + 8 * h + g
            partial[warp, at] = partial[warp, at] + sums[2 * nt + h]

"""A window's raw q, k, v and g held a channel pair to a register (the Hopper verify past 8
tokens at three CTAs an SM, ``kdagen.render.three_ctas_wide``).

Thread c owns channel c, and ptxas keeps each 16-bit load in a 32-bit register of its own: the
next unit's window, loaded one unit ahead, took 4 Q registers a thread and spilled at the 168
that three CTAs leave. Here lanes c and c ^ 1 each load the 32-bit words of their channel pair
(c & ~1, c | 1) for every other token (lane parity p: tokens 2 j + p) and swap them with one
shuffle where they are used: 2 Q registers, half the loads, and kg's raw k and g stored a word
(both channels) at a time by the lane that loaded it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kdagen.dsl.common import at

K = 128  # head dim (V = K)


@cute.jit
def load_word(address: Int64) -> Uint32:
    """One 32-bit word from global memory (a coherent load, as the window's 16-bit ones are:
    the previous launch may have written it just before this one's griddepcontrol.wait)."""
    return cute.arch.inline_ptx(
        "ld.global.b32 {$w0}, [{$r0}];", write_only_types=[Uint32], read_only_args=[address]
    )


@cute.jit
def store_word(address: Int64, word: Uint32):
    """One 32-bit word to global memory."""
    cute.arch.inline_ptx("st.global.b32 [{$r0}], {$r1};", read_only_args=[address, word])


@cute.jit
def load_window_pairs(
    acts: tuple, raw_g: cute.Tensor, bos: Int32, qlen: Int32, head: Int32, c: Int32,
    pairs: cute.Tensor, window: cutlass.Constexpr[int],
):  # fmt: skip
    """Channel pair (c & ~1, c | 1) of q, k, v and g of token 2 j + c % 2 into ``pairs[x, j]``
    (x: q, k, v, g; the lower channel in the low half); tokens past the window's last (qlen
    and Q, the odd window's extra slot included) repeat it (in bounds, unused)."""
    parity = c % 2
    col = head * K + c - parity
    last = cutlass.min(qlen, Int32(window)) - 1
    for j in cutlass.range_constexpr(pairs.shape[1]):
        row = bos + cutlass.min(2 * j + parity, last)
        for x in cutlass.range_constexpr(3):
            pairs[x, j] = load_word(at(acts[x], row, col))
        pairs[3, j] = load_word(at(raw_g, row, col))


@cute.jit
def half_selector(c: Int32) -> Uint32:
    """The byte permute that moves channel c's half of a pair word to the top, zeros below:
    the bf16 value's fp32 bits."""
    return cutlass.select_(c % 2 == 0, Uint32(0x1044), Uint32(0x3244))


@cute.jit
def as_f32(word: Uint32, selector: Uint32) -> Float32:
    """The bf16 half of ``word`` that ``selector`` (``half_selector``) picks, as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "prmt.b32 {$w0}, {$r0}, 0, {$r1};",
        write_only_types=[Float32],
        read_only_args=[word, selector],
    )


@cute.jit
def unpack_window(pairs: cute.Tensor, x: cutlass.Constexpr[int], c: Int32, window: int) -> list:
    """Channel c's fp32 values of tensor ``x`` (q, k, v, g) for the ``window`` tokens: per
    token pair one shuffle gives each lane its partner's word."""
    parity = c % 2
    selector = half_selector(c)
    values = []
    for j in cutlass.range_constexpr((window + 1) // 2):
        mine = pairs[x, j]
        theirs = cute.arch.shuffle_sync_bfly(mine, offset=1)
        values.append(as_f32(cutlass.select_(parity == 0, mine, theirs), selector))
        if cutlass.const_expr(2 * j + 1 < window):
            values.append(as_f32(cutlass.select_(parity == 0, theirs, mine), selector))
    return values


@cute.jit
def store_kg_pairs(
    kg: cute.Tensor, record: Int32, head: Int32, pairs: cute.Tensor, qlen: Int32, c: Int32,
    window: cutlass.Constexpr[int],
):  # fmt: skip
    """kg's raw k and raw g of the window's tokens (below qlen and Q), each word (a channel
    pair) by the lane that loaded it."""
    parity = c % 2
    tokens = cutlass.min(qlen, Int32(window))
    for j in cutlass.range_constexpr(pairs.shape[1]):
        t = 2 * j + parity
        if t < tokens:
            store_word(at(kg, record, head, t, c - parity), pairs[1, j])
            store_word(at(kg, record, head, t, K + c - parity), pairs[3, j])

"""A token tree's fused convolution past 8 tokens with each lag of q, k and v and the place of
the next one loaded together (docs/tree-semantics.md).

Each staged row is one 8-byte record in this thread's bytes of shared memory: its q and k
bits in the first word, its v bits and its parent row's byte offset in the second (a token's
parent token, or the newest history row at a root; a history row's older one, row 0's
itself). Lag l of token t is the record l - 1 parents above t's parent: one address and two
loads a lag for all three blocks, the chase run once a token. The records are written once a
unit, before any output overwrites its raw row. The products, sums and rounding are
``conv_silu_tree``'s, so the outputs are its bits. (docs/history/trees.md measures it against
the table of chased parent indexes it replaced: 2-6 % fewer instructions, the trees 1-6 %
faster.)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16, Uint32

from kdagen.dsl.common import bf16, bf16_broadcast, mul_bf16x2, pack_bf16x2, pack_f32_bf16x2
from kdagen.dsl.verify import conv_output, settle_doubts

HISTORY = 3  # records 0..2: the history, oldest first; record 3 + t: raw token t
RECORD = 8  # bytes a record; a parent is named by its record's byte offset
# Where each block's bits sit in a record: (word, half); the parent offset is (1, 1).
BLOCK_HALVES = ((0, 0), (0, 1), (1, 0))


@cute.jit
def halves_of(lo: Uint32, hi: Uint32, half: cutlass.Constexpr[int]) -> Uint32:
    """Half ``half`` of two records' words as one packed bf16 pair (``lo``'s in the low half)."""
    selector = 0x5410 if half == 0 else 0x7632
    return cute.arch.inline_ptx(
        f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector};",
        write_only_types=[Uint32],
        read_only_args=[lo, hi],
    )


@cute.jit
def word_at(scratch: Int32, offset: Int32) -> Uint32:
    """The 32-bit word ``offset`` bytes past ``scratch``."""
    return cute.make_tensor(
        cute.make_ptr(Uint32, scratch + offset, cute.AddressSpace.smem, assumed_align=4),
        cute.make_layout(1),
    )[0]


@cute.jit
def stage_records(
    hist_bits: cute.Tensor, raw_bits: cute.Tensor, links: cute.Tensor, halves: cute.Tensor
):  # fmt: skip
    """Every row's record (``halves[h, r]``, h = 2 word + half): q, k and v bits and the
    parent's byte offset."""
    window = raw_bits.shape[1]
    for r in cutlass.range_constexpr(HISTORY + window):
        for x in cutlass.range_constexpr(3):
            word, half = BLOCK_HALVES[x]
            bits = hist_bits[x, r] if r < HISTORY else raw_bits[x, r - HISTORY]
            halves[2 * word + half, r] = bits
        if cutlass.const_expr(r < HISTORY):
            halves[3, r] = Uint16(max(r - 1, 0) * RECORD)
        else:
            t = r - HISTORY
            parent = links[t]
            earlier = (parent >= 0) & (parent < t)
            row = Int32(cutlass.select_(earlier, parent + HISTORY, Int32(HISTORY - 1)))
            halves[3, r] = (row * RECORD).to(Uint16)


@cute.jit
def chase_lags(scratch: Int32, t: cutlass.Constexpr[int]) -> list:
    """Token t's lags 1..3, each its record's two words (q | k, v | parent)."""
    own = word_at(scratch, Int32((HISTORY + t) * RECORD + 4))
    place = scratch + Int32(own >> 16)
    lags = []
    for lag in cutlass.range_constexpr(3):
        first = word_at(place, Int32(0))
        second = word_at(place, Int32(4))
        lags.append((first, second))
        if cutlass.const_expr(lag < 2):
            place = scratch + Int32(second >> 16)
    return lags


@cute.jit
def conv_silu_tree_records(
    hist: cute.Tensor, raw: cute.Tensor, taps: cute.Tensor, links: cute.Tensor, scratch: Int32,
    lean: cutlass.Constexpr[bool],
):  # fmt: skip
    """``conv_silu_tree`` with each lag of all three blocks loaded from a record that also
    names the next one: this thread's 8 (Q + 3) bytes of shared memory at ``scratch``, which
    no other thread reads or writes during the call."""
    window = raw.shape[1]
    f32_taps = cutlass.const_expr(taps.element_type == Float32)
    as_bits = cutlass.const_expr(not (lean or f32_taps))
    hist_bits = cute.recast_tensor(hist, Uint16)
    raw_bits = cute.recast_tensor(raw, Uint16)
    halves = cute.make_tensor(
        cute.make_ptr(Uint16, scratch, cute.AddressSpace.smem, assumed_align=4),
        cute.make_layout((4, HISTORY + window), stride=(1, 4)),
    )
    stage_records(hist_bits, raw_bits, links, halves)
    pres = [cute.make_rmem_tensor((window,), Float32) for _ in range(3)]
    doubts = [Int32(0), Int32(0), Int32(0)]
    if cutlass.const_expr(f32_taps):
        for t in cutlass.range_constexpr(window):
            lags = chase_lags(scratch, t)
            for x in cutlass.range_constexpr(3):
                word, half = BLOCK_HALVES[x]
                acc = Float32(0)
                for j in cutlass.range_constexpr(4):  # oldest first: lag 3 - j
                    value = bf16(lags[2 - j][word], half) if j < 3 else raw[x, t].to(Float32)
                    acc = cute.math.fma(value, taps[x, j], acc)
                doubts[x] = conv_output(raw, x, t, acc, pres[x], doubts[x], lean)
    else:
        ws = [[bf16_broadcast(taps[x, j // 2], j % 2) for j in range(4)] for x in range(3)]
        for t in cutlass.range_constexpr(0, window, 2):
            pair = cutlass.const_expr(t + 1 < window)
            lags = chase_lags(scratch, t)
            partner = chase_lags(scratch, t + 1) if pair else lags  # the odd window's last
            for x in cutlass.range_constexpr(3):
                word, half = BLOCK_HALVES[x]
                w = ws[x]
                products = []
                for j in cutlass.range_constexpr(3):
                    lo, hi = lags[2 - j][word], partner[2 - j][word]
                    if cutlass.const_expr(as_bits):
                        products.append(mul_bf16x2(halves_of(lo, hi, half), w[j]))
                    else:
                        packed = pack_f32_bf16x2(bf16(lo, half), bf16(hi, half))
                        products.append(mul_bf16x2(packed, w[j]))
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
                    doubts[x] = conv_output(raw, x, t + h, acc, pres[x], doubts[x], lean)
    if cutlass.const_expr(not lean):
        for x in cutlass.range_constexpr(3):
            settle_doubts(raw, x, pres[x], doubts[x])

"""The probe and w tiles of the wide Hopper verify (64 B columns) written a channel row at a
time.

The tile is the wgmma B operand, MN-major with the 128-byte swizzle: channel c's row is 128
bytes at ``c * 128``, its 16-byte chunk j (B columns 8 j .. 8 j + 7) at chunk ``j ^ (c % 8)``.
Column 2 n holds probe n's bf16 hi and 2 n + 1 its lo, so one 32-bit word is a probe and a
thread owning channel c writes its 32 probes as 8 16-byte stores (instead of 64 two-byte ones
into the K-major tile's columns), and its hi / lo split packs both halves in one conversion.
The coupling MMAs read the same tile with ``ldmatrix.trans``: a lane's row is its own
channel's, and the transposed 8 x 8 matrices are the m16n8k16 B fragments of the K-major tile.

The w tiles (the coupling MMAs' A operands, 8 tokens a tile) likewise: a channel's 32-byte row
holds its 8 tokens' hi, then their lo (the A rows 0..7 and 8..15), the two halves swapped in
every other group of 4 lanes so that 8 lanes' 16-byte stores and ``ldmatrix.trans`` rows fall
on distinct banks. A thread stores a tile's 8 w values in 2 16-byte stores, and packs two
tokens' hi (or lo) halves in one conversion.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32

from kdagen.dsl.bands import HALF_MOVE
from kdagen.dsl.common import mma_bf16_16816, pack_f32_bf16x2, ptx_outputs, shared_address

ROW = 128  # bytes of a channel's row: 64 bf16 columns, 32 probes (hi, lo)
CHUNK_PROBES = 4  # probes in a 16-byte chunk
W_ROW = 32  # bytes of a channel's row of a w tile: 8 tokens' hi, then their lo
W_TILE = 32 * W_ROW  # a warp's 32 channels


@cute.jit
def probe_row_at(tile: cute.Tensor, c: Int32) -> Int32:
    """Channel ``c``'s row of the probe ``tile`` with its swizzle phase: chunk j is at
    ``row_at ^ (16 j)`` (the tile is 1024-byte aligned, so the XOR stays in the row)."""
    return shared_address(tile.iterator) + c * ROW + (c % 8) * 16


@cute.jit
def probe_word(value: Float32) -> Uint32:
    """``value`` as bf16 hi (low half) and the bf16 of its remainder (high half): the
    ``bf16_split`` halves of a probe, packed by one conversion."""
    hi = value.to(BFloat16).to(Float32)
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};",
        write_only_types=[Uint32],
        read_only_args=[value, value - hi],
    )


@cute.jit
def store_chunk(row_at: Int32, j: cutlass.Constexpr[int], words: list):
    """16-byte chunk ``j`` of this thread's row (a probe row's probes 4 j .. 4 j + 3, a w
    row's hi or lo half): one store of 4 words."""
    cute.arch.inline_ptx(
        "st.shared.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[row_at ^ Int32(16 * j), *words],
    )


def probe_row(window: int) -> tuple[list, list]:
    """A row to fill: a word per probe slot (None until computed; the padding slots past the
    window's 2 ``window`` probes zero) and a stored flag per chunk."""
    slots = ROW // 4
    words = [None] * (2 * window) + [Uint32(0)] * (slots - 2 * window)
    return words, [False] * (slots // CHUNK_PROBES)


def store_ready_chunks(row_at: Int32, words: list, stored: list):
    """Each chunk of ``words`` (a probe's word, or None where not computed yet) whose four
    probes are all there and that ``stored`` (a flag a chunk) has not stored yet. Runs while
    the kernel is traced (plain Python over the unrolled window), so a chunk is stored right
    after its last probe."""
    for j, done in enumerate(stored):
        chunk = words[CHUNK_PROBES * j : CHUNK_PROBES * (j + 1)]
        if not done and all(word is not None for word in chunk):
            store_chunk(row_at, j, chunk)
            stored[j] = True


@cute.jit
def ldmatrix_x4_trans(address: Int32) -> tuple:
    """Four 8 x 8 bf16 matrices, transposed (``ldmatrix.trans``): lanes 8j..8j+7 give the
    row addresses of matrix j; lane l gets column l // 4, rows 2 (l % 4) and 2 (l % 4) + 1."""
    return cute.arch.inline_ptx(
        f"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{ptx_outputs(4)}}}, [{{$r0}}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[address],
    )


@cute.jit
def transposed_fragments(row_at: Int32, n_tile: cutlass.Constexpr[int]) -> tuple:
    """The coupling MMAs' B fragments of columns 8 ``n_tile`` .. + 7 over this warp's 32
    channels (lane l gives its own channel's chunk): words 0, 1 for channels 0..15 of the
    warp, 2, 3 for 16..31, as ``ldmatrix_x4`` reads the K-major tile."""
    return ldmatrix_x4_trans(row_at ^ Int32(16 * n_tile))


@cute.jit
def w_row_at(w_stage: Int32, lane: Int32) -> Int32:
    """This lane's row of its warp's first w tile (``w_stage``, 32-byte aligned) with the
    halves' swap: the hi half at ``row_at ^ 0``, the lo half at ``row_at ^ 16``; tile h at
    ``+ h W_TILE``."""
    return w_stage + lane * W_ROW + (lane // 4 % 2) * 16


@cute.jit
def split_pair(even: Float32, odd: Float32) -> tuple:
    """Two tokens' w values as their packed bf16 hi and packed bf16 lo (``bf16_split``'s
    halves, even token in the low half)."""
    hi = pack_f32_bf16x2(even, odd)
    hi_even = cute.arch.inline_ptx(
        "shl.b32 {$w0}, {$r0}, 16;", write_only_types=[Float32], read_only_args=[hi]
    )
    hi_odd = cute.arch.inline_ptx(
        "and.b32 {$w0}, {$r0}, 0xffff0000;", write_only_types=[Float32], read_only_args=[hi]
    )
    return hi, pack_f32_bf16x2(even - hi_even, odd - hi_odd)


@cute.jit
def store_w_row(row_at: Int32, values: list):
    """A w tile's row of this thread's channel from its 8 tokens' values: 2 16-byte stores."""
    his, los = [], []
    for i in cutlass.range_constexpr(4):
        hi, lo = split_pair(values[2 * i], values[2 * i + 1])
        his.append(hi)
        los.append(lo)
    store_chunk(row_at, 0, his)
    store_chunk(row_at, 1, los)


@cute.jit
def w_fragment_at(w_stage: Int32, lane: Int32) -> Int32:
    """The row this lane gives ``transposed_w_fragments`` for the first tile and k-step: the
    matrices are tokens' hi over the k-step's channels 0..7, their lo, hi over 8..15, lo over
    8..15, so lane l names channel 8 (l // 16) + l % 8's half (l // 8) % 2. A k-step is 16
    channels (``+ 16 W_ROW``), a tile ``+ W_TILE``."""
    channel = 8 * (lane // 16) + lane % 8
    return w_stage + channel * W_ROW + ((lane // 8 % 2) ^ (lane // 4 % 2)) * 16


@cute.jit
def transposed_w_fragments(
    first_at: Int32, tile: cutlass.Constexpr[int], k_step: cutlass.Constexpr[int]
) -> tuple:
    """One mma.sync A fragment of w tile ``tile`` and k-step ``k_step`` (16 channels), from
    ``w_fragment_at``'s row."""
    return ldmatrix_x4_trans(first_at + Int32(tile * W_TILE + k_step * 16 * W_ROW))


def store_ready_w(row_at: Int32, values: list, window: int):
    """After token ``len(values) - 1``'s w value: its tile's row once the tile's 8 tokens (or
    the window's last; the rows of tokens past it zero) are there. Runs while the kernel is
    traced, as ``store_ready_chunks``."""
    t = len(values) - 1
    if t % 8 == 7 or t == window - 1:
        first = t // 8 * 8
        row = values[first:] + [Float32(0)] * (first + 8 - len(values))
        store_w_row(row_at + Int32(t // 8 * W_TILE), row)


@cute.jit
def coupling_sums(w_stage: Int32, b_row: Int32, lane: Int32, cols: cutlass.Constexpr[int]) -> list:
    """The coupling MMAs over this warp's 32 channels (mma.sync m16n8k16; A = the w tiles,
    hi rows g and lo rows g + 8 of token 8 h + g; B = the probe tile whose row for this lane's
    channel is at ``b_row``): entry 2 nt + h is lane 4g + t's w_(8h + g) . probe(4 nt + t).
    Every fragment is loaded before the first MMA: for the compiler a store may alias the
    tiles, so a load after one would wait for it."""
    w_first = w_fragment_at(w_stage, lane)
    a_frags = []  # tile h, k-step ks at 2 h + ks
    for h in cutlass.range_constexpr(2):
        for ks in cutlass.range_constexpr(2):
            a_frags.append(transposed_w_fragments(w_first, h, ks))
    b_frags = []
    for nt in cutlass.range_constexpr(cols // 8):
        b_frags.append(transposed_fragments(b_row, nt))
    sums = []
    for nt in cutlass.range_constexpr(cols // 8):
        b = b_frags[nt]
        for h in cutlass.range_constexpr(2):
            d = mma_bf16_16816(a_frags[2 * h], (b[0], b[1]), (Float32(0),) * 4)
            d = mma_bf16_16816(a_frags[2 * h + 1], (b[2], b[3]), d)
            sums.append((d[0] + d[1]) + (d[2] + d[3]))
    return sums


@cute.jit
def store_partials(
    partial: cute.Tensor, warp: Int32, lane: Int32, sums: list, cols: cutlass.Constexpr[int],
    add: cutlass.Constexpr[bool],
):  # fmt: skip
    """This warp's ``coupling_sums`` into its row of ``partial`` (entry 16 probe + token),
    or added to what is there (``add``: the far band's pass)."""
    g, t4 = lane // 4, lane % 4
    for nt in cutlass.range_constexpr(cols // 8):
        for h in cutlass.range_constexpr(2):
            at = (4 * nt + t4) * 16 + 8 * h + g
            if cutlass.const_expr(add):
                partial[warp, at] = partial[warp, at] + sums[2 * nt + h]
            else:
                partial[warp, at] = sums[2 * nt + h]


@cute.jit
def store_far_band_rows(
    nears: cute.Tensor, far_bits: Int32, qv: cute.Tensor, kv: cute.Tensor, couple_row: Int32,
    w_row: Int32,
):  # fmt: skip
    """The softplus gate's far-band coupling operands (``kdagen.dsl.bands``) as channel rows:
    a far token's probes and w, zero probes for a near token, whose far-band w is its near one
    times 2^-184."""
    window = nears.shape[0]
    words, stored = probe_row(window)
    w_values = []
    for t in cutlass.range_constexpr(window):
        far = ((far_bits >> t) & 1) != 0
        near = cutlass.select_(far, nears[t], Float32(0))
        words[t], words[window + t] = probe_word(near * kv[t]), probe_word(near * qv[t])
        store_ready_chunks(couple_row, words, stored)
        w = cute.arch.rcp_approx(nears[t])
        w = cutlass.select_(far, w, w * Float32(1 / HALF_MOVE) * Float32(1 / HALF_MOVE))
        w_values.append(w * kv[t])
        store_ready_w(w_row, w_values, window)

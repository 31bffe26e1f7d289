"""The next unit's window staged in shared memory by ``cp.async`` (the wide one-warpgroup
Hopper verify): a row-major [4, Q, K] bf16 tile of its q, k, v and raw g rows. Sixteen threads
copy a token's 256-byte row in 16-byte pieces, so a thread issues 4 ceil(Q / 8) copies instead
of 4 Q two-byte loads, each with its own 64-bit address; at the unit's activations each thread
reads its channel back (two-byte shared loads at fixed offsets)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from kdagen.dsl.common import at

K = 128  # channels of a head: a row of the tile is 256 bytes, 16 pieces of 16


@cute.jit
def copy_16(dst: Int32, src: Int64):
    """16 bytes global -> shared, asynchronously, cached in L2 only (``cp.async.cg``)."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[dst, src]
    )


@cute.jit
def stage_window(
    acts: tuple, raw_g: cute.Tensor, bos: Int32, qlen: Int32, head: Int32, tid: Int32,
    tile_at: Int32, window: cutlass.Constexpr[int],
):  # fmt: skip
    """One ``cp.async`` group: tokens 0..window-1 of q, k, v (``acts``) and raw g of channel
    block ``head`` into the tile at ``tile_at``; tokens past qlen repeat the last one (in
    bounds, unused), as the register loads do. Thread ``tid`` copies piece tid % 16 of tokens
    tid // 16 + 8 j."""
    piece = tid % 16 * 8  # its first channel
    first = tid // 16
    for j in cutlass.range_constexpr((window + 7) // 8):
        t = first + 8 * j
        row = bos + cutlass.min(t, qlen - 1)
        dst = tile_at + (t * K + piece) * 2
        if cutlass.const_expr(8 * j + 8 <= window):
            _copy_rows(acts, raw_g, row, head * K + piece, dst, window)
        else:
            if t < window:  # a window of 9..15 tokens: its last group of 8 is partial
                _copy_rows(acts, raw_g, row, head * K + piece, dst, window)
    cute.arch.cp_async_commit_group()


@cute.jit
def _copy_rows(
    acts: tuple, raw_g: cute.Tensor, row: Int32, col: Int32, dst: Int32,
    window: cutlass.Constexpr[int],
):  # fmt: skip
    """A 16-byte piece of one token's row of each of q, k, v and g; the tile's blocks are
    window x K x 2 bytes apart."""
    for x in cutlass.range_constexpr(3):
        copy_16(dst + x * (window * K * 2), at(acts[x], row, col))
    copy_16(dst + 3 * (window * K * 2), at(raw_g, row, col))


@cute.jit
def read_window(tile: cute.Tensor, c: Int32, raw: cute.Tensor, g_raw: cute.Tensor):
    """Channel c of the staged window into ``raw[x, t]`` (q, k, v) and ``g_raw[t]``."""
    for t in cutlass.range_constexpr(raw.shape[1]):
        for x in cutlass.range_constexpr(3):
            raw[x, t] = tile[x, t, c]
        g_raw[t] = tile[3, t, c]

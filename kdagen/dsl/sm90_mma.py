"""Device helpers of the small-CTA Hopper verify (path ``sm90_mma``): shared-memory tiles of
bf16 rows with 16-byte chunks XOR-swizzled by row, their warp-level ``mma.sync`` fragments,
asynchronous copies and the scalar shared and global accesses of its stages."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kdagen.dsl.common import bf16_split, ldmatrix_x4, ptx_outputs, store_shared


def swizzled(row, col, row_bytes: int = 256):
    """Byte offset of bf16 element (row, col) of a tile with ``row_bytes``-byte rows: 16-byte
    chunk c of row r sits at chunk c ^ (r & 7), so the 8 row addresses of one ``ldmatrix``
    matrix fall in 8 different bank groups. Plain operators: Python ints or DSL integers."""
    return row * row_bytes + (((col >> 3) ^ (row & 7)) << 4) + ((col & 7) << 1)


@cute.jit
def cp_async_16(dst: Int32, src: Int64, src_bytes: Int32):
    """16 bytes global -> shared, asynchronously; bytes past ``src_bytes`` (0 or 16) are
    zero, so a token past the window lands as zeros without a branch."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
        read_only_args=[dst, src, src_bytes],
    )


@cute.jit
def load_shared_bf16(address: Int32) -> Float32:
    """One bf16 from shared memory, as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 h; ld.shared.b16 h, [{$r0}]; cvt.f32.bf16 {$w0}, h; }",
        write_only_types=[Float32],
        read_only_args=[address],
    )


@cute.jit
def load_shared_word(address: Int32, integer: cutlass.Constexpr[bool] = False):
    """One 32-bit word from shared memory: an fp32 value, or an int32 one with ``integer``."""
    return cute.arch.inline_ptx(
        "ld.shared.b32 {$w0}, [{$r0}];",
        write_only_types=[Int32 if integer else Float32],
        read_only_args=[address],
    )


@cute.jit
def store_shared_word(address: Int32, value):
    """One 32-bit word (fp32 or int32) to shared memory."""
    cute.arch.inline_ptx("st.shared.b32 [{$r0}], {$r1};", read_only_args=[address, value])


@cute.jit
def store_shared_split(value: Float32, hi_address: Int32, lo_address: Int32):
    """``value = hi + lo`` in bf16 halves (``bf16_split``), stored to shared memory."""
    hi, lo = bf16_split(value)
    store_shared(hi_address, hi)
    store_shared(lo_address, lo)


@cute.jit
def store_f32_pair(address: Int64, a: Float32, b: Float32, here: Int32):
    """Two fp32 values at ``address`` where ``here`` is not zero (a predicated store)."""
    cute.arch.inline_ptx(
        "{ .reg .pred p; setp.ne.s32 p, {$r0}, 0; @p st.global.v2.f32 [{$r1}], {{$r2}, {$r3}}; }",
        read_only_args=[here, address, a, b],
    )


@cute.jit
def store_bf16_pair(address: Int64, a: Float32, b: Float32, here: Int32):
    """Two values rounded to bf16 (``a`` at the lower address) where ``here`` is not zero."""
    cute.arch.inline_ptx(
        "{ .reg .pred p; .reg .b32 w; setp.ne.s32 p, {$r0}, 0;"
        " cvt.rn.bf16x2.f32 w, {$r3}, {$r2}; @p st.global.b32 [{$r1}], w; }",
        read_only_args=[here, address, a, b],
    )


@cute.jit
def store_bf16_zero(address: Int64):
    cute.arch.inline_ptx(
        "{ .reg .b16 z; mov.b16 z, 0; st.global.b16 [{$r0}], z; }", read_only_args=[address]
    )


@cute.jit
def ldmatrix_x4_trans(address: Int32) -> tuple:
    """``ldmatrix .trans``: the B fragments of a tile stored [k][n] (row-major in k)."""
    return cute.arch.inline_ptx(
        f"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{ptx_outputs(4)}}}, [{{$r0}}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[address],
    )


@cute.jit
def a_fragment(tile: Int32, k0: Int32, lane: Int32, row_bytes: cutlass.Constexpr[int] = 256):
    """The m16n8k16 A fragment of rows 0-15, columns k0..k0+15 of a swizzled tile: lanes
    8j..8j+7 address matrix j (rows + 8 (j & 1), columns + 8 (j >> 1))."""
    j = lane >> 3
    return ldmatrix_x4(
        tile + swizzled((lane & 7) + ((j & 1) << 3), k0 + ((j >> 1) << 3), row_bytes)
    )


@cute.jit
def b_fragments(tile: Int32, n0: Int32, k0: Int32, lane: Int32,
                row_bytes: cutlass.Constexpr[int] = 256):  # fmt: skip
    """The B fragments of n tiles n0..n0+7 and n0+8..n0+15 (columns k0..k0+15) of a swizzled
    tile whose rows are n: words (0, 1) for the first tile, (2, 3) for the second."""
    j = lane >> 3
    row = n0 + (lane & 7) + ((j >> 1) << 3)
    return ldmatrix_x4(tile + swizzled(row, k0 + ((j & 1) << 3), row_bytes))


@cute.jit
def b_fragments_trans(tile: Int32, n0: Int32, lane: Int32):
    """The B fragments of n tiles n0..n0+7 and n0+8..n0+15 of a swizzled [16 k][128 n] tile
    (``ldmatrix .trans``), words as ``b_fragments``."""
    j = lane >> 3
    return ldmatrix_x4_trans(tile + swizzled((lane & 7) + ((j & 1) << 3), n0 + ((j >> 1) << 3)))


@cute.jit
def small_a_fragment(tile: Int32, lane: Int32):
    """The A fragment of a [16 x 16] bf16 tile with 32-byte rows (no swizzle)."""
    j = lane >> 3
    return ldmatrix_x4(tile + ((lane & 7) + ((j & 1) << 3)) * 32 + ((j >> 1) << 4))

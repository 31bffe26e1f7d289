"""The commit's tensor-core fold (path ``bulk_mma``): 16-byte moves of a lane's state columns
and the bf16 hi + lo pairs its MMA operands are split into. Plain ``@cute.jit`` functions,
called from the commit template."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from kdagen.dsl.common import bf16, pack_f32_bf16x2, ptx_outputs


@cute.jit
def load_shared_words(address: Int32) -> list:
    """Four consecutive 32-bit words (eight bf16) at a 16-byte aligned shared address: the
    shared-memory twin of ``common.load_words``, kept here because an edit of ``common``
    changes the digest of every kernel that imports it (and so stales the tuned tables)."""
    words = cute.arch.inline_ptx(
        f"ld.shared.v4.b32 {{{ptx_outputs(4)}}}, [{{$r0}}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[address],
    )
    return list(words)


@cute.jit
def store_global_words(address: Int64, words: list):
    """Four 32-bit words to a 16-byte aligned global address in one store."""
    cute.arch.inline_ptx(
        "st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[address, *words],
    )


@cute.jit
def split_pair(low: Float32, high: Float32) -> tuple:
    """``common.bf16_split`` of two fp32 values at once, packed: bf16 pairs ``hi`` and ``lo``
    (``low`` in each word's low half, one conversion per pair) with ``value = hi + lo`` to
    about 16 bits: an MMA of the pairs against another such split keeps the products' error
    near 2^-16 of their size, well under the state's bf16 rounding."""
    hi = pack_f32_bf16x2(low, high)  # cvt.rn: rounded to nearest
    lo = pack_f32_bf16x2(low - bf16(hi, 0), high - bf16(hi, 1))
    return hi, lo

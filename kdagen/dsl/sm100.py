"""Blackwell (sm_100a) tensor-core helpers for the verify kernel: TMEM, UMMA descriptors,
``tcgen05.mma`` and ``tcgen05.ld``, and the no-swizzle K-major shared-memory layouts.

Constants (K = V = 128 head dim; THREADS: thread c owns channel c and state row c):
- PROBES = 16: the MMA's N, room for 2Q <= 16 probe columns (p_t then r_t); WIDE_PROBES = 32
  past 8 tokens (``umma``, ``tmem_load_row`` and the B tile take the count).
- A_KGROUP_BYTES: bytes between K groups of 8 in the state (A) tile: one 16-byte row per
  state row, so a whole 128-row group.
- B_KGROUP_BYTES: the same for the probe (B) tile: PROBES rows of 16 bytes
  (``b_kgroup_bytes(probes)`` for either count).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from kdagen.dsl.common import ptx_outputs

K = 128
THREADS = K
PROBES = 16
WIDE_PROBES = 32
CORE_ROW_BYTES = 16  # a core matrix row: 8 bf16 of one K group
A_KGROUP_BYTES = K * CORE_ROW_BYTES
B_KGROUP_BYTES = PROBES * CORE_ROW_BYTES
TMEM_COLUMNS = 32  # the smallest allocation; the accumulator uses up to 32 fp32 columns
# Instruction descriptor of tcgen05.mma kind::f16: fp32 accumulate, bf16 A and B, both
# K-major, M = 128, N = PROBES (the value prims.Tcgen05InstrDesc.build gives); N >> 3 sits in
# bits 17..22.
INSTR_DESC = 0x08040490


def b_kgroup_bytes(probes: int) -> int:
    """Bytes between K groups of 8 in a probe (B) tile of ``probes`` rows."""
    return probes * CORE_ROW_BYTES


def instr_desc(probes: int) -> int:
    """``INSTR_DESC`` with N = ``probes`` (16 or 32)."""
    return (INSTR_DESC & ~(0x3F << 17)) | ((probes >> 3) << 17)


def state_smem_layout() -> cute.Layout:
    """The state tile (V rows x K) in the no-swizzle K-major UMMA layout: row v's 8-element
    K group g at byte g * A_KGROUP_BYTES + v * 16."""
    return cute.make_layout((K, (8, K // 8)), stride=(8, (1, A_KGROUP_BYTES // 2)))


@cute.jit
def smem_desc(
    address: Int32, leading_bytes: cutlass.Constexpr[int], stride_bytes: cutlass.Constexpr[int]
) -> Int64:
    """A no-swizzle UMMA shared-memory descriptor: start address, leading byte offset (between
    K groups), stride byte offset (between 8-row core matrices), version 1."""
    start = (Int64(address) >> 4) & Int64(0x3FFF)
    return (
        start
        | Int64((leading_bytes >> 4) << 16)
        | Int64((stride_bytes >> 4) << 32)
        | Int64(1 << 46)
    )


@cute.jit
def umma(
    tmem: Int32, a_desc: Int64, b_desc: Int64, accumulate: cutlass.Constexpr[int],
    probes: cutlass.Constexpr[int] = PROBES,
):  # fmt: skip
    """One ``tcgen05.mma.cta_group::1.kind::f16`` (M 128, N ``probes``, K 16) into TMEM;
    issued by one thread."""
    cute.arch.inline_ptx(
        "{\n .reg .pred p;\n setp.ne.b32 p, {$r4}, 0;\n"
        " tcgen05.mma.cta_group::1.kind::f16 [{$r0}], {$r1}, {$r2}, {$r3}, p;\n}",
        read_only_args=[tmem, a_desc, b_desc, Int32(instr_desc(probes)), Int32(accumulate)],
    )


@cute.jit
def umma_commit(barrier: cute.Pointer):
    """Arrive on ``barrier`` once every MMA this thread issued has completed."""
    cute.arch.inline_ptx(
        "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [{$r0}];",
        read_only_args=[Int32(barrier.toint())],
    )


@cute.jit
def tmem_alloc(destination: cute.Pointer):
    """Warp-collective: allocate TMEM_COLUMNS columns, the address written to ``destination``."""
    cute.arch.inline_ptx(
        "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [{$r0}], {$r1};",
        read_only_args=[Int32(destination.toint()), Int32(TMEM_COLUMNS)],
    )


@cute.jit
def tmem_relinquish():
    """Warp-collective: let other CTAs on this SM allocate TMEM (ours is taken)."""
    cute.arch.inline_ptx("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;")


@cute.jit
def tmem_dealloc(tmem: Int32):
    """Warp-collective: free the CTA's TMEM columns."""
    cute.arch.inline_ptx(
        "tcgen05.dealloc.cta_group::1.sync.aligned.b32 {$r0}, {$r1};",
        read_only_args=[tmem, Int32(TMEM_COLUMNS)],
    )


@cute.jit
def tmem_load_row(address: Int32, probes: cutlass.Constexpr[int] = PROBES) -> tuple:
    """Warp-collective ``tcgen05.ld.32x32b.x16`` (``x32``): lane l gets the ``probes`` fp32
    columns of TMEM lane (address >> 16) + l, i.e. its state row's projections."""
    return cute.arch.inline_ptx(
        f"tcgen05.ld.sync.aligned.32x32b.x{probes}.b32 {{" + ptx_outputs(probes) + "}, [{$r0}];\n"
        "tcgen05.wait::ld.sync.aligned;",
        write_only_types=[Float32] * probes,
        read_only_args=[address],
    )


@cute.jit
def tc_fence_before():
    """Order tcgen05 operations before the next thread barrier."""
    cute.arch.inline_ptx("tcgen05.fence::before_thread_sync;")


@cute.jit
def tc_fence_after():
    """Order tcgen05 operations after the last thread barrier."""
    cute.arch.inline_ptx("tcgen05.fence::after_thread_sync;")


def coupling_pairs(window: int) -> list[tuple[int, int, int]]:
    """The verify window's coupling scalars in storage order: (0, t, i) = c_ti for i < t,
    then (1, t, i) = d_ti for i <= t."""
    pairs = [(0, t, i) for t in range(window) for i in range(t)]
    return pairs + [(1, t, i) for t in range(window) for i in range(t + 1)]


def coupling_index(kind: int, t: int, i: int, window: int) -> int:
    """Where ``coupling_pairs(window)`` stores scalar (kind, t, i): a trace-time constant, so
    the solve reads the coefficients at fixed offsets and the writers need no lookup."""
    if kind == 0:
        return t * (t - 1) // 2 + i
    return window * (window - 1) // 2 + t * (t + 1) // 2 + i

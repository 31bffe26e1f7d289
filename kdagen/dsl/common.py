"""Architecture-neutral device helpers: shared-memory allocation, addresses, the work ticket,
bf16 packing and the small math of the KDA kernels. Plain ``@cute.jit`` functions, called
from ``@cute.kernel`` code."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32


def ptx_outputs(count: int) -> str:
    """Inline-PTX output operands ``{$w0}, ..., {$w<count-1>}``."""
    return ", ".join(f"{{$w{i}}}" for i in range(count))


def alloc(
    smem: cutlass.memory.SmemAllocator, dtype: type, shape: tuple, align: int = 16
) -> cute.Tensor:
    """A compact shared-memory tensor of ``shape`` aligned to ``align`` bytes."""
    return smem.allocate_tensor(dtype, cute.make_layout(shape), byte_alignment=align)


def row_major(pointer: cute.Pointer, *shape) -> cute.Tensor:
    """A compact row-major tensor over ``pointer`` (the last dimension contiguous)."""
    return cute.make_tensor(
        pointer, cute.make_ordered_layout(shape, tuple(reversed(range(len(shape)))))
    )


@cute.jit
def shared_address(pointer: cute.Pointer) -> Int32:
    """The 32-bit shared-window address of a shared-memory pointer (for descriptors)."""
    return Int32(pointer.toint())


@cute.jit
def at(tensor: cute.Tensor, *coords) -> Int64:
    """The generic 64-bit address of ``tensor[coords]``."""
    return Int64((tensor.iterator + cute.crd2idx(coords, tensor.layout)).toint())


@cute.jit
def load_words(address: Int64, count: cutlass.Constexpr[int] = 2) -> list:
    """``count`` (2 or 4) consecutive 32-bit words from global memory in one vector load."""
    words = cute.arch.inline_ptx(
        f"ld.global.nc.v{count}.b32 {{{ptx_outputs(count)}}}, [{{$r0}}];",
        write_only_types=[Uint32] * count,
        read_only_args=[address],
    )
    return list(words)


@cute.jit
def bf16(word: Uint32, half: cutlass.Constexpr[int]) -> Float32:
    """Half ``half`` (0: low 16 bits, 1: high) of a packed bf16 pair, as fp32 (exact)."""
    bits = (word << 16) if half == 0 else (word & Uint32(0xFFFF0000))
    return cute.arch.inline_ptx(
        "mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[bits]
    )


@cute.jit
def bf16_split(value: Float32) -> tuple:
    """``value = hi + lo`` with both halves bf16: the probes keep ~fp32 accuracy through a
    bf16 tensor-core product (two MMAs, high then low)."""
    hi = value.to(BFloat16)
    lo = (value - hi.to(Float32)).to(BFloat16)
    return hi, lo


@cute.jit
def store_bf16_split(value: Float32, hi_address: Int32, lo_address: Int32):
    """``value = hi + lo`` (as ``bf16_split``) with hi and lo stored to shared memory."""
    hi = value.to(BFloat16).to(Float32)
    store_shared_bf16(hi_address, value)  # rounds to hi
    store_shared_bf16(lo_address, value - hi)  # rounds to lo


@cute.jit
def sigmoid(x: Float32, approx_rcp: cutlass.Constexpr[bool] = True) -> Float32:
    """``1 / (1 + exp(-x))`` with the approximate exp unit; ``approx_rcp``: the approximate
    reciprocal too (a few instructions instead of an IEEE division with its slow-path
    branch, but ptxas then overlaps more gates and holds more registers)."""
    if cutlass.const_expr(approx_rcp):
        return cute.arch.rcp_approx(Float32(1) + cute.math.exp(-x, fastmath=True))
    return Float32(1) / (Float32(1) + cute.math.exp(-x, fastmath=True))


@cute.jit
def warp_sum(value: Float32) -> Float32:
    """Sum over the 32 lanes of a warp, every lane getting the total."""
    for shift in (16, 8, 4, 2, 1):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=shift)
    return value


@cute.jit
def warp_reduce_scatter(values: list, lane: Int32) -> Float32:
    """Sums ``values`` (a power-of-two count n <= 32, the same list on every lane) over the
    warp's lanes; lane l gets the total of ``values[l // (32 // n)]``. Halving rounds
    (shift 16, 8, ...) exchange only the half a lane gives away: n - 1 shuffles instead of
    5 n for n separate warp sums; lanes pair up as in ``warp_sum``, so each total is
    bit-identical to it."""
    halvings = len(values).bit_length() - 1  # log2(n)
    for step in cutlass.range_constexpr(halvings):
        shift = 16 >> step
        half = len(values) // 2
        upper = (lane & shift) != 0
        kept = []
        for j in cutlass.range_constexpr(half):
            send, keep = values[j + half], values[j]
            if upper:
                send, keep = values[j], values[j + half]
            kept.append(keep + cute.arch.shuffle_sync_bfly(send, shift))
        values = kept
    total = values[0]
    for step in cutlass.range_constexpr(halvings, 5):
        total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> step)
    return total


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


@cute.jit
def store_shared_bf16(address: Int32, value: Float32):
    """``value`` rounded to bf16 (round to nearest even, as ``.to(BFloat16)``) at a
    shared-memory address. For swizzled tiles written a row at a time: the caller XORs a
    per-row constant into a per-thread base and adds the row offset, which ptxas folds into
    the store's immediate (one LOP3 per swizzle phase, not the index arithmetic per store)."""
    cute.arch.inline_ptx(
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, {$r1}; st.shared.b16 [{$r0}], h; }",
        read_only_args=[address, value],
    )


@cute.jit
def ldmatrix_x4(address: Int32) -> tuple:
    """Four 8 x 8 bf16 matrices from shared memory into a warp's registers (``ldmatrix``):
    lanes 8j..8j+7 give the row addresses of matrix j; lane l gets word l % 4 of row l // 4
    of every matrix, i.e. one mma.sync A fragment or two B fragments."""
    return cute.arch.inline_ptx(
        f"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{ptx_outputs(4)}}}, [{{$r0}}];",
        write_only_types=[Uint32] * 4,
        read_only_args=[address],
    )


@cute.jit
def mma_bf16_16816(a: tuple, b: tuple, c: tuple) -> tuple:
    """One warp-level ``mma.sync`` m16n8k16, bf16 inputs, fp32 accumulators: d = a b + c
    (a: 4 words of the 16 x 16 row-major A fragment, b: 2 of the 16 x 8 column-major B,
    c and d: rows g and g + 8, columns 2t and 2t + 1 of lane 4g + t)."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, "
        "{{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4,
        read_only_args=[*a, *b, *c],
    )


@cute.jit
def take_ticket(counter_address: Int64) -> Int32:
    """The next work ticket: an atomic add of 1 on the launch's int32 counter."""
    return cute.arch.inline_ptx(
        "atom.global.add.u32 {$w0}, [{$r0}], 1;",
        write_only_types=[Int32],
        read_only_args=[counter_address],
    )


@cute.jit
def reset_counter(counter_address: Int64):
    """Zero the counter for the next launch (or graph replay). Only the taker of the last
    ticket calls it: every other ticket of this launch has been taken by then."""
    cute.arch.inline_ptx(
        "st.relaxed.gpu.global.b32 [{$r0}], {$r1};",
        read_only_args=[counter_address, Int32(0)],
    )


@cute.jit
def proxy_fence():
    """Make this thread's generic-proxy shared-memory writes visible to the async proxy
    (tensor cores, bulk copies) after the next barrier."""
    cute.arch.fence_proxy("async.shared", space="cta")

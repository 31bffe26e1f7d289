"""Architecture-neutral device helpers: shared-memory allocation, addresses, the work ticket,
bf16 packing and the small math of the KDA kernels. Plain ``@cute.jit`` functions, called
from ``@cute.kernel`` code."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint16, Uint32


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
def prefetch_l2(address: Int64, size: cutlass.Constexpr[int]):
    """Fetch ``size`` bytes at ``address`` (both multiples of 16) into L2, asynchronously.
    No value reaches the thread, so it may run before ``griddepcontrol.wait``: L2 is the
    point of coherence, and an upstream kernel's later write updates the fetched line."""
    cute.arch.inline_ptx(
        f"cp.async.bulk.prefetch.L2.global [{{$r0}}], {size};", read_only_args=[address]
    )


@cute.jit
def prefetch_l2_line(address: Int64):
    """Fetch the 128-byte line holding ``address`` into L2 (no alignment needed; as
    ``prefetch_l2``, safe before ``griddepcontrol.wait``)."""
    cute.arch.inline_ptx("prefetch.global.L2 [{$r0}];", read_only_args=[address])


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
    hi, lo = bf16_split(value)
    store_shared(hi_address, hi)
    store_shared(lo_address, lo)


@cute.jit
def store_shared(address: Int32, value: BFloat16):
    """One bf16 at a shared-memory address. For swizzled tiles written a row at a time: the
    caller XORs a per-row constant into a per-thread base and adds the row offset, which
    ptxas folds into the store's immediate (one LOP3 per swizzle phase, not the index
    arithmetic per store)."""
    pointer = cute.make_ptr(BFloat16, address, cute.AddressSpace.smem, assumed_align=2)
    cute.make_tensor(pointer, cute.make_layout(1))[0] = value


@cute.jit
def sigmoid(x: Float32, approx_rcp: cutlass.Constexpr[bool] = True) -> Float32:
    """``1 / (1 + exp(-x))`` with the approximate exp unit; ``approx_rcp``: the approximate
    reciprocal too (a few instructions instead of an IEEE division with its slow-path
    branch, but ptxas then overlaps more gates and holds more registers)."""
    if cutlass.const_expr(approx_rcp):
        return cute.arch.rcp_approx(Float32(1) + cute.math.exp(-x, fastmath=True))
    return Float32(1) / (Float32(1) + cute.math.exp(-x, fastmath=True))


# The fast SiLU's rounding test (see ``silu_fast``): its fp32 result is at most 17 ulp from
# x / (1 + expf(-x)) for -16 <= x and |x| >= 2^-100 (every fp32 x checked on an H200 by
# tests/test_silu.py); 32 ulp of margin from a bf16 rounding midpoint settles the rounding.
SILU_MARGIN_ULP = 32
SILU_FAST = (
    "{ .reg .f32 t, e, d, r, ax; .reg .b32 b; .reg .pred p;"
    " mul.f32 t, {$r0}, 0fBFB8AA3B;"  # -x log2(e)
    " ex2.approx.ftz.f32 e, t;"
    " add.f32 d, e, 0f3F800000;"
    " rcp.approx.ftz.f32 r, d;"
    " mul.f32 {$w0}, {$r0}, r;"
    " mov.b32 b, {$w0};"
    f" add.u32 b, b, {(1 << 32) - 0x8000 + SILU_MARGIN_ULP};"
    " and.b32 b, b, 65535;"
    f" setp.le.u32 p, b, {2 * SILU_MARGIN_ULP};"  # within the margin of a bf16 midpoint
    " abs.f32 ax, {$r0};"
    " setp.lt.or.f32 p, ax, 0f0D800000, p;"  # |x| < 2^-100: flushed subnormals
    " setp.lt.or.f32 p, {$r0}, 0fC1800000, p;"  # x < -16: the exp argument's error grows
    " selp.u32 {$w1}, 1, 0, p; }"
)


@cute.jit
def silu(x: Float32) -> Float32:
    """``x / (1 + exp(-x))`` with the accurate exp and an IEEE division: the form whose bf16
    rounding ``kg`` and the conv state record."""
    return x / (Float32(1) + cute.math.exp(-x))


@cute.jit
def silu_fast(x: Float32) -> tuple:
    """``silu(x)`` through the approximate exp and reciprocal (5 instructions), and a doubt
    flag (Int32 1 or 0): set where the result lies within ``SILU_MARGIN_ULP`` of a bf16
    rounding midpoint or outside the range where that margin is proven (~0.1 % of values).
    Where it is clear, the result rounds to the same bf16 as ``silu(x)``."""
    return cute.arch.inline_ptx(SILU_FAST, write_only_types=[Float32, Int32], read_only_args=[x])


@cute.jit
def silu_settled(x: Float32) -> Float32:
    """``silu(x)`` for a doubted fast result, its input through an opaque move so the
    compiler cannot hoist the exact form out of the rare branch and run it for every value."""
    x_opaque = cute.arch.inline_ptx(
        "mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[x]
    )
    return silu(x_opaque)


@cute.jit
def pack_bf16x2(lo: Uint16, hi: Uint16) -> Uint32:
    """Two bf16 bit patterns as one packed word, ``lo`` in the low half (one byte permute)."""
    return cute.arch.inline_ptx(
        "mov.b32 {$w0}, {{$r0}, {$r1}};", write_only_types=[Uint32], read_only_args=[lo, hi]
    )


@cute.jit
def pack_f32_bf16x2(lo: Float32, hi: Float32) -> Uint32:
    """Two bf16-valued fp32 numbers as one packed bf16 word (``lo`` in the low half; the
    conversion is exact for values that came from bf16)."""
    return cute.arch.inline_ptx(
        "cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};",
        write_only_types=[Uint32],
        read_only_args=[lo, hi],
    )


@cute.jit
def bf16_broadcast(word: Uint32, half: cutlass.Constexpr[int]) -> Uint32:
    """Half ``half`` (0: low, 1: high) of a packed bf16 pair in both halves."""
    selector = 0x1010 if half == 0 else 0x3232
    return cute.arch.inline_ptx(
        f"prmt.b32 {{$w0}}, {{$r0}}, 0, {selector};",
        write_only_types=[Uint32],
        read_only_args=[word],
    )


@cute.jit
def mul_bf16x2(a: Uint32, b: Uint32) -> Uint32:
    """Two bf16 products at once, each rounded to bf16 (the exact product of two bf16 values
    rounded once, as an fp32 multiply then a bf16 conversion)."""
    return cute.arch.inline_ptx(
        "mul.rn.bf16x2 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32], read_only_args=[a, b]
    )


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
def store_token_row(
    tokens_left: Int32, out_address: Int64, o: Float32, corr_address: Int64, u: Float32
):
    """A token's out (bf16, rounded to nearest) and corr (fp32) values of one state row,
    stored only where ``tokens_left`` (qlen - t) is positive. Predicated stores, not a branch:
    LLVM sinks a value's loads and FMAs into the only block that uses it, and with a branch per
    token ptxas then ran each token's shared loads and FMA chain after the previous token's."""
    cute.arch.inline_ptx(
        "{ .reg .pred p; .reg .b16 h; setp.gt.s32 p, {$r0}, 0; cvt.rn.bf16.f32 h, {$r2}; "
        "@p st.global.b16 [{$r1}], h; @p st.global.f32 [{$r3}], {$r4}; }",
        read_only_args=[tokens_left, out_address, o, corr_address, u],
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

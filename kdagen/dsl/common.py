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
def sigmoid(x: Float32, fast: cutlass.Constexpr[bool] = True) -> Float32:
    return Float32(1) / (Float32(1) + cute.math.exp(-x, fastmath=fast))


@cute.jit
def warp_sum(value: Float32) -> Float32:
    """Sum over the 32 lanes of a warp, every lane getting the total."""
    for shift in (16, 8, 4, 2, 1):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=shift)
    return value


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

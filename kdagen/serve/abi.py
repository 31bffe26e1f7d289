"""The host-call signature each kernel template implements, in one place.

Kernels take raw pointers plus sizes and strides (not DLPack tensors): the run-time API
validates the torch tensors itself and passes what the kernel needs, and a GPU-less compile
passes the same parameter list with null pointers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .variant import Variant


@dataclass(frozen=True)
class Param:
    """One argument of a kernel's ``__call__``: a pointer, a scalar or the stream."""

    name: str
    kind: str  # "ptr", "i32", "i64", "f32" or "stream"
    dtype: str = ""  # element type of a pointer: bf16, fp32, int32, int64
    align: int = 4  # bytes the kernel assumes the pointer is aligned to


def commit_params(variant: Variant) -> tuple[Param, ...]:
    # One launch folds every layer: layer l's state, corr, kg and conv state lie
    # layer_offsets[l] elements after layer 0's (the pointers below). The plan arguments
    # select kdagen's contract (records by request row, accepted by request) or vLLM's
    # commit context (records by slot, request indices, window lengths, prefix caching);
    # with ``by_path`` request b's records are read at positions ``path[b, :]``.
    return (
        Param("state", "ptr", "bf16", 16),
        Param("corr", "ptr", "fp32", 16),
        Param("kg", "ptr", "bf16", 16),
        Param("conv_state", "ptr", "bf16", 2),
        Param("a_log", "ptr", "fp32", 4),  # [L, H]
        Param("dt_bias", "ptr", "fp32", 4),  # [L, H * K]
        Param("layer_offsets", "ptr", "int64", 8),  # [L, 4]: state, corr, kg, conv
        Param("slots", "ptr", variant.slot_dtype, 4),
        Param("accepted", "ptr", "int32", 4),  # [owners]
        Param("request_index", "ptr", "int32", 4),  # [B] (indirect)
        Param("query_start", "ptr", "int32", 4),  # [B + 1] (windowed)
        *_prefix_caching_pointers(variant),
        Param("path", "ptr", "int32", 4),  # [B, Q] (by_path)
        Param("layers", "i32"),
        Param("batch", "i32"),
        Param("owners", "i32"),
        Param("slot_count", "i32"),
        Param("slot_stride", "i64"),
        Param("rows", "i32"),
        Param("corr_row_stride", "i64"),
        Param("kg_row_stride", "i64"),
        Param("records_by_slot", "i32"),
        Param("indirect", "i32"),
        Param("windowed", "i32"),
        *_prefix_caching_sizes(variant),
        Param("by_path", "i32"),
        Param("conv_mode", "i32"),  # 0: no conv state, 1: channel by channel, 2: 16-byte rows
        Param("conv_slot_stride", "i64"),
        Param("conv_dim_stride", "i64"),
        Param("conv_token_stride", "i64"),
        Param("lower_bound", "f32"),
        Param("null_slot", "i64"),
        Param("stream", "stream"),
    )


def _prefix_caching_pointers(variant: Variant) -> tuple[Param, ...]:
    """vLLM's prefix caching (align mode): only a build with ``prefix_caching`` takes it."""
    if not variant.prefix_caching:
        return ()
    return (
        Param("block_table", "ptr", "int32", 4),  # [table_rows, table_width] (block_size > 0)
        Param("num_computed", "ptr", "int32", 4),  # [owners] (block_size > 0)
    )


def _prefix_caching_sizes(variant: Variant) -> tuple[Param, ...]:
    if not variant.prefix_caching:
        return ()
    return (
        Param("block_size", "i32"),
        Param("table_rows", "i32"),
        Param("table_width", "i32"),
        Param("table_stride", "i64"),
    )


def verify_params(variant: Variant) -> tuple[Param, ...]:
    conv = (
        (
            Param("conv_state", "ptr", "bf16", 2),
            Param("conv_w", "ptr", variant.conv_weight_dtype, 8),
            Param("accepted", "ptr", "int32", 4),
        )
        if variant.conv
        else ()
    )
    # q, k and v are separate pointers with one row stride: channel blocks of a fused
    # [T, 3HK] projection (stride 3HK) or separate [T, H, K] tensors (stride HK), no copy.
    return (
        Param("q", "ptr", "bf16", 16),
        Param("k", "ptr", "bf16", 16),
        Param("v", "ptr", "bf16", 16),
        Param("raw_g", "ptr", "bf16", 16),
        Param("raw_beta", "ptr", "bf16", 2),
        Param("a_log", "ptr", "fp32", 4),
        Param("dt_bias", "ptr", "fp32", 4),
        Param("state", "ptr", "bf16", 16),
        Param("corr", "ptr", "fp32", 16),
        Param("kg", "ptr", "bf16", 16),
        Param("out", "ptr", "bf16", 16),
        Param("query_start", "ptr", "int32", 4),
        Param("slots", "ptr", variant.slot_dtype, 4),
        # [T] int32: each token's parent position in its window (-1: the root)
        *((Param("parents", "ptr", "int32", 4),) if variant.tree else ()),
        *conv,
        Param("counter", "ptr", "int32", 4),
        Param("tokens", "i32"),
        Param("act_stride", "i32"),
        Param("batch", "i32"),
        Param("rows", "i32"),
        # 0: request b's corr/kg records go to row b (the semantics page); 1: to row slots[b]
        # (vLLM's correction and key/gate caches are per state block).
        Param("records_by_slot", "i32"),
        Param("slot_count", "i32"),
        Param("slot_stride", "i64"),
        Param("lower_bound", "f32"),
        Param("null_slot", "i64"),
        Param("stream", "stream"),
    )


def params(variant: Variant) -> tuple[Param, ...]:
    return commit_params(variant) if variant.kernel == "commit" else verify_params(variant)


def _cutlass_dtype(name: str) -> Any:
    import cutlass

    return {
        "bf16": cutlass.BFloat16,
        "fp32": cutlass.Float32,
        "int32": cutlass.Int32,
        "int64": cutlass.Int64,
    }[name]


def _scalar(kind: str, value: Any) -> Any:
    import cutlass

    return {"i32": cutlass.Int32, "i64": cutlass.Int64, "f32": cutlass.Float32}[kind](value)


def placeholder_args(variant: Variant) -> list[Any]:
    """Arguments for a GPU-less compile: null pointers, zero scalars, a fake stream."""
    from cutlass.cute import AddressSpace
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    args: list[Any] = []
    for p in params(variant):
        if p.kind == "ptr":
            args.append(
                make_ptr(_cutlass_dtype(p.dtype), 0, AddressSpace.gmem, assumed_align=p.align)
            )
        elif p.kind == "stream":
            args.append(make_fake_stream())
        else:
            args.append(_scalar(p.kind, 0))
    return args


def launch_args(variant: Variant, values: dict[str, Any]) -> list[Any]:
    """Arguments for a launch: ``values`` maps each parameter name to a tensor, a number or,
    for the stream, a torch stream."""
    import cuda.bindings.driver as cuda
    from cutlass.cute import AddressSpace
    from cutlass.cute.runtime import make_ptr

    args: list[Any] = []
    for p in params(variant):
        value = values[p.name]
        if p.kind == "ptr":
            args.append(
                make_ptr(
                    _cutlass_dtype(p.dtype),
                    value.data_ptr(),
                    AddressSpace.gmem,
                    assumed_align=p.align,
                )
            )
        elif p.kind == "stream":
            args.append(cuda.CUstream(value.cuda_stream))
        else:
            args.append(_scalar(p.kind, value))
    return args

"""Run-time API: validate torch tensors, pick a variant, launch on the current stream.

Launches allocate nothing on the device and never synchronise, so they can be captured in
CUDA graphs. The first launch of a variant in a process loads its exported object from the
compile cache, or compiles it (seconds) and exports it for the next process.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kdagen.validate import KdaInputError, check_scalar, check_state, check_tensor
from kdagen.variant import Variant


def device_arch(device: torch.device | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return f"sm_{major}{minor}"


@functools.cache
def launcher(variant: Variant, arch: str) -> Any:
    """The compiled kernel for ``arch``: from the cache's exported object, else compiled now."""
    from kdagen import compile as kcompile

    if arch not in variant.spec.archs:
        raise KdaInputError(
            f"variant {variant.name} targets {list(variant.spec.archs)}, not this GPU's {arch}"
        )
    out_dir = kcompile.variant_dir(variant) / arch
    obj = out_dir / "kernel.o"
    if obj.exists():
        try:
            import cutlass.cute as cute

            module = cute.runtime.load_module(str(obj))
            return getattr(module, kcompile.export_symbol(variant))
        except Exception as err:  # a stale or foreign object: compile instead
            warnings.warn(f"kdagen: could not load {obj} ({err}); compiling", stacklevel=2)
    import cutlass.cute as cute

    from kdagen.abi import placeholder_args

    compiled = cute.compile(
        kcompile.kernel_object(variant), *placeholder_args(variant),
        options=kcompile.compile_options(arch),
    )  # fmt: skip
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(str(out_dir), "kernel", kcompile.export_symbol(variant))
    except Exception as err:  # the in-process function still works
        warnings.warn(f"kdagen: could not export {variant.name}: {err}", stacklevel=2)
    return compiled


def default_commit_variant(heads: int, window: int, slot_dtype: str, batch: int) -> Variant:
    """Built-in heuristic until a dispatch table is present (the H200 sweep in
    docs/perf-notes.md): split each (request, head) over more CTAs while the items alone
    cannot keep every SM's copy engine busy."""
    items = batch * heads
    threads, row_split = (128, 4) if items < 128 else (128, 2) if items < 384 else (256, 1)
    return Variant(
        kernel="commit", heads=heads, window=window, slot_dtype=slot_dtype,
        path="bulk", threads=threads, vec=4, row_split=row_split,
    )  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.int32: "int32", torch.int64: "int64"}[dtype]


@dataclass(frozen=True)
class CommitLaunch:
    """What validation resolved: the variant and the kernel's scalar arguments."""

    variant: Variant
    batch: int
    slot_count: int
    slot_stride: int


def validate_commit(
    state: torch.Tensor,
    corr: torch.Tensor,
    kg: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    *,
    lower_bound: float,
    null_slot: int,
    variant: Variant | str | None = None,
    require_cuda: bool = True,
) -> CommitLaunch:
    """Every check ``commit`` makes, without launching (CPU tensors pass with
    ``require_cuda=False``, so the messages are testable anywhere)."""
    op = "kdagen.commit"
    check_state(op, state, require_cuda=require_cuda)
    heads, device = state.shape[1], state.device
    check_tensor(
        op, "slots", slots, dims=[("B", 0)], dtypes=[torch.int32, torch.int64], device=device
    )
    batch = slots.shape[0]
    check_tensor(op, "accepted", accepted, dims=[batch], dtypes=[torch.int32], device=device)
    if not (isinstance(corr, torch.Tensor) and corr.dim() == 4 and 1 <= corr.shape[2] <= 8):
        shape = list(corr.shape) if isinstance(corr, torch.Tensor) else type(corr).__name__
        raise KdaInputError(
            f"{op}: `corr` must have shape [rows>={batch}, {heads}, Q (1..8), 128], got {shape}"
        )
    window = corr.shape[2]
    check_tensor(op, "corr", corr, dims=[("rows", batch), heads, window, 128],
                 dtypes=[torch.float32], device=device, align=16)  # fmt: skip
    check_tensor(op, "kg", kg, dims=[("rows", batch), heads, window, 256],
                 dtypes=[torch.bfloat16], device=device, align=16)  # fmt: skip
    check_tensor(op, "a_log", a_log, dims=[heads], dtypes=[torch.float32], device=device)
    check_tensor(op, "dt_bias", dt_bias, dims=[heads * 128], dtypes=[torch.float32], device=device)
    check_scalar(op, "lower_bound", lower_bound, float, negative=True)
    check_scalar(op, "null_slot", null_slot, int)
    slot_dtype = _dtype_name(slots.dtype)
    chosen = _resolve_variant(variant, "commit", heads, window, slot_dtype, batch)
    return CommitLaunch(chosen, batch, state.shape[0], state.stride(0))


def commit(
    state: torch.Tensor,
    corr: torch.Tensor,
    kg: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    *,
    lower_bound: float = -5.0,
    null_slot: int = 0,
    variant: Variant | str | None = None,
) -> None:
    """Fold each request's accepted prefix into ``state`` in place (see the semantics page).

    state [slots, H, 128, 128] bf16 (slot stride may be padded), corr [rows, H, Q, 128] fp32,
    kg [rows, H, Q, 256] bf16 (request b reads row b), a_log [H] fp32, dt_bias [H*128] fp32,
    slots [B] int32/int64 (``<= null_slot``: padding), accepted [B] int32 (0..Q).
    Launches on the current stream; no allocation, no synchronisation.
    """
    launch = validate_commit(
        state, corr, kg, a_log, dt_bias, slots, accepted,
        lower_bound=lower_bound, null_slot=null_slot, variant=variant,
    )  # fmt: skip
    if launch.batch == 0:
        return
    from kdagen.abi import launch_args

    fn = launcher(launch.variant, device_arch(state.device))
    values = {
        "state": state, "corr": corr, "kg": kg, "a_log": a_log, "dt_bias": dt_bias,
        "slots": slots, "accepted": accepted, "batch": launch.batch,
        "slot_count": launch.slot_count, "slot_stride": launch.slot_stride,
        "lower_bound": float(lower_bound), "null_slot": int(null_slot),
        "stream": torch.cuda.current_stream(state.device),
    }  # fmt: skip
    with torch.cuda.device(state.device):
        fn(*launch_args(launch.variant, values))


def _resolve_variant(
    variant: Variant | str | None, kernel: str, heads: int, window: int, slot_dtype: str, batch: int
) -> Variant:
    if variant is None:
        return default_commit_variant(heads, window, slot_dtype, batch)
    chosen = Variant.parse(variant) if isinstance(variant, str) else variant
    expected = {"kernel": kernel, "heads": heads, "window": window, "slot_dtype": slot_dtype}
    wrong = {k: (getattr(chosen, k), v) for k, v in expected.items() if getattr(chosen, k) != v}
    if wrong:
        detail = ", ".join(
            f"{k}: variant has {a!r}, tensors need {b!r}" for k, (a, b) in wrong.items()
        )
        raise KdaInputError(
            f"kdagen.{kernel}: variant {chosen.name} does not fit the inputs ({detail})"
        )
    return chosen

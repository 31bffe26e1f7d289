"""Input checks for the run-time API: every error names the tensor and expected vs actual."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .variant import MAX_HEADS

# What callers call the API by, for error messages: ``kdagen.verify`` in kdagen, the package's
# own name (``kda_kernels.verify``) in one ``kdagen emit`` wrote.
API = "kdagen" if __package__ == "kdagen.serve" else __package__

# A dimension is an exact size, or (name, minimum) for a size the caller chooses.
Dim = int | tuple[str, int]
FLOAT32_MAX = 3.4028234663852886e38  # the kernels take float scalars as fp32


class KdaInputError(ValueError):
    """A tensor passed to a kdagen kernel does not match the contract."""


def _dims_text(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else f"{d[0]}>={d[1]}" for d in dims) + "]"


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dims: Sequence[Dim],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    contiguous: bool = True,
    align: int = 0,
) -> torch.Tensor:
    """Checks type, device, dtype, shape, contiguity and pointer alignment, in that order."""
    where = f"{op}: `{name}`"
    if not isinstance(t, torch.Tensor):
        raise KdaInputError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise KdaInputError(f"{where} must be on {device} (like `state`), got {t.device}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise KdaInputError(f"{where} must be {allowed}, got {str(t.dtype).replace('torch.', '')}")
    ok = t.dim() == len(dims) and all(
        t.shape[i] == d if isinstance(d, int) else t.shape[i] >= d[1] for i, d in enumerate(dims)
    )
    if not ok:
        raise KdaInputError(f"{where} must have shape {_dims_text(dims)}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KdaInputError(
            f"{where} must be contiguous, got strides {list(t.stride())} for shape {list(t.shape)}"
        )
    if align and t.data_ptr() % align:
        raise KdaInputError(
            f"{where} must start on a {align}-byte boundary (vector accesses), "
            f"got address {t.data_ptr():#x}"
        )
    return t


def check_state(
    op: str,
    state: object,
    require_cuda: bool = True,
    dtypes: Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """state [slots, H, V, K] bf16 (or ``dtypes``) on a GPU; rows contiguous, the slot stride
    may be padded."""
    if not isinstance(state, torch.Tensor):
        raise KdaInputError(f"{op}: `state` must be a torch.Tensor, got {type(state).__name__}")
    if require_cuda and state.device.type != "cuda":
        raise KdaInputError(f"{op}: `state` must be on a CUDA device, got {state.device}")
    check_tensor(
        op, "state", state, dims=[("slots", 1), ("H", 1), 128, 128],
        dtypes=dtypes or [torch.bfloat16],
        device=state.device, contiguous=False, align=16,
    )  # fmt: skip
    n_heads = state.shape[1]
    if n_heads > MAX_HEADS:
        raise KdaInputError(f"{op}: `state` must have at most {MAX_HEADS} heads (dim 1), got "
                            f"{n_heads}")  # fmt: skip
    inner = (128 * 128, 128, 1)
    if tuple(state.stride()[1:]) != inner:
        raise KdaInputError(
            f"{op}: `state` must have strides [slot_stride, {inner[0]}, {inner[1]}, 1] "
            f"(each head's V x K block contiguous), got {list(state.stride())}"
        )
    slot_stride = state.stride(0)
    if state.shape[0] > 1 and (slot_stride < n_heads * 128 * 128 or slot_stride % 8):
        raise KdaInputError(
            f"{op}: `state` slot stride must be >= H*V*K = {n_heads * 128 * 128} and a multiple "
            f"of 8 elements (16 bytes), got {slot_stride}"
        )
    return state


def check_flag(op: str, name: str, value: object) -> None:
    """A Python bool (an option that picks a layout or an indexing: a truthy string is a
    caller's mistake, not a choice)."""
    if not isinstance(value, bool):
        raise KdaInputError(f"{op}: `{name}` must be a Python bool, got {value!r}")


def check_scalar(
    op: str, name: str, value: object, kind: type, negative: bool = False, bits: int = 0
) -> None:
    """A Python int or float (``kind``); a float finite as the kernels' fp32, ``negative``
    when asked; an int the kernels take as a ``bits``-bit integer below ``2**(bits - 1)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise KdaInputError(f"{op}: `{name}` must be a Python {kind.__name__}, got {value!r}")
    if kind is float and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise KdaInputError(f"{op}: `{name}` must be finite (as float32), got {value!r}")
    if bits and value >= 2 ** (bits - 1):
        raise KdaInputError(f"{op}: `{name}` must be below 2**{bits - 1} (the kernels' "
                            f"int{bits}), got {value!r}")  # fmt: skip
    if negative and not value < 0:
        raise KdaInputError(f"{op}: `{name}` must be negative (Kimi-K3 uses -5.0), got {value!r}")

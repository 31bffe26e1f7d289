"""The argument contract of verify and commit: one type per kernel, one check per kernel.

The run-time, the vLLM entry points, the reference, the emulator, the test inputs and the
bench all pass ``VerifyArgs`` / ``CommitArgs`` and validate through ``check_verify`` /
``check_commit``, so a tensor the kernels would refuse is refused everywhere, with the same
message. The oracles (reference, emulator) run the checks on any device and, with
``float_results``, take fp64 result buffers (unrounded results).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .validate import API, KdaInputError, check_flag, check_scalar, check_state, check_tensor

# verify's bound on |Q x lower_bound|. The window's log decay G_t reaches Q x lower_bound when
# every gate saturates; the kernels scale the probes by exp(G) and the w rows by exp(-G), so
# the probes' bf16 low halves must stay normal fp32 numbers. Measured on the H200 with every
# gate saturated (H 12, Q 8): out rel-L2 8.6e-5 at G = -72 (5.6e-5 at -40), 2.7e-4 at -80,
# 3.1e-2 at -86.4 and NaN at -96 (exp(G) flushed to zero).
MAX_LOG_DECAY = 72.0
# Past 8 tokens the kernels take the couplings relative to half the window's deepest log
# decay (-Q lower_bound / 2), so each factor stays within exp(+-64) for Q x lower_bound down to
# -128, and only the state's probes underflow, where the recurrence decays the state away.
# Measured on the H200 (Q 9-16, every gate saturated): at -160 (factors to exp(+-80)) the bf16
# low halves of the smallest factors turn subnormal and out's element-wise error reached 4.8e-2.
MAX_WIDE_LOG_DECAY = 128.0
MAX_WINDOW = 16  # verify's and commit's windows: 1..16 tokens

# The result buffers' dtypes the oracles also take (``float_results``).
_FLOATS = (torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)


@dataclass(frozen=True)
class VerifyArgs:
    """verify's arguments (see ``kdagen.verify``): q, k, v [T, H*128] bf16 (column blocks of
    the fused projection or separate tensors with one row stride), the rest by the public
    API's names; ``lower_bound`` None is Kimi-Linear's softplus gate; the conv tensors all
    or none."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    raw_g: torch.Tensor
    raw_beta: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    state: torch.Tensor
    query_start: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor
    corr: torch.Tensor
    kg: torch.Tensor
    lower_bound: float | None
    null_slot: int
    conv_state: torch.Tensor | None = None
    conv_w: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    conv_dim_first: bool = False
    parents: torch.Tensor | None = None  # [T] int32: the window is a token tree

    @classmethod
    def from_qkv(cls, qkv: torch.Tensor, *args: Any, **kwargs: Any) -> VerifyArgs:
        """The arguments with q, k, v the column blocks of ``qkv`` [T, 3*H*128] (views);
        ``args``, ``kwargs``: the other fields, in ``kdagen.verify``'s order."""
        width = qkv.shape[-1] // 3 if isinstance(qkv, torch.Tensor) and qkv.dim() == 2 else 0
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 2 or qkv.shape[1] != 3 * width:
            shape = list(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
            raise KdaInputError(f"{API}.verify: `qkv` must have shape [T, 3*H*128], got {shape}")
        q, k, v = qkv[:, :width], qkv[:, width : 2 * width], qkv[:, 2 * width :]
        return cls(q, k, v, *args, **kwargs)

    @property
    def qkv(self) -> torch.Tensor:
        """q, k, v side by side [T, 3*H*128] (a copy), as the oracles read the projection."""
        return torch.cat([self.q, self.k, self.v], dim=1)

    @property
    def conv(self) -> bool:
        """Whether verify convolves (the conv tensors are given)."""
        return self.conv_state is not None

    def with_(self, **changes: Any) -> VerifyArgs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CommitArgs:
    """commit's arguments (see ``kdagen.commit``), by the public API's names."""

    state: torch.Tensor
    corr: torch.Tensor
    kg: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    slots: torch.Tensor
    accepted: torch.Tensor
    lower_bound: float | None
    null_slot: int

    def with_(self, **changes: Any) -> CommitArgs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Checked:
    """What the checks read off the arguments: the variant's contract ``fields`` (heads,
    window, slot_dtype, gate and, for verify, the conv settings), the batch and (verify)
    the activations' row stride."""

    fields: dict[str, Any]
    batch: int
    act_stride: int = 0


def gate_of(op: str, lower_bound: float | None, window: int | None = None) -> str:
    """The gate contract field ``lower_bound`` selects: a negative float is Kimi-K3's bounded
    gate (``kda``), within ``max_log_decay(window)`` over a window of ``window`` tokens
    when given; None is Kimi-Linear's unbounded softplus gate, which the kernels take as it is."""
    if lower_bound is None:
        return "softplus"
    check_scalar(op, "lower_bound", lower_bound, float, negative=True)
    if window is not None and lower_bound * window < -max_log_decay(window):
        raise KdaInputError(
            f"{op}: `lower_bound` x Q must be >= -{max_log_decay(window):g} at Q = {window} "
            f"(the closed form's factors must stay inside fp32's normal range), got "
            f"{lower_bound:g} x {window}"
        )
    return "kda"


def max_log_decay(window: int) -> float:
    """The deepest log decay (``-Q x lower_bound``) the kernels take at a window of ``window``."""
    return MAX_LOG_DECAY if window <= 8 else MAX_WIDE_LOG_DECAY


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.int32: "int32", torch.int64: "int64"}[dtype]


def _check_records(op: str, corr: object, batch: int, heads: int) -> int:
    """corr's rank and window (1..MAX_WINDOW), before its full check; returns the window Q."""
    if not (
        isinstance(corr, torch.Tensor) and corr.dim() == 4 and 1 <= corr.shape[2] <= MAX_WINDOW
    ):
        shape = list(corr.shape) if isinstance(corr, torch.Tensor) else type(corr).__name__
        raise KdaInputError(
            f"{op}: `corr` must have shape [rows>={batch}, {heads}, Q (1..{MAX_WINDOW}), 128], "
            f"got {shape}"
        )
    return corr.shape[2]


def check_commit(
    args: CommitArgs, *, op: str = f"{API}.commit", require_cuda: bool = True,
    float_results: bool = False,
) -> Checked:  # fmt: skip
    """Every check of commit's arguments (shapes, dtypes, strides, devices, the gate);
    ``float_results``: ``state`` and ``corr`` of any float dtype (the oracles)."""
    results = _FLOATS if float_results else None
    state = check_state(op, args.state, require_cuda=require_cuda, dtypes=results)
    heads, device = state.shape[1], state.device
    check_tensor(op, "slots", args.slots, dims=[("B", 0)], dtypes=_INDEX, device=device)
    batch = args.slots.shape[0]
    check_tensor(op, "accepted", args.accepted, dims=[batch], dtypes=[torch.int32],
                 device=device)  # fmt: skip
    window = _check_records(op, args.corr, batch, heads)
    check_tensor(op, "corr", args.corr, dims=[("rows", batch), heads, window, 128],
                 dtypes=results or [torch.float32], device=device, align=16)  # fmt: skip
    check_tensor(op, "kg", args.kg, dims=[("rows", batch), heads, window, 256],
                 dtypes=[torch.bfloat16], device=device, align=16)  # fmt: skip
    _check_gate_params(op, args.a_log, args.dt_bias, heads, device)
    gate = gate_of(op, args.lower_bound)
    check_scalar(op, "null_slot", args.null_slot, int, bits=64)
    fields = {"heads": heads, "window": window, "slot_dtype": _dtype_name(args.slots.dtype),
              "gate": gate}  # fmt: skip
    return Checked(fields, batch)


def _check_gate_params(
    op: str, a_log: object, dt_bias: object, heads: int, device: torch.device
) -> None:
    check_tensor(op, "a_log", a_log, dims=[heads], dtypes=[torch.float32], device=device)
    check_tensor(op, "dt_bias", dt_bias, dims=[heads * 128], dtypes=[torch.float32],
                 device=device)  # fmt: skip


def _check_activations(
    op: str, q: object, k: object, v: object, tokens: int, heads: int, device: torch.device
) -> int:
    """q, k, v [T, H*128] bf16: rows contiguous, one shared row stride (a fused projection's
    channel blocks or separate tensors), 16-byte aligned. Returns the row stride."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, dims=[tokens, heads * 128], dtypes=[torch.bfloat16],
                     device=device, contiguous=False, align=16)  # fmt: skip
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    stride = q.stride(0) if tokens > 1 else heads * 128
    for name, t in (("q", q), ("k", k), ("v", v)):
        row = t.stride(0) if tokens > 1 else stride
        if t.stride(1) != 1 or row != stride or row % 8:
            raise KdaInputError(
                f"{op}: `{name}` must have contiguous rows and the row stride of `q` (a "
                f"multiple of 8), got strides {list(t.stride())} (q: {list(q.stride())})"
            )
    return stride


def _check_conv(
    op: str, args: VerifyArgs, *, heads: int, window: int, batch: int, device: torch.device
) -> dict[str, Any]:
    """The conv tensors (all three or none); returns the variant's conv contract fields."""
    names = ("conv_state", "conv_w", "accepted")
    given = [getattr(args, n) is not None for n in names]
    if not any(given):
        return {"conv": False}
    if not all(given):
        missing = [n for n, g in zip(names, given, strict=True) if not g]
        raise KdaInputError(f"{op}: with conv, `conv_state`, `conv_w` and `accepted` are all "
                            f"required; missing {missing}")  # fmt: skip
    channels = 3 * heads * 128
    rows = [channels, window + 2] if args.conv_dim_first else [window + 2, channels]
    check_tensor(op, "conv_state", args.conv_state, dims=[args.state.shape[0], *rows],
                 dtypes=[torch.bfloat16], device=device)  # fmt: skip
    conv_w = check_tensor(op, "conv_w", args.conv_w, dims=[channels, 4],
                          dtypes=[torch.bfloat16, torch.float32], device=device, align=8)  # fmt: skip
    check_tensor(op, "accepted", args.accepted, dims=[batch], dtypes=[torch.int32],
                 device=device)  # fmt: skip
    return {
        "conv": True,
        "conv_layout": "dim_first" if args.conv_dim_first else "token_major",
        "conv_weight_dtype": "fp32" if conv_w.dtype == torch.float32 else "bf16",
    }


def check_verify(
    args: VerifyArgs,
    *,
    op: str = f"{API}.verify",
    require_cuda: bool = True,
    records_by_slot: bool = False,
    float_results: bool = False,
) -> Checked:
    """Every check of verify's arguments (shapes, dtypes, strides, devices, the gate, the
    conv tensors); ``records_by_slot``: corr/kg rows per state slot (vLLM's caches), not per
    request; ``float_results``: ``state``, ``out`` and ``corr`` of any float dtype (the
    oracles)."""
    results = _FLOATS if float_results else None
    state = check_state(op, args.state, require_cuda=require_cuda, dtypes=results)
    heads, device = state.shape[1], state.device
    check_flag(op, "records_by_slot", records_by_slot)
    check_flag(op, "conv_dim_first", args.conv_dim_first)
    check_tensor(op, "slots", args.slots, dims=[("B", 0)], dtypes=_INDEX, device=device)
    batch = args.slots.shape[0]
    check_tensor(op, "query_start", args.query_start, dims=[batch + 1], dtypes=[torch.int32],
                 device=device)  # fmt: skip
    q = args.q
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise KdaInputError(f"{op}: `q` must have shape [T, {heads * 128}], got {shape}")
    tokens = q.shape[0]
    act_stride = _check_activations(op, q, args.k, args.v, tokens, heads, device)
    check_tensor(op, "raw_g", args.raw_g, dims=[tokens, heads * 128], dtypes=[torch.bfloat16],
                 device=device, align=16)  # fmt: skip
    check_tensor(op, "raw_beta", args.raw_beta, dims=[tokens, heads], dtypes=[torch.bfloat16],
                 device=device)  # fmt: skip
    window = _check_records(op, args.corr, batch, heads)
    rows = state.shape[0] if records_by_slot else ("rows", batch)
    check_tensor(op, "corr", args.corr, dims=[rows, heads, window, 128],
                 dtypes=results or [torch.float32], device=device, align=16)  # fmt: skip
    check_tensor(op, "kg", args.kg, dims=[args.corr.shape[0], heads, window, 256],
                 dtypes=[torch.bfloat16], device=device, align=16)  # fmt: skip
    check_tensor(op, "out", args.out, dims=[tokens, heads * 128],
                 dtypes=results or [torch.bfloat16], device=device, align=16)  # fmt: skip
    _check_gate_params(op, args.a_log, args.dt_bias, heads, device)
    gate = gate_of(op, args.lower_bound, window)
    check_scalar(op, "null_slot", args.null_slot, int, bits=64)
    conv = _check_conv(op, args, heads=heads, window=window, batch=batch, device=device)
    fields = {"heads": heads, "window": window, "slot_dtype": _dtype_name(args.slots.dtype),
              "gate": gate, **conv}  # fmt: skip
    if args.parents is not None:
        fields["tree"] = _check_parents(op, args, tokens, device, fields)
    return Checked(fields, batch, act_stride)


def _check_parents(
    op: str, args: VerifyArgs, tokens: int, device: torch.device, fields: dict[str, Any]
) -> bool:
    """A token tree's ``parents`` [T] int32 (each token's parent position in its window, -1
    at the root; the kernels treat any other value that is not an earlier position as -1):
    the tree kernels take either gate, conv off or on, windows of 2 to 16 tokens."""
    check_tensor(op, "parents", args.parents, dims=[tokens], dtypes=[torch.int32],
                 device=device)  # fmt: skip
    if fields["window"] < 2:
        raise KdaInputError(
            f"{op}: `parents` (a token tree) needs a window (corr.shape[2]) of 2 to 16; "
            f"got {fields['window']}"
        )
    return True

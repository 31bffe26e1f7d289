"""Run-time API of the all-layer commit: a model's per-layer pools prepared once, every layer
folded by one launch per sampling step.

A serving engine commits the accepted tokens of every KDA layer after each sampling step.
``ModelCommit`` validates the layers' tensors once, tables their addresses on the device and
stacks the gate parameters; ``ModelCommit.commit`` then checks only the step's small index
tensors and launches one kernel: no allocation, no synchronisation, so a step can be captured
in a CUDA graph. The tensors given at construction must stay allocated (the table holds their
addresses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .contract import MAX_WINDOW, gate_of
from .runtime import _resolve_variant, check_path, kernel_lower_bound, launch_commit
from .validate import API, KdaInputError, check_flag, check_scalar, check_state, check_tensor
from .values import check_commit_values, wanted
from .variant import Variant

K = 128
HISTORY = 3  # conv rows a width-4 convolution keeps between windows
OP = f"{API}.ModelCommit"


@dataclass(frozen=True)
class _Records:
    """The layers' corr and kg: rows, shared row strides (elements)."""

    rows: int
    corr_row_stride: int
    kg_row_stride: int


def _list(op: str, name: str, values: object, count: int | None = None) -> list:
    if not isinstance(values, Sequence) or isinstance(values, (str, torch.Tensor)) or not values:
        raise KdaInputError(f"{op}: `{name}` must be a non-empty list of tensors, one per layer")
    if count is not None and len(values) != count:
        raise KdaInputError(
            f"{op}: `{name}` must hold one tensor per layer ({count}), got {len(values)}"
        )
    return list(values)


def _offsets(
    op: str, name: str, tensors: list[torch.Tensor], align: int, written: bool = False
) -> list[int]:
    """Elements from layer 0's tensor to each layer's; every tensor shares layer 0's
    device, strides and dtype and keeps its ``align``-byte alignment; ``written`` tensors
    (the kernel writes every layer's at once) share no element with another layer's."""
    first = tensors[0]
    size = first.element_size()
    out = []
    for layer, t in enumerate(tensors):
        if (
            t.shape != first.shape
            or t.stride() != first.stride()
            or t.dtype != first.dtype
            or t.device != first.device
        ):
            raise KdaInputError(
                f"{op}: `{name}[{layer}]` must match `{name}[0]` in shape, strides, dtype and "
                f"device ({list(first.shape)}, {list(first.stride())}, {first.dtype}, "
                f"{first.device}), got {list(t.shape)}, {list(t.stride())}, {t.dtype}, {t.device}"
            )
        delta = t.data_ptr() - first.data_ptr()
        if t.data_ptr() % align or delta % size:
            raise KdaInputError(
                f"{op}: `{name}[{layer}]` must start on a {align}-byte boundary, got address "
                f"{t.data_ptr():#x}"
            )
        out.append(delta // size)
    if written:
        dims = sorted((s, n) for s, n in zip(first.stride(), first.shape, strict=True) if n > 1)
        for later in range(1, len(out)):
            for earlier in range(later):
                if first.numel() and _meets(out[later] - out[earlier], dims):
                    raise KdaInputError(
                        f"{op}: `{name}[{later}]` must not overlap `{name}[{earlier}]` (every "
                        f"layer's own memory), got addresses {tensors[later].data_ptr():#x} "
                        f"and {tensors[earlier].data_ptr():#x} with strides {list(first.stride())}"
                    )
    return out


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: its dims of size > 1, by stride, must
    each step past the whole span of the smaller ones."""
    span = 1
    for stride, n in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride < span:
            return True
        span = stride * n
    return False


def _meets(delta: int, dims: list[tuple[int, int]]) -> bool:
    """Whether a tensor whose (stride, size) ``dims`` (ascending, each stride past the span of
    the smaller ones) shares an element with itself moved by ``delta`` elements: ``delta`` is
    a sum of ``step x stride`` with ``|step| < size``, and past the smaller dims' span only
    the two nearest steps of the largest can reach it."""
    if not dims:
        return delta == 0
    stride, size = dims[-1]
    return any(
        abs(step) < size and _meets(delta - step * stride, dims[:-1])
        for step in {delta // stride, -(-delta // stride)}
    )


def _check_records(
    op: str, corrs: list, kgs: list, heads: int, device: torch.device
) -> tuple[int, _Records]:
    """corr [rows, H, Q, 128] fp32 and kg [rows, H, Q, 256] bf16 per layer: each row's block
    contiguous, the row stride may be padded (a vLLM cache page) but keeps 16-byte rows."""
    first = corrs[0]
    if not (
        isinstance(first, torch.Tensor) and first.dim() == 4 and 1 <= first.shape[2] <= MAX_WINDOW
    ):
        shape = list(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise KdaInputError(f"{op}: `corrs[0]` must have shape [rows, {heads}, Q "
                            f"(1..{MAX_WINDOW}), 128], got {shape}")  # fmt: skip
    rows, window = first.shape[0], first.shape[2]
    for name, tensors, width, dtype, step in (
        ("corrs", corrs, K, torch.float32, 4), ("kgs", kgs, 2 * K, torch.bfloat16, 8),
    ):  # fmt: skip
        for layer, t in enumerate(tensors):
            check_tensor(op, f"{name}[{layer}]", t, dims=[rows, heads, window, width],
                         dtypes=[dtype], device=device, contiguous=False, align=16)  # fmt: skip
            inner = (window * width, width, 1)
            if (
                tuple(t.stride()[1:]) != inner
                or t.stride(0) % step
                or (rows > 1 and t.stride(0) < heads * window * width)
            ):
                raise KdaInputError(
                    f"{op}: `{name}[{layer}]` must have strides [row_stride, {inner[0]}, "
                    f"{inner[1]}, 1] with row_stride >= {heads * window * width} and a multiple "
                    f"of {step} (16-byte rows), got {list(t.stride())}"
                )
    return window, _Records(rows, first.stride(0), kgs[0].stride(0))


def _stack(op: str, name: str, params: list, shape: tuple[int, ...], device: torch.device):
    for layer, p in enumerate(params):
        ok = (
            isinstance(p, torch.Tensor)
            and p.dtype == torch.float32
            and p.numel() == (shape[0] * (shape[1] if len(shape) > 1 else 1))
        )
        if not ok or p.device != device:
            got = (list(p.shape), p.dtype, p.device) if isinstance(p, torch.Tensor) else p
            raise KdaInputError(f"{op}: `{name}[{layer}]` must be float32 with {shape} elements "
                                f"on {device}, got {got}")  # fmt: skip
    return torch.stack([p.reshape(-1) for p in params]).contiguous()


class ModelCommit:
    """Every KDA layer of a model, committed by one launch per step.

    Args, one tensor per layer: ``states`` [slots, H, 128, 128] bf16 (padded slot stride
    allowed), ``corrs`` [rows, H, Q, 128] fp32 and ``kgs`` [rows, H, Q, 256] bf16 (request b's
    records in row b, or with ``records_by_slot`` in row ``slots[b]`` as in vLLM's caches),
    ``a_logs`` [H] fp32, ``dt_biases`` [H*128] fp32 (stacked into copies here). Layers share
    shapes, strides and dtypes. ``lower_bound`` (Kimi-K3: -5.0; None: Kimi-Linear's softplus
    gate) and ``null_slot`` (vLLM: 0) apply to every layer. ``conv_states`` (optional, vLLM's compaction after the step; its
    channels are every head's q, k and v):
    [slots, Q+2, 3*H*128] bf16 per layer, or [slots, 3*H*128, Q+2] with ``conv_dim_first``.
    """

    def __init__(
        self,
        states: Sequence[torch.Tensor],
        corrs: Sequence[torch.Tensor],
        kgs: Sequence[torch.Tensor],
        a_logs: Sequence[torch.Tensor],
        dt_biases: Sequence[torch.Tensor],
        *,
        lower_bound: float | None = -5.0,
        null_slot: int = 0,
        records_by_slot: bool = False,
        conv_states: Sequence[torch.Tensor] | None = None,
        conv_dim_first: bool = False,
        op: str = OP,
        require_cuda: bool = True,
    ) -> None:
        self.op = op
        states = _list(op, "states", states)
        layers = len(states)
        for layer, state in enumerate(states):
            check_state(f"{op}: layer {layer}", state, require_cuda=require_cuda)
        first = states[0]
        self.heads, self.device = first.shape[1], first.device
        corrs, kgs = _list(op, "corrs", corrs, layers), _list(op, "kgs", kgs, layers)
        self.window, self.records = _check_records(op, corrs, kgs, self.heads, self.device)
        self.gate = gate_of(op, lower_bound)
        check_scalar(op, "null_slot", null_slot, int, bits=64)
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.null_slot = int(null_slot)
        check_flag(op, "records_by_slot", records_by_slot)
        check_flag(op, "conv_dim_first", conv_dim_first)
        self.records_by_slot = records_by_slot
        if self.records_by_slot and self.records.rows < first.shape[0]:
            raise KdaInputError(
                f"{op}: with `records_by_slot`, `corrs` and `kgs` must have a row per state slot "
                f"(slot s reads row s): rows >= {first.shape[0]}, got {self.records.rows}"
            )
        self.a_log = _stack(op, "a_logs", _list(op, "a_logs", a_logs, layers), (self.heads,),
                            self.device)  # fmt: skip
        self.dt_bias = _stack(op, "dt_biases", _list(op, "dt_biases", dt_biases, layers),
                              (self.heads, K), self.device)  # fmt: skip
        columns = [
            _offsets(op, "states", states, 16, written=True),
            _offsets(op, "corrs", corrs, 16),
            _offsets(op, "kgs", kgs, 16),
        ]
        self.conv_states = self._conv_views(conv_states, conv_dim_first, layers, first.shape[0])
        columns.append(_offsets(op, "conv_states", self.conv_states, 2, written=True)
                       if self.conv_states else [0] * layers)  # fmt: skip
        self.layer_offsets = torch.tensor(list(zip(*columns, strict=True)), dtype=torch.int64,
                                          device=self.device)  # fmt: skip
        self.states, self.corrs, self.kgs = states, corrs, kgs

    def over(
        self, states: Sequence[torch.Tensor], conv_states: Sequence[torch.Tensor]
    ) -> ModelCommit:
        """The same commit (records, gates, settings) into other state and conv-state tensors
        of the same layout, e.g. the copies a functionalized graph passes (``conv_states`` as
        this model's ``[slots, dim, Q + 2]`` views); tables their addresses anew."""
        return ModelCommit(
            states, self.corrs, self.kgs, list(self.a_log), list(self.dt_bias),
            lower_bound=self.lower_bound, null_slot=self.null_slot,
            records_by_slot=self.records_by_slot, conv_states=list(conv_states) or None,
            conv_dim_first=True, op=self.op,
        )  # fmt: skip

    @property
    def layers(self) -> int:
        return len(self.states)

    def _conv_views(
        self, conv_states: object, dim_first: bool, layers: int, slot_count: int
    ) -> list[torch.Tensor]:
        """[slots, dim, Q + 2] views (any strides) of the layers' conv states, or []."""
        if conv_states is None:
            return []
        views = []
        for layer, t in enumerate(_list(self.op, "conv_states", conv_states, layers)):
            name = f"conv_states[{layer}]"
            tokens, channels = self.window + HISTORY - 1, 3 * self.heads * K  # q, k, v
            dims = [slot_count, channels, tokens] if dim_first else [slot_count, tokens, channels]
            check_tensor(self.op, name, t, dims=dims, dtypes=[torch.bfloat16], device=self.device,
                         contiguous=False)  # fmt: skip
            if _overlaps_itself(t):
                raise KdaInputError(f"{self.op}: `{name}` must not overlap itself (each slot, "
                                    f"channel and token its own element), got strides "
                                    f"{list(t.stride())} for shape {list(t.shape)}")  # fmt: skip
            views.append(t if dim_first else t.transpose(1, 2))
        return views

    def commit(
        self,
        slots: torch.Tensor,
        accepted: torch.Tensor,
        *,
        query_start: torch.Tensor | None = None,
        request_index: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        num_computed: torch.Tensor | None = None,
        block_size: int = 0,
        path: torch.Tensor | None = None,
        variant: Variant | str | None = None,
    ) -> None:
        """Fold request b's accepted tokens into every layer's slot ``slots[b]`` (int32 or
        int64 [B]; outside (null_slot, slots): padding). ``accepted`` [B] int32, clamped to
        0..Q; with ``request_index`` [B] int32 it is indexed by ``request_index[b]`` (as are
        ``block_table`` and ``num_computed``); with ``query_start`` [B+1] int32 it is at most
        the window's length. Prefix caching (vLLM's align mode): ``block_table`` [R, W]
        int32, ``num_computed`` [R] int32 and ``block_size`` >= Q (``block_size`` x W below
        2**31 - Q, the kernels' int32 token positions) send the state to the slot
        of the block holding the last committed token, and the state at the first block
        boundary the window crosses to that block's slot (with the conv history likewise).
        After a token-tree verify, ``path`` [B, Q] int32 lists request b's accepted nodes root
        first (no prefix caching); the conv history then becomes the path's last three tokens
        (rows 0..2 of the slot: the next verify takes ``accepted = 1``).
        Launches on the current stream; no allocation, no synchronisation."""
        values = self.validate_step(
            slots, accepted, query_start=query_start, request_index=request_index,
            block_table=block_table, num_computed=num_computed, block_size=block_size,
        )  # fmt: skip
        if path is not None:
            values |= self._path_args(path, values)
        if wanted(self.device):
            check_commit_values(f"{self.op}.commit", slots=slots, accepted=accepted,
                                null_slot=self.null_slot, slot_count=values["slot_count"],
                                window=self.window, query_start=query_start,
                                request_index=request_index, path=path)  # fmt: skip
        if values["batch"] == 0:
            return
        chosen = self.variant_for(values["batch"], slots.dtype, path=path is not None,
                                  block_tables=values.get("block_size", 0) > 0,
                                  variant=variant)  # fmt: skip
        launch_commit(chosen, **values)

    def variant_for(
        self,
        batch: int,
        slot_dtype: torch.dtype = torch.int32,
        *,
        path: bool = False,
        block_tables: bool = False,
        variant: Variant | str | None = None,
    ) -> Variant:
        """The kernel a commit of ``batch`` requests launches (the dispatch table's choice at
        layers x batch, else the built-in one; an explicit ``variant`` is checked instead):
        block tables need the build with prefix caching, without them either build serves;
        the conv history along a tree's ``path`` is the tree commit kernel's (rows by path)."""
        prefix = {"prefix_caching": True} if block_tables else {}
        return _resolve_variant(variant, "commit", self.heads, self.window,
                                "int32" if slot_dtype == torch.int32 else "int64",
                                self.layers * batch, self.device, gate=self.gate,
                                tree=path and bool(self.conv_states), **prefix)  # fmt: skip

    def validate_step(
        self,
        slots: torch.Tensor,
        accepted: torch.Tensor,
        *,
        query_start: torch.Tensor | None = None,
        request_index: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        num_computed: torch.Tensor | None = None,
        block_size: int = 0,
    ) -> dict:
        """Every check ``commit`` makes of a step's tensors; the kernel's arguments."""
        op, device = f"{self.op}.commit", self.device
        check_tensor(op, "slots", slots, dims=[("B", 0)], dtypes=[torch.int32, torch.int64],
                     device=device)  # fmt: skip
        batch = slots.shape[0]
        if request_index is None:
            check_tensor(op, "accepted", accepted, dims=[batch], dtypes=[torch.int32],
                         device=device)  # fmt: skip
        else:
            check_tensor(op, "request_index", request_index, dims=[batch], dtypes=[torch.int32],
                         device=device)  # fmt: skip
            check_tensor(op, "accepted", accepted, dims=[("R", 1)], dtypes=[torch.int32],
                         device=device)  # fmt: skip
        if query_start is not None:
            check_tensor(op, "query_start", query_start, dims=[batch + 1], dtypes=[torch.int32],
                         device=device)  # fmt: skip
        if not self.records_by_slot and batch > self.records.rows:
            raise KdaInputError(f"{op}: {batch} requests but the records hold "
                                f"{self.records.rows} rows (request b reads row b)")  # fmt: skip
        owners = accepted.shape[0]
        align = self._check_align(op, block_table, num_computed, block_size, owners)
        conv = self.conv_states[0] if self.conv_states else None
        return dict(
            state=self.states[0], corr=self.corrs[0], kg=self.kgs[0], conv_state=conv,
            a_log=self.a_log, dt_bias=self.dt_bias, layer_offsets=self.layer_offsets,
            slots=slots, accepted=accepted, request_index=request_index,
            query_start=query_start, layers=self.layers, batch=batch, owners=owners,
            slot_count=self.states[0].shape[0], slot_stride=self.states[0].stride(0),
            rows=self.records.rows, corr_row_stride=self.records.corr_row_stride,
            kg_row_stride=self.records.kg_row_stride, records_by_slot=int(self.records_by_slot),
            indirect=int(request_index is not None), windowed=int(query_start is not None),
            **align, **self._conv_args(), lower_bound=kernel_lower_bound(self.lower_bound),
            null_slot=self.null_slot,
        )  # fmt: skip

    def _path_args(self, path: torch.Tensor, values: dict) -> dict:
        """A tree's accepted paths as the kernel's arguments (see ``commit``)."""
        op = f"{self.op}.commit"
        if values.get("block_size"):
            raise KdaInputError(f"{op}: `path` takes no prefix caching (`block_table`)")
        check_path(op, path, values["batch"], self.window, self.device)
        return {"path": path, "by_path": 1}

    def _check_align(
        self, op: str, block_table: object, num_computed: object, block_size: int, owners: int
    ) -> dict:
        """Prefix caching's arguments: all three or none."""
        given = [block_table is not None, num_computed is not None, bool(block_size)]
        if not any(given):
            return {}
        if not all(given):
            raise KdaInputError(f"{op}: prefix caching needs `block_table`, `num_computed` and "
                                f"`block_size` together; got only {given}")  # fmt: skip
        check_scalar(op, "block_size", block_size, int, bits=32)
        if block_size < self.window:
            raise KdaInputError(f"{op}: `block_size` must cover one window (>= {self.window}), "
                                f"got {block_size}")  # fmt: skip
        check_tensor(op, "block_table", block_table, dims=[("R", owners), ("W", 1)],
                     dtypes=[torch.int32], device=self.device, contiguous=False)  # fmt: skip
        assert isinstance(block_table, torch.Tensor)
        if block_table.stride(1) != 1:
            raise KdaInputError(f"{op}: `block_table` rows must be contiguous, got strides "
                                f"{list(block_table.stride())}")  # fmt: skip
        check_tensor(op, "num_computed", num_computed, dims=[("R", owners)],
                     dtypes=[torch.int32], device=self.device)  # fmt: skip
        # The kernels place tokens in int32: the end of the table's last block, plus a window
        # past it, must not wrap (a wrapped boundary would read conv rows far past the slot).
        span = block_size * block_table.shape[1]
        if span > 2**31 - 1 - self.window:
            raise KdaInputError(f"{op}: `block_size` x the width of `block_table` ({block_size} x "
                                f"{block_table.shape[1]} = {span} tokens) must stay below "
                                f"2**31 - {self.window} (the kernels' int32 token positions)")  # fmt: skip
        return {
            "block_table": block_table, "num_computed": num_computed, "block_size": block_size,
            "table_rows": block_table.shape[0], "table_width": block_table.shape[1],
            "table_stride": block_table.stride(0),
        }  # fmt: skip

    def _conv_args(self) -> dict:
        """The conv state's strides and how the kernel moves it: 16-byte pieces when rows are
        token-major and every row starts on a 16-byte boundary, else channel by channel."""
        if not self.conv_states:
            return {}
        view = self.conv_states[0]
        pieces = (
            view.stride(1) == 1
            and all(t.data_ptr() % 16 == 0 for t in self.conv_states)
            and view.stride(0) % 8 == 0
            and view.stride(2) % 8 == 0
        )
        return {
            "conv_mode": 2 if pieces else 1, "conv_slot_stride": view.stride(0),
            "conv_dim_stride": view.stride(1), "conv_token_stride": view.stride(2),
        }  # fmt: skip

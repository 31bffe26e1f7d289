"""Drop-ins for vLLM's Kimi-K3 RecoverSSM ops: ``kda_recoverssm_verify`` on kdagen's verify and
``KDARecoverSSMCommitContext`` on kdagen's all-layer commit.

``kda_recoverssm_verify`` has the signature and layouts of FlashInfer 0.7.2's drop-in (and of
vLLM's Triton kernel before 0.33): q, k, v, raw_g [1, T, H, 128], raw_beta [1, T, H], the
correction and key/gate caches indexed by state block (``state_indices[b]``, not by request),
null block 0, conv done upstream. vLLM 0.33's verify takes one records object instead, rows
per request: ``kda_recoverssm_verify_records``, its exact signature; use that one with a
commit context made from layers with ``recoverssm_records``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .contract import VerifyArgs
from .model_commit import ModelCommit
from .runtime import launch_verify, validate_verify
from .validate import KdaInputError, check_scalar

OP = f"{__package__}.vllm.kda_recoverssm_verify"
COMMIT_OP = f"{__package__}.vllm.KDARecoverSSMCommitContext"
NULL_BLOCK_ID = 0  # vLLM's padding block
K = 128

# vLLM's names of the arguments kdagen's checks name by the run-time's (``VerifyArgs``,
# ``ModelCommit.commit``), so an error names what the caller passed.
_VERIFY_NAMES = {
    "a_log": "A_log", "state": "checkpoint_state", "corr": "correction_cache",
    "kg": "kg_cache", "query_start": "query_start_loc", "slots": "state_indices",
}  # fmt: skip
_RECORDS_NAMES = _VERIFY_NAMES | {"corr": "records.correction", "kg": "records.key_gate"}
_COMMIT_NAMES = {
    "slots": "state_indices", "accepted": "num_accepted_tokens",
    "query_start": "query_start_loc", "request_index": "request_indices",
    "num_computed": "num_computed_tokens", "block_size": "mamba_block_size",
}  # fmt: skip


# ``ModelCommit``'s per-layer lists, as ``create`` takes them from vLLM's layers.
_LAYER_NAMES = {
    "states": "layers[{i}].kv_cache[1]", "conv_states": "layers[{i}].kv_cache[0]",
    "corrs": "layers[{i}].kv_cache[2]", "kgs": "layers[{i}].kv_cache[3]",
    "a_logs": "layers[{i}].A_log", "dt_biases": "layers[{i}].dt_bias",
    "state": "kv_cache[1]", "lower_bound": "gate_lower_bound",
    "conv_dim_first": "conv_state_dim_first",
}  # fmt: skip
_LAYER_RECORDS_NAMES = _LAYER_NAMES | {
    "corrs": "layers[{i}].recoverssm_records.correction",
    "kgs": "layers[{i}].recoverssm_records.key_gate",
}


def _rename(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each backquoted run-time name (``name`` or ``name[i]``) in ``names``
    replaced by vLLM's (a format string of ``i`` for the indexed ones)."""

    def one(m: re.Match[str]) -> str:
        if m[1] not in names or (m[2] is None) != ("{i}" not in names[m[1]]):
            return m[0]
        return f"`{names[m[1]].format(i=m[2])}`"

    return re.sub(r"`(\w+)(?:\[(\d+)\])?`", one, text)


def _renamed(err: KdaInputError, names: Mapping[str, str]) -> KdaInputError:
    """``err`` with the run-time's names of the arguments replaced by vLLM's (``_rename``):
    raised from an ``except`` around the call, which costs nothing on the launch path (a
    context manager cost about 1 us a call, 69 layers a step)."""
    return KdaInputError(_rename(str(err), names))


def _tokens_view(name: str, t: object, width: int | None = K) -> torch.Tensor:
    """[1, T, H, 128] -> [T, H*128] (``width`` 128), or [1, T, H] -> [T, H] (``width`` None),
    without a copy."""
    shape = f"[1, T, H, {width}]" if width else "[1, T, H]"
    if (
        not isinstance(t, torch.Tensor)
        or t.dim() != (4 if width else 3)
        or t.shape[0] != 1
        or (width and t.shape[3] != width)
    ):
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise KdaInputError(f"{OP}: `{name}` must have shape {shape}, got {got}")
    flat = t[0]
    if not width:
        return flat
    if (flat.shape[1] > 1 and flat.stride(1) != width) or flat.stride(2) != 1:
        raise KdaInputError(f"{OP}: `{name}` heads must be contiguous (strides [.., "
                            f"{width}, 1]), got {list(t.stride())}")  # fmt: skip
    return flat.as_strided((flat.shape[0], flat.shape[1] * width), (flat.stride(0), 1))


def _flat(param: object) -> object:
    """A gate parameter in any contiguous shape (vLLM's layers hold ``dt_bias`` as [H*128] or
    [H, 128], ``A_log`` as [H] or [1, 1, H, 1]) as the 1-D view the kernels read."""
    if isinstance(param, torch.Tensor) and param.is_contiguous():
        return param.reshape(-1)
    return param


def kda_recoverssm_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803 (vLLM's parameter name)
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    checkpoint_state: torch.Tensor,
    correction_cache: torch.Tensor,
    kg_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    spec_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify each request's window from its checkpoint without writing the checkpoint;
    fills ``correction_cache`` / ``kg_cache`` rows ``state_indices[b]`` for the commit and
    returns ``out`` [1, T, H, 128] (allocated when None, like vLLM)."""
    return verify_records(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, checkpoint_state,
        correction_cache, kg_cache, query_start_loc, state_indices, spec_query_len, out,
        records_by_slot=True,
    )  # fmt: skip


def kda_recoverssm_verify_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803 (vLLM's parameter name)
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    checkpoint_state: torch.Tensor,
    records: Any,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    spec_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM 0.33's ``kda_recoverssm_verify``: the same verify, with the records in one
    object (``records.correction`` [rows, H, Q, 128] fp32 and ``records.key_gate`` [rows, H,
    Q, 256] bf16, vLLM's ``KDARecoverSSMRecords``) whose row b is request b's."""
    found = {name: getattr(records, name, None) for name in ("correction", "key_gate")}
    missing = [name for name, t in found.items() if not isinstance(t, torch.Tensor)]
    if missing:
        raise KdaInputError(f"{OP}: `records` must have tensor attributes `correction` and "
                            f"`key_gate` (vLLM's KDARecoverSSMRecords); missing {missing}")  # fmt: skip
    return verify_records(
        q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, checkpoint_state,
        found["correction"], found["key_gate"], query_start_loc, state_indices, spec_query_len,
        out, records_by_slot=False,
    )  # fmt: skip


def verify_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803 (vLLM's parameter name)
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    checkpoint_state: torch.Tensor,
    correction: torch.Tensor,
    key_gate: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    spec_query_len: int,
    out: torch.Tensor | None = None,
    *,
    records_by_slot: bool,
) -> torch.Tensor:
    """``kda_recoverssm_verify`` with the records in row ``state_indices[b]``
    (``records_by_slot``, vLLM's caches per state block) or in row b (vLLM 0.33's
    ``KDARecoverSSMRecords``, rows per request of the step)."""
    names = _VERIFY_NAMES if records_by_slot else _RECORDS_NAMES
    check_scalar(OP, "spec_query_len", spec_query_len, int)
    flat = {name: _tokens_view(name, t) for name, t in (("q", q), ("k", k), ("v", v),
                                                        ("raw_g", raw_g))}  # fmt: skip
    flat_beta = _tokens_view("raw_beta", raw_beta, None)
    tokens = flat["q"].shape[0]
    if (
        isinstance(state_indices, torch.Tensor)
        and state_indices.dim() == 1
        and (tokens > state_indices.shape[0] * spec_query_len)
    ):
        raise KdaInputError(f"{OP}: `q` has {tokens} tokens, more than the "
                            f"{state_indices.shape[0]} requests x `spec_query_len` "
                            f"({spec_query_len}) hold (vLLM refuses it too)")  # fmt: skip
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if (
        not isinstance(correction, torch.Tensor)
        or correction.dim() != 4
        or (correction.shape[2] != spec_query_len)
    ):
        shape = list(correction.shape) if isinstance(correction, torch.Tensor) else None
        raise KdaInputError(f"{OP}: `{names['corr']}` must have shape [rows, H, "
                            f"spec_query_len={spec_query_len}, 128], got {shape}")  # fmt: skip
    flat_out = _tokens_view("out", out)
    if flat_out.stride(0) != flat_out.shape[1]:
        raise KdaInputError(f"{OP}: `out` must be contiguous, got strides {list(out.stride())}")
    args = VerifyArgs(
        flat["q"], flat["k"], flat["v"], flat["raw_g"], flat_beta, _flat(A_log), _flat(dt_bias),
        checkpoint_state, query_start_loc, state_indices, flat_out, correction, key_gate,
        lower_bound, NULL_BLOCK_ID,
    )  # fmt: skip
    try:
        launch = validate_verify(args, records_by_slot=records_by_slot, op=OP)
    except KdaInputError as err:
        raise _renamed(err, names) from None
    launch_verify(launch)
    return out


class KDARecoverSSMCommitContext:
    """A drop-in for vLLM's commit context (Kimi-K3 RecoverSSM): every layer's accepted tokens
    folded by one launch of kdagen's commit kernel, the conv state compacted in the same
    launch.

    ``create(layers, spec_query_len=, max_num_reqs=)`` takes vLLM's KDA layers (each with
    ``A_log``, ``dt_bias``, ``gate_lower_bound`` and ``kv_cache`` = (conv state, state,
    correction cache, key/gate cache): records per state block; or, as vLLM 0.33 lays them
    out, ``kv_cache`` = (conv state, state) and ``recoverssm_records`` with ``correction``
    and ``key_gate`` rows per request of the step) and prepares the per-layer address table
    once; ``commit`` then never synchronises (CUDA-graph safe) and allocates nothing past
    its first steps (see ``commit``). The conv state is vLLM's for a 4-tap conv, ``Q + 2``
    rows a block (``conv state length - Q + 1`` = 3 history rows), either layout.
    """

    def __init__(self, pools: ModelCommit, spec_query_len: int, max_num_reqs: int) -> None:
        self.pools, self.spec_query_len, self.max_num_reqs = pools, spec_query_len, max_num_reqs
        self.indices = _Int32Indices(pools.device, max_num_reqs + 1)

    @classmethod
    def create(
        cls,
        layers: Sequence[Any],
        *,
        spec_query_len: int,
        max_num_reqs: int,
        backend: str | None = None,
        conv_state_dim_first: bool | None = None,
    ) -> KDARecoverSSMCommitContext:
        """``backend``: vLLM's choice of its own kernels ("triton" or "cute"), taken so that
        vLLM's call works unchanged; kdagen's kernel serves either. ``conv_state_dim_first``:
        the conv states' layout ([blocks, dim, len] rather than [blocks, len, dim]); by
        default vLLM's own setting when vLLM is importable, else token-major."""
        op = COMMIT_OP
        if backend not in (None, "triton", "cute"):
            raise KdaInputError(f"{op}: `backend` must be 'triton', 'cute' or None (vLLM's "
                                f"choices; kdagen's kernel serves either), got {backend!r}")  # fmt: skip
        # Any collection of layers vLLM's own create takes (a list, a tuple, a ModuleList).
        if isinstance(layers, (str, bytes, torch.Tensor)) or not isinstance(layers, Iterable):
            raise KdaInputError(f"{op}: `layers` must hold at least one KDA layer, got "
                                f"{type(layers).__name__}")  # fmt: skip
        layers = list(layers)
        if not layers:
            raise KdaInputError(f"{op}: `layers` must hold at least one KDA layer, got none")
        by_request = all(hasattr(layer, "recoverssm_records") for layer in layers)
        need = 2 if by_request else 4
        if any(
            not isinstance(getattr(layer, "kv_cache", ()), Sequence)
            or len(getattr(layer, "kv_cache", ())) < need
            for layer in layers
        ):
            raise KdaInputError(f"{op}: each layer needs `kv_cache` = (conv state, state, "
                                "correction cache, key/gate cache), or (conv state, state) and "
                                "`recoverssm_records` (vLLM 0.33)")  # fmt: skip
        wanted = ("A_log", "dt_bias", "gate_lower_bound")
        for index, layer in enumerate(layers):
            missing = [name for name in wanted if not hasattr(layer, name)]
            if by_request:
                records = layer.recoverssm_records
                missing += [f"recoverssm_records.{name}" for name in ("correction", "key_gate")
                            if not hasattr(records, name)]  # fmt: skip
            if missing:
                raise KdaInputError(f"{op}: `layers[{index}]` must have `A_log`, `dt_bias` and "
                                    "`gate_lower_bound` (and with `recoverssm_records` its "
                                    f"`correction` and `key_gate`); missing {missing}")  # fmt: skip
        for index, layer in enumerate(layers):  # None, or Kimi-K3's bound (hashable below)
            if layer.gate_lower_bound is not None:
                check_scalar(op, f"layers[{index}].gate_lower_bound", layer.gate_lower_bound,
                             float, negative=True)  # fmt: skip
        bounds = {layer.gate_lower_bound for layer in layers}
        if len(bounds) != 1:
            raise KdaInputError(f"{op}: every layer needs the same `gate_lower_bound`, got "
                                f"{sorted(map(str, bounds))}")  # fmt: skip
        lower_bound = bounds.pop()  # None: Kimi-Linear's softplus gate
        check_scalar(op, "spec_query_len", spec_query_len, int)
        check_scalar(op, "max_num_reqs", max_num_reqs, int)
        if conv_state_dim_first is None:
            conv_state_dim_first = _vllm_conv_dim_first()
        caches = [layer.kv_cache for layer in layers]
        if by_request:  # vLLM 0.33: records per request of the step, outside the KV cache
            corrs = [layer.recoverssm_records.correction for layer in layers]
            kgs = [layer.recoverssm_records.key_gate for layer in layers]
        else:
            corrs, kgs = [c[2] for c in caches], [c[3] for c in caches]
        try:
            pools = ModelCommit(
                [c[1] for c in caches], corrs, kgs, [layer.A_log for layer in layers],
                [layer.dt_bias for layer in layers], lower_bound=lower_bound,
                null_slot=NULL_BLOCK_ID, records_by_slot=not by_request,
                conv_states=[c[0] for c in caches], conv_dim_first=conv_state_dim_first, op=op,
            )  # fmt: skip
        except KdaInputError as err:
            raise _renamed(err, _LAYER_RECORDS_NAMES if by_request else _LAYER_NAMES) from None
        if pools.window != spec_query_len:
            raise KdaInputError(f"{op}: the correction caches hold {pools.window} positions, "
                                f"`spec_query_len` is {spec_query_len}")  # fmt: skip
        return cls(pools, spec_query_len, max_num_reqs)

    def commit(
        self,
        num_accepted_tokens: torch.Tensor,
        state_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        request_indices: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
        mamba_block_size: int | None = None,
    ) -> None:
        """Fold each request's accepted tokens into every layer (vLLM's semantics): request b
        commits ``min(num_accepted_tokens[r], its window length)`` tokens, r =
        ``request_indices[b]`` when given, else b; with ``block_table``,
        ``num_computed_tokens`` and ``mamba_block_size`` (prefix caching) the state goes to
        the block of the last committed token and the state at a crossed block boundary to
        that block. Index tensors may be int32 or int64 and strided, as vLLM's take them
        (``num_accepted_tokens`` longer than the batch: its first rows); a batch of none
        does nothing."""
        op = f"{COMMIT_OP}.commit"
        if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 1:
            got = (list(state_indices.shape) if isinstance(state_indices, torch.Tensor)
                   else type(state_indices).__name__)  # fmt: skip
            raise KdaInputError(f"{op}: `state_indices` must be a 1-D tensor, got {got}")
        batch = state_indices.shape[0]
        if batch == 0:
            return
        if batch > self.max_num_reqs:
            raise KdaInputError(f"{op}: {batch} requests exceed `max_num_reqs` "
                                f"({self.max_num_reqs})")  # fmt: skip
        if request_indices is not None:
            if (
                not isinstance(request_indices, torch.Tensor)
                or request_indices.dim() != 1
                or (request_indices.shape[0] < batch)
            ):
                raise KdaInputError(f"{op}: `request_indices` must be 1-D with at least "
                                    f"{batch} entries")  # fmt: skip
            request_indices = request_indices[:batch]
        elif isinstance(num_accepted_tokens, torch.Tensor) and (
            num_accepted_tokens.dim() == 1 and num_accepted_tokens.shape[0] > batch
        ):
            num_accepted_tokens = num_accepted_tokens[:batch]  # vLLM reads rows 0..B-1
        # 0 reaches the commit as "no prefix caching" (vLLM passes None): named here instead.
        if isinstance(mamba_block_size, int) and mamba_block_size < self.spec_query_len:
            raise KdaInputError(f"{op}: `mamba_block_size` must cover one window "
                                f"(>= {self.spec_query_len}), got {mamba_block_size}")  # fmt: skip
        as_int32 = self.indices
        try:
            self.pools.commit(
                as_int32.slots(state_indices), as_int32("num_accepted_tokens", num_accepted_tokens),
                query_start=as_int32("query_start_loc", query_start_loc),
                request_index=as_int32("request_indices", request_indices),
                block_table=as_int32("block_table", block_table),
                num_computed=as_int32("num_computed_tokens", num_computed_tokens),
                block_size=mamba_block_size or 0,
            )  # fmt: skip
        except KdaInputError as err:
            raise _renamed(err, _COMMIT_NAMES) from None


class _Int32Indices:
    """vLLM's index tensors as kdagen's commit kernel reads them: int32 (slots: int32 or
    int64) and contiguous. Tensors already so pass as they are; the others (vLLM's int64
    buffers, a column of a 2-D tensor) are copied into buffers this context keeps, one a
    name, made at the first step that needs them and reused (sliced) after: one small copy
    kernel each, nothing allocated in the steady state, so CUDA graphs capture it."""

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device, self.rows = device, rows
        self.buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, index: Any, dtype: torch.dtype = torch.int32) -> Any:
        if not self._convertible(index) or (index.dtype == dtype and index.is_contiguous()):
            return index  # as it is: the commit's own checks name anything wrong with it
        shape = tuple(index.shape)
        held = self.buffers.get(name)
        fits = (held is not None and held.dtype == dtype and held.shape[1:] == shape[1:]
                and held.shape[0] >= shape[0])  # fmt: skip
        if not fits:
            self.buffers[name] = held = torch.empty(
                (max(shape[0], self.rows), *shape[1:]), dtype=dtype, device=self.device
            )
        staged = held[: shape[0]]
        staged.copy_(index)
        return staged

    def slots(self, index: Any) -> Any:
        """State indices keep their dtype (the kernel is built for either)."""
        dtype = index.dtype if self._convertible(index) else torch.int32
        return self("state_indices", index, dtype)

    def _convertible(self, index: Any) -> bool:
        return (isinstance(index, torch.Tensor) and index.device == self.device
                and index.dtype in (torch.int32, torch.int64) and index.dim() in (1, 2))  # fmt: skip


def _vllm_conv_dim_first() -> bool:
    """vLLM's conv-state layout setting when vLLM is importable, else token-major."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return False
    return bool(is_conv_state_dim_first())

"""Run-time API: validate torch tensors, pick a variant, launch on the current stream.

Launches allocate nothing on the device and never synchronise, so they can be captured in
CUDA graphs. The first launch of a variant in a process gets its kernel from the kernel
source (``kernel_source``): in a package written by ``kdagen emit`` its prebuilt object; in
kdagen the compile cache's exported object, or a compile (seconds) exported for the next
process (``kdagen.first_use``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import kernel_source
from .contract import CommitArgs, VerifyArgs, check_commit, check_verify
from .validate import API, KdaInputError, check_tensor
from .values import check_commit_values, check_verify_values, wanted
from .variant import Variant, VariantError, lean_commit_key


def device_arch(device: torch.device | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return f"sm_{major}{minor}"


@functools.cache
def launcher(variant: Variant, arch: str) -> Any:
    """The launchable kernel of ``variant`` for ``arch``, from the current kernel source:
    an emitted package's prebuilt object, else the build side's (``kernel_source``)."""
    if arch not in variant.spec.archs:
        raise KdaInputError(
            f"variant {variant.name} targets {list(variant.spec.archs)}, not this GPU's {arch}"
        )
    return kernel_source.current().load(variant, arch)


def default_commit_variant(
    heads: int,
    window: int,
    slot_dtype: str,
    batch: int,
    gate: str = "kda",
    tree: bool = False,
    prefix_caching: bool = True,
) -> Variant:
    """Built-in heuristic until a dispatch table is present (the H200 sweep in
    docs/history/commit.md): split each (request, head) over more CTAs while the items alone
    cannot keep every SM's copy engine busy. ``tree``: the conv history along a tree's path;
    ``prefix_caching``: the build that takes vLLM's block tables."""
    items = batch * heads
    threads, row_split = (128, 4) if items < 128 else (128, 2) if items < 384 else (256, 1)
    return Variant(
        kernel="commit", heads=heads, window=window, slot_dtype=slot_dtype, gate=gate,
        tree=tree, prefix_caching=prefix_caching, path="bulk", threads=threads, vec=4,
        row_split=row_split,
    )  # fmt: skip


@dataclass(frozen=True)
class CommitLaunch:
    """A validated commit: its arguments, the variant and the batch."""

    args: CommitArgs
    variant: Variant
    batch: int


def validate_commit(
    args: CommitArgs, *, variant: Variant | str | None = None, require_cuda: bool = True
) -> CommitLaunch:
    """Every check ``commit`` makes (``contract.check_commit``) and the variant, without
    launching (CPU tensors pass with ``require_cuda=False``, so the messages are testable
    anywhere)."""
    checked = check_commit(args, require_cuda=require_cuda)
    chosen = _resolve_variant(variant, "commit", batch=checked.batch, device=args.state.device,
                              **checked.fields)  # fmt: skip
    return CommitLaunch(args, chosen, checked.batch)


def commit(
    state: torch.Tensor,
    corr: torch.Tensor,
    kg: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    *,
    lower_bound: float | None = -5.0,
    null_slot: int = 0,
    path: torch.Tensor | None = None,
    variant: Variant | str | None = None,
) -> None:
    """Fold each request's accepted prefix into ``state`` in place (see the semantics page).

    state [slots, H, 128, 128] bf16 (slot stride may be padded), corr [rows, H, Q, 128] fp32,
    kg [rows, H, Q, 256] bf16 (request b reads row b), a_log [H] fp32, dt_bias [H*128] fp32,
    slots [B] int32/int64 (``<= null_slot`` or outside the pool: padding), accepted [B] int32
    (clamped to 0..Q); ``lower_bound``: Kimi-K3's gate bound, or None for Kimi-Linear's
    softplus gate. One layer; ``kdagen.ModelCommit`` folds every layer of a model in one
    launch. Launches on the current stream; no allocation, no synchronisation.
    After a token-tree verify, ``path`` [B, Q] int32 lists each request's accepted nodes root
    first (docs/tree-semantics.md): the kernel reads their records in that order, in place.
    This commit leaves the conv state alone; after a conv tree, ``kdagen.ModelCommit`` (one
    layer or many) also moves the path's last three tokens into the history rows.
    """
    args = CommitArgs(state, corr, kg, a_log, dt_bias, slots, accepted, lower_bound, null_slot)
    run_commit(args, path=path, variant=variant)


def check_path(op: str, path: torch.Tensor, batch: int, window: int, device: torch.device) -> None:
    """A tree's accepted paths: ``path`` [B, Q] int32, request b's nodes root first (entries
    outside the window are clamped into it: a wrong path reads only its own request's row)."""
    check_tensor(op, "path", path, dims=[batch, window], dtypes=[torch.int32], device=device)


def run_commit(
    args: CommitArgs,
    *,
    path: torch.Tensor | None = None,
    variant: Variant | str | None = None,
) -> None:
    """``commit`` on its arguments as one ``CommitArgs`` (``path``: see ``commit``)."""
    launch = validate_commit(args, variant=variant)
    if launch.batch == 0:
        return
    if path is not None:
        check_path(f"{API}.commit", path, launch.batch, args.corr.shape[2], args.state.device)
    state, corr, kg = args.state, args.corr, args.kg
    if wanted(state.device):
        check_commit_values(f"{API}.commit", slots=args.slots, accepted=args.accepted,
                            null_slot=int(args.null_slot), slot_count=state.shape[0],
                            window=corr.shape[2], path=path)  # fmt: skip
    launch_commit(
        launch.variant, state=state, corr=corr, kg=kg, a_log=args.a_log, dt_bias=args.dt_bias,
        slots=args.slots, accepted=args.accepted, layers=1, batch=launch.batch,
        owners=launch.batch, slot_count=state.shape[0], slot_stride=state.stride(0),
        rows=corr.shape[0], corr_row_stride=corr.stride(0), kg_row_stride=kg.stride(0),
        lower_bound=kernel_lower_bound(args.lower_bound), null_slot=int(args.null_slot),
        path=path, by_path=int(path is not None),
    )  # fmt: skip


def kernel_lower_bound(lower_bound: float | None) -> float:
    """The kernels' ``lower_bound`` argument: the bound, or 0 for the softplus gate (whose
    kernels do not read it)."""
    return 0.0 if lower_bound is None else float(lower_bound)


def kernel_null_slot(null_slot: int) -> int:
    """The kernels' ``null_slot`` argument: every negative slot pads. Their in-pool test is
    ``slot > null_slot``, so a null slot below -1 would let -1 through; -1 rejects the same
    requests the caller meant."""
    return max(int(null_slot), -1)


# What the commit kernel's plan arguments are when a caller has none of vLLM's extras: no
# layer table (one layer), records by request row, accepted by request, no window lengths,
# no prefix caching, no conv state. Absent tensors are never read (the pointer is `state`).
_COMMIT_DEFAULTS: dict[str, Any] = {
    "records_by_slot": 0, "indirect": 0, "windowed": 0, "block_size": 0, "table_rows": 0,
    "table_width": 0, "table_stride": 0, "conv_mode": 0, "conv_slot_stride": 0,
    "conv_dim_stride": 0, "conv_token_stride": 0, "by_path": 0,
}  # fmt: skip
_COMMIT_TENSORS = (
    "conv_state", "layer_offsets", "request_index", "query_start", "block_table", "num_computed",
    "path",
)  # fmt: skip


def launch_commit(variant: Variant, **values: Any) -> None:
    """Launch the commit kernel on the current stream; ``values`` maps its parameters
    (``abi.commit_params``) to tensors and numbers; the plan parameters a caller
    leaves out take ``_COMMIT_DEFAULTS`` and absent tensors are never read."""
    from .abi import launch_args

    state = values["state"]
    values = _COMMIT_DEFAULTS | values
    values["null_slot"] = kernel_null_slot(values["null_slot"])
    for name in _COMMIT_TENSORS:
        if values.get(name) is None:
            values[name] = state
    values["stream"] = torch.cuda.current_stream(state.device)
    fn = launcher(variant, device_arch(state.device))
    with torch.cuda.device(state.device):
        fn(*launch_args(variant, values))


def _dispatched(
    kernel: str,
    heads: int,
    window: int,
    slot_dtype: str,
    batch: int,
    device: torch.device | None,
    arch: str | None,
    **fields: Any,
) -> Variant:
    """The GPU's dispatch table choice (generated/<gpu>/), else the built-in heuristic;
    ``fields``: the other contract fields (gate, conv settings). A commit that does not use
    prefix caching (no ``prefix_caching`` field) runs the build without it where the table
    has measured that build's key, else the general one."""
    from . import dispatch

    contract = {"heads": heads, "window": window, "slot_dtype": slot_dtype, **fields}
    if kernel == "commit" and "prefix_caching" not in contract:
        lean = _lean_commit_key(tuple(sorted(contract.items())))
        contract["prefix_caching"] = not dispatch.tuned(kernel, lean, device)
    return dispatch.choose(
        kernel, contract, batch, lambda: heuristic_variant(kernel, contract, batch, arch),
        device=device,
    )  # fmt: skip


def heuristic_variant(
    kernel: str,
    contract: Mapping[str, Any],
    batch: int,
    arch: str | None = None,
    sms: int | None = None,
) -> Variant:
    """The built-in choice for ``kernel`` with ``contract`` (a Variant's contract fields; the
    conv ones only matter for verify) at ``batch``: what runs without a dispatch table, and
    the untuned default a tuned winner is measured against. ``arch``, ``sms``: of the GPU
    it is for (default: the current one)."""
    heads, window, slot_dtype = contract["heads"], contract["window"], contract["slot_dtype"]
    gate = contract.get("gate", "kda")
    if kernel == "commit":
        return default_commit_variant(heads, window, slot_dtype, batch, gate,
                                      contract.get("tree", False),
                                      contract.get("prefix_caching", True))  # fmt: skip
    fields = ("conv", "conv_layout", "conv_weight_dtype", "tree")
    return default_verify_variant(heads, window, slot_dtype, batch, arch=arch, sms=sms,
                                  gate=gate, **{k: contract[k] for k in fields if k in contract})  # fmt: skip


@functools.cache
def _lean_commit_key(contract: tuple[tuple[str, Any], ...]) -> str:
    """``lean_commit_key``, cached: every commit launch asks it."""
    return lean_commit_key(dict(contract))


def _resolve_variant(
    variant: Variant | str | None,
    kernel: str,
    heads: int,
    window: int,
    slot_dtype: str,
    batch: int,
    device: torch.device,
    arch: str | None = None,
    **fields: Any,
) -> Variant:
    """An explicit variant, checked against the inputs; else the dispatch table's choice.
    ``fields``: the other contract fields the inputs fix (gate, conv settings)."""
    if variant is None:
        return _dispatched(kernel, heads, window, slot_dtype, batch, device, arch, **fields)
    if not isinstance(variant, (Variant, str)):
        raise KdaInputError(f"{API}.{kernel}: `variant` must be a Variant, its name or None, "
                            f"got {type(variant).__name__}")  # fmt: skip
    try:
        chosen = Variant.parse(variant) if isinstance(variant, str) else variant
    except VariantError as err:
        raise KdaInputError(f"{API}.{kernel}: `variant`: {err}") from None
    expected = {"kernel": kernel, "heads": heads, "window": window, "slot_dtype": slot_dtype}
    expected |= fields
    wrong = {k: (getattr(chosen, k), v) for k, v in expected.items() if getattr(chosen, k) != v}
    if wrong:
        detail = ", ".join(
            f"{k}: variant has {a!r}, tensors need {b!r}" for k, (a, b) in wrong.items()
        )
        raise KdaInputError(
            f"{API}.{kernel}: variant {chosen.name} does not fit the inputs ({detail})"
        )
    return chosen


# ---- verify ----

# H200 sweep (docs/history/verify-sm90.md): four 54 KiB CTAs fit an SM; fused conv needs 152
# registers per thread, so three, and so does the softplus gate beyond Q = 4 (its coupling
# tile takes the shared memory of a fourth).
_SM90_RESIDENT = {False: 4, True: 3}


def default_verify_variant(
    heads: int,
    window: int,
    slot_dtype: str,
    batch: int,
    conv: bool = False,
    conv_layout: str = "token_major",
    conv_weight_dtype: str = "bf16",
    arch: str | None = None,
    sms: int | None = None,
    gate: str = "kda",
    tree: bool = False,
) -> Variant:
    """Built-in heuristic until a dispatch table is present: the arch's path, every SM's
    resident CTAs, and (without conv) two CTAs per item while items alone leave SMs idle.
    ``arch`` and ``sms`` (SM count): the current GPU's when not given."""
    arch = arch or device_arch()
    contract = {
        "kernel": "verify", "heads": heads, "window": window, "slot_dtype": slot_dtype,
        "conv": conv, "conv_layout": conv_layout, "conv_weight_dtype": conv_weight_dtype,
        "gate": gate, "tree": tree,
    }  # fmt: skip
    if arch == "sm_100a":
        # B200: 148 SMs, 5 resident CTAs to Q = 8; past it 152-168 registers a thread (3 per
        # SM), trees 234-255 and the softplus gate's chains to 232 (2 per SM), measured by
        # compiling.
        resident = 5 if window <= 8 else 2 if tree or gate == "softplus" else 3
        return Variant(**contract, path="sm100_tcgen05", ctas=resident * 148)
    sms = sms or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if window > 8:  # 255 registers a thread: two resident CTAs, one per item (split ones spill)
        return Variant(**contract, path="sm90_wgmma", row_split=1, ctas=2 * sms, stages=1)
    split = 2 if not conv and batch * heads < 2 * sms else 1
    # A tree kernel takes 166-168 registers at Q = 8: 3 resident CTAs (4 spill when split).
    resident = _SM90_RESIDENT[conv or tree or (gate == "softplus" and window > 4)]
    return Variant(**contract, path="sm90_wgmma", row_split=split, ctas=resident * sms, stages=1)


@dataclass(frozen=True)
class VerifyLaunch:
    """A validated verify: its arguments, the variant and the kernel's scalar arguments."""

    args: VerifyArgs
    variant: Variant
    act_stride: int
    records_by_slot: bool
    batch: int


def validate_verify(
    args: VerifyArgs,
    *,
    variant: Variant | str | None = None,
    require_cuda: bool = True,
    arch: str | None = None,
    records_by_slot: bool = False,
    op: str = f"{API}.verify",
) -> VerifyLaunch:
    """Every check ``verify`` makes (``contract.check_verify``) and the variant, without
    launching (CPU tensors pass with ``require_cuda=False``, so the messages are testable
    anywhere)."""
    checked = check_verify(args, op=op, require_cuda=require_cuda,
                           records_by_slot=records_by_slot)  # fmt: skip
    device = args.state.device
    if variant is None and arch is None:
        if device.type != "cuda":
            raise KdaInputError(f"{op}: choosing a variant needs `state` on a CUDA device (or "
                                f"`arch=` / `variant=`), got {device}")  # fmt: skip
        arch = device_arch(device)
    chosen = _resolve_variant(variant, "verify", batch=checked.batch, device=device, arch=arch,
                              **checked.fields)  # fmt: skip
    if wanted(device):
        check_verify_values(op, query_start=args.query_start, slots=args.slots,
                            null_slot=int(args.null_slot), slot_count=args.state.shape[0],
                            tokens=args.q.shape[0], window=checked.fields["window"],
                            accepted=args.accepted, parents=args.parents)  # fmt: skip
    return VerifyLaunch(args, chosen, checked.act_stride, records_by_slot, checked.batch)


_COUNTERS: dict[int, torch.Tensor] = {}


def work_counter(device: torch.device) -> torch.Tensor:
    """The zeroed int32 work counter verify uses when none is passed: one per device, made
    on first use (not during graph capture). Launches that may run concurrently on several
    streams need a counter each."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COUNTERS:
        if torch.cuda.is_current_stream_capturing():
            raise KdaInputError(
                f"{API}.verify: no work counter exists yet for this device and one cannot be "
                "made during CUDA-graph capture; call verify once before capturing, or pass "
                "`counter=` (a zeroed int32 tensor [1])"
            )
        _COUNTERS[index] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[index]


def verify(
    qkv: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    corr: torch.Tensor,
    kg: torch.Tensor,
    *,
    lower_bound: float | None = -5.0,
    null_slot: int = 0,
    conv_state: torch.Tensor | None = None,
    conv_w: torch.Tensor | None = None,
    accepted: torch.Tensor | None = None,
    conv_dim_first: bool = False,
    parents: torch.Tensor | None = None,
    counter: torch.Tensor | None = None,
    variant: Variant | str | None = None,
) -> None:
    """Verify a window of draft tokens per request (see the semantics page).

    qkv [T, 3*H*128] bf16 (the raw projection with conv, else the convolved q, k, v),
    raw_g [T, H*128] bf16, raw_beta [T, H] bf16, a_log [H] fp32, dt_bias [H*128] fp32,
    state [slots, H, 128, 128] bf16 (slot stride may be padded), query_start [B+1] int32,
    slots [B] int32/int64 (``<= null_slot``, negative or outside the pool: padding), out [T, H*128] bf16,
    corr [rows>=B, H, Q, 128] fp32, kg [rows, H, Q, 256] bf16. With conv: conv_state
    [slots, Q+2, 3*H*128] (or [slots, 3*H*128, Q+2] with ``conv_dim_first``) bf16, rolled in
    place; conv_w [3*H*128, 4] bf16 or fp32; accepted [B] int32 (1..Q). Window lengths must
    be <= Q, ``query_start`` nondecreasing inside [0, T] (``out`` is written at rows
    ``query_start[b]..query_start[b+1]-1``, padding requests' included) and live slots unique
    (not checked: that would synchronise). With PDL the kernel reads ``slots`` and starts
    loading states before it waits for the kernel launched before it on the stream, which
    must therefore not write them (a ``commit`` directly before ``verify`` does).
    ``lower_bound``: Kimi-K3's gate bound, or None for Kimi-Linear's softplus gate.
    ``parents`` [T] int32:
    each window is a token tree, token t's parent at window position ``parents[t]`` (-1:
    the root; docs/tree-semantics.md), conv off or on.
    Launches on the current stream; no allocation, no synchronisation.
    """
    args = VerifyArgs.from_qkv(
        qkv, raw_g, raw_beta, a_log, dt_bias, state, query_start, slots, out, corr, kg,
        lower_bound, null_slot, conv_state, conv_w, accepted, conv_dim_first, parents,
    )  # fmt: skip
    run_verify(args, counter=counter, variant=variant)


def run_verify(
    args: VerifyArgs,
    *,
    counter: torch.Tensor | None = None,
    variant: Variant | str | None = None,
) -> None:
    """``verify`` on its arguments as one ``VerifyArgs``."""
    launch_verify(validate_verify(args, variant=variant), counter)


def launch_verify(launch: VerifyLaunch, counter: torch.Tensor | None = None) -> None:
    """Launch a validated verify (``validate_verify``'s result) on the current stream."""
    if launch.batch == 0:
        return
    args = launch.args
    device = args.state.device
    if counter is None:
        counter = work_counter(device)
    else:
        check_tensor(f"{API}.verify", "counter", counter, dims=[1], dtypes=[torch.int32],
                     device=device)  # fmt: skip
    from .abi import launch_args

    fn = launcher(launch.variant, device_arch(device))
    values = {
        **vars(args),
        "counter": counter, "tokens": args.q.shape[0], "act_stride": launch.act_stride,
        "batch": launch.batch, "rows": args.corr.shape[0],
        "records_by_slot": int(launch.records_by_slot), "slot_count": args.state.shape[0],
        "slot_stride": args.state.stride(0), "lower_bound": kernel_lower_bound(args.lower_bound),
        "null_slot": kernel_null_slot(args.null_slot), "stream": torch.cuda.current_stream(device),
    }  # fmt: skip
    with torch.cuda.device(device):
        fn(*launch_args(launch.variant, values))

"""Timing with the method of docs/anchors.md, so figures compare with the peers'.

Cold L2: R input sets (R = ceil(3 x L2 / bytes of one set), at most 64); one CUDA graph
launches the kernel once per set; time = graph replay / R, median of 20 replays after 3
warm-up replays, with the 10th-90th percentile spread. Floor: the bytes a launch must move
over the device-to-device copy bandwidth measured in the same process.

Inputs are the anchors' benchmark case: every request a full window of live slots, slots a
random permutation of 1..B (slot 0 is the null slot), a bf16 state pool with a padded slot
stride. Peers run in the same process on the same input sets (their own output buffers).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kdagen import first_use
from kdagen.cases import POOL_PAD, CommitCase, make_commit_inputs
from kdagen.emulate import relative_errors
from kdagen.reference import gate
from kdagen.serve.contract import CommitArgs
from kdagen.serve.variant import Variant
from kdagen.testing import lower_bound_for, poison_, verify_args, verify_inputs_for

first_use.enable()  # the launches here compile their kernels on first use

K = 128
WARMUP_REPLAYS = 3
TIMED_REPLAYS = 20
MAX_SETS = 64


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    sets: int

    @property
    def spread_pct(self) -> float:
        return 100.0 * (self.p90_us - self.p10_us) / self.median_us


def quantiles_text(values: Sequence[float]) -> str:
    """``min / median / p90 / max`` of a trace's per-CTA times (perf scripts), "-" if none."""
    if not values:
        return "-"
    ordered = sorted(values)
    return (
        f"{ordered[0]:6.2f} / {statistics.median(ordered):6.2f} / "
        f"{ordered[int(0.9 * (len(ordered) - 1))]:6.2f} / {ordered[-1]:6.2f}"
    )


def _timing_columns(t: Timing, floor: float) -> tuple[float, float, float, int, float, float]:
    """A bench row's ``median_us, p10_us, p90_us, sets, floor_us, pct_of_floor``: one rounding
    for the commit and verify rows, so their CSV columns read alike."""
    return (
        round(t.median_us, 3), round(t.p10_us, 3), round(t.p90_us, 3), t.sets, round(floor, 3),
        round(100 * floor / t.median_us, 1),
    )  # fmt: skip


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times[2:])


def sets_for(set_bytes: int) -> int:
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(MAX_SETS, math.ceil(3 * l2 / max(1, set_bytes))))


def time_graph(launches: Sequence[Callable[[], None]]) -> Timing:
    """One graph that runs every launch once; per-launch time of its replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:  # warm: loads modules, compiles, before capture
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    times = []
    for _ in range(TIMED_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(launches))
    times.sort()
    q = statistics.quantiles(times, n=10)
    return Timing(statistics.median(times), q[0], q[-1], len(launches))


# ---- commit ----


def commit_bytes(batch: int, heads: int, window: int) -> int:
    """What a commit must move with every request live and the whole window accepted:
    the state block read and written, corr rows (fp32) and kg rows (bf16) read."""
    return commit_footprint(batch, heads, window) + batch * heads * K * K * 2


def commit_footprint(batch: int, heads: int, window: int) -> int:
    """Distinct bytes one commit input set touches (the state is read and written in place):
    the size that decides how many sets keep L2 cold."""
    per_item = K * K * 2 + window * K * 4 + window * 2 * K * 2
    return batch * heads * per_item + batch * 8


def torch_commit(args: CommitArgs) -> None:
    """The same update in plain torch (gather, fp32 math, scatter): the baseline peer.
    Assumes no null slots and accepted > 0 (the benchmark case), so it needs no host sync."""
    state, corr, kg, slots, accepted = args.state, args.corr, args.kg, args.slots, args.accepted
    a_log, dt_bias = args.a_log, args.dt_bias
    batch, window = slots.shape[0], corr.shape[2]
    idx = slots.long()
    rows = kg[:batch].float()
    live = torch.arange(window, device=state.device)[None, :] < accepted[:, None]  # [B, Q]
    live = live[:, None, :, None]
    log_gate = gate(rows[..., K:].transpose(1, 2), a_log, dt_bias, args.lower_bound, torch.float32)
    log_decay = torch.where(live, log_gate.transpose(1, 2), 0.0).cumsum(dim=2)
    last = log_decay[:, :, -1:, :]
    k = torch.where(live, rows[..., :K], 0.0)
    k_norm = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    e = torch.exp(last - log_decay) * k_norm
    u = torch.where(live, corr[:batch], 0.0)
    new = state[idx].float() * torch.exp(last) + torch.einsum("bhtv,bhtk->bhvk", u, e)
    state[idx] = new.to(state.dtype)


def commit_sets(variant: Variant, batch: int, seed: int = 0) -> list[CommitArgs]:
    """The commit input sets of one measurement: enough to keep L2 cold."""
    heads, window = variant.heads, variant.window
    case = CommitCase(f"bench-{batch}", batch, full_accept=True)
    return [
        make_commit_inputs(
            case,
            heads,
            window,
            _slot_dtype(variant),
            seed + i,
            lower_bound=lower_bound_for(variant.gate),
        )  # fmt: skip
        for i in range(sets_for(commit_footprint(batch, heads, window)))
    ]


def _slot_dtype(variant: Variant) -> torch.dtype:
    return torch.int32 if variant.slot_dtype == "int32" else torch.int64


@dataclass
class CommitBenchRow:
    heads: int
    window: int
    batch: int
    variant: str
    median_us: float
    p10_us: float
    p90_us: float
    sets: int
    floor_us: float
    pct_of_floor: float
    torch_us: float | None


def bench_commit(
    variants: Sequence[Variant],
    batches: Sequence[int],
    bandwidth: float,
    with_torch: bool = True,
    seed: int = 0,
) -> list[CommitBenchRow]:
    """Every variant (of one contract key) at every batch size; rows in that order."""
    from kdagen.serve.runtime import run_commit

    rows: list[CommitBenchRow] = []
    heads, window = variants[0].heads, variants[0].window
    for batch in batches:
        sets = commit_sets(variants[0], batch, seed)
        floor = floor_us(variants[0], batch, bandwidth)
        torch_us = None
        if with_torch:
            torch_us = time_graph([lambda s=s: torch_commit(s) for s in sets]).median_us
        for v in variants:
            t = time_graph([lambda s=s, v=v: run_commit(s, variant=v) for s in sets])
            rows.append(
                CommitBenchRow(
                    heads, window, batch, v.name, *_timing_columns(t, floor),
                    None if torch_us is None else round(torch_us, 3),
                )
            )  # fmt: skip
        del sets
        torch.cuda.empty_cache()
    return rows


# ---- verify ----

ACT_BYTES = 2  # bf16: state, activations, out, kg
CONV_WIDTH = 4  # taps per channel


def verify_bytes(
    batch: int,
    heads: int,
    window: int,
    conv: bool = False,
    conv_weight_bytes: int = 2,
    slot_bytes: int = 4,
) -> int:
    """What one verify must move with every request a full window of live slots.

    Read once: the state blocks (bf16, never written), qkv, raw_g, raw_beta (bf16), a_log and
    dt_bias (fp32), query_start and slots. Written once: corr (fp32) and kg (bf16) rows, out
    (bf16). Without conv this is the anchors' floor. With conv, qkv is the raw projection (the
    same bytes) and each request also reads its 3 conv-history rows and `accepted`, and writes
    Q + 2 conv-state rows (two shifted history rows, then the window's raw tokens), 3HK bf16
    channels a row; the taps [3HK, 4] are read once per launch.
    """
    tokens, hk = batch * window, heads * K
    state = batch * heads * K * K * ACT_BYTES
    activations = tokens * (3 * hk + hk + heads) * ACT_BYTES
    small = heads * 4 + hk * 4 + (batch + 1) * 4 + batch * slot_bytes
    written = batch * heads * window * (K * 4 + 2 * K * ACT_BYTES) + tokens * hk * ACT_BYTES
    total = state + activations + small + written
    if conv:
        rows = 3 + (window + 2)
        total += batch * (rows * 3 * hk * ACT_BYTES + 4) + 3 * hk * CONV_WIDTH * conv_weight_bytes
    return total


def verify_footprint(
    batch: int,
    heads: int,
    window: int,
    conv: bool = False,
    conv_weight_bytes: int = 2,
    slot_bytes: int = 4,
) -> int:
    """Distinct bytes one verify input set touches (sizes the cold-L2 rotation): each byte of
    ``verify_bytes`` once, except that the conv history rows read lie among the Q + 2 rows
    rewritten in place, so they count once."""
    moved = verify_bytes(batch, heads, window, conv, conv_weight_bytes, slot_bytes)
    return moved - (batch * 3 * 3 * heads * K * ACT_BYTES if conv else 0)


def _verify_sizes(variant: Variant) -> dict[str, Any]:
    return {
        "conv": variant.conv,
        "conv_weight_bytes": 4 if variant.conv_weight_dtype == "fp32" else 2,
        "slot_bytes": 4 if variant.slot_dtype == "int32" else 8,
    }


def verify_inputs(
    variant: Variant, batch: int, seed: int = 0, device: str = "cuda"
) -> dict[str, Any]:
    """One benchmark input set for a verify variant's contract: full windows, no padding
    requests, slots a permutation of 1..B, the anchors' 512-element slot padding."""
    return verify_inputs_for(variant, batch, pad=POOL_PAD, seed=seed, device=device,
                             ragged=False, nulls=False, extra_slots=0, extra_rows=0)  # fmt: skip


def verify_sets(variant: Variant, batch: int, seed: int = 0) -> list[dict[str, Any]]:
    """The verify input sets of one measurement: enough to keep L2 cold."""
    size = verify_footprint(batch, variant.heads, variant.window, **_verify_sizes(variant))
    return [verify_inputs(variant, batch, seed + i) for i in range(sets_for(size))]


def verify_launch(inputs: dict[str, Any], variant: Variant) -> Callable[[], None]:
    """kdagen's verify on one input set, as a no-argument launch."""
    from kdagen.serve.runtime import run_verify

    args = verify_args(inputs).with_(lower_bound=lower_bound_for(variant.gate),
                                     parents=inputs["parents"] if variant.tree else None)  # fmt: skip
    return lambda: run_verify(args, variant=variant)


def flashinfer_args(inputs: dict[str, Any]) -> tuple[Any, ...]:
    """FlashInfer's ``kda_recoverssm_verify`` arguments on the same tensors (views, no copy):
    q, k, v, raw_g [1, T, H, 128] and raw_beta [1, T, H] out of our buffers, the same padded
    state pool and slots. Its outputs are its own, poisoned: out [1, T, H, 128] and, as
    FlashInfer (like vLLM) indexes them by state slot, corr [pool slots, H, Q, 128] fp32 and
    kg [pool slots, H, Q, 256] bf16 (the kernel requires exactly the pool's slot count)."""
    qkv, state, out = inputs["qkv"], inputs["state"], inputs["out"]
    tokens, heads, window = qkv.shape[0], state.shape[1], inputs["corr"].shape[2]
    hk, dev = heads * K, qkv.device
    q, k, v = (qkv[:, i * hk : (i + 1) * hk].unflatten(1, (heads, K))[None] for i in range(3))
    corr = poison_(torch.empty(state.shape[0], heads, window, K, device=dev))
    kg = poison_(
        torch.empty(state.shape[0], heads, window, 2 * K, dtype=torch.bfloat16, device=dev)
    )
    peer_out = poison_(torch.empty_like(out)).view(1, tokens, heads, K)
    return (
        q, k, v, inputs["raw_g"].view(1, tokens, heads, K), inputs["raw_beta"].view(1, tokens, heads),
        inputs["a_log"], inputs["dt_bias"], inputs["lower_bound"], state, corr, kg,
        inputs["query_start"], inputs["slots"].to(torch.int32), window, peer_out,
    )  # fmt: skip


def peer_distance(inputs: dict[str, Any], peer: tuple[Any, ...]) -> dict[str, float]:
    """Relative L2 distance of a peer's outputs from ours after both ran on one set: out over
    every token, corr and kg per request (our row b, the peer's row slots[b]). NaN when either
    left an element unwritten (both buffers start poisoned)."""
    slots = inputs["slots"].long()
    batch = slots.shape[0]
    theirs = {"out": peer[14].view_as(inputs["out"]), "corr": peer[9][slots], "kg": peer[10][slots]}
    ours = {"out": inputs["out"], "corr": inputs["corr"][:batch], "kg": inputs["kg"][:batch]}
    return {name: relative_errors(theirs[name], ours[name])["rel_l2"] for name in ours}


@dataclass
class VerifyBenchRow:
    heads: int
    window: int
    conv: bool
    batch: int
    variant: str
    median_us: float
    p10_us: float
    p90_us: float
    sets: int
    floor_us: float
    pct_of_floor: float
    flashinfer_us: float | None  # None: not importable here, or --no-peers
    flashinfer_spread_pct: float | None
    flashinfer_rel_l2: float | None  # worst of out/corr/kg vs ours; None with conv (no conv there)
    # corr alone vs ours: ours is within about 1e-7 of fp64, so this is the peer's own error
    # against the contract's 1e-4
    flashinfer_corr_rel_l2: float | None


def bench_verify(
    variants: Sequence[Variant],
    batches: Sequence[int],
    bandwidth: float,
    peers: bool = True,
    seed: int = 0,
) -> list[VerifyBenchRow]:
    """Every verify variant (of one contract key, or twins that differ only in the gate, each
    launched with its gate's ``lower_bound``, or in ``tree``: chains ignore the trees' parents)
    at every batch size, FlashInfer's verify on the same input sets when it loads (with conv
    it gets the same qkv unconvolved: it does not fuse the conv, so its time leaves the
    separate conv kernel out; on trees it verifies chains). Rows in that order."""
    from kdagen.peers import flashinfer_verify

    first = variants[0]
    if any(v.replace(gate=first.gate, tree=first.tree).contract_key != first.contract_key
           for v in variants):  # fmt: skip
        raise ValueError("bench_verify: the variants must share one contract key (or differ "
                         "only in the gate or in tree)")  # fmt: skip
    inputs_for = next((v for v in variants if v.tree), first)  # trees' inputs have parents
    peer = flashinfer_verify().fn if peers else None
    rows: list[VerifyBenchRow] = []
    for batch in batches:
        sets = verify_sets(inputs_for, batch, seed)
        floor = floor_us(first, batch, bandwidth)
        peer_args, failure = flashinfer_on(peer, sets) if peer is not None else ([], None)
        if failure:
            warnings.warn(f"flashinfer left out from B={batch} on: {failure}", stacklevel=2)
            peer = None
        peer_t = time_graph([partial(peer, *a) for a in peer_args]) if peer else None
        for v in variants:
            t = time_graph([verify_launch(s, v) for s in sets])
            distances = {}
            if peer_args and not first.conv:
                distances = peer_distance(sets[0], peer_args[0])
            rows.append(
                VerifyBenchRow(
                    first.heads, first.window, first.conv, batch, v.name,
                    *_timing_columns(t, floor),
                    None if peer_t is None else round(peer_t.median_us, 3),
                    None if peer_t is None else round(peer_t.spread_pct, 1),
                    float(f"{max(distances.values()):.3g}") if distances else None,
                    float(f"{distances['corr']:.3g}") if distances else None,
                )
            )  # fmt: skip
        del sets, peer_args
        torch.cuda.empty_cache()
    return rows


def flashinfer_on(
    peer: Callable[..., object], sets: Sequence[dict[str, Any]]
) -> tuple[list[tuple[Any, ...]], str | None]:
    """FlashInfer's arguments on every input set, after one eager run on the first (its
    compile); ``([], why)`` when it cannot run on them."""
    args = [flashinfer_args(s) for s in sets]
    failure = _peer_failure(peer, args[0])
    return ([], failure) if failure else (args, None)


def _peer_failure(peer: Callable[..., object], args: tuple[Any, ...]) -> str | None:
    """Run a peer once, eagerly (it compiles on its first call): why it failed, or None. A
    peer that cannot run here must not end the sweep of our own variants."""
    try:
        peer(*args)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a failing launch reports here
    except Exception as err:
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}"
    return None


# ---- either kernel (the tuner's entry points) ----


def moved_bytes(variant: Variant, batch: int) -> int:
    """The bytes one launch of ``variant`` must move at ``batch`` (full windows, live slots)."""
    if variant.kernel == "commit":
        return commit_bytes(batch, variant.heads, variant.window)
    return verify_bytes(batch, variant.heads, variant.window, **_verify_sizes(variant))


def floor_us(variant: Variant, batch: int, bandwidth: float) -> float:
    """The HBM floor in microseconds: ``moved_bytes`` over ``bandwidth`` (bytes/s)."""
    return moved_bytes(variant, batch) / bandwidth * 1e6


# One measurement's input sets: commit's arguments, or verify's inputs (``make_verify_inputs``).
InputSets = list[CommitArgs] | list[dict[str, Any]]
_SETS: dict[tuple[str, str, int, int], InputSets] = {}


def study_sets(variant: Variant, batch: int, seed: int = 0) -> InputSets:
    """The input sets of ``variant``'s contract at ``batch``, kept for the next call with the
    same contract, batch and seed: a tuner times every candidate of a study (and the peer) on
    one set of inputs instead of rebuilding up to 64 sets per candidate. One entry is kept."""
    key = (variant.kernel, variant.contract_key, batch, seed)
    if key not in _SETS:
        _SETS.clear()
        torch.cuda.empty_cache()
        build = commit_sets if variant.kernel == "commit" else verify_sets
        _SETS[key] = build(variant, batch, seed)
    return _SETS[key]


def time_variant(variant: Variant, batch: int, seed: int = 0) -> Timing:
    """Cold-L2 graph timing of one variant at one batch size (the study's input sets)."""
    sets = study_sets(variant, batch, seed)
    if variant.kernel == "commit":
        from kdagen.serve.runtime import run_commit

        return time_graph([lambda s=s: run_commit(s, variant=variant) for s in sets])
    return time_graph([verify_launch(s, variant) for s in sets])


def peer_times(variant: Variant, batch: int, seed: int = 0) -> dict[str, float]:
    """Peers' median microseconds on the study's input sets, by legend label: FlashInfer's
    verify when it loads and runs here (conv off: it does not fuse the conv); the plain torch
    commit for commit."""
    sets = study_sets(variant, batch, seed)
    if variant.kernel == "commit":
        return {"plain torch": time_graph([partial(torch_commit, s) for s in sets]).median_us}
    from kdagen.peers import flashinfer_verify

    peer = flashinfer_verify().fn
    if peer is None or variant.conv:
        return {}
    args, failure = flashinfer_on(peer, sets)
    if failure:
        return {}
    return {"flashinfer": time_graph([partial(peer, *a) for a in args]).median_us}


# ---- results ----

# Peer columns per kernel: legend label -> row field.
PEER_FIELDS: dict[str, dict[str, str]] = {
    "commit": {"plain torch": "torch_us"},
    "verify": {"flashinfer": "flashinfer_us"},
}


def rows_as_dicts(rows: Sequence[object]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]  # type: ignore[call-overload]


def best_per_batch(rows: Sequence[Any]) -> dict[int, Any]:
    """The fastest row (lowest median) at each batch size, by batch."""
    best: dict[int, Any] = {}
    for r in rows:
        if r.batch not in best or r.median_us < best[r.batch].median_us:
            best[r.batch] = r
    return dict(sorted(best.items()))


def write_results(path: Path, header: dict[str, Any], rows: Sequence[Any]) -> tuple[Path, Path]:
    """The header and every row as JSON at ``path``; the rows as CSV beside it (same stem)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header, "rows": rows_as_dicts(rows)}, indent=1) + "\n")
    csv_path = path.with_suffix(".csv")
    names = [f.name for f in fields(rows[0])] if rows else []
    with csv_path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(names)
        for r in rows:
            writer.writerow(["" if getattr(r, n) is None else getattr(r, n) for n in names])
    return path, csv_path


def latency_series(
    rows: Sequence[Any], peers: dict[str, str]
) -> dict[str, list[tuple[float, float]]]:
    """Plot series (batch, us): our best variant per batch, each peer (``label -> row field``)
    where it was measured, and the HBM floor."""
    best = best_per_batch(rows)
    series = {"kdagen (best variant)": [(float(b), r.median_us) for b, r in best.items()]}
    for label, field in peers.items():
        points = [(float(b), getattr(r, field)) for b, r in best.items()]
        points = [(b, us) for b, us in points if us is not None]
        if points:
            series[label] = points
    series["HBM floor"] = [(float(b), r.floor_us) for b, r in best.items()]
    return series


def plot_results(rows: Sequence[Any], kernel: str, title: str, path: Path) -> Path:
    """Latency against batch, log-log, as SVG."""
    from kdagen.plot import loglog_svg

    series = latency_series(rows, PEER_FIELDS[kernel])
    return loglog_svg(series, title, "batch B (requests)", "latency (us)", path)

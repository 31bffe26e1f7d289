"""Timing with the method of docs/anchors.md, so figures compare with the peers'.

Cold L2: R input sets (R = ceil(3 x L2 / bytes of one set), at most 64); one CUDA graph
launches the kernel once per set; time = graph replay / R, median of 20 replays after 3
warm-up replays, with the 10th-90th percentile spread. Floor: the bytes a launch must move
over the device-to-device copy bandwidth measured in the same process.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from kdagen.cases import CommitCase, make_commit_inputs
from kdagen.variant import Variant

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


def torch_commit(inputs: dict[str, object]) -> None:
    """The same update in plain torch (gather, fp32 math, scatter): the baseline peer.
    Assumes no null slots and accepted > 0 (the benchmark case), so it needs no host sync."""
    state, corr, kg = inputs["state"], inputs["corr"], inputs["kg"]
    a_log, dt_bias, slots, accepted = (inputs[k] for k in ("a_log", "dt_bias", "slots", "accepted"))
    assert isinstance(state, torch.Tensor) and isinstance(corr, torch.Tensor)
    assert isinstance(kg, torch.Tensor) and isinstance(slots, torch.Tensor)
    assert isinstance(accepted, torch.Tensor) and isinstance(a_log, torch.Tensor)
    assert isinstance(dt_bias, torch.Tensor)
    batch, heads, window = slots.shape[0], state.shape[1], corr.shape[2]
    idx = slots.long()
    rows = kg[:batch].float()
    live = torch.arange(window, device=state.device)[None, :] < accepted[:, None]  # [B, Q]
    live = live[:, None, :, None]
    x = torch.exp(a_log)[None, :, None, None] * (rows[..., K:] + dt_bias.view(1, heads, 1, K))
    gate = torch.where(live, float(inputs["lower_bound"]) * torch.sigmoid(x), 0.0)  # type: ignore[arg-type]
    log_decay = gate.cumsum(dim=2)
    last = log_decay[:, :, -1:, :]
    k = torch.where(live, rows[..., :K], 0.0)
    k_norm = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    e = torch.exp(last - log_decay) * k_norm
    u = torch.where(live, corr[:batch], 0.0)
    new = state[idx].float() * torch.exp(last) + torch.einsum("bhtv,bhtk->bhvk", u, e)
    state[idx] = new.to(state.dtype)


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
    from kdagen.runtime import commit

    rows: list[CommitBenchRow] = []
    heads, window = variants[0].heads, variants[0].window
    slot_dtype = torch.int32 if variants[0].slot_dtype == "int32" else torch.int64
    for batch in batches:
        moved = commit_bytes(batch, heads, window)
        case = CommitCase(f"bench-{batch}", batch, full_accept=True)
        sets = [
            make_commit_inputs(case, heads, window, slot_dtype, seed + i)
            for i in range(sets_for(commit_footprint(batch, heads, window)))
        ]
        floor_us = moved / bandwidth * 1e6
        torch_us = None
        if with_torch:
            torch_us = time_graph([lambda s=s: torch_commit(s) for s in sets]).median_us
        for v in variants:
            t = time_graph([lambda s=s, v=v: commit(**s, variant=v) for s in sets])  # type: ignore[misc]
            rows.append(
                CommitBenchRow(
                    heads, window, batch, v.name, round(t.median_us, 3), round(t.p10_us, 3),
                    round(t.p90_us, 3), t.sets, round(floor_us, 3),
                    round(100 * floor_us / t.median_us, 1),
                    None if torch_us is None else round(torch_us, 3),
                )
            )  # fmt: skip
        del sets
        torch.cuda.empty_cache()
    return rows


def rows_as_dicts(rows: Sequence[object]) -> list[dict[str, object]]:
    return [asdict(r) for r in rows]  # type: ignore[call-overload]

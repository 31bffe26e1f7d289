"""Timing a model's decode step: the all-layer commit, and L verifies plus that commit.

The method of ``kdagen.bench`` (cold L2 by rotating input sets inside one CUDA graph, median
of 20 replays) on the shapes of a whole model: L KDA layers laid out as vLLM lays them (per
layer a conv state, a padded-stride state pool, correction and key/gate caches indexed by
state block), every request a full window, accepted counts random in 1..Q, slots a random
permutation of 1..B, Kimi-K3's bounded gate (lower bound -5) or Kimi-Linear's softplus gate
(``lower_bound=None``). kdagen runs through its vLLM drop-ins (``KDARecoverSSMCommitContext``,
which also compacts the conv state, and ``kda_recoverssm_verify``) and through
``ModelCommit`` without the conv (what a fused-conv verify needs); vLLM's own Triton commit
and verify are the peers when ``.peers`` holds them. The floor counts the bytes each commit
must move: every live state read and written, the accepted records rows read and, with the
conv, three history rows read and written per layer and request.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from kdagen import first_use
from kdagen.bench import POOL_PAD, sets_for, time_graph

first_use.enable()  # the launches here compile their kernels on first use

K = 128
HISTORY = 3


@dataclass
class ModelSet:
    """One input set: the layers (vLLM-shaped), the step's index tensors, and per layer the
    verify activations when the decode step is timed."""

    layers: list[SimpleNamespace]
    step: dict[str, torch.Tensor]
    activations: list[tuple[torch.Tensor, ...]]


def model_set(heads: int, window: int, layers: int, batch: int, seed: int,
              with_activations: bool, lower_bound: float | None = -5.0) -> ModelSet:  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def randn(*shape: int, std: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * std).to(dtype)

    blocks, conv_dim, tokens = batch + 1, 3 * heads * K, batch * window
    out, acts = [], []
    for _ in range(layers):
        pool = randn(blocks, heads * K * K + POOL_PAD, std=0.1)
        state = pool[:, : heads * K * K].view(blocks, heads, K, K)
        records = SimpleNamespace(  # vLLM 0.33's KDARecoverSSMRecords: rows per request
            correction=randn(batch, heads, window, K, dtype=torch.float32),
            key_gate=randn(batch, heads, window, 2 * K),
        )
        out.append(SimpleNamespace(
            kv_cache=(randn(blocks, window + 2, conv_dim), state), recoverssm_records=records,
            gate_lower_bound=lower_bound, local_num_heads=heads, head_dim=K,
            A_log=torch.rand(heads, generator=gen, device=dev) * 2 - 1,
            dt_bias=randn(heads * K, std=0.5, dtype=torch.float32),
        ))  # fmt: skip
        if with_activations:
            acts.append(tuple(randn(1, tokens, heads, K) for _ in range(4)) +
                        (randn(1, tokens, heads),))  # fmt: skip
    slots = (1 + torch.randperm(batch, generator=gen, device=dev)).int()
    accepted = torch.randint(1, window + 1, (batch,), generator=gen, device=dev).int()
    starts = torch.arange(0, tokens + 1, window, device=dev, dtype=torch.int32)
    step = {"num_accepted_tokens": accepted, "state_indices": slots, "query_start_loc": starts}
    return ModelSet(out, step, acts)


def commit_bytes(s: ModelSet, conv: bool) -> int:
    """Bytes the all-layer commit of ``s`` must move (every request live)."""
    heads = s.layers[0].local_num_heads
    accepted = int(s.step["num_accepted_tokens"].sum())
    batch = s.step["state_indices"].shape[0]
    per_layer = batch * heads * K * K * 2 * 2 + accepted * heads * (K * 4 + 2 * K * 2)
    if conv:
        per_layer += batch * HISTORY * 3 * heads * K * 2 * 2
    return len(s.layers) * per_layer + batch * 12  # slots, accepted, query_start (int32)


def model_commit(s: ModelSet, conv: bool) -> Any:
    """``ModelCommit`` over ``s``'s layers (records per request row), with vLLM's conv
    compaction when ``conv``."""
    from kdagen.serve.model_commit import ModelCommit

    records = [layer.recoverssm_records for layer in s.layers]
    return ModelCommit(
        [layer.kv_cache[1] for layer in s.layers], [r.correction for r in records],
        [r.key_gate for r in records], [layer.A_log for layer in s.layers],
        [layer.dt_bias for layer in s.layers], lower_bound=s.layers[0].gate_lower_bound,
        conv_states=[layer.kv_cache[0] for layer in s.layers] if conv else None,
    )  # fmt: skip


def verify_bytes(s: ModelSet) -> int:
    """Bytes the L verifies of ``s`` must move (the anchors' verify floor per layer)."""
    from kdagen.bench import verify_bytes as one

    heads, window = s.layers[0].local_num_heads, s.layers[0].recoverssm_records.correction.shape[2]
    return len(s.layers) * one(s.step["state_indices"].shape[0], heads, window)


@dataclass
class ModelBenchRow:
    heads: int
    window: int
    layers: int
    gate: str  # kda (lower bound -5) or softplus
    batch: int
    sets: int
    commit_variant: str  # the kernel the run-time launched for it (layers x batch)
    commit_us: float  # kdagen's vLLM commit context (conv compacted)
    commit_spread_pct: float
    commit_floor_us: float
    commit_no_conv_us: float  # ModelCommit without the conv (a fused-conv verify's commit)
    commit_no_conv_floor_us: float
    vllm_commit_us: float | None
    step_us: float | None  # L x kdagen verify + kdagen's commit
    step_floor_us: float | None
    vllm_step_us: float | None  # L x vLLM's Triton verify + vLLM's commit


def _verifies(s: ModelSet, verify: Any) -> list:
    """One launch per layer of a vLLM-0.33-signature verify on ``s`` (records object)."""
    window = s.layers[0].recoverssm_records.correction.shape[2]
    launches = []
    for layer, act in zip(s.layers, s.activations, strict=True):
        out = torch.empty_like(act[2])
        args = (*act, layer.A_log, layer.dt_bias, layer.gate_lower_bound, layer.kv_cache[1],
                layer.recoverssm_records, s.step["query_start_loc"], s.step["state_indices"],
                window, out)  # fmt: skip
        launches.append(partial(verify, *args))
    return launches


def _kdagen_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                   lower_bound: float | None, state: torch.Tensor, records: Any,
                   query_start: torch.Tensor, slots: torch.Tensor, window: int,
                   out: torch.Tensor) -> None:  # fmt: skip
    """kdagen's verify with vLLM 0.33's signature (records by request row)."""
    from kdagen.serve.vllm import verify_records

    verify_records(q, k, v, g, beta, a_log, dt_bias, lower_bound, state, records.correction,
                   records.key_gate, query_start, slots, window, out,
                   records_by_slot=False)  # fmt: skip


def _timed(launches: list, per: int) -> float:
    """Median microseconds of ``per`` consecutive launches (one input set's share)."""
    return time_graph(launches).median_us * len(launches) / per


def model_sets(heads: int, window: int, layers: int, batch: int, seed: int,
               with_activations: bool, lower_bound: float | None = -5.0) -> list[ModelSet]:  # fmt: skip
    """As many input sets (seeds ``seed``, ``seed + 1``, ...) as rotate out of L2 in one graph
    (``sets_for`` the commit's bytes)."""
    probe = model_set(heads, window, layers, batch, seed, False, lower_bound)
    count = sets_for(commit_bytes(probe, conv=True))
    del probe
    return [model_set(heads, window, layers, batch, seed + i, with_activations, lower_bound)
            for i in range(count)]  # fmt: skip


def bench_model(heads: int, window: int, layers: int, batches: list[int], bandwidth: float,
                peers: bool = True, step: bool = True, seed: int = 0,
                lower_bound: float | None = -5.0) -> list[ModelBenchRow]:  # fmt: skip
    """The all-layer commit (and, with ``step``, the decode step) at every batch size, with
    the bounded gate at ``lower_bound`` or the softplus gate (None)."""
    from kdagen.peers import vllm_commit, vllm_verify

    peer_commit = vllm_commit().fn if peers else None
    peer_verify = vllm_verify().fn if peers and step else None
    rows = []
    for batch in batches:
        sets = model_sets(heads, window, layers, batch, seed, step, lower_bound)
        floor = commit_bytes(sets[0], True) / bandwidth * 1e6
        rows.append(_bench_batch(sets, window, batch, peer_commit, peer_verify, step, floor,
                                 commit_bytes(sets[0], False) / bandwidth * 1e6,
                                 (verify_bytes(sets[0]) + commit_bytes(sets[0], True))
                                 / bandwidth * 1e6))  # fmt: skip
        del sets
        torch.cuda.empty_cache()
    return rows


def _bench_batch(sets: list[ModelSet], window: int, batch: int, peer_commit: Any,
                 peer_verify: Any, step: bool, floor: float, floor_no_conv: float,
                 step_floor: float) -> ModelBenchRow:  # fmt: skip
    from kdagen.serve.vllm import KDARecoverSSMCommitContext

    def commits(factory: Any) -> list:
        made = [(factory.create(s.layers, spec_query_len=window, max_num_reqs=batch), s)
                for s in sets]  # fmt: skip
        return [partial(c.commit, **s.step) for c, s in made]

    ours = commits(KDARecoverSSMCommitContext)
    mine = time_graph(ours)
    models = [model_commit(s, conv=False) for s in sets]
    plain = [partial(m.commit, s.step["state_indices"], s.step["num_accepted_tokens"],
                     query_start=s.step["query_start_loc"])
             for m, s in zip(models, sets, strict=True)]  # fmt: skip
    no_conv = time_graph(plain).median_us
    # The conv only changes the kernel along a tree's path: a chain's commit is the same one.
    ran = models[0].variant_for(batch, sets[0].step["state_indices"].dtype)
    theirs = commits(peer_commit) if peer_commit is not None else None
    step_us = vllm_step = None
    if step:
        launches = []
        for s, commit in zip(sets, ours, strict=True):
            launches += [*_verifies(s, _kdagen_verify), commit]
        step_us = _timed(launches, len(sets))
        if peer_verify is not None and theirs is not None:
            launches = []
            for s, commit in zip(sets, theirs, strict=True):
                launches += [*_verifies(s, peer_verify), commit]
            vllm_step = _timed(launches, len(sets))
    heads, layers = sets[0].layers[0].local_num_heads, len(sets[0].layers)
    return ModelBenchRow(
        heads, window, layers, ran.gate, batch, len(sets), ran.name, round(mine.median_us, 3),
        round(mine.spread_pct, 1), round(floor, 3), round(no_conv, 3), round(floor_no_conv, 3),
        None if theirs is None else round(time_graph(theirs).median_us, 3),
        None if step_us is None else round(step_us, 3),
        round(step_floor, 3) if step else None,
        None if vllm_step is None else round(vllm_step, 3),
    )  # fmt: skip

"""GPU check of the all-layer commit (``kdagen.ModelCommit`` and vLLM's commit context).

Each case builds several layers' pools in separate allocations, each followed by poisoned
guard memory, with records that hold NaN wherever the contract says they were not written.
The kernel runs eagerly, again from the same start, and from a CUDA graph; the reference
(``kdagen.reference.commit_plan`` / ``commit_layers``) folds fp64 copies. Touched slots must
match within bf16 rounding, the conv history bit for bit, and every other byte (other
slots, slot padding, records, guards) must be unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kdagen import first_use, reference
from kdagen.cases import random_root_paths, scatter_along
from kdagen.check import COMMIT_MAX_REL, COMMIT_REL_L2, CaseResult
from kdagen.serve.variant import Variant
from kdagen.testing import bits, lower_bound_for, poison_
from kdagen.tree import compact_history

first_use.enable()  # the launches here compile their kernels on first use

K = 128
GUARD = 256  # poisoned elements after every buffer
PAGE_PAD = 512  # elements of padding after each slot / records row (a vLLM cache page)


@dataclass(frozen=True)
class ModelCase:
    """What an all-layer commit case exercises."""

    name: str
    batch: int
    layers: int
    vllm: bool = False  # records by slot, request indices, window lengths, conv compaction
    align: bool = False  # vLLM's prefix caching (block tables)
    dim_first: bool = False  # conv state layout
    outside: bool = False  # slots, request indices and table entries outside their tensors
    tree: bool = False  # the accepted tokens as a token tree's path
    conv: bool = False  # a conv state without vLLM's plan (a tree's: compacted along its path)


MODEL_CASES = (
    ModelCase("layers", 11, 4),
    ModelCase("vllm-layers", 9, 3, vllm=True),
    ModelCase("vllm-align", 7, 3, vllm=True, align=True, dim_first=True),
    ModelCase("outside", 10, 2, vllm=True, align=True, outside=True),
    ModelCase("tree-path", 9, 3, tree=True),
)
# The tree commit kernel's: ModelCommit runs it for paths with conv states only.
TREE_MODEL_CASES = (
    ModelCase("tree-conv", 9, 3, tree=True, conv=True),
    ModelCase("tree-conv-dim-first", 7, 2, tree=True, conv=True, dim_first=True),
)


def _guarded(shape: tuple[int, ...], dtype: torch.dtype, pad: int, gen: torch.Generator,
             std: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(view, buffer): ``shape`` with ``pad`` elements after each outer row, in one buffer
    that ends in GUARD poisoned elements; the rest random (``gen``: a CUDA generator)."""
    row = int(torch.tensor(shape[1:]).prod()) + pad
    buffer = (torch.randn(shape[0] * row + GUARD, generator=gen, device="cuda") * std).to(dtype)
    poison_(buffer[shape[0] * row :])
    inner = [int(torch.tensor(shape[i + 1 :]).prod()) for i in range(1, len(shape))]
    return buffer.as_strided(shape, (row, *inner)), buffer


def _plan_inputs(case: ModelCase, window: int, slot_count: int, gen: torch.Generator,
                 slot_dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    """The step's index tensors: distinct slots per request (each owns a run of slots)."""
    b, dev = case.batch, "cuda"
    owners = b + 2 if case.vllm else b
    per = (slot_count - 1) // b  # slots each request may own
    base = 1 + torch.randperm(b, generator=gen)[:b] * per
    out: dict[str, Any] = {}
    accepted = torch.randint(0, window + 2, (owners,), generator=gen, dtype=torch.int32)
    if case.vllm:
        perm = torch.randperm(owners, generator=gen)[:b].int()
        qlen = torch.randint(0, window + 1, (b,), generator=gen)
        if case.align:  # the last request commits at least one token (see below)
            qlen[-1] = qlen[-1].clamp(min=1)
            accepted[perm[-1]] = accepted[perm[-1]].clamp(min=1)
        out["request_index"] = perm
        out["query_start"] = torch.cat([torch.zeros(1), qlen.cumsum(0)]).int()
    if case.align:
        table = torch.zeros(owners, per, dtype=torch.int32)
        owner_of = out["request_index"].long()
        for i in range(b):
            table[owner_of[i]] = base[i].int() + torch.arange(per, dtype=torch.int32)
        block = 2 * window
        computed = torch.randint(0, block * (per - 1), (owners,), generator=gen, dtype=torch.int32)
        # The last request's window ends on a block boundary: its final state goes to the
        # block of its last token, which is also the crossed boundary's.
        last, count = int(owner_of[-1]), min(int(accepted[owner_of[-1]]), int(qlen[-1]), window)
        computed[last] = block * (1 + int(computed[last]) // block) - count
        source = table[owner_of, computed[owner_of].long() // block]
        out |= {"block_table": table, "num_computed": computed, "block_size": block}
    else:
        source = base.int()
    slots = source.clone()
    slots[torch.rand(b, generator=gen) < 0.2] = 0  # null slot: padding
    slots[-1] = source[-1]  # the boundary request above stays live
    if case.outside:
        slots[0], slots[1] = -2, slot_count
        out["request_index"][2] = owners
        if case.align:
            out["block_table"][out["request_index"][3].long(), :] = slot_count + 5
    out |= {"slots": slots.to(slot_dtype), "accepted": accepted}
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def make_model_inputs(case: ModelCase, heads: int, window: int, slot_dtype: torch.dtype,
                      seed: int) -> dict[str, Any]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)  # the small tensors, drawn on the host
    device_gen = torch.Generator(device="cuda").manual_seed(seed)
    slot_count = 1 + case.batch * (4 if case.align else 1) + 3
    rows = slot_count if case.vllm else case.batch + 2
    layers: dict[str, list] = {k: [] for k in ("states", "corrs", "kgs", "convs", "buffers")}
    for _ in range(case.layers):
        state, s_buf = _guarded((slot_count, heads, K, K), torch.bfloat16, PAGE_PAD, device_gen,
                                0.1)  # fmt: skip
        corr, c_buf = _guarded((rows, heads, window, K), torch.float32, PAGE_PAD, device_gen)
        kg, k_buf = _guarded((rows, heads, window, 2 * K), torch.bfloat16, PAGE_PAD, device_gen)
        kg[..., K:] *= 1.5
        layers["states"].append(state)
        layers["corrs"].append(corr)
        layers["kgs"].append(kg)
        layers["buffers"] += [s_buf, c_buf, k_buf]
        if case.vllm or case.conv:
            shape = (slot_count, 3 * heads * K, window + 2) if case.dim_first else (
                slot_count, window + 2, 3 * heads * K)  # fmt: skip
            conv, v_buf = _guarded(shape, torch.bfloat16, 0, device_gen)
            layers["convs"].append(conv)
            layers["buffers"].append(v_buf)
    step = _plan_inputs(case, window, slot_count, gen, slot_dtype)
    plan = _reference_plan(case, layers, step, window)
    # Records rows past each request's count were never written by verify: NaN there.
    unwritten = torch.arange(window, device="cuda")[None, :] >= plan.count[:, None]
    for corr, kg in zip(layers["corrs"], layers["kgs"], strict=True):
        for records in (corr, kg):
            rows_nan = records[plan.record.clamp(0, rows - 1)]
            rows_nan[unwritten[:, None, :, None].expand_as(rows_nan)] = float("nan")
            records[plan.record[plan.live]] = rows_nan[plan.live]
    a_logs = [torch.rand(heads, generator=gen).cuda() * 2 - 1 for _ in range(case.layers)]
    dt_biases = [(torch.randn(heads * K, generator=gen) * 0.5).cuda() for _ in range(case.layers)]
    return {**layers, "step": step, "plan": plan, "a_logs": a_logs, "dt_biases": dt_biases}


def _reference_plan(case: ModelCase, layers: dict, step: dict, window: int) -> Any:
    state, corr = layers["states"][0], layers["corrs"][0]
    return reference.commit_plan(
        step["slots"], step["accepted"], null_slot=0, slot_count=state.shape[0], window=window,
        rows=corr.shape[0], records_by_slot=case.vllm, query_start=step.get("query_start"),
        request_index=step.get("request_index"), block_table=step.get("block_table"),
        num_computed=step.get("num_computed"), block_size=step.get("block_size", 0),
    )  # fmt: skip


def _model(inputs: dict[str, Any], case: ModelCase, lower_bound: float | None) -> Any:
    from kdagen.serve.model_commit import ModelCommit

    return ModelCommit(
        inputs["states"], inputs["corrs"], inputs["kgs"], inputs["a_logs"], inputs["dt_biases"],
        lower_bound=lower_bound, records_by_slot=case.vllm, conv_states=inputs["convs"] or None,
        conv_dim_first=case.dim_first,
    )  # fmt: skip


def _along_paths(inputs: dict[str, Any], seed: int) -> torch.Tensor:
    """Every layer's records scattered in place along the same random root paths (records
    row b is request b's: ``cases.scatter_along``); the paths [B, Q]."""
    step = inputs["step"]
    path = random_root_paths(step["accepted"], inputs["corrs"][0].shape[2], seed)
    path = path.to(step["slots"].device)
    for corr, kg in zip(inputs["corrs"], inputs["kgs"], strict=True):
        scattered_corr, scattered_kg = scatter_along(corr, kg, step["accepted"], path)
        corr.copy_(scattered_corr)
        kg.copy_(scattered_kg)
    return path


def _step_kwargs(step: dict[str, Any]) -> dict[str, Any]:
    """``ModelCommit.commit``'s keyword arguments among a case's step inputs."""
    return {k: v for k, v in step.items() if k not in ("slots", "accepted")}


def run_model_case(variant: Variant, case: ModelCase, seed: int) -> CaseResult:
    """One all-layer case: eager, repeated and graph-replayed launches against the
    reference; guards, records and untouched slots bit for bit."""
    slot_dtype = torch.int32 if variant.slot_dtype == "int32" else torch.int64
    inputs = make_model_inputs(case, variant.heads, variant.window, slot_dtype, seed)
    buffers = inputs["buffers"]
    expected = [s.double() for s in inputs["states"]]
    expected_conv = [c.clone() for c in inputs["convs"]]
    views = [c if case.dim_first else c.transpose(1, 2) for c in expected_conv]
    lower_bound = lower_bound_for(variant.gate)
    reference.commit_layers(
        expected, inputs["corrs"], inputs["kgs"], torch.stack(inputs["a_logs"]),
        torch.stack(inputs["dt_biases"]), inputs["plan"], lower_bound=lower_bound,
        conv_states=None if case.tree else views or None,
    )  # fmt: skip
    # A tree case folds the same tokens, their records scattered along the paths; its conv
    # history is the path's last three tokens.
    path = {"path": _along_paths(inputs, seed)} if case.tree else {}
    if case.tree:
        plan = inputs["plan"]
        for view in views:
            compact_history(view, plan.source[plan.live], path["path"][plan.live].long(),
                            plan.count[plan.live], dim_first=True)  # fmt: skip
    start = [b.clone() for b in buffers]
    result = CaseResult(variant.name, f"model-{case.name}", 0.0, 0.0, 0.0, True, True)
    try:
        model = _model(inputs, case, lower_bound)
        kwargs = _step_kwargs(inputs["step"]) | path
        runs = []
        for mode in ("eager", "repeat", "graph"):
            for buf, first in zip(buffers, start, strict=True):
                buf.copy_(first)
            if mode == "graph":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.commit(inputs["step"]["slots"], inputs["step"]["accepted"],
                                 variant=variant, **kwargs)  # fmt: skip
                for buf, first in zip(buffers, start, strict=True):
                    buf.copy_(first)
                graph.replay()
            else:
                model.commit(inputs["step"]["slots"], inputs["step"]["accepted"],
                             variant=variant, **kwargs)  # fmt: skip
            torch.cuda.synchronize()
            runs.append([bits(b).clone() for b in buffers])
    except Exception as err:  # a launch error is a failed check, not a crash of the run
        result.error = f"{type(err).__name__}: {err}"[:300]
        return result
    result.deterministic = all(
        torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run, strict=True)
    )
    _compare(result, inputs, start, expected, expected_conv)
    return result


def _compare(result: CaseResult, inputs: dict, start: list, expected: list,
             expected_conv: list) -> None:  # fmt: skip
    """Fill ``result``: errors over the touched slots, and whether every other byte held."""
    plan = inputs["plan"]
    touched = torch.cat([plan.final[plan.live], plan.boundary[plan.boundary_live]])
    slot_count = inputs["states"][0].shape[0]
    mask = torch.zeros(slot_count, dtype=torch.bool, device="cuda")
    mask[touched] = True
    got = torch.cat([s[mask].double().flatten() for s in inputs["states"]])
    want = torch.cat([e[mask].flatten() for e in expected])
    if got.numel():
        diff = (got - want).abs()
        scale = want.pow(2).mean().sqrt()
        result.max_abs = float(diff.max())
        result.max_rel = float((diff / (want.abs() + 1e-2 * scale)).max())
        result.rel_l2 = float(diff.norm() / want.norm())
    # Every byte but the touched slots' state blocks (and the conv rows compared exactly).
    ok = True
    for layer, state in enumerate(inputs["states"]):
        before = start[_buffer_index(inputs, layer, 0)]
        after = inputs["buffers"][_buffer_index(inputs, layer, 0)]
        width = state.stride(0)
        changed = bits(after) != bits(before)
        block = changed[: slot_count * width].view(slot_count, width)
        head_bytes = state.shape[1] * K * K
        ok &= not block[~mask].any() and not block[:, head_bytes:].any()
        ok &= not changed[slot_count * width :].any()
        for kind in (1, 2):  # records: never written
            idx = _buffer_index(inputs, layer, kind)
            ok &= torch.equal(bits(inputs["buffers"][idx]), bits(start[idx]))
        if inputs["convs"]:
            idx = _buffer_index(inputs, layer, 3)
            conv_buf = inputs["buffers"][idx]
            n = inputs["convs"][layer].numel()
            ok &= torch.equal(bits(inputs["convs"][layer]), bits(expected_conv[layer]))
            ok &= torch.equal(bits(conv_buf[n:]), bits(start[idx][n:]))
    result.untouched_ok = bool(ok)


def _buffer_index(inputs: dict, layer: int, kind: int) -> int:
    per = 4 if inputs["convs"] else 3
    return layer * per + kind


def model_cases(variant: Variant) -> tuple[ModelCase, ...]:
    """The all-layer cases ``variant`` serves: a build without prefix caching takes vLLM's
    cases without block tables (the run-time never sends it any)."""
    cases = TREE_MODEL_CASES if variant.tree else MODEL_CASES
    if variant.prefix_caching:
        return cases
    lean = (replace(c, name=c.name.replace("-align", "-dim-first"), align=False) for c in cases)
    return tuple(lean)


def check_model_commit(variant: Variant, seed: int = 0) -> list[CaseResult]:
    """Every all-layer case, each on fresh random inputs."""
    cases = model_cases(variant)
    return [run_model_case(variant, case, seed + 100 + i) for i, case in enumerate(cases)]


__all__ = ["COMMIT_MAX_REL", "COMMIT_REL_L2", "MODEL_CASES", "ModelCase", "check_model_commit"]

"""The commit kernel on a GPU: reference checks, graph replay, and the spec-decode loop."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_marks import ANY_GPU

from kdagen import reference
from kdagen.cases import CHECK_CASES, make_commit_inputs, pool_of
from kdagen.check import check_commit
from kdagen.serve.contract import CommitArgs, VerifyArgs
from kdagen.serve.variant import Variant
from kdagen.space import Space

pytestmark = ANY_GPU

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure


def _representative(space: str) -> list[str]:
    """Every tuning point of one contract key, plus one variant of every other key."""
    variants = Space.load(space).expand().variants
    full = [v.name for v in variants if v.heads == 12 and v.window == 8 and v.slot_dtype == "int32"]
    seen, others = set(), []
    for v in variants:
        key = v.contract_key
        if key not in seen and not (v.heads == 12 and v.window == 8 and v.slot_dtype == "int32"):
            seen.add(key)
            others.append(v.name)
    return full + others


def _one_per_window(space: str) -> list[str]:
    """One variant per (window, gate, build, tree) of a space with many windows, spread over
    its head counts and tuning points."""
    groups: dict[tuple, list[str]] = {}
    for v in Space.load(space).expand().variants:
        groups.setdefault((v.window, v.gate, v.prefix_caching, v.tree), []).append(v.name)
    return [names[(7 * n) % len(names)] for n, names in enumerate(groups.values())]


# The shipped commits, those that fold on the tensor cores (search_spaces/commit_mma.yaml),
# those past 8 tokens (search_spaces/commit_wide.yaml), between commit.yaml's windows
# (search_spaces/commit_between.yaml) and those that stage their rows through a ring
# (search_spaces/commit_ring.yaml).
@pytest.mark.parametrize(
    "name",
    _representative("commit.yaml")
    + _representative("commit_mma.yaml")
    + _representative("commit_wide.yaml")
    + _one_per_window("commit_between.yaml")
    + _representative("commit_ring.yaml"),
)
def test_commit_variant_matches_reference(name: str) -> None:
    results = check_commit(Variant.parse(name), seed=SEED)
    failed = {r.case for r in results if not r.passed}
    assert not failed, f"seed {SEED}: {[r for r in results if not r.passed]}"


def test_commit_graph_replay_equals_eager() -> None:
    from kdagen.serve.runtime import run_commit

    variant = Variant(kernel="commit", heads=12, window=4, row_split=2)
    args = make_commit_inputs(CHECK_CASES[2], 12, 4, seed=SEED)
    state = args.state
    start = pool_of(state).clone()
    run_commit(args, variant=variant)  # eager (also compiles before capture)
    eager = pool_of(state).clone()
    pool_of(state).copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_commit(args, variant=variant)
    pool_of(state).copy_(start)  # capture does not run the kernel; start again anyway
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool_of(state).view(torch.int16), eager.view(torch.int16))


def _spec_decode_step_inputs(step: int, batch: int, heads: int, window: int) -> dict:
    """Fresh tokens for one step: ragged windows (qlen 0 included), one padding request."""
    g = torch.Generator().manual_seed(SEED + step)
    qlen = torch.randint(0, window + 1, (batch,), generator=g)
    qlen[step % batch] = window
    starts = torch.zeros(batch + 1, dtype=torch.int32)
    starts[1:] = qlen.cumsum(0)
    tokens = int(starts[-1])
    return {
        "qkv": torch.randn(tokens, 3 * heads * 128, generator=g).bfloat16().cuda(),
        "raw_g": torch.randn(tokens, heads * 128, generator=g).bfloat16().cuda(),
        "raw_beta": torch.randn(tokens, heads, generator=g).bfloat16().cuda(),
        "query_start": starts.cuda(),
        "qlen": qlen,
        "null": int(torch.randint(0, batch, (1,), generator=g)),
    }


@pytest.mark.parametrize("conv_dim_first", [False, True])
def test_spec_decode_loop_reference_verify_kernel_commit(conv_dim_first: bool) -> None:
    """20 steps of verify (reference, fp32) -> accept -> commit (kernel) on a bf16 pool track
    the same loop run entirely in fp64, and the bf16 loop with the reference commit."""
    from kdagen.serve.runtime import run_commit

    batch, heads, window, steps = 6, 12, 4, 20
    g = torch.Generator().manual_seed(SEED)
    slots = (torch.randperm(batch + 3, generator=g)[:batch] + 1).int().cuda()
    a_log = (torch.rand(heads, generator=g) * 2 - 1).cuda()
    dt_bias = (torch.randn(heads * 128, generator=g) * 0.5).cuda()
    pool = (torch.randn(batch + 4, heads * 128 * 128 + 512, generator=g) * 0.1).bfloat16().cuda()
    conv_rows = torch.randn(batch + 4, window + 2, 3 * heads * 128, generator=g).bfloat16().cuda()
    conv_w = (torch.randn(3 * heads * 128, 4, generator=g) * 0.5).bfloat16().cuda()
    runs = {
        "kernel": {"pool": pool.clone()},
        "ref_bf16": {"pool": pool.clone()},
        "fp64": {"pool": pool.double()},
    }
    for run in runs.values():
        rows = conv_rows.clone()
        run["conv"] = rows.transpose(1, 2).contiguous() if conv_dim_first else rows
        run["accepted"] = torch.ones(batch, dtype=torch.int32, device="cuda")
        run["state"] = run["pool"][:, : heads * 128 * 128].view(-1, heads, 128, 128)
    for step in range(steps):
        tok = _spec_decode_step_inputs(step, batch, heads, window)
        step_slots = slots.clone()
        step_slots[tok["null"]] = 0
        qlen = tok["qlen"].cuda()
        accept = torch.minimum(
            torch.randint(1, window + 1, (batch,), generator=g).cuda(), qlen
        ).int()
        accept[step_slots <= 0] = 0
        for name, run in runs.items():
            dtype = torch.float64 if name == "fp64" else torch.float32
            corr = torch.full((batch, heads, window, 128), float("nan"), dtype=dtype, device="cuda")
            kg = torch.zeros(batch, heads, window, 256, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(tok["qkv"].shape[0], heads * 128, dtype=dtype, device="cuda")
            verify_args = VerifyArgs.from_qkv(
                tok["qkv"], tok["raw_g"], tok["raw_beta"], a_log, dt_bias, run["state"],
                tok["query_start"], step_slots, out, corr, kg, lower_bound=-5.0, null_slot=0,
                conv_state=run["conv"], conv_w=conv_w, accepted=run["accepted"],
                conv_dim_first=conv_dim_first,
            )  # fmt: skip
            reference.verify(verify_args, compute_dtype=dtype)
            args = CommitArgs(run["state"], corr, kg, a_log, dt_bias, step_slots, accept,
                              lower_bound=-5.0, null_slot=0)  # fmt: skip
            if name == "kernel":
                run_commit(args)
            else:
                reference.commit(args, compute_dtype=dtype)
            live = (step_slots > 0) & (qlen > 0)
            run["accepted"] = torch.where(live, accept, run["accepted"])
    truth = runs["fp64"]["state"]
    for name in ("kernel", "ref_bf16"):
        got = runs[name]["state"].double()
        rel = float((got - truth).norm() / truth.norm())
        assert rel < 1e-2, f"seed {SEED}: {name} drifted from the fp64 loop: rel {rel:.2e}"
    k, r = runs["kernel"]["state"].double(), runs["ref_bf16"]["state"].double()
    rel = float((k - r).norm() / r.norm())
    assert rel < 3e-3, f"seed {SEED}: kernel commit vs reference commit in bf16: rel {rel:.2e}"
    width = heads * 128 * 128
    assert torch.equal(
        runs["kernel"]["pool"][:, width:].view(torch.int16), pool[:, width:].view(torch.int16)
    ), "the pool's padding changed"

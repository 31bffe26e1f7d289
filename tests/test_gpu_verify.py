"""The Hopper verify kernel on a GPU: the vLLM entry point, the spec-decode loop with commit,
and the default (untuned) dispatch. Every shipped variant is checked by ``kdagen check``."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_marks import HOPPER

from kdagen import reference, render
from kdagen.check_verify import OUTSIDE_CASES, VerifyCase, check_verify, run_verify_case
from kdagen.serve.runtime import commit, run_verify
from kdagen.serve.variant import Variant
from kdagen.serve.vllm import kda_recoverssm_verify
from kdagen.testing import (
    GUARD_SLOTS,
    bits,
    clone_inputs,
    commit_args,
    make_verify_inputs,
    poison_,
    verify_args,
)

pytestmark = HOPPER

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
H, Q = 12, 4


@pytest.mark.parametrize("outside", [False, True], ids=["in-pool", "outside-pool"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("window", [Q, 16])
def test_vllm_entry_point_gives_the_same_outputs_as_verify(
    window: int, lower_bound: float | None, outside: bool
) -> None:
    """The records by block, and with ``outside`` a block past the pool and one of -3
    (padding): every record block of no live request, and GUARD_SLOTS poisoned blocks after
    the records, keep their bits. Q = 16: the wide kernels."""
    inputs = make_verify_inputs(20, H, window, device="cuda", seed=SEED,
                                lower_bound=lower_bound, outside=outside)  # fmt: skip
    ours = clone_inputs(inputs)
    # Both dispatch (same contract and batch, so the same variant): variants may differ in the
    # order of their fp32 sums, so only the same variant gives the same bits.
    run_verify(verify_args(ours))

    tokens, slots = inputs["qkv"].shape[0], inputs["slots"]
    qkv = inputs["qkv"].view(1, tokens, 3, H, 128)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # strided views, no copy
    blocks = inputs["state"].shape[0]
    rows = blocks + GUARD_SLOTS  # guard blocks after the records
    corr_all = poison_(torch.empty(rows, H, window, 128, dtype=torch.float32, device="cuda"))
    kg_all = poison_(torch.empty(rows, H, window, 256, dtype=torch.bfloat16, device="cuda"))
    corr, kg = corr_all[:blocks], kg_all[:blocks]
    corr_before, kg_before = bits(corr_all).clone(), bits(kg_all).clone()
    out = kda_recoverssm_verify(
        q, k, v, inputs["raw_g"].view(1, tokens, H, 128), inputs["raw_beta"].view(1, tokens, H),
        inputs["a_log"], inputs["dt_bias"], inputs["lower_bound"], inputs["state"], corr, kg,
        inputs["query_start"], slots, window,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(bits(out.view(tokens, -1)), bits(ours["out"])), f"seed {SEED}"
    written = torch.zeros(rows, dtype=torch.bool, device="cuda")
    for b, (slot, qlen) in enumerate(zip(slots.tolist(), inputs["qlen"], strict=True)):
        if 0 < slot < blocks and qlen > 0:
            written[slot] = True
            assert torch.equal(corr[slot, :, :qlen], ours["corr"][b, :, :qlen]), f"seed {SEED}"
            assert torch.equal(bits(kg[slot, :, :qlen]), bits(ours["kg"][b, :, :qlen]))
    # Blocks of no live request, and the guard blocks, keep their poison.
    assert torch.equal(bits(corr_all)[~written], corr_before[~written])
    assert torch.equal(bits(kg_all)[~written], kg_before[~written])


def test_the_steepest_allowed_decay_keeps_the_check_bounds() -> None:
    """Every gate saturated at the lowest lower_bound verify accepts (Q x lower_bound = -72):
    the log decay reaches the guard's limit, where the probes' low halves are nearest to
    flushing; out and corr must still meet the check's bounds against the fp64 reference."""
    from kdagen.check_verify import MAX_RMS, REL_L2
    from kdagen.emulate import relative_errors
    from kdagen.serve.contract import MAX_LOG_DECAY
    from kdagen.testing import verify_write_masks

    window, batch = 8, 6
    inputs = make_verify_inputs(batch, H, window, device="cuda", ragged=False, nulls=False,
                                lower_bound=-MAX_LOG_DECAY / window, seed=SEED)  # fmt: skip
    inputs["raw_g"].fill_(8.0)  # sigmoid ~ 1: G_t = (t + 1) lower_bound
    expected = {k: v.cpu() if isinstance(v, torch.Tensor) else v
                for k, v in clone_inputs(inputs).items()}  # fmt: skip
    reference.verify(verify_args(expected))  # fp64, into expected's out, corr, kg
    run_verify(verify_args(inputs))
    torch.cuda.synchronize()
    masks = verify_write_masks(expected)  # corr's spare row stays poisoned
    for name in ("out", "corr"):
        errors = relative_errors(inputs[name].cpu()[masks[name]], expected[name][masks[name]])
        rel = errors["rel_l2"]
        assert rel <= REL_L2[name], f"seed {SEED}: {name} rel-L2 {rel:.2e}"
        if name in MAX_RMS:
            worst = errors["max_rms"]
            assert worst <= MAX_RMS[name], f"seed {SEED}: {name} max element {worst:.2e} rms"


@pytest.mark.parametrize("conv", [False, True])
def test_default_dispatch_passes_the_check(conv: bool) -> None:
    """variant=None: the built-in heuristic's choice for this GPU, through the full check."""
    from kdagen.serve.runtime import default_verify_variant

    variant = default_verify_variant(H, Q, "int32", 48, conv=conv)
    result = run_verify_case(variant, VerifyCase("random", 48), SEED)
    assert result.passed, f"seed {SEED}: {result.error or result.summary()}"


@pytest.mark.parametrize(
    ("kernel", "contract", "batch"),
    [
        ("verify", {"conv": False}, 64),
        ("verify", {"conv": True, "conv_layout": "token_major", "conv_weight_dtype": "bf16"}, 8),
        ("commit", {}, 512),
    ],
)
def test_run_time_uses_the_committed_table(kernel: str, contract: dict, batch: int) -> None:
    """With no variant given, verify and commit launch the tuned winner of the table that
    serves this GPU (exact key and bucket of generated/<gpu>/dispatch.json; on a GPU without
    its own, the same-architecture GPU's it borrows), with no other fallback warning (a
    carried table's one notice that its choices stand until a re-tune is not a fallback)."""
    import warnings

    from kdagen.serve import dispatch
    from kdagen.serve.fingerprint import gpu_fingerprint
    from kdagen.serve.runtime import _dispatched, device_arch

    folder, _ = dispatch.table_folder_for(gpu_fingerprint(torch.device("cuda")))
    table = dispatch.load_table(folder)
    if table is None:
        pytest.skip(f"no committed table for {folder.name}")
    dispatch.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.DispatchFallbackWarning)
        warnings.filterwarnings(
            "ignore", "kdagen dispatch: no dispatch table for", dispatch.DispatchFallbackWarning
        )
        warnings.filterwarnings(
            "ignore", ".*its choices stand until this GPU", dispatch.DispatchFallbackWarning
        )
        chosen = _dispatched(kernel, 12, 8, "int32", batch, torch.device("cuda"),
                             device_arch(), **contract)  # fmt: skip
    entry, how = table.lookup(kernel, chosen.contract_key, batch)
    assert how == "exact" and entry is not None and chosen.name == entry.variant


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_spec_decode_loop_verify_accept_commit(lower_bound: float | None) -> None:
    """Kernels verify -> accept -> commit -> verify ... back to back on one stream (PDL on)
    track the fp64 reference of the same loop: outputs every step, the state at the end."""
    gen = torch.Generator().manual_seed(SEED)
    inputs = make_verify_inputs(16, H, Q, device="cuda", seed=SEED, ragged=False, nulls=True,
                                lower_bound=lower_bound)  # fmt: skip
    ref = clone_inputs(inputs)
    ref["state"] = ref["state"].double()
    for step in range(4):
        if step:  # fresh activations, same pool and slots
            fresh = make_verify_inputs(16, H, Q, device="cuda", seed=SEED + step, ragged=False,
                                       nulls=True, lower_bound=lower_bound)  # fmt: skip
            for key in ("qkv", "raw_g", "raw_beta"):
                inputs[key].copy_(fresh[key])
                ref[key].copy_(fresh[key])
        run_verify(verify_args(inputs))
        reference.verify(verify_args(ref), compute_dtype=torch.float64)
        accepted = torch.randint(1, Q + 1, (16,), generator=gen, dtype=torch.int32).cuda()
        commit(inputs["state"], inputs["corr"], inputs["kg"], inputs["a_log"], inputs["dt_bias"],
               inputs["slots"], accepted, lower_bound=inputs["lower_bound"])  # fmt: skip
        reference.commit(commit_args(ref, accepted), compute_dtype=torch.float64)
        torch.cuda.synchronize()
        got, want = inputs["out"].double(), ref["out"].double()
        assert (got - want).norm() <= 1e-2 * want.norm(), f"step {step}, seed {SEED}"
    got, want = inputs["state"].double(), ref["state"]
    assert (got - want).norm() <= 1e-2 * want.norm(), f"seed {SEED}"


SHARED = ("a_log", "dt_bias", "state", "state_pool", "query_start", "slots")


def _step_inputs(base: dict, step: dict) -> dict:
    """A step's activations and output buffers over ``base``'s pool, slots and gate."""
    return dict(step) | {k: base[k] for k in SHARED}


# Skipped, not xfail: the race is intermittent (B = 64 passed by chance), so a non-strict
# xfail could not fail and a strict one would flake; it runs, unmarked, once the fix is on.
@pytest.mark.skipif(
    not render.VERIFY_STATE_AFTER_WAIT,
    reason="switched off (render.VERIFY_STATE_AFTER_WAIT): an early verify CTA copies its first "
    "state before griddepcontrol.wait (failed at B = 1 and 4 on the H200); README: no commit "
    "right before verify",
)  # fmt: skip
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_verify_right_after_commit_reads_the_committed_state(batch: int) -> None:
    """verify launched straight after commit on one stream, nothing between (a plain decode
    loop), replayed from one CUDA graph so no host gap separates them: with PDL a launch's
    prologue may run under the previous kernel, and the state it reads there is the one the
    commit is writing. Each step's activations, output buffers and accepted counts are made
    before the graph; the fp64 reference runs the same steps afterwards."""
    steps, seeds = 6, [SEED + 1 + s for s in range(6)]
    gen = torch.Generator().manual_seed(SEED)
    made = dict(device="cuda", ragged=False, nulls=False)  # every window Q: one query_start
    base = make_verify_inputs(batch, H, Q, seed=SEED, **made)
    per_step = [make_verify_inputs(batch, H, Q, seed=s, **made) for s in seeds]
    accepted = [torch.randint(1, Q + 1, (batch,), generator=gen, dtype=torch.int32).cuda()
                for _ in range(steps)]  # fmt: skip
    ref = clone_inputs(base)
    ref["state"] = ref["state"].double()
    ref_steps = [clone_inputs(p) for p in per_step]  # poisoned outputs, before any launch
    start = base["state_pool"].clone()
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")

    def loop() -> None:
        for s in range(steps):
            launched = _step_inputs(base, per_step[s])
            run_verify(verify_args(launched), counter=counter)
            commit(launched["state"], launched["corr"], launched["kg"], base["a_log"],
                   base["dt_bias"], base["slots"], accepted[s], lower_bound=base["lower_bound"])  # fmt: skip

    loop()  # loads both kernels (and picks them) outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        loop()
    torch.cuda.current_stream().wait_stream(stream)
    base["state_pool"].copy_(start)
    for p, r in zip(per_step, ref_steps, strict=True):
        for name in ("out", "corr", "kg"):
            p[name].copy_(r[name])  # poisoned again
    graph.replay()
    torch.cuda.synchronize()
    for s in range(steps):
        r = _step_inputs(ref, ref_steps[s])
        reference.verify(verify_args(r), compute_dtype=torch.float64)
        reference.commit(commit_args(r, accepted[s]), compute_dtype=torch.float64)
        got, want = per_step[s]["out"].double(), r["out"].double()
        assert (got - want).norm() <= 1e-2 * want.norm(), f"step {s}, seed {SEED}"
    got, want = base["state"].double(), ref["state"]
    assert (got - want).norm() <= 1e-2 * want.norm(), f"seed {SEED}"


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q3-i32-sm90_wgmma-t256-r1-c264-s1-pdl",
        "verify-h32-q7-i64-sm90_wgmma-t256-r1-c264-s2-pdl",
    ],
)
def test_two_warpgroups_at_odd_windows_pass_the_check(name: str) -> None:
    """The shipped space tunes two warpgroups at even windows only; at odd ones warpgroup 1
    has a token less (a guarded last slot), so the full check runs here on two of them."""
    for result in check_verify(Variant.parse(name), SEED):
        assert result.passed, f"seed {SEED}: {result.error or result.summary()}"


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("case", OUTSIDE_CASES, ids=lambda c: c.name)
def test_slots_outside_the_pool_pad(case: VerifyCase, conv: bool) -> None:
    """A slot past the pool and one of -3 above the null slot: padding. Their outputs are
    zeros, their records and the conv state's poisoned guard slots after the pool keep every
    bit (the check's cases, on the default variant of each layout)."""
    from kdagen.serve.runtime import default_verify_variant

    variant = default_verify_variant(H, Q, "int32", case.batch, conv=conv)
    result = run_verify_case(variant, case, SEED)
    assert result.passed, f"seed {SEED}: {result.error or result.summary()}"


def test_value_checks_name_bad_values_eagerly_and_stay_out_of_graph_capture() -> None:
    """``check_values(True)``: an eager launch with a window past the rows raises naming
    ``query_start``, before anything runs; a CUDA-graph capture of a good launch synchronises
    nothing (the check is skipped there) and replays to the eager launch's bits."""
    from kdagen.serve import values
    from kdagen.serve.validate import KdaInputError

    inputs = make_verify_inputs(8, H, Q, seed=SEED, device="cuda")
    args = verify_args(inputs)
    values.check_values(True)
    try:
        bad = inputs["query_start"].clone()
        bad[-1] += 1
        with pytest.raises(KdaInputError, match="`query_start`"):
            run_verify(args.with_(query_start=bad))
        run_verify(args)
        torch.cuda.synchronize()
        eager = bits(inputs["out"]).clone()
        inputs["out"].copy_(poison_(torch.empty_like(inputs["out"])))
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            run_verify(args)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(inputs["out"]), eager), f"seed {SEED}"
    finally:
        values.check_values(False)

"""The all-layer commit on a GPU: vLLM's commit context against vLLM's own Triton commit (when
``.peers`` holds it), and a 20-step decode loop (verify -> accept -> one commit of every layer,
replayed from a CUDA graph) against the CPU reference. ``kdagen check``'s model cases
(tests/test_gpu_commit.py runs them for every commit variant) cover guards and padding."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from gpu_marks import ANY_GPU, skip_without_peer

from kdagen import reference
from kdagen.serve.vllm import KDARecoverSSMCommitContext, kda_recoverssm_verify

pytestmark = ANY_GPU

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
K = 128


def vllm_layers(layers: int, heads: int, window: int, blocks: int, dim_first: bool,
                gen: torch.Generator, request_rows: int = 0) -> list[SimpleNamespace]:  # fmt: skip
    """vLLM-shaped KDA layers: kv_cache = (conv, state, correction, key/gate) per block, or
    with ``request_rows`` vLLM 0.33's (conv, state) and ``recoverssm_records`` per request."""
    out = []
    for _ in range(layers):
        conv_shape = (blocks, 3 * heads * K, window + 2) if dim_first else (
            blocks, window + 2, 3 * heads * K)  # fmt: skip
        conv = torch.randn(conv_shape, generator=gen).bfloat16().cuda()
        state = (torch.randn(blocks, heads, K, K, generator=gen) * 0.1).bfloat16().cuda()
        rows = request_rows or blocks
        corr = torch.randn(rows, heads, window, K, generator=gen).cuda()
        kg = torch.randn(rows, heads, window, 2 * K, generator=gen).bfloat16().cuda()
        layer = SimpleNamespace(
            gate_lower_bound=-5.0, local_num_heads=heads, head_dim=K,
            A_log=(torch.rand(heads, generator=gen) * 2 - 1).cuda(),
            dt_bias=(torch.randn(heads * K, generator=gen) * 0.5).cuda(),
        )  # fmt: skip
        if request_rows:
            layer.kv_cache = (conv, state)
            layer.recoverssm_records = SimpleNamespace(correction=corr, key_gate=kg)
        else:
            layer.kv_cache = (conv, state, corr, kg)
        out.append(layer)
    return out


def tensors_of(layer: SimpleNamespace) -> list[torch.Tensor]:
    records = getattr(layer, "recoverssm_records", None)
    extra = [records.correction, records.key_gate] if records is not None else []
    return [*layer.kv_cache, *extra]


def snapshot(layers: list[SimpleNamespace]) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in tensors_of(layer)] for layer in layers]


def restore(layers: list[SimpleNamespace], saved: list[list[torch.Tensor]]) -> None:
    for layer, tensors in zip(layers, saved, strict=True):
        for t, s in zip(tensors_of(layer), tensors, strict=True):
            t.copy_(s)


# With ``align``, request 0's window ends on a block boundary: its final state goes to the
# block of its last token (vLLM's rule), not the next one.
# ``index_dtype`` int64: vLLM's own index buffers, which the context copies to int32 ones.
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("dim_first", [False, True])
def test_commit_context_matches_vllm(
    align: bool, dim_first: bool, index_dtype: torch.dtype, monkeypatch
) -> None:
    from kdagen.peers import vllm_commit

    monkeypatch.setenv("KDAGEN_VLLM_CONV_DIM_FIRST", "1" if dim_first else "0")
    peer = vllm_commit()
    if peer.fn is None:
        skip_without_peer(peer.note)
    gen = torch.Generator().manual_seed(SEED)
    heads, window, batch, per = 4, 8, 6, 4
    blocks = 1 + batch * per
    # vLLM 0.33's layout (records per request of the step), which its commit reads.
    layers = vllm_layers(3, heads, window, blocks, dim_first, gen, request_rows=batch)
    owner = torch.randperm(batch + 2, generator=gen)[:batch]
    table = torch.zeros(batch + 2, per, dtype=torch.int32)
    for i in range(batch):
        table[owner[i]] = 1 + i * per + torch.arange(per, dtype=torch.int32)
    computed = torch.randint(0, 16 * (per - 1), (batch + 2,), generator=gen, dtype=torch.int32)
    qlen = torch.randint(1, window + 1, (batch,), generator=gen)
    accepted = torch.randint(0, window + 1, (batch + 2,), generator=gen, dtype=torch.int32)
    # Request 0 commits at least one token and its window ends on a block boundary.
    first = int(owner[0])
    accepted[first] = accepted[first].clamp(min=1)
    count = min(int(accepted[first]), int(qlen[0]))
    computed[first] = 16 * (1 + int(computed[first]) // 16) - count
    # The running state sits in the block of the last computed token (vLLM's align mode).
    source = table[owner, (computed[owner].long() - 1).clamp(min=0) // 16] if align else (
        1 + torch.arange(batch) * per)  # fmt: skip
    args = dict(
        num_accepted_tokens=accepted.cuda(),
        state_indices=source.int().cuda(),
        query_start_loc=torch.cat([torch.zeros(1), qlen.cumsum(0)]).int().cuda(),
        request_indices=owner.int().cuda(),
    )  # fmt: skip
    if align:
        args |= dict(block_table=table.cuda(), num_computed_tokens=computed.cuda(),
                     mamba_block_size=16)  # fmt: skip
    args = {k: v.to(index_dtype) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    start = snapshot(layers)
    ours = KDARecoverSSMCommitContext.create(layers, spec_query_len=window, max_num_reqs=64,
                                             conv_state_dim_first=dim_first)  # fmt: skip
    ours.commit(**args)
    torch.cuda.synchronize()
    mine = snapshot(layers)
    restore(layers, start)
    theirs = peer.fn.create(layers, spec_query_len=window, max_num_reqs=64)
    theirs.commit(**args)
    torch.cuda.synchronize()
    moved = False
    for layer, got, before in zip(layers, mine, start, strict=True):
        conv, state, corr, kg = tensors_of(layer)
        assert torch.equal(got[0], conv), f"seed {SEED}: conv state differs from vLLM's"
        diff = (got[1].float() - state.float()).abs()
        assert float(diff.max()) <= 2e-2 * float(state.float().abs().max()), f"seed {SEED}"
        assert torch.equal(got[2], corr) and torch.equal(got[3], kg)
        moved |= not torch.equal(got[1], before[1])
    assert moved  # the comparison covered committed slots


@pytest.mark.parametrize("dim_first", [False, True])
def test_the_build_without_prefix_caching_commits_as_the_general_one(dim_first: bool) -> None:
    """Without block tables the ``noprefix`` build (the plan and boundary fold compiled out)
    leaves every byte of every layer (states, conv states, records) as the general build
    does: the same fold, only fewer registers."""
    from kdagen.serve.model_commit import ModelCommit

    gen = torch.Generator().manual_seed(SEED)
    heads, window, batch = 12, 8, 16
    layers = vllm_layers(4, heads, window, 1 + batch, dim_first, gen)
    model = ModelCommit(
        [layer.kv_cache[1] for layer in layers], [layer.kv_cache[2] for layer in layers],
        [layer.kv_cache[3] for layer in layers], [layer.A_log for layer in layers],
        [layer.dt_bias for layer in layers], records_by_slot=True,
        conv_states=[layer.kv_cache[0] for layer in layers], conv_dim_first=dim_first,
    )  # fmt: skip
    slots = (1 + torch.randperm(batch, generator=gen)).int()
    slots[0] = 0  # a padding request
    accepted = torch.randint(0, window + 2, (batch,), generator=gen, dtype=torch.int32)
    start = snapshot(layers)
    results = []
    for key in (f"commit-h{heads}-q{window}-i32", f"commit-h{heads}-q{window}-noprefix-i32"):
        restore(layers, start)
        model.commit(slots.cuda(), accepted.cuda(), variant=f"{key}-bulk-t256-v4-r1-pdl")
        torch.cuda.synchronize()
        results.append(snapshot(layers))
    general, lean = results
    for got, want in zip(lean, general, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)), f"seed {SEED}"
    assert any(not torch.equal(got[1], before[1]) for got, before in zip(lean, start, strict=True))


def test_decode_loop_with_graph_replayed_commit() -> None:
    """20 steps over 3 layers: kdagen's vLLM verify writes the records, the sampler accepts a
    random prefix, one graph-replayed all-layer commit folds it. The state pools follow the
    CPU reference step by step (verify and commit_layers in fp64 from the same inputs)."""
    gen = torch.Generator().manual_seed(SEED)
    heads, window, batch, n_layers = 4, 4, 5, 3
    blocks = batch + 3
    layers = vllm_layers(n_layers, heads, window, blocks, False, gen)
    truth = [layer.kv_cache[1].double().cpu() for layer in layers]
    slots = (1 + torch.randperm(blocks - 1, generator=gen)[:batch]).int().cuda()
    accepted = torch.zeros(batch, dtype=torch.int32, device="cuda")
    qlen = torch.randint(1, window + 1, (batch,), generator=gen)
    query_start = torch.cat([torch.zeros(1), qlen.cumsum(0)]).int().cuda()
    ctx = KDARecoverSSMCommitContext.create(layers, spec_query_len=window, max_num_reqs=batch)
    ctx.commit(accepted, slots, query_start)  # compiles; accepted 0: nothing moves
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctx.commit(accepted, slots, query_start)
    tokens = int(qlen.sum())
    for step in range(20):
        accepted.copy_(torch.minimum(torch.randint(1, window + 1, (batch,), generator=gen), qlen))
        for index, layer in enumerate(layers):
            q, k, v, g = (torch.randn(1, tokens, heads, K, generator=gen).bfloat16().cuda()
                          for _ in range(4))  # fmt: skip
            beta = torch.randn(1, tokens, heads, generator=gen).bfloat16().cuda()
            _, state, corr, kg = layer.kv_cache
            kda_recoverssm_verify(q, k, v, g, beta, layer.A_log, layer.dt_bias, -5.0, state,
                                  corr, kg, query_start, slots, window)  # fmt: skip
            plan = reference.commit_plan(
                slots.cpu(), accepted.cpu(), null_slot=0, slot_count=blocks, window=window,
                rows=blocks, records_by_slot=True, query_start=query_start.cpu(),
            )  # fmt: skip
            # The reference folds the kernel's own records (verify is checked on its own).
            reference.commit_layers([truth[index]], [corr.cpu()], [kg.cpu()],
                                    layer.A_log.cpu()[None], layer.dt_bias.cpu()[None], plan,
                                    lower_bound=-5.0)  # fmt: skip
        graph.replay()
        torch.cuda.synchronize()
        for index, layer in enumerate(layers):
            got = layer.kv_cache[1].double().cpu()
            err = (got - truth[index]).abs().max() / truth[index].abs().max()
            assert err < 2e-2, f"seed {SEED}, step {step}, layer {index}: {err:.2e}"
            truth[index] = got  # both continue from the stored bf16 state

"""The all-layer commit's reference (kdagen.reference.commit_plan / commit_layers) against
plain token-by-token recurrences, vLLM's commit semantics written out request by request,
and a 20-step speculative loop with prefix caching and conv compaction.

The oracle here never uses the closed form: it decays, corrects and updates the state one
token at a time in fp64, and records what verify would (u_t, raw k, raw g).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from kdagen import reference

K = 128
F64 = torch.float64


def gate64(g_raw: Tensor, a_log: float, bias: Tensor, lower_bound: float | None) -> Tensor:
    x = g_raw.double() + bias.double()
    if lower_bound is None:  # Kimi-Linear's softplus gate, linear above 20
        return -math.exp(a_log) * torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))
    return lower_bound * torch.sigmoid(math.exp(a_log) * x)


def run_tokens(
    s: Tensor,
    ks: Tensor,
    gs: Tensor,
    vs: Tensor,
    betas: Tensor,
    a_log: float,
    bias: Tensor,
    lower_bound: float | None,
) -> tuple[list[Tensor], Tensor]:
    """One head, tokens one at a time from ``s`` [V, K] fp64: the states after each token and
    the corrections u_t (what verify records)."""
    states, us = [], []
    for t in range(ks.shape[0]):
        k = ks[t].double()
        k_n = k / torch.sqrt((k * k).sum() + 1e-6)
        s = s * torch.exp(gate64(gs[t], a_log, bias, lower_bound))[None, :]
        u = betas[t] * (vs[t].double() - s @ k_n)
        s = s + torch.outer(u, k_n)
        states.append(s)
        us.append(u)
    return states, torch.stack(us)


class Layers:
    """L layers' pools with records written the way verify writes them."""

    def __init__(self, layers: int, heads: int, window: int, slots: int, rows: int, seed: int,
                 lower_bound: float | None = -5.0, gate_std: float = 1.5):  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        self.heads, self.window = heads, window
        self.lower_bound, self.gate_std = lower_bound, gate_std
        self.states = [
            (torch.randn(slots, heads, K, K, generator=g) * 0.1).bfloat16() for _ in range(layers)
        ]
        self.corrs = [torch.full((rows, heads, window, K), float("nan")) for _ in range(layers)]
        self.kgs = [
            torch.full((rows, heads, window, 2 * K), float("nan")).bfloat16() for _ in range(layers)
        ]
        self.a_log = torch.rand(layers, heads, generator=g) * 2 - 1
        self.dt_bias = torch.randn(layers, heads * K, generator=g) * 0.5
        self.gen = g

    def draft(self, layer: int, slot: int, row: int, qlen: int) -> list[list[Tensor]]:
        """Random window tokens for (layer, slot): records into ``row``; returns per head the
        states after each token (truth)."""
        g, heads = self.gen, self.heads
        truth = []
        for h in range(heads):
            ks = torch.randn(qlen, K, generator=g).bfloat16()
            gs = (torch.randn(qlen, K, generator=g) * self.gate_std).bfloat16()
            vs = torch.randn(qlen, K, generator=g).bfloat16()
            betas = torch.sigmoid(torch.randn(qlen, generator=g).double())
            bias = self.dt_bias[layer, h * K : (h + 1) * K]
            s0 = self.states[layer][slot, h].double()
            states, us = run_tokens(s0, ks, gs, vs, betas, float(self.a_log[layer, h]), bias,
                                    self.lower_bound)  # fmt: skip
            self.corrs[layer][row, h, :qlen] = us.float()
            self.kgs[layer][row, h, :qlen] = torch.cat([ks, gs], -1)
            truth.append(states)
        return truth


def assert_state(got: Tensor, want: Tensor) -> None:
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err  # bf16 rounding of the stored state


@pytest.mark.parametrize(
    ("lower_bound", "gate_std"), [(-5.0, 1.5), (None, 1.5), (None, 200.0)],
    ids=["bounded", "softplus", "softplus-forgetting"],
)  # fmt: skip
def test_commit_layers_equals_the_recurrence_per_layer(
    lower_bound: float | None, gate_std: float
) -> None:
    """Three layers, records by request row, random accepted counts and a padding request:
    every layer's slot holds the state after its accepted tokens; nothing else moves. Both
    gates; with raw gates spread 200 the softplus gate forgets inside the window."""
    layers, heads, window, batch = 3, 2, 4, 5
    pools = Layers(layers, heads, window, slots=9, rows=batch + 2, seed=1,
                   lower_bound=lower_bound, gate_std=gate_std)  # fmt: skip
    slots = torch.tensor([3, 0, 7, 1, 5], dtype=torch.int32)  # request 1: null slot 0
    accepted = torch.tensor([1, 3, 4, 2, 0], dtype=torch.int32)  # request 4: a == 0
    truths = [
        [pools.draft(layer, int(slots[b]), b, window) for b in range(batch)]
        for layer in range(layers)
    ]
    before = [s.clone() for s in pools.states]
    plan = reference.commit_plan(slots, accepted, null_slot=0, slot_count=9, window=window,
                                 rows=batch + 2)  # fmt: skip
    reference.commit_layers(pools.states, pools.corrs, pools.kgs, pools.a_log, pools.dt_bias,
                            plan, lower_bound=lower_bound)  # fmt: skip
    for layer in range(layers):
        for b in range(batch):
            slot, a = int(slots[b]), int(accepted[b])
            if slot == 0 or a == 0:
                assert torch.equal(pools.states[layer][slot], before[layer][slot])
                continue
            for h in range(heads):
                assert_state(pools.states[layer][slot, h], truths[layer][b][h][a - 1])
        untouched = [s for s in range(9) if s not in (3, 7, 1)]
        assert torch.equal(pools.states[layer][untouched], before[layer][untouched])


def test_every_negative_slot_is_padding_whatever_the_null_slot() -> None:
    """With a null slot below -1, the slots between it and 0 are no pool slots either: the
    plan pads them (never state[-1], the pool's last slot by Python's indexing)."""
    slots = torch.tensor([-1, -2, -3, 2, 4], dtype=torch.int32)
    accepted = torch.full((5,), 2, dtype=torch.int32)
    plan = reference.commit_plan(slots, accepted, null_slot=-3, slot_count=4, window=4, rows=5)
    assert plan.live.tolist() == [False, False, False, True, False]


def vllm_plan(
    slots: list[int],
    accepted: list[int],
    qlens: list[int],
    request_index: list[int] | None,
    table: list[list[int]] | None,
    computed: list[int] | None,
    block_size: int,
    window: int,
    slot_count: int,
) -> list[tuple]:
    """vLLM's commit plan, request by request, as its prepare step states it (with kdagen's
    rule that slots outside the pool are padding): (count, final, boundary, boundary count)."""
    out = []
    for b, slot in enumerate(slots):
        r = b if request_index is None else request_index[b]
        count = min(max(accepted[r], 0), qlens[b], window)
        final, boundary, crossing = slot, 0, 0
        if table is not None:
            done = computed[r]
            final = table[r][min(max(done + count - 1, 0) // block_size, len(table[r]) - 1)]
            nxt = (done // block_size + 1) * block_size
            if done + count >= nxt:
                boundary, crossing = table[r][nxt // block_size - 1], nxt - done
        live = 0 < slot < slot_count and count > 0 and 0 < final < slot_count
        if not live:
            out.append((0, 0, 0, 0))
            continue
        if not 0 < boundary < slot_count:
            boundary, crossing = 0, 0
        out.append((count, final, boundary, crossing))
    return out


def test_commit_plan_follows_vllm_request_by_request() -> None:
    slots = [4, 9, 0, 2, 7, 30, -1]  # 30 and -1: outside a pool of 12 slots
    accepted = [3, 8, 2, 1, 5, 2, 2, 4]  # indexed through request_index
    qlens = [4, 4, 3, 4, 2, 4, 4]
    request_index = [7, 0, 1, 2, 3, 4, 5]
    table = [[1 + (7 * r + c) % 11 for c in range(3)] for r in range(8)]
    computed = [14, 3, 15, 16, 0, 9, 31, 12]
    plan = reference.commit_plan(
        torch.tensor(slots), torch.tensor(accepted, dtype=torch.int32), null_slot=0,
        slot_count=12, window=4, rows=12, records_by_slot=True,
        query_start=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
        request_index=torch.tensor(request_index, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        num_computed=torch.tensor(computed, dtype=torch.int32), block_size=16,
    )  # fmt: skip
    want = vllm_plan(slots, accepted, qlens, request_index, table, computed, 16, 4, 12)
    got = [
        (int(c), int(f), int(bo), int(bc)) if live else (0, 0, 0, 0)
        for c, f, bo, bc, live in zip(
            plan.count, plan.final, plan.boundary, plan.boundary_count, plan.live, strict=True
        )  # fmt: skip
    ]
    got = [(c, f, bo if bc else 0, bc) for c, f, bo, bc in got]
    assert got == want
    assert plan.record.tolist() == slots  # records by state block
    assert any(bc for *_, bc in want) and any(c == 0 for c, *_ in want)  # both kinds covered


@pytest.mark.parametrize(
    ("dim_first", "lower_bound"), [(False, -5.0), (True, -5.0), (False, None)],
    ids=["token-major", "dim-first", "token-major-softplus"],
)  # fmt: skip
def test_speculative_loop_with_prefix_caching(dim_first: bool, lower_bound: float | None) -> None:
    """20 steps of vLLM's align mode on two layers: per request a block table of 16-token
    blocks, the running state in the block of the last computed token; each step drafts a
    ragged window from it, accepts a random prefix and commits. After every step the final
    slot holds the state after every accepted token, each crossed boundary's block the
    state at that boundary, and the conv history rows the last three accepted tokens."""
    layers, heads, window, batch, block, blocks = 2, 1, 4, 3, 16, 8
    slot_count = 1 + batch * blocks
    pools = Layers(layers, heads, window, slots=slot_count, rows=slot_count, seed=7,
                   lower_bound=lower_bound)  # fmt: skip
    g = pools.gen
    conv_dim = 3 * heads * K
    convs = []
    for _ in range(layers):
        conv = torch.randn(slot_count, window + 2, conv_dim, generator=g).bfloat16()
        convs.append(conv.transpose(1, 2).contiguous() if dim_first else conv)
    views = [c if dim_first else c.transpose(1, 2) for c in convs]
    table = torch.tensor([[1 + r * blocks + c for c in range(blocks)] for r in range(batch)],
                         dtype=torch.int32)  # fmt: skip
    computed = torch.tensor([5, 15, 30], dtype=torch.int32)
    truth = {}  # (layer, request) -> [H, V, K] fp64
    history = {}  # (layer, request) -> last three accepted raw conv tokens
    for layer in range(layers):
        for r in range(batch):
            slot = int(table[r, (int(computed[r]) - 1) // block])
            truth[layer, r] = pools.states[layer][slot].double()
            history[layer, r] = [views[layer][slot, :, i].clone() for i in range(3)]
    on_boundary = 0  # windows that end on a block boundary (the final block is the last token's)
    for step in range(20):
        qlens = torch.randint(1, window + 1, (batch,), generator=g)
        accepted = torch.minimum(torch.randint(1, window + 1, (batch,), generator=g), qlens)
        if step == 0:
            accepted[1] = 1  # 15 + 1: a window that ends on a block boundary
        sources = [int(table[r, (int(computed[r]) - 1) // block]) for r in range(batch)]
        drafts, raws = {}, {}
        for layer in range(layers):
            for r in range(batch):
                drafts[layer, r] = pools.draft(layer, sources[r], sources[r], int(qlens[r]))
                # The verify-side conv left rows [h1, h2, x_0 .. x_{qlen-1}] in the source.
                raw = torch.randn(int(qlens[r]), conv_dim, generator=g).bfloat16()
                raws[layer, r] = raw
                rows = [*history[layer, r][1:], *raw]
                for i, row in enumerate(rows):
                    views[layer][sources[r], :, i] = row
        query_start = torch.tensor([0, *qlens.cumsum(0).tolist()], dtype=torch.int32)
        plan = reference.commit_plan(
            torch.tensor(sources, dtype=torch.int32), accepted.int(), null_slot=0,
            slot_count=slot_count, window=window, rows=slot_count, records_by_slot=True,
            query_start=query_start, block_table=table, num_computed=computed,
            block_size=block,
        )  # fmt: skip
        before = [state.clone() for state in pools.states]
        reference.commit_layers(pools.states, pools.corrs, pools.kgs, pools.a_log,
                                pools.dt_bias, plan, lower_bound=lower_bound,
                                conv_states=views)  # fmt: skip
        for layer in range(layers):  # only the final and the crossed boundaries' blocks change
            changed = (pools.states[layer] != before[layer]).flatten(1).any(1).nonzero()
            written = {int(table[r, (int(computed[r]) + int(accepted[r]) - 1) // block])
                       for r in range(batch)}  # fmt: skip
            written |= {int(table[r, int(computed[r]) // block]) for r in range(batch)}
            assert set(changed.flatten().tolist()) <= written
        for r in range(batch):
            done, a = int(computed[r]), int(accepted[r])
            final = int(table[r, (done + a - 1) // block])  # the last accepted token's block
            on_boundary += (done + a) % block == 0
            boundary_at = (done // block + 1) * block
            for layer in range(layers):
                states = drafts[layer, r][0]
                tokens = [*history[layer, r], *raws[layer, r][:a]]
                if done + a >= boundary_at:
                    crossed = boundary_at - done
                    slot = int(table[r, done // block])
                    assert_state(pools.states[layer][slot, 0], states[crossed - 1])
                    kept = [*history[layer, r], *raws[layer, r][:crossed]][-3:]
                    for i in range(3):
                        assert torch.equal(views[layer][slot, :, i], kept[i])
                truth[layer, r] = states[a - 1]
                history[layer, r] = tokens[-3:]
                assert_state(pools.states[layer][final, 0], truth[layer, r])
                for i in range(3):
                    assert torch.equal(views[layer][final, :, i], history[layer, r][i])
        computed += accepted.int()
    assert on_boundary > 0

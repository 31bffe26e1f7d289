"""Speculative decoding end to end on the CPU reference: verify -> sample -> commit, many steps.

The truth never sees a draft: per request it keeps the accepted raw tokens (the three prefill
tokens first) and decodes them one at a time with the plain recurrence (conv over the three
preceding accepted raw tokens, then gate, norms, delta rule). After every step the state pool
must equal the truth and the conv state's rows a-1, a, a+1 must hold the last three accepted raw
tokens, while padding requests leave their slots alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from oracle import conv_row, conv_token
from torch import Tensor

from kdagen import reference
from kdagen.serve.contract import CommitArgs, VerifyArgs
from kdagen.testing import bits, is_poisoned, poison_

K = 128
F64 = torch.float64


@dataclass
class Model:
    heads: int
    a_log: Tensor
    dt_bias: Tensor
    conv_w: Tensor
    lower_bound: float | None = -5.0  # None: Kimi-Linear's softplus gate

    def step(self, s: Tensor, mixed: Tensor, g_raw: Tensor, b_raw: Tensor) -> tuple[Tensor, Tensor]:
        """One token through all heads: ``s [H, V, K]`` fp64 -> (new state, output [H, V])."""
        heads = self.heads
        new, outs = [], []
        for h in range(heads):
            q = mixed[h * K : (h + 1) * K].double()
            k = mixed[(heads + h) * K : (heads + h + 1) * K].double()
            v = mixed[(2 * heads + h) * K : (2 * heads + h + 1) * K].double()
            rate = math.exp(float(self.a_log[h]))
            bias = self.dt_bias[h * K : (h + 1) * K].double()
            x = g_raw[h * K : (h + 1) * K].double() + bias
            if self.lower_bound is None:  # linear above 20, like the models' softplus
                g = -rate * torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))
            else:
                g = self.lower_bound * torch.sigmoid(rate * x)
            k_n = k / torch.sqrt((k * k).sum() + 1e-6)
            q_n = q / torch.sqrt((q * q).sum() + 1e-6) * K**-0.5
            beta = torch.sigmoid(b_raw[h].double())
            sh = s[h] * torch.exp(g)[None, :]
            sh = sh + torch.outer(beta * (v - sh @ k_n), k_n)
            new.append(sh)
            outs.append(sh @ q_n)
        return torch.stack(new), torch.stack(outs)


@dataclass
class Request:
    slot: int
    state: Tensor  # truth, [H, V, K] fp64
    history: list[Tensor] = field(default_factory=list)  # accepted raw tokens [3HK] bf16
    accepted: int = 1


def simulate(
    *,
    heads: int,
    batch: int,
    window: int,
    dim_first: bool,
    w_dtype: torch.dtype,
    null_slot: int,
    state_dtype: torch.dtype,
    steps: int,
    seed: int,
    lower_bound: float | None = -5.0,
    gate_std: float = 1.0,
) -> list[float]:
    """Runs the decode loop, checking everything each step; returns the per-step state error
    (max abs error over live slots, relative to the truth's max abs value). ``lower_bound``
    None: the softplus gate; ``gate_std``: raw_g's spread (large: gates that forget)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return (torch.randn(*shape, generator=gen, dtype=F64) * std).to(dtype)

    channels = 3 * heads * K
    per_slot = heads * K * K
    first_real = max(null_slot + 1, 0)
    num_slots = first_real + batch + 2
    model = Model(
        heads=heads,
        a_log=(torch.rand(heads, generator=gen, dtype=F64) * 2 - 1).float(),
        dt_bias=randn(heads * K, std=0.5, dtype=torch.float32),
        conv_w=randn(channels, 4, std=0.5, dtype=w_dtype),
        lower_bound=lower_bound,
    )
    pool = poison_(torch.empty(num_slots, per_slot + 512, dtype=state_dtype))
    pool[:, :per_slot] = randn(num_slots, per_slot, std=0.1)  # bf16 values, exact in any pool
    state = pool[:, :per_slot].view(num_slots, heads, K, K)
    token_major = randn(num_slots, window + 2, channels)
    conv_state = token_major.transpose(1, 2).contiguous() if dim_first else token_major
    real = (torch.randperm(num_slots - first_real, generator=gen)[:batch] + first_real).tolist()
    requests = [
        Request(
            slot=s,
            state=state[s].double(),
            history=[conv_row(conv_state, s, i, dim_first).clone() for i in range(3)],
        )
        for s in real
    ]
    null_block = (
        (pool[null_slot].clone(), conv_state[null_slot].clone()) if null_slot >= 0 else None
    )
    corr_dtype = F64 if state_dtype == F64 else torch.float32
    errors = []
    for _ in range(steps):
        null = (torch.rand(batch, generator=gen) < 0.25).tolist()
        qlen = torch.randint(1, window + 1, (batch,), generator=gen).tolist()
        starts = [0, *torch.tensor(qlen).cumsum(0).tolist()]
        tokens = starts[-1]
        qkv, raw_g, raw_beta = (
            randn(tokens, channels),
            randn(tokens, heads * K, std=gate_std),
            randn(tokens, heads),
        )
        slots = torch.tensor(
            [null_slot if n else r.slot for n, r in zip(null, requests, strict=True)]
        )
        accepted = torch.tensor([r.accepted for r in requests], dtype=torch.int32)
        out = poison_(torch.empty(tokens, heads * K, dtype=corr_dtype))
        corr = poison_(torch.empty(batch, heads, window, K, dtype=corr_dtype))
        kg = poison_(torch.empty(batch, heads, window, 2 * K, dtype=torch.bfloat16))
        pool_before, conv_before = pool.clone(), conv_state.clone()

        args = VerifyArgs.from_qkv(
            qkv, raw_g, raw_beta, model.a_log, model.dt_bias, state,
            torch.tensor(starts, dtype=torch.int32), slots, out, corr, kg,
            lower_bound=model.lower_bound, null_slot=null_slot, conv_state=conv_state,
            conv_w=model.conv_w, accepted=accepted, conv_dim_first=dim_first,
        )  # fmt: skip
        reference.verify(args)
        counts = []
        for b, req in enumerate(requests):
            bos, n = starts[b], qlen[b]
            if null[b]:
                assert (out[bos : bos + n] == 0).all()
                counts.append(int(torch.randint(1, window + 1, (1,), generator=gen)))
                continue
            raw = list(qkv[bos : bos + n])
            win = req.history[-3:] + raw
            s, states = req.state, []
            for t in range(n):
                s, o = model.step(
                    s, conv_token(win[t : t + 4], model.conv_w), raw_g[bos + t], raw_beta[bos + t]
                )
                states.append(s)
                got = out[bos + t].view(heads, K).double()
                tol = 1e-9 if state_dtype == F64 else 0.05
                assert (got - o).abs().max() <= tol * max(o.abs().max(), 1e-3)
            a = int(torch.randint(1, n + 1, (1,), generator=gen))
            counts.append(a)
            req.state, req.accepted = states[a - 1], a
            req.history += raw[:a]

        counts_t = torch.tensor(counts, dtype=torch.int32)
        reference.commit(
            CommitArgs(state, corr, kg, model.a_log, model.dt_bias, slots, counts_t,
                       lower_bound=model.lower_bound, null_slot=null_slot)
        )  # fmt: skip
        worst = 0.0
        for b, req in enumerate(requests):
            if null[b]:  # this step's padding request: slot and conv rows untouched
                assert (bits(pool[req.slot]) == bits(pool_before[req.slot])).all()
                assert (bits(conv_state[req.slot]) == bits(conv_before[req.slot])).all()
                continue
            scale = req.state.abs().max()
            worst = max(worst, float((state[req.slot].double() - req.state).abs().max() / scale))
            rows = torch.stack(
                [conv_row(conv_state, req.slot, req.accepted - 1 + i, dim_first) for i in range(3)]
            )
            assert (bits(rows) == bits(torch.stack(req.history[-3:]))).all(), "conv history"
        assert is_poisoned(pool[:, per_slot:]).all(), "slot padding written"
        errors.append(worst)
    if null_block is not None:  # the null block itself is never written
        assert (bits(pool[null_slot]) == bits(null_block[0])).all()
        assert (bits(conv_state[null_slot]) == bits(null_block[1])).all()
    return errors


@pytest.mark.parametrize(
    ("heads", "batch", "window", "dim_first", "w_dtype", "null_slot"),
    [
        (2, 5, 8, False, torch.bfloat16, 0),
        (3, 4, 6, True, torch.bfloat16, -1),
        (2, 6, 4, False, torch.float32, -1),
        (2, 5, 8, True, torch.float32, 0),
    ],
    ids=["token-major-bf16", "dim-first-bf16", "token-major-fp32", "dim-first-fp32"],
)
def test_decode_matches_token_by_token_truth(
    heads: int, batch: int, window: int, dim_first: bool, w_dtype: torch.dtype, null_slot: int
) -> None:
    errors = simulate(
        heads=heads,
        batch=batch,
        window=window,
        dim_first=dim_first,
        w_dtype=w_dtype,
        null_slot=null_slot,
        state_dtype=F64,
        steps=22,
        seed=batch * 10 + window,
    )
    assert max(errors) <= 1e-9, errors


@pytest.mark.parametrize("gate_std", [1.0, 60.0], ids=["softplus", "softplus-forgetting"])
def test_decode_with_the_softplus_gate_matches_token_by_token_truth(gate_std: float) -> None:
    """Kimi-Linear's unbounded gate through 22 steps; with raw_g spread 60 some channels'
    log decays reach hundreds a token (the state forgotten inside a window)."""
    errors = simulate(heads=2, batch=5, window=8, dim_first=False, w_dtype=torch.bfloat16,
                      null_slot=0, state_dtype=F64, steps=22, seed=3, lower_bound=None,
                      gate_std=gate_std)  # fmt: skip
    assert max(errors) <= 1e-9, errors


def test_decode_bf16_state_pool_stays_at_bf16_error() -> None:
    """With the production bf16 pool each commit rounds the state; the decay and the delta rule's
    contraction keep the drift at the level of a few bf16 roundings, not growing with steps."""
    errors = simulate(
        heads=2,
        batch=5,
        window=8,
        dim_first=False,
        w_dtype=torch.bfloat16,
        null_slot=0,
        state_dtype=torch.bfloat16,
        steps=24,
        seed=99,
    )
    assert max(errors) <= 4 * 2**-8, errors
    assert max(errors[-8:]) <= 2 * max(errors[:8]) + 2**-8, errors

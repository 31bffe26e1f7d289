"""CPU tests of kdagen.reference against two independent oracles.

Oracle A is FLA's ``naive_recurrent_kda`` (fp32), loaded by file path because importing ``fla``
pulls in Triton. Oracle B is the contract written out token by token below, with plain loops
over requests, heads and tokens, recomputing gates, norms and the convolution inline.
"""

from __future__ import annotations

import importlib.util
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from oracle import conv_row, conv_token
from torch import Tensor

from kdagen import reference
from kdagen.serve.validate import KdaInputError
from kdagen.testing import (
    bits,
    clone_inputs,
    commit_args,
    commit_write_mask,
    is_poisoned,
    make_verify_inputs,
    poison_,
    untouched_mask,
    verify_args,
    verify_write_masks,
)

K = 128
F64 = torch.float64


# --------------------------------------------------------------------------- oracle B


def oracle_gate(x: Tensor, rate: float, lower_bound: float | None) -> Tensor:
    """One token's log decay from ``x = raw_g + dt_bias`` (fp64): Kimi-K3's bounded gate, or
    with ``lower_bound`` None Kimi-Linear's ``-rate * softplus(x)`` (x itself above 20)."""
    if lower_bound is None:
        return -rate * torch.where(x > 20, x, torch.log(1 + torch.exp(x.clamp(max=20))))
    return lower_bound * torch.sigmoid(rate * x)


def oracle_verify(inp: dict[str, Any]) -> dict[str, Any]:
    """The contract, token by token in fp64. Returns expected ``out``/``corr`` (fp64, NaN where
    not written), ``kg`` and ``conv_state`` (input copies with the allowed elements replaced) and
    ``states[(b, h)]``, the state after each window token."""
    heads = inp["a_log"].shape[0]
    starts, slots = inp["query_start"].tolist(), inp["slots"].tolist()
    conv_state, conv_w = inp["conv_state"], inp["conv_w"]
    dim_first = inp["conv_dim_first"]
    out = torch.full(inp["out"].shape, math.nan, dtype=F64)
    corr = torch.full(inp["corr"].shape, math.nan, dtype=F64)
    kg = inp["kg"].clone()
    new_conv = None if conv_state is None else conv_state.clone()
    states: dict[tuple[int, int], list[Tensor]] = {}
    slot_count = inp["state"].shape[0]
    for b, slot in enumerate(slots):
        bos, qlen = starts[b], starts[b + 1] - starts[b]
        if not max(inp["null_slot"], -1) < slot < slot_count:  # padding: negative, null, past
            out[bos : bos + qlen] = 0.0
            continue
        if qlen == 0:
            continue
        raw = [inp["qkv"][bos + t] for t in range(qlen)]
        if conv_state is None:
            mixed = raw
        else:
            first = int(inp["accepted"][b]) - 1
            hist = [conv_row(conv_state, slot, first + i, dim_first).clone() for i in range(3)]
            win = hist + raw
            mixed = [conv_token(win[t : t + 4], conv_w) for t in range(qlen)]
            for row, value in enumerate(hist[1:] + raw):
                if dim_first:
                    new_conv[slot, :, row] = value
                else:
                    new_conv[slot, row] = value
        for h in range(heads):
            chan = slice(h * K, (h + 1) * K)
            rate = math.exp(float(inp["a_log"][h]))
            bias = inp["dt_bias"][chan].double()
            s = inp["state"][slot, h].double()
            states[(b, h)] = []
            for t in range(qlen):
                q = mixed[t][chan].double()
                k = mixed[t][heads * K + h * K : heads * K + (h + 1) * K].double()
                v = mixed[t][2 * heads * K + h * K : 2 * heads * K + (h + 1) * K].double()
                g_raw = inp["raw_g"][bos + t, chan]
                g = oracle_gate(g_raw.double() + bias, rate, inp["lower_bound"])
                k_n = k / torch.sqrt((k * k).sum() + 1e-6)
                q_n = q / torch.sqrt((q * q).sum() + 1e-6) * K**-0.5
                beta = torch.sigmoid(inp["raw_beta"][bos + t, h].double())
                s = s * torch.exp(g)[None, :]
                u = beta * (v - s @ k_n)
                s = s + torch.outer(u, k_n)
                out[bos + t, h * K : (h + 1) * K] = s @ q_n
                corr[b, h, t] = u
                kg[b, h, t] = torch.cat(
                    [mixed[t][heads * K + h * K : heads * K + (h + 1) * K], g_raw]
                )
                states[(b, h)].append(s)
    return {"out": out, "corr": corr, "kg": kg, "conv_state": new_conv, "states": states}


# --------------------------------------------------------------------------- checks


def assert_written(name: str, got: Tensor, want: Tensor, mask: Tensor, rtol: float) -> None:
    """Allowed elements close to ``want`` (relative to the tensor's scale), others poisoned."""
    assert is_poisoned(got)[~mask].all(), f"{name}: wrote outside the allowed elements"
    assert not is_poisoned(got)[mask].any(), f"{name}: left allowed elements unwritten"
    scale = want[mask].abs().max().clamp(min=1e-30)
    err = (got[mask].double() - want[mask]).abs().max()
    assert err <= rtol * scale, f"{name}: max error {err:.3e} vs scale {scale:.3e}"


def assert_inputs_untouched(before: dict[str, Any], after: dict[str, Any], names: list[str]):
    for name in names:
        if before.get(name) is not None:
            assert untouched_mask(before[name], after[name]).all(), f"{name} was modified"


INPUT_NAMES = ["qkv", "raw_g", "raw_beta", "a_log", "dt_bias", "query_start", "slots"]
INPUT_NAMES += ["conv_w", "accepted"]

# B, H, Q, conv, conv_dim_first, conv_w dtype, null_slot, slot dtype, seed, slots outside the
# pool (one past its end, one of -3: padding)
CASES = [
    (6, 3, 8, False, False, torch.bfloat16, 0, torch.int32, 1, False),
    (7, 2, 8, True, False, torch.bfloat16, -1, torch.int64, 2, False),
    (6, 2, 8, True, True, torch.float32, 0, torch.int64, 3, False),
    (8, 2, 5, True, False, torch.float32, 0, torch.int32, 4, False),
    (5, 4, 4, True, True, torch.bfloat16, -1, torch.int32, 5, False),
    (4, 2, 1, True, False, torch.bfloat16, 0, torch.int64, 6, False),
    (6, 2, 3, False, False, torch.bfloat16, -1, torch.int64, 7, False),
    (7, 2, 4, True, False, torch.bfloat16, -4, torch.int32, 8, True),
    (6, 2, 8, False, False, torch.bfloat16, 0, torch.int64, 9, True),
]


def case_inputs(case: tuple, **kw: Any) -> dict[str, Any]:
    batch, heads, window, conv, dim_first, w_dtype, null_slot, slot_dtype, seed, outside = case
    return make_verify_inputs(
        batch,
        heads,
        window,
        conv=conv,
        conv_dim_first=dim_first,
        conv_w_dtype=w_dtype,
        null_slot=null_slot,
        slot_dtype=slot_dtype,
        seed=seed,
        outside=outside,
        **kw,
    )


# --------------------------------------------------------------------------- verify vs oracle B


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_verify_matches_recurrence(case: tuple) -> None:
    inp = case_inputs(case, out_dtype=F64, corr_dtype=F64)
    before = clone_inputs(inp)
    want = oracle_verify(before)
    reference.verify(verify_args(inp))
    masks = verify_write_masks(before)

    assert_written("out", inp["out"], want["out"], masks["out"], rtol=1e-12)
    assert_written("corr", inp["corr"], want["corr"], masks["corr"], rtol=1e-12)
    assert (bits(inp["kg"]) == bits(want["kg"])).all(), "kg not bit-exact"
    assert is_poisoned(inp["kg"])[~masks["kg"]].all()
    if inp["conv_state"] is not None:
        assert (bits(inp["conv_state"]) == bits(want["conv_state"])).all(), "conv state roll"
        untouched = untouched_mask(before["conv_state"], inp["conv_state"])
        assert untouched[~masks["conv_state"]].all()
    assert untouched_mask(before["state_pool"], inp["state_pool"]).all(), "verify wrote state"
    assert_inputs_untouched(before, inp, INPUT_NAMES + ["conv_guard"])
    # Padding requests (the null slot, negative slots, slots past the pool) wrote zeros for
    # their tokens and nothing else.
    slot_count = inp["state"].shape[0]
    for b, slot in enumerate(inp["slots"].tolist()):
        bos, end = inp["query_start"][b : b + 2].tolist()
        if not max(inp["null_slot"], -1) < slot < slot_count:
            assert (inp["out"][bos:end] == 0).all() and is_poisoned(inp["corr"][b]).all()


def test_cases_cover_the_corners() -> None:
    """The parametrisation above really contains empty, short and padding windows."""
    seen = {"empty": 0, "short": 0, "null": 0, "null_tokens": 0}
    for case in CASES:
        inp = case_inputs(case)
        window = case[2]
        for qlen, slot in zip(inp["qlen"], inp["slots"].tolist(), strict=True):
            null = slot <= inp["null_slot"]
            seen["null"] += null
            seen["null_tokens"] += null and qlen > 0
            seen["empty"] += not null and qlen == 0
            seen["short"] += not null and 0 < qlen < window
    assert all(seen.values()), seen


def test_verify_bf16_buffers() -> None:
    """Real buffer dtypes (bf16 out, fp32 corr): the fp64 results rounded on store."""
    inp = case_inputs(CASES[1])
    before = clone_inputs(inp)
    want = oracle_verify(before)
    reference.verify(verify_args(inp))
    masks = verify_write_masks(before)
    out_mask = masks["out"]
    assert is_poisoned(inp["out"])[~out_mask].all()
    exact = want["out"][out_mask]
    got = inp["out"][out_mask].double()
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()
    assert_written("corr", inp["corr"], want["corr"], masks["corr"], rtol=1e-6)


def test_out_of_request_data_never_leaks() -> None:
    """NaN in tokens of padding requests, in trailing token rows, in the null slot's state and
    conv rows: live results are unchanged, bit for bit."""
    inp = make_verify_inputs(6, 2, 6, conv=True, null_slot=0, seed=11, out_dtype=F64)
    clean = clone_inputs(inp)
    reference.verify(verify_args(clean))
    dirty = clone_inputs(inp)
    tail = 3
    for name in ("qkv", "raw_g", "raw_beta", "out"):
        pad = poison_(torch.empty(tail, dirty[name].shape[1], dtype=dirty[name].dtype))
        dirty[name] = torch.cat([dirty[name], pad])
    for b, slot in enumerate(dirty["slots"].tolist()):
        if slot <= 0:
            bos, end = dirty["query_start"][b : b + 2].tolist()
            for name in ("qkv", "raw_g", "raw_beta"):
                poison_(dirty[name][bos:end])
    poison_(dirty["state_pool"][0])
    poison_(dirty["conv_state"][0])
    reference.verify(verify_args(dirty))
    tokens = clean["out"].shape[0]
    assert (bits(dirty["out"][:tokens]) == bits(clean["out"])).all()
    assert is_poisoned(dirty["out"][tokens:]).all()
    for name in ("corr", "kg"):
        assert (bits(dirty[name]) == bits(clean[name])).all()
    assert (bits(dirty["conv_state"][1:]) == bits(clean["conv_state"][1:])).all()


def test_window_positions_past_qlen_are_inert() -> None:
    """Changing the tokens of the next request does not move this request's results."""
    inp = make_verify_inputs(2, 2, 8, conv=True, ragged=False, nulls=False, seed=12)
    inp["query_start"] = torch.tensor([0, 3, 11], dtype=torch.int32)
    first = clone_inputs(inp)
    reference.verify(verify_args(first))
    second = clone_inputs(inp)
    second["qkv"][3:] = -second["qkv"][3:]
    second["raw_g"][3:] += 1
    reference.verify(verify_args(second))
    assert (bits(first["out"][:3]) == bits(second["out"][:3])).all()
    assert (bits(first["corr"][0]) == bits(second["corr"][0])).all()
    assert (bits(first["kg"][0]) == bits(second["kg"][0])).all()


# --------------------------------------------------------------------------- oracle A (FLA)


def load_fla_naive() -> Any:
    spec = importlib.util.find_spec("fla")
    if (
        spec is None
        or not spec.submodule_search_locations
        or not importlib.util.find_spec("einops")
    ):
        pytest.skip("fla-core (and einops) not installed")
    path = Path(spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} missing")
    module_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_recurrent_kda


def test_against_fla_naive_recurrent() -> None:
    naive = load_fla_naive()
    inp = make_verify_inputs(5, 3, 8, seed=21, state_dtype=F64, out_dtype=F64, corr_dtype=F64)
    heads = 3
    reference.verify(verify_args(inp))
    starts, slots = inp["query_start"].tolist(), inp["slots"].tolist()
    checked = 0
    for b, slot in enumerate(slots):
        bos, qlen = starts[b], starts[b + 1] - starts[b]
        if slot <= inp["null_slot"] or qlen == 0:
            continue
        rows = inp["qkv"][bos : bos + qlen].double().view(qlen, 3, heads, K)
        q, k, v = rows[:, 0], rows[:, 1], rows[:, 2]
        q_n = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k_n = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        rate = torch.exp(inp["a_log"].double())[:, None]
        g_raw = inp["raw_g"][bos : bos + qlen].double().view(qlen, heads, K)
        g = inp["lower_bound"] * torch.sigmoid(
            rate * (g_raw + inp["dt_bias"].double().view(heads, K))
        )
        beta = torch.sigmoid(inp["raw_beta"][bos : bos + qlen].double())
        s0 = inp["state"][slot].transpose(-1, -2)[None].float()  # FLA keeps [K, V]

        def run(n: int, q_n=q_n, k_n=k_n, v=v, g=g, beta=beta, s0=s0) -> tuple[Tensor, Tensor]:
            args = [x[None, :n].float() for x in (q_n, k_n, v, g, beta)]
            o, s = naive(*args, scale=K**-0.5, initial_state=s0, output_final_state=True)
            return o[0], s[0].transpose(-1, -2).double()  # back to [H, V, K]

        o, final = run(qlen)
        got = inp["out"][bos : bos + qlen].view(qlen, heads, K)
        torch.testing.assert_close(got, o.double(), rtol=1e-4, atol=1e-5)
        # u_t from consecutive FLA states: S_t - S_{t-1} e^{g_t} = u_t k_t^T.
        prev = s0[0].transpose(-1, -2).double()
        for t in range(qlen):
            _, s_t = run(t + 1)
            delta = s_t - prev * torch.exp(g[t])[:, None, :]
            k_t = k_n[t]
            u = (delta @ k_t[:, :, None])[..., 0] / (k_t * k_t).sum(-1, keepdim=True)
            torch.testing.assert_close(inp["corr"][b, :, t], u, rtol=1e-4, atol=1e-4)
            prev = s_t
        # Commit of the whole window equals FLA's final state.
        state = inp["state"]
        accepted = torch.zeros(len(slots), dtype=torch.int32)
        accepted[b] = qlen
        reference.commit(commit_args(inp, accepted))
        torch.testing.assert_close(state[slot], final, rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked >= 2


# --------------------------------------------------------------------------- commit


def accept_counts(inp: dict[str, Any], seed: int) -> Tensor:
    """Accept counts cycling a == qlen, a == 1, a == 0, random over the live windows; a == 0 for
    empty windows and anything for padding requests (their slot must stay untouched)."""
    gen = torch.Generator().manual_seed(seed)
    window = inp["corr"].shape[2]
    counts, live = [], 0
    for qlen, slot in zip(inp["qlen"], inp["slots"].tolist(), strict=True):
        if slot <= inp["null_slot"]:
            counts.append(int(torch.randint(1, window + 1, (1,), generator=gen)))
        elif qlen == 0:
            counts.append(0)
        else:
            pick = int(torch.randint(1, qlen + 1, (1,), generator=gen))
            counts.append([qlen, 1, 0, pick][live % 4])
            live += 1
    return torch.tensor(counts, dtype=torch.int32)


def poison_rejected_(inp: dict[str, Any], accepted: Tensor) -> None:
    """NaN into corr/kg rows t >= a: commit must select them away, not multiply them by 0."""
    for b, a in enumerate(accepted.tolist()):
        poison_(inp["corr"][b, :, a:])
        poison_(inp["kg"][b, :, a:])


@pytest.mark.parametrize(
    "case", CASES[:5], ids=lambda c: "-".join(map(str, c)).replace("torch.", "")
)
def test_commit_matches_recurrence(case: tuple) -> None:
    inp = case_inputs(case, state_dtype=F64, corr_dtype=F64)
    want = oracle_verify(clone_inputs(inp))
    reference.verify(verify_args(inp))
    accepted = accept_counts(inp, seed=case[8])
    poison_rejected_(inp, accepted)
    before = clone_inputs(inp)
    reference.commit(commit_args(inp, accepted))

    writable = commit_write_mask(before, accepted)
    assert untouched_mask(before["state_pool"], inp["state_pool"])[~writable].all()
    heads = inp["a_log"].shape[0]
    seen = set()
    for b, (a, slot) in enumerate(zip(accepted.tolist(), inp["slots"].tolist(), strict=True)):
        if slot <= inp["null_slot"] or a == 0:
            continue
        seen |= {"full"} if a == inp["qlen"][b] else set()
        seen |= {"one"} if a == 1 else set()
        for h in range(heads):
            expect = want["states"][(b, h)][a - 1]
            torch.testing.assert_close(inp["state"][slot, h], expect, rtol=1e-12, atol=1e-12)
    assert {"full", "one"} <= seen
    assert (accepted == 0).any()


def test_commit_bf16_pool_and_fp32_corr() -> None:
    """Production dtypes: bf16 state pool, fp32 corr; the result is the fp64 truth rounded."""
    inp = case_inputs(CASES[2])
    want = oracle_verify(clone_inputs(inp))
    reference.verify(verify_args(inp))
    accepted = accept_counts(inp, seed=5)
    before = clone_inputs(inp)
    reference.commit(commit_args(inp, accepted))
    writable = commit_write_mask(before, accepted)
    assert untouched_mask(before["state_pool"], inp["state_pool"])[~writable].all()
    for b, (a, slot) in enumerate(zip(accepted.tolist(), inp["slots"].tolist(), strict=True)):
        if slot <= inp["null_slot"] or a == 0:
            continue
        for h in range(inp["a_log"].shape[0]):
            expect = want["states"][(b, h)][a - 1]
            err = (inp["state"][slot, h].double() - expect).abs()
            assert (err <= expect.abs() * 2**-8 + 1e-6).all()


def test_commit_nothing_live_is_a_no_op() -> None:
    inp = make_verify_inputs(4, 2, 4, seed=31)
    reference.verify(verify_args(inp))
    before = clone_inputs(inp)
    accepted = torch.zeros(4, dtype=torch.int32)
    reference.commit(commit_args(inp, accepted))
    assert untouched_mask(before["state_pool"], inp["state_pool"]).all()


# --------------------------------------------------------------------------- precision


def test_fp32_compute_close_to_fp64() -> None:
    inp = case_inputs(CASES[3], state_dtype=F64, out_dtype=F64, corr_dtype=F64)
    lo, hi = clone_inputs(inp), clone_inputs(inp)
    reference.verify(verify_args(lo), compute_dtype=torch.float32)
    reference.verify(verify_args(hi))
    masks = verify_write_masks(inp)
    for name in ("out", "corr"):
        scale = hi[name][masks[name]].abs().max()
        err = (lo[name] - hi[name])[masks[name]].abs().max()
        assert err <= 1e-5 * scale, (name, float(err), float(scale))
    assert (bits(lo["kg"]) == bits(hi["kg"])).all()
    assert (bits(lo["conv_state"]) == bits(hi["conv_state"])).all()
    accepted = accept_counts(inp, seed=3)
    reference.commit(commit_args(lo, accepted), compute_dtype=torch.float32)
    reference.commit(commit_args(hi, accepted))
    err = (lo["state_pool"] - hi["state_pool"]).nan_to_num().abs().max()
    assert err <= 1e-5 * hi["state"].abs().max()


def round_to_f32(x: Fraction) -> float:
    """Correctly rounded fp32 of an exact rational (ties to even), by exact comparison."""
    guess = torch.tensor(float(x), dtype=F64).float()
    cands = [
        torch.nextafter(guess, torch.tensor(d, dtype=torch.float32)) for d in (-math.inf, math.inf)
    ]
    cands.append(guess)
    return min(
        (float(c) for c in cands),
        key=lambda c: (
            abs(Fraction(c) - x),
            int(torch.tensor(c, dtype=torch.float32).view(torch.int32)) & 1,
        ),
    )


def test_fma_f32_is_correctly_rounded() -> None:
    gen = torch.Generator().manual_seed(0)
    # Crafted exact-midpoint cases, where fp64-then-fp32 double-rounds: a*b = +-2^-24 (1 - j^2
    # 2^-46), c in [1, 2), so the fp64 sum is a midpoint and the truth lies just beside it.
    j = torch.randint(1, 300, (200,), generator=gen).double()
    sign = torch.where(torch.rand(200, generator=gen) < 0.5, -1.0, 1.0).double()
    a = (1 + j * 2.0**-23).float()
    b = (sign * 2.0**-24 * (1 - j * 2.0**-23)).float()
    c = (1 + torch.randint(0, 2**23, (200,), generator=gen).double() * 2.0**-23).float()
    # Plus random triples of mixed magnitude.
    ra = (torch.randn(300, generator=gen) * 4).float()
    rb = (
        torch.randn(300, generator=gen) * 2.0 ** torch.randint(-30, 30, (300,), generator=gen)
    ).float()
    rc = torch.randn(300, generator=gen).float()
    a, b, c = torch.cat([a, ra]), torch.cat([b, rb]), torch.cat([c, rc])
    got = reference.fma_f32(a, b, c)
    naive = (a.double() * b.double() + c.double()).float()
    want = [
        round_to_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        for x, y, z in zip(a, b, c, strict=True)
    ]
    assert got.tolist() == want
    assert (naive != got).sum() > 50, "the crafted cases should defeat the naive rounding"


# --------------------------------------------------------------------------- helpers and errors


def test_helpers_shapes() -> None:
    heads = 2
    a_log, dt_bias = torch.zeros(heads), torch.zeros(heads * K)
    g = reference.gate(torch.zeros(5, heads, K), a_log, dt_bias, -5.0)
    assert g.shape == (5, heads, K) and torch.allclose(g, torch.full_like(g, -2.5))
    x = reference.l2_normalise(torch.zeros(3, K))
    assert (x == 0).all()
    y = reference.l2_normalise(torch.ones(K, dtype=F64) * 3)
    assert torch.isclose(y.norm(), torch.tensor(1.0, dtype=F64))


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda d: d.update(qkv=d["qkv"].float()), "`q` must be bfloat16"),  # q: its first block
        (lambda d: d.update(corr=d["corr"][:, :1]), "corr"),
        (lambda d: d.update(kg=d["kg"].float()), "kg"),
        (lambda d: d.update(raw_beta=d["raw_beta"][:, :1]), "raw_beta"),
        (lambda d: d.update(conv_w=None), "conv_w"),
        (lambda d: d.update(accepted=d["accepted"].float()), "accepted"),
        (lambda d: d.update(accepted=d["accepted"] * 0), "accepted"),
        (lambda d: d.update(conv_state=d["conv_state"][:, :3]), "conv_state"),
        (lambda d: d.update(query_start=d["query_start"] * 3), "query_start"),
        (lambda d: d.update(slots=d["slots"].float()), "slots"),
    ],
)
def test_verify_rejects_bad_inputs(mutate, pattern: str) -> None:
    inp = make_verify_inputs(4, 2, 4, conv=True, seed=41, ragged=False, nulls=False)
    mutate(inp)
    with pytest.raises(ValueError, match=pattern):
        reference.verify(verify_args(inp))


def test_commit_rejects_bad_inputs() -> None:
    inp = make_verify_inputs(4, 2, 4, seed=42, ragged=False, nulls=False)
    reference.verify(verify_args(inp))
    accepted = torch.full((4,), 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="accepted"):
        reference.commit(commit_args(inp, accepted[:3]))
    dup = inp["slots"].clone()
    dup[1] = dup[0]
    with pytest.raises(ValueError, match="slots"):
        reference.commit(commit_args(inp, accepted).with_(slots=dup))


def test_the_reference_runs_the_run_times_checks() -> None:
    """Inputs the kernels would refuse, the reference refuses with the run-time's message."""
    inp = make_verify_inputs(4, 2, 4, seed=45)
    with pytest.raises(KdaInputError, match="kdagen.reference.verify: `lower_bound` x Q must be"):
        reference.verify(verify_args(inp).with_(lower_bound=-19.0))
    with pytest.raises(KdaInputError, match="kdagen.reference.commit: `accepted` must be int32"):
        reference.commit(commit_args(inp, torch.ones(4, dtype=torch.int64)))


def test_commit_clamps_accepted_and_skips_slots_outside_the_pool() -> None:
    """accepted > Q folds the whole window (the kernels clamp it); a slot below 0 or past
    the pool is a padding request: its records are never read, no slot is written."""
    inp = make_verify_inputs(4, 2, 4, seed=43, ragged=False, nulls=False)
    reference.verify(verify_args(inp))
    window = inp["corr"].shape[2]
    clamped, full = clone_inputs(inp), clone_inputs(inp)
    reference.commit(commit_args(clamped, torch.full((4,), 3 * window, dtype=torch.int32)))
    reference.commit(commit_args(full, torch.full((4,), window, dtype=torch.int32)))
    assert torch.equal(clamped["state"], full["state"])
    outside = clone_inputs(inp)
    slot_count = outside["state"].shape[0]
    slots = outside["slots"].clone()
    slots[0], slots[1] = -3, slot_count
    outside["corr"][:2] = float("nan")  # their records: never read
    before = outside["state"].clone()
    accepted = torch.full((4,), 2, dtype=torch.int32)
    reference.commit(commit_args(outside, accepted).with_(slots=slots))
    changed = (outside["state"] != before).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == sorted(slots[2:].tolist())
    assert not outside["state"].isnan().any()


@pytest.mark.parametrize(
    ("conv", "bias"), [(False, 0.0), (True, 0.0), (False, 160.0), (True, 160.0)]
)
def test_softplus_gate_matches_recurrence(conv: bool, bias: float) -> None:
    """Kimi-Linear's unbounded gate (``lower_bound=None``): verify and commit against the
    token-by-token recurrence, also where dt_bias makes every gate about -160 e^a_log, so the
    window's log decay passes -1000 and the state is forgotten inside the window."""
    inp = make_verify_inputs(5, 2, 8, conv=conv, seed=44, out_dtype=F64, corr_dtype=F64,
                             state_dtype=F64, lower_bound=None, nulls=True)  # fmt: skip
    inp["dt_bias"] += bias
    want = oracle_verify(clone_inputs(inp))
    if bias:
        steps = torch.nn.functional.softplus(inp["raw_g"].double() + inp["dt_bias"].double())
        assert float(steps.min()) * 8 * math.exp(float(inp["a_log"].min())) > 1000
    reference.verify(verify_args(inp))
    masks = verify_write_masks(clone_inputs(inp))
    assert_written("out", inp["out"], want["out"], masks["out"], rtol=1e-10)
    assert_written("corr", inp["corr"], want["corr"], masks["corr"], rtol=1e-10)
    assert torch.isfinite(inp["out"][masks["out"]]).all()
    accepted = accept_counts(inp, seed=45)
    poison_rejected_(inp, accepted)
    reference.commit(commit_args(inp, accepted))
    for b, (a, slot) in enumerate(zip(accepted.tolist(), inp["slots"].tolist(), strict=True)):
        if slot <= inp["null_slot"] or a == 0:
            continue
        for h in range(2):
            expect = want["states"][(b, h)][a - 1]
            torch.testing.assert_close(inp["state"][slot, h], expect, rtol=1e-10, atol=1e-12)

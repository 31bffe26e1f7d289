"""Tree verify / path commit (kdagen.tree) against an independent node-by-node fp64 oracle.

The oracle walks each node's root path token by token with the plain recurrence and the plain
width-4 convolution over (history, path tokens); it shares nothing with kdagen.reference but
``tests/oracle.py``'s conv token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import conv_row, conv_token
from torch import Tensor

from kdagen import reference, tree
from kdagen.serve.validate import KdaInputError
from kdagen.testing import (
    clone_inputs,
    commit_args,
    make_verify_inputs,
    random_parents,
    verify_args,
)

K = 128
F64 = torch.float64


# --------------------------------------------------------------------------- random trees


def request_parents(parents: Tensor, bos: int, qlen: int) -> list[int]:
    return parents[bos : bos + qlen].tolist()


def root_path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def random_paths(
    inp: dict[str, Any], parents: Tensor, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """A random accepted root path per request (``path [B, Q]``, ``accepted [B]``)."""
    batch, window = inp["slots"].shape[0], inp["corr"].shape[2]
    starts = inp["query_start"].tolist()
    path = torch.zeros(batch, window, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        qlen = starts[b + 1] - starts[b]
        if qlen == 0:
            continue
        node = int(torch.randint(0, qlen, (1,), generator=gen))
        steps = root_path(request_parents(parents, starts[b], qlen), node)
        path[b, : len(steps)] = torch.tensor(steps, dtype=torch.int32)
        accepted[b] = len(steps)
    return path, accepted


# --------------------------------------------------------------------------- the oracle


def oracle_gate(x: Tensor, rate: Tensor, lower_bound: float | None) -> Tensor:
    if lower_bound is None:
        soft = torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))
        return -rate * soft
    return lower_bound / (1 + torch.exp(-rate * x))


def oracle_token(inp: dict[str, Any], row: int, mixed: Tensor) -> dict[str, Tensor]:
    """One token's per-head inputs of the recurrence (fp64), from its conv output ``mixed``."""
    heads = inp["a_log"].shape[0]
    x = mixed.view(3, heads, K)
    q, k, v = x[0].double(), x[1].double(), x[2].double()
    raw_g = inp["raw_g"][row].view(heads, K)
    rate = torch.exp(inp["a_log"].double())[:, None]
    g = oracle_gate(raw_g.double() + inp["dt_bias"].double().view(heads, K), rate,
                    inp["lower_bound"])  # fmt: skip
    norm = (k * k).sum(-1, keepdim=True).add(1e-6).sqrt()
    qnorm = (q * q).sum(-1, keepdim=True).add(1e-6).sqrt()
    return {
        "k_raw": x[1], "g_raw": raw_g, "k": k / norm, "q": q / qnorm * K**-0.5, "v": v,
        "g": g, "beta": torch.sigmoid(inp["raw_beta"][row].double()),
    }  # fmt: skip


def oracle_step(s: Tensor, tok: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """The plain recurrence over one token for every head: returns (S, u, o)."""
    s = s * torch.exp(tok["g"])[:, None, :]
    u = tok["beta"][:, None] * (tok["v"] - torch.einsum("hvk,hk->hv", s, tok["k"]))
    s = s + u[:, :, None] * tok["k"][:, None, :]
    return s, u, torch.einsum("hvk,hk->hv", s, tok["q"])


def history_of(inp: dict[str, Any], slot: int) -> list[Tensor]:
    """The three history tokens the verify reads (rows accepted - 1 .. accepted + 1)."""
    first = int(inp["accepted"][inp["slot_request"][slot]]) - 1
    rows = [conv_row(inp["conv_state"], slot, first + i, inp["conv_dim_first"]) for i in range(3)]
    return [row.clone() for row in rows]  # the verify rolls the rows in place


def oracle_walk(inp: dict[str, Any], b: int, parents: list[int], nodes: list[int],
                hist: list[Tensor] | None) -> tuple[Tensor, list[dict[str, Tensor]]]:  # fmt: skip
    """The state after ``nodes`` (a root path) of request b, token by token, and each token's
    records (u, o, inputs)."""
    bos, slot = int(inp["query_start"][b]), int(inp["slots"][b])
    s = inp["state"][slot].double()
    window = list(hist) if hist is not None else []
    done: list[dict[str, Tensor]] = []
    for n in nodes:
        raw = inp["qkv"][bos + n]
        if hist is not None:
            window.append(raw)
            mixed = conv_token(window[-4:], inp["conv_w"])
        else:
            mixed = raw
        tok = oracle_token(inp, bos + n, mixed)
        s, u, o = oracle_step(s, tok)
        done.append({**tok, "u": u, "o": o, "raw": raw})
    return s, done


def oracle_history(hist: list[Tensor], done: list[dict[str, Tensor]]) -> list[Tensor]:
    return (list(hist) + [d["raw"] for d in done])[-3:]


# --------------------------------------------------------------------------- cases


def tree_inputs(batch: int, heads: int, window: int, *, conv: bool, lower_bound: float | None,
                seed: int, dim_first: bool = False, **kw: Any) -> dict[str, Any]:  # fmt: skip
    inp = make_verify_inputs(batch, heads, window, conv=conv, conv_dim_first=dim_first,
                             seed=seed, out_dtype=F64, corr_dtype=F64, state_dtype=F64,
                             lower_bound=lower_bound, **kw)  # fmt: skip
    inp["slot_request"] = {int(s): b for b, s in enumerate(inp["slots"].tolist())}
    return inp


CASES = [  # batch, heads, window, conv, dim_first, lower_bound, seed
    (5, 2, 16, False, False, -5.0, 1),
    (5, 2, 16, True, False, -5.0, 2),
    (4, 1, 16, True, True, None, 3),
    (6, 2, 7, False, False, None, 4),
    (3, 1, 1, True, False, -5.0, 5),
    (5, 1, 12, True, False, None, 6),
]


def case_id(case: tuple) -> str:
    return "-".join(map(str, case))


def run_tree_verify(inp: dict[str, Any], parents: Tensor) -> dict[str, Any]:
    got = clone_inputs(inp)
    tree.verify_tree(verify_args(got), parents)
    return got


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_verify_tree_matches_node_by_node_oracle(case: tuple) -> None:
    batch, heads, window, conv, dim_first, lower_bound, seed = case
    inp = tree_inputs(batch, heads, window, conv=conv, lower_bound=lower_bound, seed=seed,
                      dim_first=dim_first)  # fmt: skip
    parents = random_parents(inp["qlen"], torch.Generator().manual_seed(seed))
    got = run_tree_verify(inp, parents)
    starts = inp["query_start"].tolist()
    for b, slot in enumerate(inp["slots"].tolist()):
        bos, qlen = starts[b], starts[b + 1] - starts[b]
        if slot <= inp["null_slot"]:
            assert (got["out"][bos : bos + qlen] == 0).all()
            assert torch.isnan(got["corr"][b]).all()  # a padding request records nothing
            continue
        mine = request_parents(parents, bos, qlen)
        hist = history_of(inp, slot) if conv else None
        for t in range(qlen):
            _, done = oracle_walk(inp, b, mine, root_path(mine, t), hist)
            last = done[-1]
            torch.testing.assert_close(got["out"][bos + t].view(heads, K), last["o"],
                                       rtol=1e-10, atol=1e-12)  # fmt: skip
            torch.testing.assert_close(got["corr"][b, :, t], last["u"], rtol=1e-10, atol=1e-12)
            record = torch.cat([last["k_raw"], last["g_raw"]], dim=-1)
            assert torch.equal(got["kg"][b, :, t], record)  # bit-exact, as for the chain
        assert torch.isnan(got["corr"][b, :, qlen:]).all()  # never written past qlen


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_commit_path_matches_oracle_state_and_history(case: tuple) -> None:
    batch, heads, window, conv, dim_first, lower_bound, seed = case
    inp = tree_inputs(batch, heads, window, conv=conv, lower_bound=lower_bound, seed=seed,
                      dim_first=dim_first)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 100)
    parents = random_parents(inp["qlen"], gen)
    got = run_tree_verify(inp, parents)
    path, accepted = random_paths(inp, parents, gen)
    tree.commit_path(commit_args(got, accepted), path, conv_state=got["conv_state"],
                     conv_dim_first=dim_first)  # fmt: skip
    starts = inp["query_start"].tolist()
    touched = set()
    for b, slot in enumerate(inp["slots"].tolist()):
        if slot <= inp["null_slot"] or accepted[b] == 0:
            continue
        touched.add(slot)
        mine = request_parents(parents, starts[b], starts[b + 1] - starts[b])
        nodes = path[b, : int(accepted[b])].tolist()
        hist = history_of(inp, slot) if conv else None
        state, done = oracle_walk(inp, b, mine, nodes, hist)
        torch.testing.assert_close(got["state"][slot], state, rtol=1e-10, atol=1e-12)
        if conv:
            want = oracle_history(hist, done)
            for i in range(3):
                assert torch.equal(conv_row(got["conv_state"], slot, i, dim_first), want[i])
    for slot in range(inp["state"].shape[0]):
        if slot not in touched:
            assert torch.equal(got["state"][slot], inp["state"][slot])


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_a_chain_is_the_chain_reference(conv: bool, lower_bound: float | None) -> None:
    window = 8  # the chain reference's limit
    inp = tree_inputs(6, 2, window, conv=conv, lower_bound=lower_bound, seed=11)
    parents = random_parents(inp["qlen"], torch.Generator(), chain=True)
    got = run_tree_verify(inp, parents)
    want = clone_inputs(inp)
    reference.verify(verify_args(want))
    for name in ("out", "corr", "kg", "conv_state"):
        if want[name] is not None:
            assert torch.equal(got[name].nan_to_num(7.0), want[name].nan_to_num(7.0)), name
    accepted = torch.tensor([min(q, 1 + b % window) for b, q in enumerate(inp["qlen"])],
                            dtype=torch.int32)  # fmt: skip
    path = torch.arange(window, dtype=torch.int32).expand(6, window).contiguous()
    tree.commit_path(commit_args(got, accepted), path)
    reference.commit(commit_args(want, accepted))
    assert torch.equal(got["state_pool"].nan_to_num(7.0), want["state_pool"].nan_to_num(7.0))


def test_speculative_loop_on_trees() -> None:
    """20 steps of verify + commit on random trees and accepted paths (ragged, null slots,
    conv on, Q = 16): the pool's states and conv histories equal the recurrence run over the
    accepted paths only."""
    batch, heads, window, steps = 5, 1, 16, 20
    base = tree_inputs(batch, heads, window, conv=True, lower_bound=-5.0, seed=0)
    pool, conv_state = base["state_pool"].clone(), base["conv_state"].clone()
    truth = {s: pool[s, : heads * K * K].view(heads, K, K).clone() for s in range(pool.shape[0])}
    hist = {s: [conv_row(conv_state, s, i, False).clone() for i in range(3)] for s in truth}
    gen = torch.Generator().manual_seed(99)
    for step in range(steps):
        inp = tree_inputs(batch, heads, window, conv=True, lower_bound=-5.0, seed=1000 + step)
        for name in ("a_log", "dt_bias", "conv_w"):
            inp[name] = base[name]
        inp["state_pool"], inp["conv_state"] = pool, conv_state
        inp["state"] = pool[:, : heads * K * K].view(pool.shape[0], heads, K, K)
        inp["accepted"] = torch.ones(batch, dtype=torch.int32)  # history compacted to rows 0..2
        inp["slot_request"] = {int(s): b for b, s in enumerate(inp["slots"].tolist())}
        parents = random_parents(inp["qlen"], gen)
        tree.verify_tree(verify_args(inp), parents)
        path, accepted = random_paths(inp, parents, gen)
        tree.commit_path(commit_args(inp, accepted), path, conv_state=conv_state)
        starts = inp["query_start"].tolist()
        for b, slot in enumerate(inp["slots"].tolist()):
            if slot <= inp["null_slot"] or accepted[b] == 0:
                continue
            mine = request_parents(parents, starts[b], starts[b + 1] - starts[b])
            walk = {**inp, "state": {slot: truth[slot]}}
            truth[slot], done = oracle_walk(walk, b, mine, path[b, : int(accepted[b])].tolist(),
                                            hist[slot])  # fmt: skip
            hist[slot] = oracle_history(hist[slot], done)
        for slot, want in truth.items():
            torch.testing.assert_close(inp["state"][slot], want, rtol=1e-9, atol=1e-11)
            for i in range(3):
                assert torch.equal(conv_row(conv_state, slot, i, False), hist[slot][i]), step


# --------------------------------------------------------------------------- validation


def test_narrow_buffers_hold_the_fp64_results_rounded() -> None:
    """bf16 state and out, fp32 corr (the pool's and kernels' dtypes): the fp64 results cast
    on store."""
    wide = tree_inputs(4, 2, 16, conv=True, lower_bound=-5.0, seed=41)
    narrow = make_verify_inputs(4, 2, 16, conv=True, seed=41, lower_bound=-5.0)
    wide["state_pool"].copy_(narrow["state_pool"])  # the same bf16-valued pool
    parents = random_parents(wide["qlen"], torch.Generator().manual_seed(1))
    got = run_tree_verify(narrow, parents)
    want = run_tree_verify(wide, parents)
    assert torch.equal(got["out"].nan_to_num(7.0), want["out"].bfloat16().nan_to_num(7.0))
    assert torch.equal(got["corr"].nan_to_num(7.0), want["corr"].float().nan_to_num(7.0))
    assert torch.equal(got["kg"].nan_to_num(7.0), want["kg"].nan_to_num(7.0))


def test_bad_parents_are_refused() -> None:
    inp = tree_inputs(2, 1, 4, conv=False, lower_bound=-5.0, seed=3, ragged=False)
    parents = random_parents(inp["qlen"], torch.Generator())
    bos = int(inp["query_start"][1])
    for pos, value in ((0, 0), (1, 1), (1, -1)):
        bad = parents.clone()
        bad[bos + pos] = value
        with pytest.raises(KdaInputError, match="parents"):
            tree.verify_tree(verify_args(clone_inputs(inp)), bad)
    with pytest.raises(KdaInputError, match="parents"):
        tree.verify_tree(verify_args(clone_inputs(inp)), parents.long())


def test_bad_paths_are_refused() -> None:
    inp = tree_inputs(3, 1, 4, conv=False, lower_bound=-5.0, seed=3, nulls=False)
    inp["slots"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32)
    for bad in ([1, 2, 0, 0], [0, 0, 0, 0]):
        path = torch.zeros(3, 4, dtype=torch.int32)
        path[0] = torch.tensor(bad)
        with pytest.raises(KdaInputError, match="path"):
            tree.commit_path(commit_args(clone_inputs(inp), accepted), path)


def test_windows_past_16_and_wrong_conv_states_are_refused() -> None:
    inp = tree_inputs(2, 1, 17, conv=True, lower_bound=-5.0, seed=3, nulls=False)
    parents = random_parents(inp["qlen"], torch.Generator())
    with pytest.raises(KdaInputError, match="1..16"):
        tree.verify_tree(verify_args(clone_inputs(inp)), parents)
    accepted = torch.ones(2, dtype=torch.int32)
    path = torch.zeros(2, 17, dtype=torch.int32)
    with pytest.raises(KdaInputError, match="1..16"):
        tree.commit_path(commit_args(clone_inputs(inp), accepted), path)
    inp = tree_inputs(2, 1, 16, conv=True, lower_bound=-5.0, seed=3, nulls=False)
    with pytest.raises(KdaInputError, match="conv_state"):
        tree.commit_path(commit_args(inp, accepted), path[:, :16].contiguous(),
                         conv_state=inp["conv_state"][:, :17])  # fmt: skip


def test_ancestor_table() -> None:
    parents = torch.tensor([-1, 0, 0, 1, 3])
    table = tree.ancestor_table(parents).int().tolist()
    assert table == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                     [1, 1, 0, 1, 1]]  # fmt: skip


def test_all_layer_commit_is_each_layers_commit() -> None:
    """commit_path_layers over two layers (with conv) equals commit_path layer by layer."""
    first = tree_inputs(4, 2, 9, conv=True, lower_bound=None, seed=21)
    second = clone_inputs(first)  # another layer: its own state, weights and activations
    for name in ("state_pool", "qkv", "raw_g", "a_log", "conv_state"):
        second[name].copy_(second[name].flip(0))
    layers = [first, second]
    gen = torch.Generator().manual_seed(5)
    parents = random_parents(layers[0]["qlen"], gen)
    done = [run_tree_verify(inp, parents) for inp in layers]
    path, accepted = random_paths(done[0], parents, gen)
    one = [clone_inputs(d) for d in done]
    for d in one:
        tree.commit_path(commit_args(d, accepted), path, conv_state=d["conv_state"])
    tree.commit_path_layers(
        [d["state"] for d in done], [d["corr"] for d in done], [d["kg"] for d in done],
        torch.stack([d["a_log"] for d in done]), torch.stack([d["dt_bias"] for d in done]),
        done[0]["slots"], path, accepted, lower_bound=None, null_slot=done[0]["null_slot"],
        conv_states=[d["conv_state"] for d in done],
    )  # fmt: skip
    for d, want in zip(done, one, strict=True):
        assert torch.equal(d["state_pool"].nan_to_num(7.0), want["state_pool"].nan_to_num(7.0))
        assert torch.equal(d["conv_state"], want["conv_state"])


def test_a_chain_commit_compacts_the_history_the_chain_verify_reads() -> None:
    """Two windows with conv: the chain reference (next verify reads rows a-1..a+1) and the
    tree reference on chains (commit compacts them into rows 0..2, next verify with
    accepted = 1) give the same second window, bit for bit."""
    window, batch = 8, 5
    first = tree_inputs(batch, 2, window, conv=True, lower_bound=-5.0, seed=31)
    chain = random_parents(first["qlen"], torch.Generator(), chain=True)
    accepted = torch.tensor([max(1, q // 2) if q else 0 for q in first["qlen"]], dtype=torch.int32)
    path = torch.arange(window, dtype=torch.int32).expand(batch, window).contiguous()

    ours, theirs = clone_inputs(first), clone_inputs(first)
    tree.verify_tree(verify_args(ours), chain)
    tree.commit_path(commit_args(ours, accepted), path, conv_state=ours["conv_state"])
    reference.verify(verify_args(theirs))
    reference.commit(commit_args(theirs, accepted))

    second = tree_inputs(batch, 2, window, conv=True, lower_bound=-5.0, seed=32)
    second["slots"], second["a_log"], second["dt_bias"] = (
        first["slots"],
        first["a_log"],
        first["dt_bias"],
    )
    second["conv_w"] = first["conv_w"]
    chain = random_parents(second["qlen"], torch.Generator(), chain=True)
    # Requests that committed nothing kept their history where the first window read it.
    committed = accepted > 0
    results = []
    for done, next_accepted in ((ours, torch.ones_like(accepted)), (theirs, accepted)):
        step = clone_inputs(second)
        for name in ("state_pool", "conv_state"):
            step[name] = done[name]
        step["state"] = done["state"]
        step["accepted"] = torch.where(committed, next_accepted, first["accepted"])
        if done is ours:
            tree.verify_tree(verify_args(step), chain)
        else:
            reference.verify(verify_args(step))
        results.append(step)
    for name in ("out", "corr", "kg"):
        assert torch.equal(*(r[name].nan_to_num(7.0) for r in results)), name
    rolled = [s for s, q in zip(second["slots"].tolist(), second["qlen"], strict=True)
              if s > second["null_slot"] and q > 0]  # fmt: skip
    assert torch.equal(*(r["conv_state"][rolled] for r in results))

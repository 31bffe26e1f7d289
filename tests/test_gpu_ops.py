"""The torch custom ops on a Hopper GPU: ``torch.library.opcheck`` on each, and a small decode
step (verify on every layer -> accept -> one all-layer commit) that gives bit-identical pools
and outputs eagerly, under ``torch.compile(fullgraph=True)`` and replayed from a CUDA graph."""

from __future__ import annotations

import random

import torch
from gpu_marks import HOPPER

from kdagen.serve import ops
from kdagen.serve.model_commit import ModelCommit
from kdagen.testing import make_verify_inputs

pytestmark = HOPPER

SEED = random.randrange(1 << 30)  # fresh inputs every run; printed on failure
B, H, Q, LAYERS = 4, 2, 4, 3


def layers() -> list[dict]:
    """Full windows, live slots; every layer shares the step's slots and windows."""
    made = [make_verify_inputs(B, H, Q, device="cuda", seed=SEED + i, ragged=False, nulls=False)
            for i in range(LAYERS)]  # fmt: skip
    for x in made[1:]:
        x["slots"], x["query_start"] = made[0]["slots"], made[0]["query_start"]
    return made


def verify(x: dict) -> None:
    torch.ops.kdagen.verify(x["qkv"], x["raw_g"], x["raw_beta"], x["a_log"], x["dt_bias"],
                            x["state"], x["query_start"], x["slots"], x["out"], x["corr"],
                            x["kg"], None, None, None, -5.0, 0, False)  # fmt: skip


def test_opcheck_every_op() -> None:
    xs = layers()
    accepted = torch.randint(1, Q + 1, (B,), dtype=torch.int32, device="cuda")
    x = xs[0]
    verify_args = (x["qkv"], x["raw_g"], x["raw_beta"], x["a_log"], x["dt_bias"], x["state"],
                   x["query_start"], x["slots"], x["out"], x["corr"], x["kg"], None, None,
                   None, -5.0, 0, False)  # fmt: skip
    torch.library.opcheck(torch.ops.kdagen.verify.default, verify_args)
    torch.library.opcheck(torch.ops.kdagen.commit.default,
                          (x["state"], x["corr"], x["kg"], x["a_log"], x["dt_bias"], x["slots"],
                           accepted, -5.0, 0))  # fmt: skip
    model = ModelCommit([y["state"] for y in xs], [y["corr"] for y in xs],
                        [y["kg"] for y in xs], [y["a_log"] for y in xs],
                        [y["dt_bias"] for y in xs])  # fmt: skip
    torch.library.opcheck(torch.ops.kdagen.commit_layers.default,
                          (ops.register(model), list(model.states), [], x["slots"], accepted,
                           None, None, None, None, 0))  # fmt: skip


def test_decode_step_eager_compiled_and_graph_agree_bit_for_bit() -> None:
    xs = layers()
    model = ModelCommit([y["state"] for y in xs], [y["corr"] for y in xs],
                        [y["kg"] for y in xs], [y["a_log"] for y in xs],
                        [y["dt_bias"] for y in xs])  # fmt: skip
    handle, states = ops.register(model), list(model.states)
    slots = xs[0]["slots"]
    accepted = torch.randint(1, Q + 1, (B,), dtype=torch.int32, device="cuda")

    def step() -> None:
        for x in xs:
            verify(x)
        torch.ops.kdagen.commit_layers(handle, states, [], slots, accepted, None, None, None,
                                       None, 0)  # fmt: skip

    kept = ("state_pool", "out", "corr", "kg")
    start = [[x[k].clone() for k in kept] for x in xs]

    def restore() -> None:
        for x, saved in zip(xs, start, strict=True):
            for k, t in zip(kept, saved, strict=True):
                x[k].copy_(t)

    def result() -> list[torch.Tensor]:
        torch.cuda.synchronize()
        return [x[k].view(torch.int16 if x[k].element_size() == 2 else torch.int32).clone()
                for x in xs for k in kept]  # fmt: skip

    step()  # eager (compiles the kernels, makes the work counter)
    eager = result()
    restore()
    torch.compile(step, fullgraph=True)()
    compiled = result()
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    restore()
    graph.replay()
    replayed = result()
    for a, b, c in zip(eager, compiled, replayed, strict=True):
        assert torch.equal(a, b), f"seed {SEED}: torch.compile differs from eager"
        assert torch.equal(a, c), f"seed {SEED}: graph replay differs from eager"
    assert not torch.equal(eager[0], start[0][0].view(torch.int16))  # the step wrote state

"""The torch custom ops (kdagen/serve/ops.py) without a GPU: their schemas declare exactly the
tensors each kernel writes, their fake implementations trace under fake CUDA tensors, and
``commit_layers`` refuses a handle that is not its model's. tests/test_gpu_ops.py runs them."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kdagen.serve import ops
from kdagen.serve.validate import KdaInputError

H, Q, T, SLOTS, B = 2, 4, 8, 5, 2


def written(name: str) -> set[str]:
    schema = getattr(torch.ops.kdagen, name).default._schema
    return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def test_each_op_mutates_exactly_what_its_kernel_writes() -> None:
    assert written("verify") == {"out", "corr", "kg", "conv_state"}
    assert written("commit") == {"state"}
    assert written("commit_layers") == {"states", "conv_states"}


def tensors(device: str = "cuda") -> dict[str, torch.Tensor]:
    def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    return {
        "qkv": empty(T, 3 * H * 128), "raw_g": empty(T, H * 128), "raw_beta": empty(T, H),
        "a_log": empty(H, dtype=torch.float32), "dt_bias": empty(H * 128, dtype=torch.float32),
        "state": empty(SLOTS, H, 128, 128),
        "query_start": empty(B + 1, dtype=torch.int32), "slots": empty(B, dtype=torch.int32),
        "out": empty(T, H * 128), "corr": empty(B, H, Q, 128, dtype=torch.float32),
        "kg": empty(B, H, Q, 256), "accepted": empty(B, dtype=torch.int32),
    }  # fmt: skip


def decode_step(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """verify -> commit, as a serving engine's step would call them."""
    torch.ops.kdagen.verify(x["qkv"], x["raw_g"], x["raw_beta"], x["a_log"], x["dt_bias"],
                            x["state"], x["query_start"], x["slots"], x["out"], x["corr"],
                            x["kg"], None, None, None, -5.0, 0, False)  # fmt: skip
    torch.ops.kdagen.commit(x["state"], x["corr"], x["kg"], x["a_log"], x["dt_bias"],
                            x["slots"], x["accepted"], -5.0, 0)  # fmt: skip
    return x["out"]


def test_the_step_traces_on_fake_cuda_tensors() -> None:
    with FakeTensorMode():
        x = tensors()
        assert decode_step(x).device.type == "cuda"  # the fake implementations ran
    graph = make_fx(lambda *args: decode_step(dict(zip(tensors("cpu"), args, strict=True))),
                    tracing_mode="fake")(*tensors("cpu").values())  # fmt: skip
    code = graph.code
    assert code.index("kdagen.verify.default") < code.index("kdagen.commit.default")


def test_commit_layers_refuses_a_foreign_handle() -> None:
    state = torch.zeros(SLOTS, H, 128, 128, dtype=torch.bfloat16)
    slots = torch.zeros(B, dtype=torch.int32)
    with pytest.raises(KdaInputError, match="a handle kdagen.serve.ops.register gave"):
        torch.ops.kdagen.commit_layers(12345, [state], [], slots, slots, None, None, None, None, 0)
    assert ops._MODELS.get(12345) is None

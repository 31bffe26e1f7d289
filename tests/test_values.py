"""The opt-in checks of index values (``kdagen.serve.values``), on the CPU: with them on, each
out-of-contract value gets a KdaInputError naming the tensor, the request and the value, before
anything launches; with them off (the default) nothing is read back."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kdagen.serve import values
from kdagen.serve.model_commit import ModelCommit
from kdagen.serve.runtime import validate_verify
from kdagen.serve.validate import KdaInputError
from kdagen.serve.variant import Variant
from kdagen.testing import make_verify_inputs, verify_args

H, Q, B = 2, 4, 6
VARIANT = Variant(kernel="verify", heads=H, window=Q, conv=True, tree=True, path="sm90_wgmma",
                  ctas=396)  # fmt: skip


@pytest.fixture
def checking() -> Iterator[None]:
    values.check_values(True)
    yield
    values.check_values(False)


def _inputs() -> dict[str, Any]:
    """Six requests of four tokens each (T = 24), conv on, every window a random tree; slots
    1..6 (0 is the null slot), all live."""
    inputs = make_verify_inputs(B, H, Q, conv=True, tree=True, ragged=False, nulls=False, seed=2)
    assert inputs["query_start"].tolist() == [0, 4, 8, 12, 16, 20, 24]
    return inputs


def _validate(inputs: dict[str, Any], **changes: Any) -> None:
    validate_verify(verify_args(inputs).with_(**changes), variant=VARIANT, require_cuda=False)


def _int32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_contract_inputs_pass(checking: None) -> None:
    _validate(_inputs())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query_start": _int32(-1, 4, 8, 12, 16, 20, 24)}, "`query_start` starts at row -1"),
        (
            {"query_start": _int32(0, 4, 9, 12, 16, 20, 24)},
            "`query_start` gives request 1 5 tokens (rows 4 to 9); expected 0 to 4",
        ),
        (
            {"query_start": _int32(0, 4, 8, 6, 16, 20, 24)},
            "`query_start` gives request 2 -2 tokens",
        ),
        (
            {"query_start": _int32(1, 5, 9, 13, 17, 21, 25)},
            "`query_start` ends at row 25, past the 24 rows of the activations",
        ),
        ({"accepted": _int32(1, 2, 0, 4, 1, 1)}, "`accepted` gives live request 2 0 accepted"),
        ({"accepted": _int32(1, 2, 3, 4, 5, 1)}, "`accepted` gives live request 4 5 accepted"),
    ],
)
def test_bad_verify_values_are_named(checking: None, change: dict, message: str) -> None:
    with pytest.raises(KdaInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _validate(_inputs(), **change)


def test_live_requests_on_one_slot_are_named(checking: None) -> None:
    inputs = _inputs()
    slots = inputs["slots"].clone()
    slots[4] = slots[1]
    with pytest.raises(KdaInputError, match=f"requests 1 and 4 the same slot {int(slots[1])}"):
        _validate(inputs, slots=slots)
    slots[4] = 0  # the null slot: padding, which may repeat
    slots[5] = 0
    _validate(inputs, slots=slots)


@pytest.mark.parametrize(("row", "parent", "expected"), [(8, 0, "-1"), (9, 1, "0 to 0"),
                                                        (11, -1, "0 to 2")])  # fmt: skip
def test_bad_parents_are_named(checking: None, row: int, parent: int, expected: str) -> None:
    inputs = _inputs()
    parents = inputs["parents"].clone()
    parents[row] = parent
    with pytest.raises(KdaInputError, match=f"`parents` gives request 2's token {row - 8} "
                                            f"\\(row {row}\\) the parent {parent}; expected {expected}"):  # fmt: skip
        _validate(inputs, parents=parents)


def test_values_are_not_read_unless_asked() -> None:
    values.check_values(False)
    _validate(_inputs(), query_start=_int32(-7, 4, 8, 12, 16, 20, 99))


@pytest.mark.parametrize(("env", "on"), [(None, False), ("0", False), ("1", True), ("yes", True)])
def test_the_value_checks_start_off_unless_the_environment_asks(env: str | None, on: bool) -> None:
    """The default a fresh process starts with (a serving process must not synchronise)."""
    environ = {k: v for k, v in os.environ.items() if k != "KDAGEN_CHECK_VALUES"}
    if env is not None:
        environ["KDAGEN_CHECK_VALUES"] = env
    script = (
        "import torch; from kdagen.serve import values; print(values.wanted(torch.device('cpu')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=environ)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(on)


def _model() -> ModelCommit:
    """Two layers of CPU pools: 6 slots, H 2, Q 4."""
    k = 128
    states = [torch.zeros(6, H, k, k, dtype=torch.bfloat16) for _ in range(2)]
    corrs = [torch.zeros(6, H, Q, k) for _ in range(2)]
    kgs = [torch.zeros(6, H, Q, 2 * k, dtype=torch.bfloat16) for _ in range(2)]
    gates = [torch.zeros(H) for _ in range(2)], [torch.zeros(H * k) for _ in range(2)]
    return ModelCommit(states, corrs, kgs, *gates, require_cuda=False)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (
            {"query_start": _int32(0, 4, 9, 10)},
            "`query_start` gives request 1 5 tokens",
        ),
        (
            {"slots": _int32(1, 3, 1)},
            "`slots` gives requests 0 and 2 the same slot 1, and both fold",
        ),
        (
            {"accepted": _int32(1, 2), "request_index": _int32(0, 1, 2)},
            "`request_index` gives request 2 the entry 2; expected 0 to 1",
        ),
        (
            {"path": torch.tensor([[0, 1, 2, 3], [0, 2, 1, 3], [0, 1, 2, 3]], dtype=torch.int32)},
            r"`path` gives request 1 the nodes \[0, 2, 1\]; expected a root path",
        ),
        (
            {"path": torch.tensor([[1, 2, 3, 3], [0, 1, 2, 3], [0, 1, 2, 3]], dtype=torch.int32)},
            r"`path` gives request 0 the nodes \[1\]",
        ),
    ],
)
def test_bad_commit_values_are_named(checking: None, step: dict, message: str) -> None:
    step = {"slots": _int32(1, 3, 5), "accepted": _int32(1, 3, 2)} | step
    with pytest.raises(KdaInputError, match=message):
        _model().commit(step.pop("slots"), step.pop("accepted"), **step)


def test_contract_commit_values_pass(checking: None) -> None:
    """Counts outside 0..Q are clamped by contract (a slot folding none may repeat), and so is
    the null slot; only the folded nodes of a path count."""
    slots, accepted = _int32(1, 3, 5, 0, 3), _int32(1, 9, 2, 4, -2)
    path = [[0, 7, 7, 7], [0, 1, 2, 3], [0, 2, 1, 1], [9, 9, 9, 9], [5, 5, 5, 5]]
    values.check_commit_values("commit", slots=slots, accepted=accepted, null_slot=0,
                               slot_count=6, window=Q,
                               path=torch.tensor(path, dtype=torch.int32))  # fmt: skip

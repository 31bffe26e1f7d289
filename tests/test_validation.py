"""Run-time input validation: every bad input gets an error naming the tensor and the fix."""

from __future__ import annotations

import pytest
import torch

from kdagen.cases import CHECK_CASES, make_commit_inputs
from kdagen.serve.contract import CommitArgs
from kdagen.serve.runtime import validate_commit
from kdagen.serve.validate import KdaInputError


def _inputs(**changes: object) -> CommitArgs:
    return make_commit_inputs(CHECK_CASES[2], heads=2, window=4, device="cpu").with_(**changes)


def _validate(args: CommitArgs, **kwargs: object):
    return validate_commit(args, require_cuda=False, **kwargs)  # type: ignore[arg-type]


def test_good_inputs_pass_and_resolve_a_variant() -> None:
    launch = _validate(_inputs())
    assert launch.variant.contract_key == "commit-h2-q4-i32"
    assert launch.batch == 37 and launch.args.state.stride(0) == 2 * 128 * 128 + 512


def test_cpu_state_is_refused_when_a_gpu_launch_is_asked_for() -> None:
    with pytest.raises(KdaInputError, match="`state` must be on a CUDA device, got cpu"):
        validate_commit(_inputs())


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("corr", lambda t: t.double(), "`corr` must be float32, got float64"),
        (
            "corr",
            lambda t: t[:, :, :3].contiguous(),
            "`kg` must have shape [rows>=37, 2, 3, 256], got [40, 2, 4, 256]",
        ),
        (
            "corr",
            lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
            "`corr` must be contiguous",
        ),
        (
            "corr",
            lambda t: t[:10],
            "`corr` must have shape [rows>=37, 2, 4, 128], got [10, 2, 4, 128]",
        ),
        ("kg", lambda t: t.float(), "`kg` must be bfloat16, got float32"),
        ("kg", lambda t: t[..., :128], "`kg` must have shape [rows>=37, 2, 4, 256]"),
        ("a_log", lambda t: t[:1], "`a_log` must have shape [2], got [1]"),
        ("dt_bias", lambda t: t.half(), "`dt_bias` must be float32, got float16"),
        ("slots", lambda t: t.float(), "`slots` must be int32 or int64, got float32"),
        ("accepted", lambda t: t[:5], "`accepted` must have shape [37], got [5]"),
        ("accepted", lambda t: t.long(), "`accepted` must be int32, got int64"),
        ("state", lambda t: t.float(), "`state` must be bfloat16, got float32"),
        ("state", lambda t: t[:, :, :64], "`state` must have shape [slots>=1, H>=1, 128, 128]"),
        (
            "state",
            lambda t: t.transpose(2, 3),
            "`state` must have strides [slot_stride, 16384, 128, 1]",
        ),
        ("state", lambda t: t.float().numpy(), "`state` must be a torch.Tensor, got ndarray"),
    ],
)
def test_bad_tensor_is_named_with_expected_and_actual(name, bad, message) -> None:
    inputs = _inputs()
    with pytest.raises(KdaInputError) as err:
        _validate(inputs.with_(**{name: bad(getattr(inputs, name))}))
    assert message in str(err.value)


def test_unaligned_corr_is_refused() -> None:
    inputs = _inputs()
    flat = torch.empty(inputs.corr.numel() + 1)
    with pytest.raises(KdaInputError, match="`corr` must start on a 16-byte boundary"):
        _validate(inputs.with_(corr=flat[1:].view(inputs.corr.shape)))


def test_slot_stride_must_keep_rows_aligned() -> None:
    pool = torch.zeros(4, 128 * 128 + 3, dtype=torch.bfloat16)
    state = pool[:, : 128 * 128].view(4, 1, 128, 128)
    inputs = make_commit_inputs(CHECK_CASES[1], heads=1, window=2, device="cpu").with_(state=state)
    with pytest.raises(
        KdaInputError, match="slot stride must be >= H\\*V\\*K = 16384 and a multiple of 8"
    ):
        _validate(inputs)


def test_other_device_is_named() -> None:
    inputs = _inputs(a_log=torch.zeros(2, device="meta"))
    with pytest.raises(KdaInputError, match="`a_log` must be on cpu \\(like `state`\\), got meta"):
        _validate(inputs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lower_bound": 5.0}, "`lower_bound` must be negative"),
        ({"lower_bound": float("-inf")}, "`lower_bound` must be finite"),
        ({"null_slot": 0.5}, "`null_slot` must be a Python int"),
        # what the kernels' fp32 / int64 arguments cannot hold (-inf, a wrapped null slot)
        ({"lower_bound": -1e39}, r"`lower_bound` must be finite \(as float32\), got -1e\+39"),
        ({"null_slot": 2**63}, r"`null_slot` must be below 2\*\*63 \(the kernels' int64\)"),
    ],
)
def test_bad_scalars(kwargs, message) -> None:
    with pytest.raises(KdaInputError, match=message):
        _validate(_inputs(**kwargs))


def test_explicit_variant_must_fit_the_tensors() -> None:
    with pytest.raises(KdaInputError, match="window: variant has 8, tensors need 4"):
        _validate(_inputs(), variant="commit-h2-q8-i32-bulk-t128-v8-r1-pdl")
    launch = _validate(_inputs(), variant="commit-h2-q4-i32-bulk-t256-v8-r2-pdl")
    assert launch.variant.threads == 256


def test_a_bad_variant_name_is_an_input_error() -> None:
    with pytest.raises(KdaInputError, match="kdagen.commit: `variant`: cannot parse variant name"):
        _validate(_inputs(), variant="bogus")


@pytest.mark.parametrize("variant", [123, object(), {"threads": 256}])
def test_a_variant_of_another_type_is_named(variant: object) -> None:
    with pytest.raises(KdaInputError, match="`variant` must be a Variant, its name or None, got"):
        _validate(_inputs(), variant=variant)

"""verify's and the vLLM entry point's input validation, on the CPU: every bad input gets an
error naming the tensor and what was expected, before anything reaches the DSL."""

from __future__ import annotations

import functools
import inspect
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kdagen.serve import vllm
from kdagen.serve.runtime import heuristic_variant, validate_verify
from kdagen.serve.validate import KdaInputError
from kdagen.serve.variant import Variant
from kdagen.serve.vllm import kda_recoverssm_verify, kda_recoverssm_verify_records
from kdagen.testing import make_verify_inputs, verify_args

H, Q = 2, 4
VARIANT = Variant(kernel="verify", heads=H, window=Q, path="sm90_wgmma", ctas=396)


def _inputs(conv: bool = False) -> dict[str, Any]:
    return make_verify_inputs(7, H, Q, conv=conv, seed=1)


def _validate(inputs: dict[str, Any], variant: Variant | str = VARIANT, **changes: Any):
    args = verify_args(inputs).with_(**changes)
    return validate_verify(args, variant=variant, require_cuda=False)


def test_good_inputs_pass_with_the_fused_projection_stride() -> None:
    launch = _validate(_inputs())
    assert launch.act_stride == 3 * H * 128 and launch.batch == 7 and not launch.records_by_slot
    assert launch.args.state.stride(0) == H * 128 * 128 + 512


def test_good_conv_inputs_pick_the_conv_contract() -> None:
    conv_variant = VARIANT.replace(conv=True)
    assert _validate(_inputs(conv=True), conv_variant).variant == conv_variant


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: {"raw_g": x["raw_g"].float()}, "`raw_g` must be bfloat16, got float32"),
        (lambda x: {"out": x["out"][:-1]}, "`out` must have shape"),
        (lambda x: {"corr": x["corr"][:3]}, "`corr` must have shape [rows>=7, 2, 4, 128]"),
        (lambda x: {"kg": x["kg"].float()}, "`kg` must be bfloat16"),
        (lambda x: {"query_start": x["query_start"].long()}, "`query_start` must be int32"),
        (lambda x: {"a_log": x["a_log"][:1]}, "`a_log` must have shape [2]"),
        (lambda x: {"lower_bound": 5.0}, "`lower_bound` must be negative"),
        (lambda x: {"lower_bound": -19.0}, "`lower_bound` x Q must be >= -72"),
        (lambda x: {"null_slot": 2**64}, "`null_slot` must be below 2**63 (the kernels' int64)"),
        (
            lambda x: {"v": x["qkv"][:, :256].clone()[:, :256:1].t().contiguous().t()},
            "`v` must have contiguous rows and the row stride of `q`",
        ),
        (lambda x: {"state": x["state"].transpose(2, 3)}, "`state` must have strides"),
        (lambda x: {"conv_dim_first": "yes"}, "`conv_dim_first` must be a Python bool"),
        (
            lambda x: {"state": torch.zeros(2, 257, 128, 128, dtype=torch.bfloat16)},
            "`state` must have at most 256 heads (dim 1), got 257",
        ),
    ],
)
def test_bad_inputs_name_the_tensor(change, message: str) -> None:
    inputs = _inputs()
    with pytest.raises(KdaInputError, match=re.escape(message)):
        _validate(inputs, **change(inputs))


def test_the_steepest_allowed_lower_bound_passes() -> None:
    assert _validate(_inputs(), lower_bound=-72.0 / Q).batch == 7


def test_windows_past_8_take_the_bounded_gate_down_to_128() -> None:
    """Q = 16 (the wide kernels): lower_bound x Q down to -128 passes, below it is refused
    naming the field; the softplus gate passes; the built-in choice on either arch."""
    inputs = make_verify_inputs(3, H, 16, seed=2)
    wide = VARIANT.replace(window=16, ctas=264)
    assert _validate(inputs, wide, lower_bound=-128.0 / 16).variant == wide
    with pytest.raises(KdaInputError, match=r"`lower_bound` x Q must be >= -128 at Q = 16"):
        _validate(inputs, wide, lower_bound=-8.5)
    softplus = wide.replace(gate="softplus")
    assert _validate(inputs, softplus, lower_bound=None).variant == softplus
    blackwell = validate_verify(verify_args(inputs), require_cuda=False, arch="sm_100a")
    assert (blackwell.variant.path, blackwell.variant.ctas) == ("sm100_tcgen05", 3 * 148)
    contract = {"heads": H, "window": 16, "slot_dtype": "int32"}
    chosen = heuristic_variant("verify", contract, 3, arch="sm_90a", sms=132)
    assert (chosen.ctas, chosen.row_split) == (264, 1)
    tree = heuristic_variant("verify", contract | {"tree": True}, 3, arch="sm_100a")
    assert (tree.path, tree.ctas) == ("sm100_tcgen05", 2 * 148)


def test_records_by_slot_must_be_a_bool() -> None:
    args = verify_args(_inputs())
    with pytest.raises(KdaInputError, match="`records_by_slot` must be a Python bool, got 1"):
        validate_verify(args, variant=VARIANT, require_cuda=False, records_by_slot=1)


def test_conv_tensors_come_all_or_none() -> None:
    inputs = _inputs(conv=True)
    with pytest.raises(KdaInputError, match=r"missing \['accepted'\]"):
        _validate(inputs, accepted=None)


def test_conv_state_layout_must_match_conv_dim_first() -> None:
    inputs = _inputs(conv=True)
    with pytest.raises(KdaInputError, match="`conv_state` must have shape"):
        _validate(inputs, VARIANT.replace(conv=True), conv_dim_first=True)


def test_an_explicit_variant_must_fit_the_inputs() -> None:
    with pytest.raises(KdaInputError, match="window: variant has 8, tensors need 4"):
        _validate(_inputs(), VARIANT.replace(window=8))
    with pytest.raises(KdaInputError, match="conv: variant has True, tensors need False"):
        _validate(_inputs(), VARIANT.replace(conv=True))


def test_a_variant_choice_for_cpu_tensors_asks_for_an_arch() -> None:
    """Without ``variant`` or ``arch`` the variant is the GPU's: CPU tensors (the
    ``require_cuda=False`` checks) get a KdaInputError, not torch's no-CUDA assertion."""
    with pytest.raises(KdaInputError, match="choosing a variant needs `state` on a CUDA device"):
        validate_verify(verify_args(_inputs()), require_cuda=False)


@pytest.mark.parametrize("variant", [123, object()])
def test_a_variant_of_another_type_is_named(variant: object) -> None:
    with pytest.raises(KdaInputError, match="`variant` must be a Variant, its name or None"):
        _validate(_inputs(), variant)  # type: ignore[arg-type]


def test_lower_bound_none_selects_the_softplus_gate() -> None:
    softplus = VARIANT.replace(gate="softplus")
    assert _validate(_inputs(), softplus, lower_bound=None).variant == softplus
    with pytest.raises(KdaInputError, match="gate: variant has 'kda', tensors need 'softplus'"):
        _validate(_inputs(), VARIANT, lower_bound=None)
    with pytest.raises(KdaInputError, match="gate: variant has 'softplus', tensors need 'kda'"):
        _validate(_inputs(), softplus)


def test_vllm_entry_rejects_bad_layouts() -> None:
    x = _inputs()
    t = x["qkv"].shape[0]
    q = torch.zeros(1, t, H, 128, dtype=torch.bfloat16)
    args = (q, q, q, q, q[..., 0], x["a_log"], x["dt_bias"])
    tail = (x["state"], x["corr"], x["kg"], x["query_start"], x["slots"], Q)
    with pytest.raises(KdaInputError, match="must be on a CUDA device"):  # past the gate
        kda_recoverssm_verify(*args, None, *tail)
    with pytest.raises(KdaInputError, match=r"`q` must have shape \[1, T, H, 128\]"):
        kda_recoverssm_verify(q[0], *args[1:], -5.0, *tail)
    strided = torch.zeros(1, t, 128, H, dtype=torch.bfloat16).transpose(2, 3)
    with pytest.raises(KdaInputError, match="`k` heads must be contiguous"):
        kda_recoverssm_verify(q, strided, *args[2:], -5.0, *tail)


# vLLM 0.33.0's kda_recoverssm_verify (vllm/models/kimi_k3/nvidia/ops/recoverssm.py), by name.
VLLM_033_VERIFY = (
    "q", "k", "v", "raw_g", "raw_beta", "A_log", "dt_bias", "lower_bound", "checkpoint_state",
    "records", "query_start_loc", "state_indices", "spec_query_len", "out",
)  # fmt: skip


def test_vllm_033_entry_takes_its_records_object(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tuple(inspect.signature(kda_recoverssm_verify_records).parameters) == VLLM_033_VERIFY
    x = _inputs()
    q = torch.zeros(1, x["qkv"].shape[0], H, 128, dtype=torch.bfloat16)
    head = (q, q, q, q, q[..., 0], x["a_log"], x["dt_bias"], None, x["state"])
    tail = (x["query_start"], x["slots"], Q)
    with pytest.raises(KdaInputError, match=r"`records` must have .* missing \['key_gate'\]"):
        kda_recoverssm_verify_records(*head, SimpleNamespace(correction=x["corr"]), *tail)
    seen = {}
    monkeypatch.setattr(vllm, "verify_records", lambda *a, **kw: seen.update(args=a, **kw))
    records = SimpleNamespace(correction=x["corr"], key_gate=x["kg"])
    kda_recoverssm_verify_records(*head, records, *tail)
    assert seen["records_by_slot"] is False  # row b is request b's
    assert seen["args"][9] is x["corr"] and seen["args"][10] is x["kg"]


def _vllm_verify_args() -> dict[str, Any]:
    """Valid arguments of vLLM's ``kda_recoverssm_verify`` by name (CPU tensors; the caches
    one row per state block)."""
    x = make_verify_inputs(5, H, Q, seed=1)
    t, blocks = x["qkv"].shape[0], x["state"].shape[0]
    qkv = x["qkv"].view(1, t, 3 * H, 128)
    return dict(
        q=qkv[:, :, :H], k=qkv[:, :, H : 2 * H], v=qkv[:, :, 2 * H :],
        raw_g=x["raw_g"].view(1, t, H, 128), raw_beta=x["raw_beta"].view(1, t, H),
        A_log=x["a_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, checkpoint_state=x["state"],
        correction_cache=torch.zeros(blocks, H, Q, 128),
        kg_cache=torch.zeros(blocks, H, Q, 256, dtype=torch.bfloat16),
        query_start_loc=x["query_start"], state_indices=x["slots"], spec_query_len=Q,
    )  # fmt: skip


@pytest.fixture
def vllm_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list:
    """vLLM's entry validating CPU tensors (the sm_100a choice needs no GPU); the launches it
    would make, recorded."""
    launches: list = []
    monkeypatch.setattr(vllm, "validate_verify", functools.partial(
        validate_verify, require_cuda=False, arch="sm_100a"))  # fmt: skip
    monkeypatch.setattr(vllm, "launch_verify", lambda launch: launches.append(launch))
    return launches


def test_vllm_entry_on_cpu_passes_valid_arguments(vllm_on_cpu: list) -> None:
    out = kda_recoverssm_verify(**_vllm_verify_args())
    assert out.shape == (1, vllm_on_cpu[0].args.q.shape[0], H, 128)


def test_vllm_entry_refuses_more_tokens_than_the_windows_hold(vllm_on_cpu: list) -> None:
    args = _vllm_verify_args()
    two = {
        "state_indices": args["state_indices"][:2],
        "query_start_loc": args["query_start_loc"][:3],
    }
    with pytest.raises(KdaInputError, match=r"`q` has 12 tokens, more than the 2 requests x "
                                            r"`spec_query_len` \(4\) hold"):  # fmt: skip
        kda_recoverssm_verify(**(args | two))


def test_vllm_entry_takes_the_gate_parameters_in_the_layers_shapes(vllm_on_cpu: list) -> None:
    """vLLM's layers hold dt_bias as [H*128] or [H, 128] and A_log as [H] or [1, 1, H, 1]:
    any contiguous shape with the right count reaches the kernel as its 1-D view."""
    args = _vllm_verify_args()
    a_log, dt_bias = args["A_log"], args["dt_bias"]
    kda_recoverssm_verify(**(args | {"A_log": a_log.view(1, 1, H, 1),
                                     "dt_bias": dt_bias.view(H, 128)}))  # fmt: skip
    launched = vllm_on_cpu[-1].args
    assert launched.a_log.shape == (H,) and launched.a_log.data_ptr() == a_log.data_ptr()
    assert launched.dt_bias.shape == (H * 128,)
    assert launched.dt_bias.data_ptr() == dt_bias.data_ptr()
    with pytest.raises(KdaInputError, match=r"`dt_bias` must have shape \[256\], got \[128\]"):
        kda_recoverssm_verify(**(args | {"dt_bias": dt_bias.view(H, 128)[:1]}))


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("state_indices", lambda t: t.float(), "`state_indices` must be int32 or int64"),
        ("query_start_loc", lambda t: t[:-1], "`query_start_loc` must have shape [6]"),
        ("checkpoint_state", lambda t: t.float(), "`checkpoint_state` must be bfloat16"),
        ("correction_cache", lambda t: t[:2], "`correction_cache` must have shape [9, 2, 4, 128]"),
        ("kg_cache", lambda t: t.float(), "`kg_cache` must be bfloat16"),
        ("A_log", lambda t: t[:1], "`A_log` must have shape [2], got [1]"),
        ("dt_bias", lambda t: t.double(), "`dt_bias` must be float32"),
        ("spec_query_len", lambda n: float(n), "`spec_query_len` must be a Python int, got 4.0"),
    ],
)
def test_vllm_entry_names_vllm_arguments(vllm_on_cpu: list, name: str, bad, message: str) -> None:
    """Errors name the argument as the caller passed it (vLLM's names), not the run-time's."""
    args = _vllm_verify_args()
    with pytest.raises(KdaInputError) as err:
        kda_recoverssm_verify(**(args | {name: bad(args[name])}))
    assert message in str(err.value)


def test_vllm_033_entry_names_the_records_fields(vllm_on_cpu: list) -> None:
    args = _vllm_verify_args()
    corr, kg = args.pop("correction_cache"), args.pop("kg_cache")
    records = SimpleNamespace(correction=corr, key_gate=kg[..., :128])
    with pytest.raises(KdaInputError, match=r"`records.key_gate` must have shape"):
        kda_recoverssm_verify_records(**args, records=records)
    records = SimpleNamespace(correction=corr[:, :, :2], key_gate=kg)
    with pytest.raises(KdaInputError, match=r"`records.correction` must have shape \[rows, H, "):
        kda_recoverssm_verify_records(**args, records=records)


@pytest.mark.parametrize("v", [None, 3, [1, 2]])
def test_vllm_entry_checks_v_before_allocating_out(vllm_on_cpu: list, v: object) -> None:
    """``out=None`` allocates ``out`` like ``v``: a ``v`` that is no tensor is named first."""
    with pytest.raises(KdaInputError, match=r"`v` must have shape \[1, T, H, 128\], got"):
        kda_recoverssm_verify(**(_vllm_verify_args() | {"v": v}))


@pytest.mark.parametrize("name", ["q", "k", "v", "raw_g", "out", "raw_beta"])
def test_vllm_entry_refuses_other_head_dims(vllm_on_cpu: list, name: str) -> None:
    """[1, T, 2H, 64] has the bytes of [1, T, H, 128], but not its heads: refused, as is
    raw_beta other than [1, T, H]."""
    args = _vllm_verify_args()
    t = args["q"].shape[1]
    if name == "raw_beta":
        bad, message = args["raw_beta"][..., None], r"`raw_beta` must have shape \[1, T, H\]"
    else:
        bad = torch.zeros(1, t, 2 * H, 64, dtype=torch.bfloat16)
        message = rf"`{name}` must have shape \[1, T, H, 128\], got \[1, {t}, 4, 64\]"
    with pytest.raises(KdaInputError, match=message):
        kda_recoverssm_verify(**(args | {name: bad}))

"""Input checks of the all-layer commit and vLLM's commit context, on the CPU: each bad input
gets a KdaInputError naming the tensor or option and what was expected."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdagen.serve.model_commit import ModelCommit
from kdagen.serve.validate import KdaInputError
from kdagen.serve.vllm import KDARecoverSSMCommitContext

K, H, Q, SLOTS, LAYERS = 128, 2, 4, 6, 3


def pools(**changes) -> dict:
    """Three layers of valid CPU pools, with ``changes`` applied to the keyword arguments."""
    args = dict(
        states=[torch.zeros(SLOTS, H, K, K, dtype=torch.bfloat16) for _ in range(LAYERS)],
        corrs=[torch.zeros(SLOTS, H, Q, K) for _ in range(LAYERS)],
        kgs=[torch.zeros(SLOTS, H, Q, 2 * K, dtype=torch.bfloat16) for _ in range(LAYERS)],
        a_logs=[torch.zeros(H) for _ in range(LAYERS)],
        dt_biases=[torch.zeros(H * K) for _ in range(LAYERS)],
    )
    return args | changes


def model(**changes) -> ModelCommit:
    args = pools(**changes)
    options = {k: args.pop(k) for k in list(args) if k not in
               ("states", "corrs", "kgs", "a_logs", "dt_biases")}  # fmt: skip
    return ModelCommit(*args.values(), require_cuda=False, **options)


def test_valid_pools_table_every_layer() -> None:
    m = model(conv_states=[torch.zeros(SLOTS, Q + 2, 3 * H * K, dtype=torch.bfloat16)
                           for _ in range(LAYERS)])  # fmt: skip
    assert m.layers == LAYERS and m.window == Q and m.layer_offsets.shape == (LAYERS, 4)
    size = [t.element_size() for t in (m.states[0], m.corrs[0], m.kgs[0])]
    for layer in range(LAYERS):
        for column, tensors in enumerate((m.states, m.corrs, m.kgs)):
            delta = tensors[layer].data_ptr() - tensors[0].data_ptr()
            assert m.layer_offsets[layer, column] * size[column] == delta
    values = m.validate_step(torch.tensor([1, 0, 5], dtype=torch.int32),
                             torch.tensor([1, 2, 3], dtype=torch.int32))  # fmt: skip
    assert values["layers"] == LAYERS and values["conv_mode"] == 2  # token-major, aligned


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"states": []}, "`states` must be a non-empty list"),
        ({"corrs": [torch.zeros(SLOTS, H, Q, K)] * 2}, "`corrs` must hold one tensor per layer"),
        (
            {
                "states": [torch.zeros(SLOTS, H, K, K, dtype=torch.bfloat16)] * 2
                + [torch.zeros(SLOTS + 1, H, K, K, dtype=torch.bfloat16)]
            },
            r"`states\[2\]` must match `states\[0\]`",
        ),  # fmt: skip
        ({"kgs": [torch.zeros(SLOTS, H, Q, 2 * K)] * LAYERS}, "`kgs.0.` must be bfloat16"),
        ({"corrs": [torch.zeros(SLOTS, H, 17, K)] * LAYERS}, r"Q \(1..16\)"),
        ({"a_logs": [torch.zeros(H + 1)] * LAYERS}, r"`a_logs\[0\]` must be float32"),
        ({"lower_bound": 5.0}, "`lower_bound` must be negative"),
        ({"lower_bound": -1e39}, r"`lower_bound` must be finite \(as float32\)"),
        ({"null_slot": 2**63}, r"`null_slot` must be below 2\*\*63"),
        ({"records_by_slot": "x"}, "`records_by_slot` must be a Python bool, got 'x'"),
        ({"conv_dim_first": 1}, "`conv_dim_first` must be a Python bool, got 1"),
        (
            {
                "conv_states": [torch.zeros(SLOTS, Q + 2, 3 * H * K + 8, dtype=torch.bfloat16)]
                * LAYERS
            },
            r"`conv_states\[0\]` must have shape",
        ),  # fmt: skip
    ],
)
def test_bad_pools_are_named(changes: dict, pattern: str) -> None:
    with pytest.raises(KdaInputError, match=pattern):
        model(**changes)


def test_misaligned_layer_is_refused() -> None:
    base = torch.zeros(SLOTS * H * Q * K + 1)
    shifted = base[1:].view(SLOTS, H, Q, K)  # 4 bytes off a 16-byte boundary
    with pytest.raises(KdaInputError, match=r"`corrs\[0\]` must start on a 16-byte boundary"):
        model(corrs=[shifted] * LAYERS)


@pytest.mark.parametrize(
    ("step", "pattern"),
    [
        ({"slots": torch.tensor([1.0, 2.0])}, "`slots` must be int32 or int64"),
        (
            {"accepted": torch.tensor([1, 2, 3], dtype=torch.int32)},
            r"`accepted` must have shape \[2\]",
        ),
        (
            {"request_index": torch.tensor([0], dtype=torch.int32)},
            "`request_index` must have shape",
        ),
        ({"query_start": torch.tensor([0, 4], dtype=torch.int32)}, "`query_start` must have shape"),
        (
            {"block_table": torch.zeros(2, 3, dtype=torch.int32)},
            "needs `block_table`, `num_computed`",
        ),
        (
            {
                "block_table": torch.zeros(2, 3, dtype=torch.int32),
                "num_computed": torch.zeros(2, dtype=torch.int32),
                "block_size": 2,
            },
            r"`block_size` must cover one window \(>= 4\)",
        ),  # fmt: skip
        *(
            (
                {
                    "block_table": torch.zeros(2, 3, dtype=torch.int32),
                    "num_computed": torch.zeros(2, dtype=torch.int32),
                    "block_size": size,  # the kernel's int32 would wrap it (to -2**31, to 16)
                },
                r"`block_size` must be below 2\*\*31 \(the kernels' int32\)",
            )
            for size in (2**31, 2**32 + 16)
        ),  # fmt: skip
        (
            {
                "block_table": torch.zeros(2, 2048, dtype=torch.int32),
                "num_computed": torch.zeros(2, dtype=torch.int32),
                "block_size": 2**20,  # 2**31 token positions: the last block's end wraps
            },
            r"`block_size` x the width of `block_table` \(1048576 x 2048 = 2147483648 tokens\) "
            r"must stay below 2\*\*31 - 4",
        ),  # fmt: skip
        (
            {
                "block_table": torch.zeros(3, 2, dtype=torch.int32).t(),
                "num_computed": torch.zeros(2, dtype=torch.int32),
                "block_size": 16,
            },
            "`block_table` rows must be contiguous",
        ),  # fmt: skip
        (
            {
                "slots": torch.arange(SLOTS + 1, dtype=torch.int32),
                "accepted": torch.ones(SLOTS + 1, dtype=torch.int32),
            },
            "records hold 6 rows",
        ),  # fmt: skip
    ],
)
def test_bad_steps_are_named(step: dict, pattern: str) -> None:
    args = {"slots": torch.tensor([1, 2], dtype=torch.int32),
            "accepted": torch.tensor([1, 2], dtype=torch.int32)} | step  # fmt: skip
    with pytest.raises(KdaInputError, match=pattern):
        model().validate_step(args.pop("slots"), args.pop("accepted"), **args)


def test_block_tables_refuse_a_build_without_prefix_caching() -> None:
    """An explicit ``noprefix`` variant cannot serve vLLM's align mode (it has no block
    tables): refused before any launch, naming the field; without block tables it fits."""
    lean = f"commit-h{H}-q{Q}-noprefix-i32-bulk-t128-v4-r4-pdl"
    slots, accepted = torch.tensor([1, 2], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    align = {"block_table": torch.ones(2, 3, dtype=torch.int32),
             "num_computed": torch.zeros(2, dtype=torch.int32), "block_size": 16}  # fmt: skip
    with pytest.raises(KdaInputError, match="prefix_caching: variant has False, tensors need True"):
        model().commit(slots, accepted, variant=lean, **align)


def vllm_layers(bounds: list | None = None) -> list[SimpleNamespace]:
    """vLLM-shaped layers over ``pools()`` (records per state block in kv_cache)."""
    args, bounds = pools(), bounds or [-5.0] * LAYERS
    return [
        SimpleNamespace(
            kv_cache=(torch.zeros(SLOTS, Q + 2, 3 * H * K, dtype=torch.bfloat16),
                      args["states"][i], args["corrs"][i], args["kgs"][i]),
            A_log=args["a_logs"][i], dt_bias=args["dt_biases"][i], gate_lower_bound=bounds[i],
        )
        for i in range(LAYERS)
    ]  # fmt: skip


def test_commit_context_refuses_what_it_cannot_serve(monkeypatch) -> None:
    monkeypatch.setattr("kdagen.serve.model_commit.check_state",
                        lambda op, t, require_cuda=True: t)  # CPU tensors here  # fmt: skip
    with pytest.raises(KdaInputError, match="the same `gate_lower_bound`"):
        KDARecoverSSMCommitContext.create(vllm_layers(bounds=[-5.0, -5.0, -4.0]),
                                          spec_query_len=Q, max_num_reqs=8)  # fmt: skip
    softplus = KDARecoverSSMCommitContext.create(vllm_layers(bounds=[None] * LAYERS),
                                                 spec_query_len=Q, max_num_reqs=8)  # fmt: skip
    assert softplus.pools.gate == "softplus" and softplus.pools.lower_bound is None
    with pytest.raises(KdaInputError, match="`spec_query_len` is 8"):
        KDARecoverSSMCommitContext.create(vllm_layers(), spec_query_len=8, max_num_reqs=8)
    with pytest.raises(KdaInputError, match="`kv_cache` = "):
        KDARecoverSSMCommitContext.create([SimpleNamespace(kv_cache=(1,))], spec_query_len=Q,
                                          max_num_reqs=8)  # fmt: skip
    ctx = KDARecoverSSMCommitContext.create(vllm_layers(), spec_query_len=Q, max_num_reqs=2,
                                            conv_state_dim_first=False)  # fmt: skip
    assert ctx.pools.records_by_slot and ctx.pools.conv_states
    three = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(KdaInputError, match=r"3 requests exceed `max_num_reqs` \(2\)"):
        ctx.commit(three, three, torch.arange(4, dtype=torch.int32))
    with pytest.raises(KdaInputError, match="`request_indices` must be 1-D with at least 2"):
        ctx.commit(three, three[:2], three, request_indices=three[:1])


def test_commit_context_takes_vllms_index_tensors_as_they_come(monkeypatch) -> None:
    """int64 and strided index tensors (vLLM's buffers) reach the kernel as int32 contiguous
    copies in buffers the context keeps (slots keep their dtype); a longer accepted buffer
    gives its first rows; a batch of none does nothing; vLLM's `backend=` is taken."""
    monkeypatch.setattr("kdagen.serve.model_commit.check_state",
                        lambda op, t, require_cuda=True: t)  # CPU tensors here  # fmt: skip
    seen: list[dict] = []
    monkeypatch.setattr(ModelCommit, "commit", lambda self, slots, accepted, **step: seen.append(
        {"slots": slots, "accepted": accepted, **step}))  # fmt: skip
    ctx = KDARecoverSSMCommitContext.create(vllm_layers(), spec_query_len=Q, max_num_reqs=8,
                                            backend="cute", conv_state_dim_first=False)  # fmt: skip
    table = torch.tensor([[3, 1], [4, 2], [5, 9]])  # int64; column 0 is strided
    accepted = torch.tensor([2, 1, 4, 4, 4, 4, 4, 4])  # vLLM's persistent int64 buffer
    ctx.commit(accepted, table[:2, 0], torch.tensor([0, 4, 8]), block_table=table[:2],
               num_computed_tokens=torch.tensor([16, 32]), mamba_block_size=16)  # fmt: skip
    step = seen[-1]
    assert step["slots"].dtype == torch.int64 and step["slots"].is_contiguous()
    assert step["slots"].tolist() == [3, 4] and step["accepted"].tolist() == [2, 1]
    for name in ("accepted", "query_start", "block_table", "num_computed"):
        assert step[name].dtype == torch.int32 and step[name].is_contiguous(), name
    assert step["block_table"].tolist() == [[3, 1], [4, 2]] and step["block_size"] == 16
    first = step["accepted"].data_ptr()
    ctx.commit(accepted, table[:2, 0], torch.tensor([0, 4, 8]))
    assert seen[-1]["accepted"].data_ptr() == first  # the same buffer, nothing allocated
    int32 = torch.tensor([1, 2], dtype=torch.int32)
    ctx.commit(int32, int32, torch.tensor([0, 4, 8], dtype=torch.int32))
    assert seen[-1]["accepted"] is int32 and seen[-1]["slots"] is int32  # as they are
    calls = len(seen)
    ctx.commit(accepted, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert len(seen) == calls  # no requests: nothing launched, as vLLM returns early
    with pytest.raises(KdaInputError, match=r"`mamba_block_size` must cover one window \(>= 4\), "
                                            r"got 0"):  # fmt: skip
        ctx.commit(int32, int32, torch.tensor([0, 4, 8]), block_table=table[:2],
                   num_computed_tokens=int32, mamba_block_size=0)  # fmt: skip
    with pytest.raises(KdaInputError, match="`backend` must be 'triton', 'cute' or None"):
        KDARecoverSSMCommitContext.create(vllm_layers(), spec_query_len=Q, max_num_reqs=8,
                                          backend="tilelang")  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ls: delattr(ls[1], "gate_lower_bound"), r"missing \['gate_lower_bound'\]"),
        (lambda ls: delattr(ls[0], "A_log"), r"`layers\[0\]` must have `A_log`"),
        (lambda ls: setattr(ls[0], "gate_lower_bound", [-5.0]),
         r"`layers\[0\].gate_lower_bound` must be a Python float, got \[-5.0\]"),
        (lambda ls: setattr(ls[2], "gate_lower_bound", float("nan")),
         r"`layers\[2\].gate_lower_bound` must be finite"),
        (lambda ls: setattr(ls[0], "kv_cache", torch.zeros(4)), "each layer needs `kv_cache`"),
        (lambda ls: setattr(ls[1], "kv_cache", ls[1].kv_cache[:2] + (
            ls[1].kv_cache[2].double(), ls[1].kv_cache[3])),
         r"`layers\[1\].kv_cache\[2\]` must be float32, got float64"),
        (lambda ls: setattr(ls[2], "A_log", torch.zeros(H + 1)),
         r"`layers\[2\].A_log` must be float32 with \(2,\) elements"),
        (lambda ls: setattr(ls[0], "kv_cache", (torch.zeros(SLOTS, Q + 2, 8),) + ls[0].kv_cache[1:]),
         r"`layers\[0\].kv_cache\[0\]` must be bfloat16"),
    ],
)  # fmt: skip
def test_commit_context_names_the_layer_attribute(monkeypatch, change, message: str) -> None:
    """A layer without KDA's attributes, an unhashable or NaN bound, or a bad cache tensor
    gets a KdaInputError naming it as vLLM's layer holds it (no AttributeError/TypeError)."""
    monkeypatch.setattr("kdagen.serve.model_commit.check_state",
                        lambda op, t, require_cuda=True: t)  # CPU tensors here  # fmt: skip
    layers = vllm_layers()
    change(layers)
    with pytest.raises(KdaInputError, match=message):
        KDARecoverSSMCommitContext.create(layers, spec_query_len=Q, max_num_reqs=8,
                                          conv_state_dim_first=False)  # fmt: skip


def test_commit_context_names_missing_records_fields(monkeypatch) -> None:
    monkeypatch.setattr("kdagen.serve.model_commit.check_state",
                        lambda op, t, require_cuda=True: t)  # CPU tensors here  # fmt: skip
    layers = vllm_layers()
    for layer in layers:
        conv, state, corr, _ = layer.kv_cache
        layer.kv_cache, layer.recoverssm_records = (conv, state), SimpleNamespace(correction=corr)
    with pytest.raises(KdaInputError, match=r"missing \['recoverssm_records.key_gate'\]"):
        KDARecoverSSMCommitContext.create(layers, spec_query_len=Q, max_num_reqs=8)
    for layer in layers:
        layer.recoverssm_records.key_gate = torch.zeros(SLOTS, H, Q, 2 * K)
    with pytest.raises(KdaInputError,
                       match=r"`layers\[0\].recoverssm_records.key_gate` must be bfloat16"):  # fmt: skip
        KDARecoverSSMCommitContext.create(layers, spec_query_len=Q, max_num_reqs=8)
    with pytest.raises(KdaInputError, match="`layers` must hold at least one KDA layer, got T"):
        KDARecoverSSMCommitContext.create(torch.zeros(3), spec_query_len=Q, max_num_reqs=8)
    with pytest.raises(KdaInputError, match="`layers` must hold at least one KDA layer, got none"):
        KDARecoverSSMCommitContext.create(iter(()), spec_query_len=Q, max_num_reqs=8)
    # Any collection vLLM's create takes: the error past the layers' own check shows it got in.
    with pytest.raises(KdaInputError, match=r"`layers\[0\].recoverssm_records.key_gate` must"):
        KDARecoverSSMCommitContext.create(tuple(layers), spec_query_len=Q, max_num_reqs=8)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ({"state_indices": torch.tensor([1.0, 2.0])}, "`state_indices` must be int32 or int64"),
        ({"state_indices": torch.zeros(2, 1)}, r"`state_indices` must be a 1-D tensor, got \[2, 1\]"),
        ({"num_accepted_tokens": None}, "`num_accepted_tokens` must be a torch.Tensor"),
        ({"query_start_loc": torch.zeros(3)}, "`query_start_loc` must be int32"),
        ({"request_indices": torch.zeros(2)}, "`request_indices` must be int32, got float32"),
        ({"block_table": torch.zeros(2, 3, dtype=torch.int32)},
         "`block_table`, `num_computed_tokens` and `mamba_block_size` together"),
        ({"block_table": torch.zeros(2, 3, dtype=torch.int32),
          "num_computed_tokens": torch.zeros(2), "mamba_block_size": 16},
         "`num_computed_tokens` must be int32"),
        ({"block_table": torch.zeros(2, 3, dtype=torch.int32),
          "num_computed_tokens": torch.zeros(2, dtype=torch.int32), "mamba_block_size": 16.0},
         "`mamba_block_size` must be a Python int, got 16.0"),
    ],
)  # fmt: skip
def test_commit_context_step_errors_name_vllm_arguments(monkeypatch, step, message) -> None:
    monkeypatch.setattr("kdagen.serve.model_commit.check_state",
                        lambda op, t, require_cuda=True: t)  # CPU tensors here  # fmt: skip
    ctx = KDARecoverSSMCommitContext.create(vllm_layers(), spec_query_len=Q, max_num_reqs=4,
                                            conv_state_dim_first=False)  # fmt: skip
    two = torch.tensor([1, 2], dtype=torch.int32)
    args = {"num_accepted_tokens": two, "state_indices": two,
            "query_start_loc": torch.tensor([0, 4, 8], dtype=torch.int32)} | step  # fmt: skip
    with pytest.raises(KdaInputError, match=message):
        ctx.commit(**args)


def _states(count: int = LAYERS) -> list[torch.Tensor]:
    return [torch.zeros(SLOTS, H, K, K, dtype=torch.bfloat16) for _ in range(count)]


def _shifted_states() -> list[torch.Tensor]:
    """Two layers' states one slot apart in one pool: slots 1.. of the first are slots ..-1
    of the second."""
    pool = torch.zeros(SLOTS + 1, H * K * K, dtype=torch.bfloat16)
    return [pool[:SLOTS].view(SLOTS, H, K, K), pool[1:].view(SLOTS, H, K, K)]


def _convs(count: int = LAYERS) -> list[torch.Tensor]:
    return [torch.zeros(SLOTS, Q + 2, 3 * H * K, dtype=torch.bfloat16) for _ in range(count)]


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (
            {"records_by_slot": True, "corrs": [torch.zeros(2, H, Q, K) for _ in range(LAYERS)],
             "kgs": [torch.zeros(2, H, Q, 2 * K, dtype=torch.bfloat16) for _ in range(LAYERS)]},
            r"with `records_by_slot`, `corrs` and `kgs` must have a row per state slot .*"
            r"rows >= 6, got 2",
        ),
        (
            {"states": _states(2) + [torch.zeros(SLOTS, H, K, K, dtype=torch.bfloat16,
                                                 device="meta")]},
            r"`states\[2\]` must match `states\[0\]` in shape, strides, dtype and device .* meta",
        ),
        ({"states": [_states(1)[0]] * LAYERS}, r"`states\[1\]` must not overlap `states\[0\]`"),
        ({"states": _states(1) + _shifted_states()}, r"`states\[2\]` must not overlap `states\[1\]`"),
        ({"conv_states": [_convs(1)[0]] * LAYERS},
         r"`conv_states\[1\]` must not overlap `conv_states\[0\]`"),
        (
            {"conv_states": [torch.zeros(1, Q + 2, 3 * H * K, dtype=torch.bfloat16)
                             .expand(SLOTS, Q + 2, 3 * H * K) for _ in range(LAYERS)]},
            r"`conv_states\[0\]` must not overlap itself .* strides \[0, 768, 1\]",
        ),
    ],
)  # fmt: skip
def test_pools_that_would_commit_wrong_rows_are_refused(changes: dict, pattern: str) -> None:
    """Records by slot with fewer rows than slots (the kernel would skip those slots), layers
    on other devices, and state or conv-state memory shared by two layers or by two slots of
    one layer (writes that race) are refused, naming the tensor."""
    with pytest.raises(KdaInputError, match=pattern):
        model(**changes)


def test_layers_interleaved_in_one_pool_do_not_overlap() -> None:
    """Per-layer views of one [slots, layers, H*V*K] pool (a padded slot stride) share no
    element: accepted, every layer's offset tabled."""
    pool = torch.zeros(SLOTS, LAYERS, H * K * K, dtype=torch.bfloat16)
    m = model(states=[pool[:, layer].view(SLOTS, H, K, K) for layer in range(LAYERS)],
              records_by_slot=True, conv_states=_convs())  # fmt: skip
    assert m.layer_offsets[:, 0].tolist() == [layer * H * K * K for layer in range(LAYERS)]

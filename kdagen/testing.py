"""Input construction and write tracking for KDA verify / commit checks (CPU tests, GPU checks).

Outputs are poisoned with a NaN bit pattern no computation produces, so a check can tell, bit
for bit, which elements a kernel wrote: everything outside the contract's write set must still
hold the poison (or, for buffers with real data such as the state pool, its old bits).
"""

from __future__ import annotations

from dataclasses import fields
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from kdagen.reference import CONV_WIDTH, K, V, in_pool
from kdagen.serve.contract import CommitArgs, VerifyArgs
from kdagen.serve.runtime import check_path
from kdagen.serve.variant import Variant
from kdagen.tree import gather_path

__all__ = [
    "POISON_BITS",
    "bits",
    "clone_inputs",
    "commit_args",
    "commit_write_mask",
    "in_contract",
    "is_poisoned",
    "make_verify_inputs",
    "path_records",
    "poison_",
    "untouched_mask",
    "verify_args",
    "verify_write_masks",
    "with_rows_outside",
]

# Integer dtype of the same width, for bitwise views.
_BITS_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.int16: torch.int16,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
    torch.int8: torch.int8,
    torch.uint8: torch.uint8,
}

# Poisoned conv-state slots after the pool's in ``outside`` inputs (a slot past the pool is
# at most num_slots + 2).
GUARD_SLOTS = 4
# Quiet NaNs with a payload arithmetic never makes (floats), a recognisable sentinel (ints).
POISON_BITS: dict[torch.dtype, int] = {
    torch.bfloat16: 0x7FD5,
    torch.float16: 0x7ED5,
    torch.float32: 0x7FD5A5A5,
    torch.float64: 0x7FFDA5A5A5A5A5A5,
    torch.int16: -0x5A5B,
    torch.int32: -0x5A5A5A5B,
    torch.int64: -0x5A5A5A5A5A5A5A5B,
    torch.int8: -0x5B,
    torch.uint8: 0xA5,
}


def bits(t: Tensor) -> Tensor:
    """The raw bits of ``t`` as a same-width integer view (works on strided views)."""
    return t.view(_BITS_VIEW[t.dtype])


def poison_(t: Tensor) -> Tensor:
    """Fill ``t`` in place with the poison pattern of its dtype; returns ``t``."""
    bits(t).fill_(POISON_BITS[t.dtype])
    return t


def is_poisoned(t: Tensor) -> Tensor:
    """Elementwise: does ``t`` still hold the poison pattern?"""
    return bits(t) == POISON_BITS[t.dtype]


def untouched_mask(before: Tensor, after: Tensor) -> Tensor:
    """Elementwise bit equality (NaN-safe, unlike ``==``): True where nothing changed."""
    if before.shape != after.shape or before.dtype != after.dtype:
        raise ValueError(
            f"untouched_mask: {tuple(before.shape)} {before.dtype} vs "
            f"{tuple(after.shape)} {after.dtype}"
        )
    return bits(before) == bits(after)


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def _window_lengths(
    batch: int, window: int, ragged: bool, null: list[bool], gen: torch.Generator
) -> list[int]:
    """Per-request qlen: full windows, or random 1..Q plus forced corner cases when ragged.

    Ragged batches get (where B allows) a qlen 0, a 0 < qlen < Q and a full window among the live
    requests, and every padding request a nonzero qlen so its zero-writes are exercised.
    """
    if not ragged:
        return [window] * batch
    qlen = torch.randint(1, window + 1, (batch,), generator=gen).tolist()
    live = [b for b in range(batch) if not null[b]]
    order = [live[i] for i in torch.randperm(len(live), generator=gen).tolist()]
    corners = [0, int(torch.randint(1, window, (1,), generator=gen)) if window > 1 else 1, window]
    for b, length in zip(order, corners, strict=False):
        qlen[b] = length
    return qlen


def _padding_requests(batch: int, nulls: bool, gen: torch.Generator) -> list[bool]:
    """Which requests sit on the null slot: one in five (at least one), at random positions."""
    if not nulls or batch < 2:
        return [False] * batch
    count = max(1, round(batch / 5))
    chosen = set(torch.randperm(batch, generator=gen)[:count].tolist())
    return [b in chosen for b in range(batch)]


def make_verify_inputs(
    B: int,
    H: int,
    Q: int,
    *,
    conv: bool = False,
    conv_dim_first: bool = False,
    conv_w_dtype: torch.dtype = torch.bfloat16,
    null_slot: int = 0,
    slot_dtype: torch.dtype = torch.int32,
    pad: int = 512,
    seed: int = 0,
    device: str | torch.device = "cpu",
    ragged: bool = True,
    nulls: bool = True,
    extra_slots: int = 3,
    extra_rows: int = 1,
    outside: bool = False,
    state_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype = torch.bfloat16,
    corr_dtype: torch.dtype = torch.float32,
    lower_bound: float | None = -5.0,
    tree: bool = False,
) -> dict[str, Any]:
    """Random, realistic inputs for one verify launch (then commit), outputs poisoned.

    Keys: ``qkv, raw_g, raw_beta, a_log, dt_bias, state, state_pool, query_start, slots, out,
    corr, kg, conv_state, conv_w, accepted`` (the last three None without ``conv``) and the
    scalars ``lower_bound, null_slot, conv_dim_first, qlen`` (a list).

    - ``state`` is the ``[slots, H, V, K]`` view of ``state_pool`` ``[slots, H*V*K + pad]`` (a
      vLLM cache page with a padded slot stride); the padding is poisoned so stray writes show.
    - Slots are a random permutation of the real slots (> null_slot), unique per request;
      padding requests use ``null_slot``. With ``ragged`` some windows are empty or short.
    - Data are never zero: projections ~N(0,1), raw_g ~N(0,1), a_log ~U(-1,1),
      dt_bias ~N(0,0.5), state ~N(0,0.1), taps ~N(0,0.5); ``accepted`` ~U{1..Q}.
    - ``out``, ``corr`` and ``kg`` (``B + extra_rows`` rows) are poisoned.
    - With ``outside`` the first request's slot lies past the pool and the last one's is -3
      (above a null slot below it): both pad. With conv, ``conv_guard`` then holds poisoned
      slots right after the conv state's, where a kernel that took the first slot would write.
    - With ``tree`` each window is a random token tree: ``parents`` [T] int32 holds -1 at a
      window's first token and a random earlier position elsewhere (else ``parents`` is None).
    """
    gen = _generator(seed)
    null = _padding_requests(B, nulls, gen)
    qlen = _window_lengths(B, Q, ragged, null, gen)
    tokens = sum(qlen)
    first_real = null_slot + 1 if null_slot >= 0 else 0
    num_slots = first_real + B + extra_slots
    real = (torch.randperm(num_slots - first_real, generator=gen)[:B] + first_real).tolist()
    slots = [null_slot if null[b] else real[b] for b in range(B)]
    if outside and B >= 2:
        slots[0], slots[-1] = num_slots + 2, -3

    # Bulk data are drawn where they will live: on a GPU that is ~100x faster than fp64 on
    # the host (a H = 96 pool is ~10^8 values), and seeded, so a case still reproduces.
    on_host = torch.device(device).type == "cpu"
    data_gen = gen if on_host else torch.Generator(device=device).manual_seed(seed)
    wide = torch.float64 if on_host else torch.float32

    def randn(*shape: int, std: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        drawn = torch.randn(*shape, generator=data_gen, dtype=wide, device=device)
        return (drawn * std).to(dtype)

    per_slot = H * V * K
    pool = poison_(torch.empty(num_slots, per_slot + pad, dtype=state_dtype, device=device))
    pool[:, :per_slot] = randn(num_slots, per_slot, std=0.1, dtype=state_dtype)
    inputs: dict[str, Any] = {
        "qkv": randn(tokens, 3 * H * K),
        "raw_g": randn(tokens, H * K),
        "raw_beta": randn(tokens, H),
        "a_log": (torch.rand(H, generator=gen, dtype=torch.float64) * 2 - 1).float(),
        "dt_bias": randn(H * K, std=0.5, dtype=torch.float32),
        "state_pool": pool,
        "query_start": torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32),
        "slots": torch.tensor(slots, dtype=slot_dtype),
        "out": poison_(torch.empty(tokens, H * V, dtype=out_dtype, device=device)),
        "corr": poison_(torch.empty(B + extra_rows, H, Q, V, dtype=corr_dtype, device=device)),
        "kg": poison_(
            torch.empty(B + extra_rows, H, Q, 2 * K, dtype=torch.bfloat16, device=device)
        ),
        "conv_state": None,
        "conv_w": None,
        "accepted": None,
        "lower_bound": lower_bound,
        "null_slot": null_slot,
        "conv_dim_first": conv_dim_first,
        "qlen": qlen,
        "parents": random_parents(qlen, gen) if tree else None,
    }
    guard = GUARD_SLOTS if outside else 0
    if conv:
        channels = 3 * H * K
        rows = randn(num_slots + guard, Q + 2, channels)
        inputs["conv_state"] = rows.transpose(1, 2).contiguous() if conv_dim_first else rows
        inputs["conv_w"] = randn(channels, CONV_WIDTH, std=0.5, dtype=conv_w_dtype)
        inputs["accepted"] = torch.randint(1, Q + 1, (B,), generator=gen, dtype=torch.int32)
    inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
    inputs["state"] = _state_view(inputs["state_pool"], H)
    if conv and guard:
        rows = inputs["conv_state"]
        inputs["conv_state"], inputs["conv_guard"] = rows[:num_slots], poison_(rows[num_slots:])
    return inputs


# Poisoned rows on each side of ``out`` in ``with_rows_outside``'s inputs: every row an uncut
# kernel would write there (windows from row -7, or from T + 4 and T + 9, of up to 16 tokens).
OUT_GUARD_ROWS = 32
# Accepted counts outside 1..Q that ``with_rows_outside`` gives its first requests, after 0 and
# Q + 1 (conv variants).
COUNTS_OUTSIDE = (1000, -3)


def with_rows_outside(inputs: dict[str, Any]) -> dict[str, Any]:
    """``make_verify_inputs``'s inputs (at least 6 requests, all on live slots, every window of
    Q tokens, so each bad count below is read) with index values
    a kernel must cut to its tensors (kdagen/dsl/bounds.py), each standing for the value inside
    the contract it is cut to (``in_contract``):

    - the last two requests' tokens are dropped (T shrinks), and they start past the last row,
      the last one ending before it starts;
    - the first window starts at row -7;
    - with conv, the first requests' accepted counts are 0, Q + 1 and ``COUNTS_OUTSIDE``;
    - ``out`` is the middle of a buffer with ``OUT_GUARD_ROWS`` poisoned rows on each side
      (``out_guard_before``, ``out_guard_after``: read-only inputs to a check, so a write past
      ``out`` fails it)."""
    starts = inputs["query_start"]
    batch = starts.numel() - 1
    if batch < 6 or min(inputs["qlen"]) < 1:
        raise ValueError(f"with_rows_outside needs at least 6 requests with tokens, got "
                         f"{inputs['qlen']}")  # fmt: skip
    rows = int(starts[batch - 2])
    bad = dict(inputs)
    for name in ("qkv", "raw_g", "raw_beta"):
        bad[name] = inputs[name][:rows].clone()
    if inputs["parents"] is not None:
        bad["parents"] = inputs["parents"][:rows].clone()
    bad["qlen"] = [*inputs["qlen"][: batch - 2], 0, 0]
    guarded = poison_(inputs["out"].new_empty(rows + 2 * OUT_GUARD_ROWS, inputs["out"].shape[1]))
    bad["out_guard_before"] = guarded[:OUT_GUARD_ROWS]
    bad["out"] = guarded[OUT_GUARD_ROWS : OUT_GUARD_ROWS + rows]
    bad["out_guard_after"] = guarded[OUT_GUARD_ROWS + rows :]
    outside = starts.clone()
    outside[0] = -7
    outside[batch - 2 :] = torch.tensor([rows + 4, rows + 9, rows + 6], dtype=starts.dtype)
    bad["query_start"] = outside
    if inputs["accepted"] is not None:
        window = inputs["corr"].shape[2]
        counts = (0, window + 1, *COUNTS_OUTSIDE)
        accepted = inputs["accepted"].clone()
        accepted[: len(counts)] = torch.tensor(counts, dtype=accepted.dtype)
        bad["accepted"] = accepted
    return bad


def in_contract(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with ``query_start`` and ``accepted`` replaced by the contract's values a
    verify kernel cuts them to (the rule of kdagen/dsl/bounds.py, on the host): each window to
    the token rows [0, T) and to Q tokens, each accepted count to 1..Q. Values inside the
    contract are kept; a window longer than Q has no contract value (its last rows are
    nobody's) and raises."""
    rows, window = inputs["raw_g"].shape[0], inputs["corr"].shape[2]
    starts = inputs["query_start"].tolist()
    cut = []
    for first, end in pairwise(starts):
        bos = min(max(first, 0), rows)
        cut.append((bos, min(max(end, bos), rows, bos + window)))
    if any(end != bos for (_, end), (bos, _) in pairwise(cut)):
        raise ValueError(f"the cut windows {cut} are not one query_start (a request's end is not "
                         "the next one's start)")  # fmt: skip
    fixed = dict(inputs)
    device = inputs["query_start"].device
    fixed["query_start"] = torch.tensor([cut[0][0], *(end for _, end in cut)],
                                        dtype=inputs["query_start"].dtype, device=device)  # fmt: skip
    if inputs["accepted"] is not None:
        fixed["accepted"] = inputs["accepted"].clamp(1, window)
    return fixed


def random_parents(qlen: list[int], gen: torch.Generator, chain: bool = False) -> Tensor:
    """``parents [T]`` int32: per window -1 at its first token, then each token's parent a
    random earlier one (with ``chain`` the one before it)."""
    rows = [-1 if t == 0 else t - 1 if chain else int(torch.randint(0, t, (1,), generator=gen))
            for n in qlen for t in range(n)]  # fmt: skip
    return torch.tensor(rows, dtype=torch.int32)


def lower_bound_for(gate: str) -> float | None:
    """The test inputs' ``lower_bound`` for a gate: Kimi-K3's -5 (``kda``), or None
    (Kimi-Linear's ``softplus``)."""
    return None if gate == "softplus" else -5.0


def verify_inputs_for(variant: Variant, batch: int, **options: Any) -> dict[str, Any]:
    """``make_verify_inputs`` for a verify variant's contract (H, Q, gate, conv layout and tap
    dtype, slot dtype); ``options`` go through (seed, device, ragged, nulls, ...)."""
    options.setdefault("lower_bound", lower_bound_for(variant.gate))
    options.setdefault("tree", variant.tree)
    return make_verify_inputs(
        batch, variant.heads, variant.window, conv=variant.conv,
        conv_dim_first=variant.conv_layout == "dim_first",
        conv_w_dtype=torch.float32 if variant.conv_weight_dtype == "fp32" else torch.bfloat16,
        slot_dtype=torch.int32 if variant.slot_dtype == "int32" else torch.int64, **options,
    )  # fmt: skip


def _state_view(pool: Tensor, heads: int) -> Tensor:
    return pool[:, : heads * V * K].view(pool.shape[0], heads, V, K)


def clone_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """Deep copy of a ``make_verify_inputs`` dict; ``state`` stays a view of the new pool."""
    copy = {k: v.clone() if isinstance(v, Tensor) else v for k, v in inputs.items()}
    copy["qlen"] = list(inputs["qlen"])
    copy["state"] = _state_view(copy["state_pool"], inputs["state"].shape[1])
    return copy


def verify_args(inputs: dict[str, Any]) -> VerifyArgs:
    """The ``VerifyArgs`` of ``make_verify_inputs``'s inputs (q, k, v: views of ``qkv``)."""
    names = [f.name for f in fields(VerifyArgs) if f.name not in ("q", "k", "v")]
    return VerifyArgs.from_qkv(inputs["qkv"], **{n: inputs[n] for n in names})


def commit_args(inputs: dict[str, Any], accepted: Tensor) -> CommitArgs:
    """The ``CommitArgs`` of a commit after a verify on ``inputs``."""
    names = [f.name for f in fields(CommitArgs) if f.name != "accepted"]
    return CommitArgs(**{n: inputs[n] for n in names}, accepted=accepted)


def _requests(inputs: dict[str, Any]) -> list[tuple[int, int, int, bool]]:
    """(bos, qlen, slot, live slot) per request, on the host."""
    starts = inputs["query_start"].tolist()
    slots = inputs["slots"].tolist()
    null, count = inputs["null_slot"], inputs["state"].shape[0]
    return [(starts[b], starts[b + 1] - starts[b], s, in_pool(s, null, count))
            for b, s in enumerate(slots)]  # fmt: skip


def verify_write_masks(inputs: dict[str, Any]) -> dict[str, Tensor]:
    """Boolean masks of the elements verify may write: ``out``, ``corr``, ``kg``, and
    ``conv_state`` (when present). Everything else (the state pool included) must keep its bits.
    """
    out = torch.zeros(inputs["out"].shape, dtype=torch.bool)
    corr = torch.zeros(inputs["corr"].shape, dtype=torch.bool)
    kg = torch.zeros(inputs["kg"].shape, dtype=torch.bool)
    conv_state = inputs.get("conv_state")
    conv = None if conv_state is None else torch.zeros(conv_state.shape, dtype=torch.bool)
    for b, (bos, qlen, slot, live) in enumerate(_requests(inputs)):
        out[bos : bos + qlen] = True
        if not live or qlen == 0:
            continue
        corr[b, :, :qlen] = True
        kg[b, :, :qlen] = True
        if conv is not None:
            if inputs["conv_dim_first"]:
                conv[slot, :, : 2 + qlen] = True
            else:
                conv[slot, : 2 + qlen] = True
    masks = {"out": out, "corr": corr, "kg": kg}
    if conv is not None:
        masks["conv_state"] = conv
    return {k: m.to(inputs["out"].device) for k, m in masks.items()}


def write_as_kernel(inputs: dict[str, Any], ref: dict[str, Any]) -> None:
    """What a kernel that computes exactly the reference leaves in ``inputs``: every element
    the contract lets verify write, the reference's value rounded to the buffer's dtype."""
    for name, mask in verify_write_masks(ref).items():
        inputs[name][mask] = ref[name][mask].to(inputs[name].dtype)


def commit_write_mask(inputs: dict[str, Any], accepted: Tensor) -> Tensor:
    """Boolean mask over ``state_pool`` of the elements commit may write (live, a > 0)."""
    pool = inputs["state_pool"]
    mask = torch.zeros(pool.shape, dtype=torch.bool)
    per_slot = inputs["state"][0].numel()
    for (_, _, slot, live), a in zip(_requests(inputs), accepted.tolist(), strict=True):
        if live and a > 0:
            mask[slot, :per_slot] = True
    return mask.to(pool.device)


def path_records(args: CommitArgs, path: torch.Tensor, op: str = "kdagen.commit") -> CommitArgs:
    """``args`` with records that hold each request's accepted tree path as a chain: request
    b's records at positions ``path[b, j]`` moved to positions j, in copies. The chain commit
    of these is what a commit with ``path`` computes (the reference's tree-path fold, and the
    kernels' in-place reads, are tested against it). Positions from ``accepted[b]`` on are
    unused."""
    batch, window = args.slots.shape[0], args.corr.shape[2]
    check_path(op, path, batch, window, args.state.device)
    at = path.long().clamp(0, window - 1)
    return args.with_(corr=gather_path(args.corr[:batch], at), kg=gather_path(args.kg[:batch], at))

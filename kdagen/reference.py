"""Reference KDA speculative verify and commit in plain torch (no Triton, any device).

Every generated kernel is checked against this module, so it follows the contract in
``shared/docs/kda-verify-semantics.md`` literally: the same rounding points where the contract
fixes them (the convolution, which feeds the bit-exact ``kg`` record), ``compute_dtype``
everywhere else, and writes to exactly the elements a kernel may write. Computation is
vectorised over requests and heads; the only Python loops run over the window (Q <= 8) and the
four convolution taps.

Layout reminders (K = V = 128): ``state[slot, h]`` is V x K (row v contiguous in K),
``qkv`` channel ``x*H*K + h*K + c`` for x in (q, k, v), request b owns tokens
``[query_start[b], query_start[b+1])`` and rows ``b`` of ``corr`` / ``kg``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kdagen.serve.contract import CommitArgs, VerifyArgs, check_commit, check_verify

K = 128  # head dim
V = K  # value dim
CONV_WIDTH = 4  # taps of the short convolution; the history holds CONV_WIDTH - 1 tokens
NORM_EPS = 1e-6  # added to the sum of squares before the square root
VERIFY_OP, COMMIT_OP = "kdagen.reference.verify", "kdagen.reference.commit"

__all__ = [
    "CONV_WIDTH",
    "K",
    "NORM_EPS",
    "V",
    "CommitPlan",
    "Requests",
    "commit",
    "commit_layers",
    "commit_plan",
    "conv_window_outputs",
    "fma_f32",
    "fold_accepted",
    "gate",
    "in_pool",
    "l2_normalise",
    "request_layout",
    "silu_f32",
    "solve_window",
    "verify",
]


# --------------------------------------------------------------------------- validation


def _fail(name: str, what: str, expected: object, actual: object) -> None:
    raise ValueError(f"{name}: expected {what} {expected}, got {actual}")


def _check_shape(name: str, t: Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        _fail(name, "shape", tuple(expected), tuple(t.shape))


def _check_dtype(name: str, t: Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        _fail(name, "dtype in", allowed, t.dtype)


_INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- pure helpers


def gate(
    raw_g: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Per-channel log decay of one token: ``lower_bound * sigmoid(exp(a_log[h]) * (g + bias))``
    (Kimi-K3's bounded gate), or with ``lower_bound`` None Kimi-Linear's unbounded
    ``-exp(a_log[h]) * softplus(g + bias)``, softplus linear above 20 as in vLLM.

    ``raw_g`` is ``[..., H, K]`` (token rows of the ``[T, H*K]`` tensor are ``raw_g.view(T, H, K)``);
    the result has the same shape, in ``dtype``, and is <= 0 (a negative ``lower_bound``).
    """
    heads = a_log.shape[0]
    if raw_g.shape[-2:] != (heads, K):
        _fail("raw_g", "trailing shape", (heads, K), tuple(raw_g.shape[-2:]))
    rate = torch.exp(a_log.to(dtype))[:, None]
    x = raw_g.to(dtype) + dt_bias.to(dtype).reshape(heads, K)
    if lower_bound is None:
        return -rate * torch.nn.functional.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(rate * x)


def l2_normalise(x: Tensor, dtype: torch.dtype = torch.float64, scale: float = 1.0) -> Tensor:
    """``scale * x / sqrt(sum(x^2) + 1e-6)`` over the last dim, in ``dtype``.

    The epsilon keeps an all-zero vector (a masked token) at zero instead of NaN.
    """
    x = x.to(dtype)
    return x * (torch.rsqrt((x * x).sum(-1, keepdim=True) + NORM_EPS) * scale)


def fma_f32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Correctly rounded fp32 ``a * b + c`` (broadcasting), as the GPU's ``fma.rn.f32``.

    The fp32 x fp32 product is exact in fp64 (48 <= 53 bits); the fp64 sum is not always, and
    rounding it to fp32 would double-round when it lands exactly on an fp32 midpoint. That case is
    repaired with the exact fp64 residual of the sum (TwoSum): the true value lies on the
    residual's side of the midpoint. So this is exact, not just nearly so.
    """
    prod = a.double() * b.double()
    addend = c.double()
    total = prod + addend
    back = total - prod
    residual = (prod - (total - back)) + (addend - back)  # total + residual == prod + addend
    nearest = total.float()  # ties to even
    nearest64 = nearest.double()
    toward = torch.where(total > nearest64, torch.inf, -torch.inf).float()
    neighbour = torch.nextafter(nearest, toward)  # the other fp32 bracketing ``total``
    midpoint = (total != nearest64) & ((nearest64 + neighbour.double()) * 0.5 == total)
    # At a midpoint with a nonzero residual, round toward the residual's side.
    beyond = (residual > 0) == (neighbour.double() > nearest64)
    fix = midpoint & (residual != 0) & beyond
    return torch.where(fix, neighbour, nearest)


def silu_f32(x: Tensor) -> Tensor:
    """SiLU in fp32 as the kernels write it: ``x / (1 + exp(-x))``."""
    x = x.float()
    return x / (1.0 + torch.exp(-x))


def conv_window_outputs(window: Tensor, conv_w: Tensor) -> Tensor:
    """Causal width-4 convolution + SiLU of a window, rounded like the stock kernel.

    ``window`` is ``[..., 3 + Q, C]`` bf16: three history tokens, then the Q raw tokens.
    ``conv_w`` is ``[C, 4]``; its dtype selects the arithmetic (the rounding points are part of
    the contract because the result lands bit-exact in ``kg``):

    - bf16 taps: each product (exact in fp32) is rounded to bf16, then summed in fp32 in tap
      order starting from 0;
    - fp32 taps: ``acc = fma(win, w, acc)`` in fp32, tap by tap.

    Returns ``y[..., t, c] = bf16(SiLU(acc))`` of shape ``[..., Q, C]``.
    """
    if window.dtype != torch.bfloat16:
        _fail("conv window", "dtype", torch.bfloat16, window.dtype)
    _check_dtype("conv_w", conv_w, (torch.bfloat16, torch.float32))
    steps = window.shape[-2] - (CONV_WIDTH - 1)
    win = window.float()
    taps = conv_w.float()
    acc = torch.zeros_like(win[..., :steps, :])
    for j in range(CONV_WIDTH):
        x = win[..., j : j + steps, :]
        if conv_w.dtype == torch.bfloat16:
            acc = acc + (x * taps[:, j]).to(torch.bfloat16).float()
        else:
            acc = fma_f32(x, taps[:, j], acc)
    return silu_f32(acc).to(torch.bfloat16)


def solve_window(
    s0: Tensor,
    k_n: Tensor,
    q_n: Tensor,
    v: Tensor,
    beta: Tensor,
    g_cum: Tensor,
    ancestors: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The delta-rule recurrence over one window, in closed form (one read of the state).

    Shapes (any leading dims ``...``): ``s0 [..., V, K]``, ``k_n, q_n, g_cum [..., Q, K]``,
    ``v [..., Q, V]``, ``beta [..., Q]``. Returns ``(u, o)``, both ``[..., Q, V]``, equal to::

        S <- S * exp(gate_t)[None, :];  u_t = beta_t (v_t - S k_t);  S <- S + u_t k_t^T;  o_t = S q_t

    via ``u_t = beta_t (v_t - S0 p_t - sum_{i<t} c_ti u_i)`` and ``o_t = S0 r_t + sum_{i<=t} d_ti
    u_i`` with ``p_t = e^{G_t} k_t``, ``r_t = e^{G_t} q_t``. The couplings are summed as
    ``sum_c k_i[c] x_t[c] exp(G_t[c] - G_i[c])`` so no ``exp(-G)`` factor can overflow. A token
    with ``beta = 0`` and ``k_n = 0`` is inert, which is how positions past ``qlen`` are masked.

    ``ancestors`` (a token tree, see ``kdagen.tree``): a bool ``[..., Q, Q]`` mask broadcasting
    against ``[..., Q, Q]`` with ``[t, i]`` true where i is an ancestor of t or t itself (parents
    before children); the sums then run over ancestors instead of all earlier positions and
    ``g_cum`` holds each node's log decay along its root path. None is the chain.
    """
    window = k_n.shape[-2]
    decay = torch.exp(g_cum)
    probes = torch.cat([decay * k_n, decay * q_n], dim=-2)  # [..., 2Q, K]
    proj = probes @ s0.transpose(-1, -2)  # row n: S0 @ probe_n, [..., 2Q, V]
    pos = torch.arange(window, device=k_n.device)
    causal = pos[:, None] >= pos[None, :]  # [t, i]: i <= t
    if ancestors is not None:
        causal = ancestors & causal  # ancestors precede their descendants
    strict = causal & (pos[:, None] != pos[None, :])
    rel = g_cum[..., :, None, :] - g_cum[..., None, :, :]  # [..., t, i, K]: G_t - G_i
    weighted = torch.exp(torch.where(causal[..., None], rel, 0.0)) * k_n[..., None, :, :]
    c = torch.einsum("...tik,...tk->...ti", weighted, k_n)
    d = torch.einsum("...tik,...tk->...ti", weighted, q_n)
    c = torch.where(strict, c, 0.0)
    d = torch.where(causal, d, 0.0)
    us: list[Tensor] = []
    for t in range(window):
        acc = v[..., t, :] - proj[..., t, :]
        if t:
            done = torch.stack(us, dim=-2)  # [..., t, V]
            acc = acc - (c[..., t : t + 1, :t] @ done).squeeze(-2)
        us.append(beta[..., t, None] * acc)
    u = torch.stack(us, dim=-2)
    o = proj[..., window:, :] + d @ u
    return u, o


def fold_accepted(s0: Tensor, k_n: Tensor, u: Tensor, g_cum: Tensor, count: Tensor) -> Tensor:
    """The state after the first ``count`` window tokens: the commit formula.

    ``s0 [..., V, K]``, ``k_n, g_cum [..., Q, K]``, ``u [..., Q, V]``, ``count [...]`` in 1..Q.
    ``S = S0 * exp(L)[None, :] + sum_{i<count} u_i (exp(L - G_i) k_i)^T`` with
    ``L = G_{count-1}``. Positions ``i >= count`` are selected away with ``torch.where`` (not
    multiplied by 0), so garbage or NaN there cannot leak in.
    """
    window = k_n.shape[-2]
    count = count.long()
    keep = (torch.arange(window, device=k_n.device) < count[..., None])[..., None]  # [..., Q, 1]
    index = (count - 1).clamp(min=0)[..., None, None].expand(*count.shape, 1, g_cum.shape[-1])
    last = torch.gather(torch.where(keep, g_cum, 0.0), -2, index)  # [..., 1, K]
    w = torch.where(keep, torch.exp(torch.where(keep, last - g_cum, 0.0)) * k_n, 0.0)
    u = torch.where(keep, u, 0.0)
    return s0 * torch.exp(last) + u.transpose(-1, -2) @ w


# --------------------------------------------------------------------------- request layout


@dataclass(frozen=True)
class Requests:
    """Where each request's window lives, as index tensors (all on the inputs' device).

    ``rows[b, t]`` is the token row of window position t, clamped into the request (positions
    past ``qlen`` repeat its last token, like the seed) and into the token tensor, so gathers
    never fault; ``tokens`` says which positions exist. ``slot`` is clamped to 0 for padding
    requests for the same reason; their gathered values are never written.
    """

    bos: Tensor  # [B] int64
    qlen: Tensor  # [B] int64
    valid: Tensor  # [B] bool: max(null_slot, -1) < slot < slot_count (any other slot pads)
    live: Tensor  # [B] bool: valid and qlen > 0
    tokens: Tensor  # [B, Q] bool: t < qlen
    rows: Tensor  # [B, Q] int64
    slot: Tensor  # [B] int64


def in_pool(slot: Tensor | int, null_slot: int, slot_count: int) -> Tensor | bool:
    """Whether ``slot`` (an int, or a tensor elementwise) is one of the pool's slots and not the
    null slot: every other slot, negative ones included, is a padding request's."""
    return (slot > max(null_slot, -1)) & (slot < slot_count)


def request_layout(
    query_start: Tensor,
    slots: Tensor,
    null_slot: int,
    window: int,
    num_tokens: int,
    slot_count: int,
) -> Requests:
    """Index tensors for B = ``slots.shape[0]`` requests of at most ``window`` tokens; a
    slot outside ``(max(null_slot, -1), slot_count)`` (the pool's slots, not the null slot) is
    a padding request's.

    Raises ValueError if a window is negative, longer than ``window`` or past ``num_tokens``.
    """
    batch = slots.shape[0]
    _check_dtype("query_start", query_start, _INDEX_DTYPES)
    _check_dtype("slots", slots, _INDEX_DTYPES)
    _check_shape("query_start", query_start, (batch + 1,))
    starts = query_start.long()
    bos, qlen = starts[:-1], starts[1:] - starts[:-1]
    if batch and (qlen.min() < 0 or qlen.max() > window):
        _fail("query_start", "window lengths in", f"[0, {window}]", qlen.tolist())
    if batch and qlen.max() > 0 and starts[1:][qlen > 0].max() > num_tokens:
        _fail("query_start", "token ends <=", num_tokens, starts.tolist())
    slot = slots.long()
    valid = in_pool(slot, null_slot, slot_count)
    pos = torch.arange(window, device=slots.device)
    tokens = pos[None, :] < qlen[:, None]
    rows = bos[:, None] + torch.minimum(pos[None, :], (qlen - 1).clamp(min=0)[:, None])
    rows = rows.clamp(0, max(num_tokens - 1, 0))
    return Requests(
        bos=bos,
        qlen=qlen,
        valid=valid,
        live=valid & (qlen > 0),
        tokens=tokens,
        rows=rows,
        slot=torch.where(valid, slot, 0),
    )


def check_live_slots(name: str, slot: Tensor, live: Tensor, num_slots: int, unique: bool) -> None:
    """Live requests' slots index the pool; with ``unique`` (slots written) no two share one."""
    used = slot[live]
    if used.numel() and (used.min() < 0 or used.max() >= num_slots):
        _fail(name, "live slots in", f"[0, {num_slots})", used.tolist())
    if unique and used.unique().numel() != used.numel():
        _fail(name, "distinct live slots (they are written), got", "", used.tolist())


# --------------------------------------------------------------------------- convolution


def _conv_rows(conv_state: Tensor, slot: Tensor, rows: Tensor, dim_first: bool) -> Tensor:
    """``conv_state`` rows ``rows [B, n]`` of ``slot [B]`` as ``[B, n, 3HK]``."""
    if dim_first:
        return conv_state[slot[:, None], :, rows]
    return conv_state[slot[:, None], rows]


def _convolve_and_roll(
    raw: Tensor,
    req: Requests,
    conv_state: Tensor,
    conv_w: Tensor,
    accepted: Tensor,
    dim_first: bool,
) -> Tensor:
    """Convolve the raw window ``[B, Q, 3HK]`` and roll the conv state of live requests.

    History rows are read for every request before any row is written.
    """
    window = raw.shape[1]
    first = torch.where(req.live, accepted.long() - 1, 0)
    if req.live.any() and (first[req.live].min() < 0 or first[req.live].max() >= window):
        _fail("accepted", "live values in", f"[1, {window}]", accepted[req.live].tolist())
    history = torch.arange(CONV_WIDTH - 1, device=raw.device)
    hist = _conv_rows(conv_state, req.slot, first[:, None] + history, dim_first)  # [B, 3, C]
    y = conv_window_outputs(torch.cat([hist, raw], dim=1), conv_w)
    roll_conv_state(conv_state, req, hist, raw, dim_first)
    return y


def roll_conv_state(
    conv_state: Tensor, req: Requests, hist: Tensor, raw: Tensor, dim_first: bool
) -> None:
    """Live requests' conv rows become ``hist[1], hist[2]`` (the last two history tokens),
    then the raw tokens ``t < qlen`` (``hist`` [B, 3, C], ``raw`` [B, Q, C])."""
    rolled = torch.cat([hist[:, 1:], raw], dim=1)  # [B, Q + 2, C]
    row = torch.arange(rolled.shape[1], device=raw.device)
    write = req.live[:, None] & (row[None, :] < 2 + req.qlen[:, None])
    b_idx, r_idx = torch.nonzero(write, as_tuple=True)
    values = rolled[b_idx, r_idx].to(conv_state.dtype)
    if dim_first:
        conv_state[req.slot[b_idx], :, r_idx] = values
    else:
        conv_state[req.slot[b_idx], r_idx] = values


# --------------------------------------------------------------------------- verify


def verify(args: VerifyArgs, *, compute_dtype: torch.dtype = torch.float64) -> None:
    """Writes in place, exactly the elements the contract allows and nothing else:
    out[T, H*V], corr[rows, H, Q, V], kg[rows, H, Q, 2K] (request b -> row b), and, with conv
    (conv_state is not None), rolls conv_state in place. heads H = a_log.shape[0],
    window Q = corr.shape[2], B = slots.shape[0]. state, out and corr may be given in any float
    dtype (bf16/fp32/fp64): values are computed in compute_dtype and cast on store, so fp64
    buffers keep unrounded results. kg is always bf16 and must be bit-exact (k post-conv as
    bf16, then raw_g). conv weight dtype (bf16 or fp32 taps) is taken from conv_w.dtype;
    conv_dim_first selects the [slots, 3HK, Q+2] conv-state layout, else token-major
    [slots, Q+2, 3HK]. The arguments pass the run-time's checks (``check_verify``). With
    ``args.parents`` the windows are token trees: ``kdagen.tree.verify_tree``."""
    if args.parents is not None:
        from kdagen.tree import verify_tree  # it builds on this module

        verify_tree(args.with_(parents=None), args.parents, compute_dtype=compute_dtype)
        return
    check_verify(args, op=VERIFY_OP, require_cuda=False, float_results=True)
    qkv, raw_g, a_log, state = args.qkv, args.raw_g, args.a_log, args.state
    conv_state = args.conv_state
    heads, window, batch = a_log.shape[0], args.corr.shape[2], args.slots.shape[0]
    req = request_layout(
        args.query_start, args.slots, args.null_slot, window, qkv.shape[0], state.shape[0]
    )
    if batch == 0 or not req.tokens.any():
        return
    here = req.tokens[:, :, None]  # [B, Q, 1]: masks token positions past qlen

    raw = torch.where(here, qkv[req.rows], 0.0)  # [B, Q, 3HK] bf16
    if conv_state is not None:
        check_live_slots("slots", req.slot, req.live, conv_state.shape[0], unique=True)
        mixed = _convolve_and_roll(
            raw, req, conv_state, args.conv_w, args.accepted, args.conv_dim_first
        )
        mixed = torch.where(here, mixed, 0.0)  # outputs past qlen exist only as zeros
    else:
        mixed = raw
    mixed = mixed.view(batch, window, 3, heads, K)
    k_raw = mixed[:, :, 1]  # [B, Q, H, K] bf16, what kg records
    g_raw = torch.where(here, raw_g[req.rows], 0.0).view(batch, window, heads, K)

    here4 = here[..., None]  # [B, Q, 1, 1]
    g_cum = torch.where(
        here4, gate(g_raw, a_log, args.dt_bias, args.lower_bound, compute_dtype), 0.0
    )
    g_cum = g_cum.cumsum(dim=1)
    k_n = l2_normalise(k_raw, compute_dtype)
    q_n = l2_normalise(mixed[:, :, 0], compute_dtype, scale=K**-0.5)
    v = mixed[:, :, 2].to(compute_dtype)
    beta = torch.where(here, torch.sigmoid(args.raw_beta[req.rows].to(compute_dtype)), 0.0)

    def heads_first(x: Tensor) -> Tensor:  # [B, Q, H, ...] -> [B, H, Q, ...]
        return x.transpose(1, 2)

    s0 = state[req.slot].to(compute_dtype)  # [B, H, V, K]
    u, o = solve_window(
        s0,
        heads_first(k_n),
        heads_first(q_n),
        heads_first(v),
        heads_first(beta),
        heads_first(g_cum),
    )
    _store_verify(req, u, o, k_raw, g_raw, args.out, args.corr, args.kg)


def _store_verify(
    req: Requests,
    u: Tensor,
    o: Tensor,
    k_raw: Tensor,
    g_raw: Tensor,
    out: Tensor,
    corr: Tensor,
    kg: Tensor,
) -> None:
    """Scatter the window results to the allowed elements only (cast on store)."""
    b_idx, t_idx = torch.nonzero(req.tokens, as_tuple=True)
    rows = o.transpose(1, 2)[b_idx, t_idx]  # [N, H, V]
    rows = torch.where(req.valid[b_idx, None, None], rows, 0.0)  # padding requests write zeros
    out[req.bos[b_idx] + t_idx] = rows.reshape(rows.shape[0], -1).to(out.dtype)
    b_idx, t_idx = torch.nonzero(req.tokens & req.live[:, None], as_tuple=True)
    corr[b_idx, :, t_idx] = u[b_idx, :, t_idx].to(corr.dtype)
    record = torch.cat([k_raw, g_raw.to(torch.bfloat16)], dim=-1)  # [B, Q, H, 2K]
    kg[b_idx, :, t_idx] = record[b_idx, t_idx]


# --------------------------------------------------------------------------- commit


@dataclass(frozen=True)
class CommitPlan:
    """What commit does for each request b (tensors [B] on the inputs' device).

    Fold ``count[b]`` tokens of records row ``record[b]`` into the state read from slot
    ``source[b]`` and store it to slot ``final[b]``, when ``live[b]``; with prefix caching,
    also store the state after ``boundary_count[b]`` tokens to slot ``boundary[b]`` when
    ``boundary_live[b]`` (first, so the final state wins should the two slots coincide).
    A slot outside ``(max(null_slot, -1), slot_count)`` is a padding request's.
    """

    source: Tensor  # int64
    record: Tensor  # int64
    count: Tensor  # int64, 0..Q
    final: Tensor  # int64
    boundary: Tensor  # int64
    boundary_count: Tensor  # int64
    live: Tensor  # bool
    boundary_live: Tensor  # bool


def commit_plan(
    slots: Tensor,
    accepted: Tensor,
    *,
    null_slot: int,
    slot_count: int,
    window: int,
    rows: int,
    records_by_slot: bool = False,
    query_start: Tensor | None = None,
    request_index: Tensor | None = None,
    block_table: Tensor | None = None,
    num_computed: Tensor | None = None,
    block_size: int = 0,
) -> CommitPlan:
    """The plan every commit kernel computes per request, from kdagen's arguments (``slots``,
    ``accepted`` [B]: records row b) or vLLM's commit context (records row = slot,
    ``accepted`` indexed by ``request_index[b]``, at most the window's length from
    ``query_start``, and with ``block_size > 0`` prefix caching: the final state goes to the
    block-table slot of the last committed token, the state at the first block boundary the
    window crosses to that block's slot). Indices outside their tensors make a padding
    request; nothing is read there."""
    batch, device = slots.shape[0], slots.device
    source = slots.long()
    record = source if records_by_slot else torch.arange(batch, device=device)
    source_ok = in_pool(source, null_slot, slot_count) & (record < rows)
    owner = torch.arange(batch, device=device) if request_index is None else request_index.long()
    owner_ok = (owner >= 0) & (owner < accepted.shape[0])
    owner = torch.where(owner_ok, owner, 0)
    count = torch.where(owner_ok, accepted.long()[owner].clamp(0, window), 0)
    if query_start is not None:
        count = torch.minimum(count, query_start[1:].long() - query_start[:-1].long())
    final, boundary = source, torch.full_like(source, null_slot)
    boundary_count = torch.zeros_like(count)
    if block_size > 0:
        assert block_table is not None and num_computed is not None
        width = block_table.shape[1]
        done = num_computed.long()[owner]
        last_block = ((done + count - 1) // block_size).clamp(max=width - 1)  # the last token's
        table = block_table.long()[owner]  # [B, width]
        final = torch.where(
            last_block >= 0, table.gather(1, last_block.clamp(min=0)[:, None])[:, 0], null_slot
        )
        block = done // block_size
        crosses = (done + count >= (block + 1) * block_size) & (block >= 0) & (block < width)
        at_block = table.gather(1, block.clamp(0, width - 1)[:, None])[:, 0]
        boundary = torch.where(crosses, at_block, null_slot)
        boundary_count = torch.where(crosses, (block + 1) * block_size - done, 0)
    live = source_ok & (count > 0) & (final > null_slot) & (final < slot_count)
    boundary_live = live & (boundary > null_slot) & (boundary < slot_count)
    return CommitPlan(source, record, count, final, boundary, boundary_count, live, boundary_live)


def _fold_layer(
    state: Tensor,
    corr: Tensor,
    kg: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    source: Tensor,
    record: Tensor,
    count: Tensor,
    lower_bound: float | None,
    compute_dtype: torch.dtype,
) -> Tensor:
    """The states of ``source`` [N] slots after folding ``count`` [N] tokens of their
    records rows ``record`` [N]: [N, H, V, K] in ``compute_dtype``. Rows i >= count are
    selected away (never multiplied), so whatever they hold cannot leak in."""
    heads, window = state.shape[1], corr.shape[2]
    keep = (torch.arange(window, device=kg.device) < count[:, None])[:, None, :, None]  # N,1,Q,1
    records = kg[record]  # [N, H, Q, 2K]
    k_raw = torch.where(keep, records[..., :K], 0.0)
    g_raw = torch.where(keep, records[..., K:], 0.0)
    g = gate(g_raw.transpose(1, 2), a_log, dt_bias, lower_bound, compute_dtype).transpose(1, 2)
    g_cum = torch.where(keep, g, 0.0).cumsum(dim=2)
    u = torch.where(keep, corr[record].to(compute_dtype), 0.0)
    s0 = state[source].to(compute_dtype)
    k_n = l2_normalise(k_raw, compute_dtype)
    return fold_accepted(s0, k_n, u, g_cum, count[:, None].expand(-1, heads))


def commit_layers(
    states: list[Tensor],
    corrs: list[Tensor],
    kgs: list[Tensor],
    a_log: Tensor,
    dt_bias: Tensor,
    plan: CommitPlan,
    *,
    lower_bound: float | None,
    conv_states: list[Tensor] | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> None:
    """Every layer's commit of ``plan``, in place: ``states[l]`` [slots, H, V, K],
    ``corrs[l]`` [rows, H, Q, V], ``kgs[l]`` [rows, H, Q, 2K], ``a_log`` [L, H],
    ``dt_bias`` [L, H*K]; with ``conv_states[l]`` ([slots, dim, Q + 2] views, any strides)
    vLLM's compaction: the 3 history rows from token count - 1 on move to rows 0..2 of the
    final slot (from the boundary on, of the boundary slot). Every read precedes every
    write, and boundary slots are written before final ones."""
    live, both = plan.live, plan.boundary_live
    history = torch.arange(CONV_WIDTH - 1, device=plan.count.device)
    for layer, (state, corr, kg) in enumerate(zip(states, corrs, kgs, strict=True)):
        args = (state, corr, kg, a_log[layer], dt_bias[layer])
        final = _fold_layer(*args, plan.source[live], plan.record[live], plan.count[live],
                            lower_bound, compute_dtype)  # fmt: skip
        crossing = _fold_layer(*args, plan.source[both], plan.record[both],
                               plan.boundary_count[both], lower_bound, compute_dtype)  # fmt: skip
        if conv_states is not None:
            conv = conv_states[layer]
            kept = conv[plan.source[live][:, None], :, plan.count[live][:, None] - 1 + history]
            crossed = conv[plan.source[both][:, None], :,
                           plan.boundary_count[both][:, None] - 1 + history]  # fmt: skip
            conv[plan.boundary[both][:, None], :, history] = crossed
            conv[plan.final[live][:, None], :, history] = kept
        state[plan.boundary[both]] = crossing.to(state.dtype)
        state[plan.final[live]] = final.to(state.dtype)


def commit(args: CommitArgs, *, compute_dtype: torch.dtype = torch.float64) -> None:
    """Folds the accepted prefix into state[slot, h] in place (cast to state.dtype): for
    requests whose slot lies in (null_slot, slots) with accepted[b] > 0 (clamped to Q). Other
    slots untouched. H = state.shape[1], Q = corr.shape[2]; request b reads records row b.
    state and corr may be any float dtype; otherwise the run-time's checks
    (``check_commit``)."""
    check_commit(args, op=COMMIT_OP, require_cuda=False, float_results=True)
    state, corr = args.state, args.corr
    plan = commit_plan(
        args.slots, args.accepted, null_slot=args.null_slot, slot_count=state.shape[0],
        window=corr.shape[2], rows=corr.shape[0],
    )  # fmt: skip
    check_live_slots("slots", plan.source, plan.live, state.shape[0], unique=True)
    commit_layers([state], [corr], [args.kg], args.a_log[None], args.dt_bias[None], plan,
                  lower_bound=args.lower_bound, compute_dtype=compute_dtype)  # fmt: skip

"""Reference tree verify and path commit (issue 31), fp64 by default, any device.

The contract is ``docs/tree-semantics.md``: a request's window is a token tree given by
``parents [T]`` (int32, aligned with the token rows like ``raw_g``: the parent's position
inside the same window, -1 only at position 0, parents before children). Verify gives every
node the output of the recurrence along its root path and records ``corr`` / ``kg`` per node;
commit folds an accepted root path ``path [B, Q]`` (its first ``accepted[b]`` entries) into
the state. A chain (``parents[t] = t - 1``) is ``kdagen.reference.verify`` / ``commit``.

Everything but the tree is the chain reference's own code: gate, normalisation, convolution
rounding, the closed-form solve (given the ancestor mask) and the fold (given the path's
records gathered into a chain). Windows up to ``MAX_TREE_WINDOW`` tokens.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kdagen.reference import (
    CONV_WIDTH,
    K,
    Requests,
    _store_verify,
    check_live_slots,
    commit_layers,
    commit_plan,
    conv_window_outputs,
    gate,
    l2_normalise,
    request_layout,
    roll_conv_state,
    solve_window,
)
from kdagen.serve.contract import CommitArgs, VerifyArgs, check_commit, check_verify, gate_of
from kdagen.serve.validate import KdaInputError, check_tensor

MAX_TREE_WINDOW = 16  # FlashInfer's window limit, issue 31
HISTORY = CONV_WIDTH - 1
VERIFY_TREE_OP, COMMIT_PATH_OP = "kdagen.tree.verify_tree", "kdagen.tree.commit_path"

__all__ = [
    "MAX_TREE_WINDOW",
    "ancestor_table",
    "commit_path",
    "commit_path_layers",
    "check_parents",
    "check_path",
    "check_tree_verify",
    "gather_path",
    "verify_tree",
]


# --------------------------------------------------------------------------- tree structure


def check_parents(op: str, name: str, parents: Tensor, qlen: Tensor, rows: Tensor) -> Tensor:
    """Each request's parents ``[B, Q]`` (gathered from ``parents`` by ``rows``), checked for
    its first ``qlen[b]`` positions: -1 at position 0 only, else an earlier position. Positions
    past ``qlen`` become roots (-1) so they are nobody's ancestor. Returns int64 ``[B, Q]``."""
    window = rows.shape[1]
    pos = torch.arange(window, device=rows.device)
    mine = parents.long()[rows] if parents.numel() else torch.full_like(rows, -1)
    here = pos[None, :] < qlen[:, None]
    ok = torch.where(pos == 0, mine == -1, (mine >= 0) & (mine < pos))
    if (first := _first_failure(here, ok)) is not None:
        b, t = first
        raise KdaInputError(
            f"{op}: `{name}` must hold -1 at a window's first token and an earlier position "
            f"(parents before children) elsewhere; request {b} position {t} has {int(mine[b, t])}"
        )
    return torch.where(here, mine, -1)


def _first_failure(used: Tensor, ok: Tensor) -> tuple[int, int] | None:
    """(request, position) of the first entry of ``[B, Q]`` that is used but not ok, or None:
    the one offending entry a check's message names (one host sync when every entry passes)."""
    bad = used & ~ok
    if not bad.any():
        return None
    b, t = (int(i) for i in torch.nonzero(bad)[0])
    return b, t


def ancestor_table(parents: Tensor) -> Tensor:
    """``[..., Q, Q]`` bool: ``[t, i]`` true where i is t or one of its ancestors.

    ``parents [..., Q]`` int64 with -1 at roots and ``parents[t] < t`` elsewhere, so one pass in
    position order sees each parent's row complete before its children's.
    """
    window = parents.shape[-1]
    eye = torch.eye(window, dtype=torch.bool, device=parents.device)
    rows = [eye[0].expand(*parents.shape[:-1], window)]
    for t in range(1, window):
        parent = parents[..., t]
        above = torch.stack(rows, dim=-2)  # [..., t, Q]
        index = parent.clamp(min=0)[..., None, None].expand(*parent.shape, 1, window)
        inherited = torch.gather(above, -2, index).squeeze(-2) & (parent >= 0)[..., None]
        rows.append(inherited | eye[t])
    return torch.stack(rows, dim=-2)


def _lag_rows(parents: Tensor) -> tuple[Tensor, Tensor]:
    """For each node and lag l in 0..3 (the conv taps, newest first): the l-th ancestor's
    position and the node's depth. ``parents [B, Q]``; returns ``[B, Q, 4]`` (-1 past the
    root) and ``[B, Q]``."""
    batch, window = parents.shape
    lags = [torch.arange(window, device=parents.device).expand(batch, window)]
    for _ in range(CONV_WIDTH - 1):
        prev = lags[-1]
        up = torch.gather(parents, 1, prev.clamp(min=0))
        lags.append(torch.where(prev >= 0, up, -1))
    lag = torch.stack(lags, dim=-1)
    depth = torch.zeros_like(parents)
    for t in range(1, window):  # parents precede children
        p = parents[:, t]
        depth[:, t] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, 0)
    return lag, depth


def _path_windows(raw: Tensor, hist: Tensor, parents: Tensor) -> Tensor:
    """Each node's convolution window ``[B, Q, 4, C]``: the last four of (history rows, the
    raw tokens of its root path), oldest first."""
    lag, depth = _lag_rows(parents)
    taps = []
    for j in range(CONV_WIDTH):  # tap j reads lag 3 - j
        l = CONV_WIDTH - 1 - j  # noqa: E741
        node = lag[..., l]  # [B, Q]
        from_path = torch.gather(raw, 1, node.clamp(min=0)[..., None].expand(-1, -1, raw.shape[-1]))
        h_row = (HISTORY + depth - l).clamp(0, HISTORY - 1)  # history index once past the root
        from_hist = torch.gather(hist, 1, h_row[..., None].expand(-1, -1, hist.shape[-1]))
        taps.append(torch.where((node >= 0)[..., None], from_path, from_hist))
    return torch.stack(taps, dim=2)


def check_path(op: str, path: Tensor, count: Tensor, live: Tensor, window: int) -> Tensor:
    """``path [B, Q]`` int32: for live requests the first ``count[b]`` entries start at the
    root (0) and increase (a root path visits parents before children). Returns int64."""
    check_tensor(op, "path", path, dims=[count.shape[0], window], dtypes=[torch.int32],
                 device=path.device)  # fmt: skip
    steps = path.long()
    pos = torch.arange(window, device=path.device)
    used = live[:, None] & (pos[None, :] < count[:, None])
    prev = torch.cat([torch.full_like(steps[:, :1], -1), steps[:, :-1]], dim=1)
    ok = torch.where(pos == 0, steps == 0, (steps > prev) & (steps < window))
    if (first := _first_failure(used, ok)) is not None:
        b, j = first
        raise KdaInputError(
            f"{op}: `path` must start at the root (0) and list increasing positions below "
            f"{window} (root first); request {b} entry {j} is {int(steps[b, j])}"
        )
    return torch.where(used, steps, 0)


# --------------------------------------------------------------------------- checks


def _check_records(op: str, corr: object, kg: object) -> tuple[int, Tensor, Tensor]:
    """corr ``[rows, H, Q, 128]`` (any float) and kg ``[rows, H, Q, 256]`` bf16 with Q in
    1..16; returns Q and window-1 stand-ins for the run-time's checks (whose window is 1..8)."""
    if not (isinstance(corr, Tensor) and corr.dim() == 4):
        shape = list(corr.shape) if isinstance(corr, Tensor) else type(corr).__name__
        raise KdaInputError(f"{op}: `corr` must have shape [rows, H, Q, 128], got {shape}")
    rows, heads, window = corr.shape[:3]
    if not 1 <= window <= MAX_TREE_WINDOW:
        raise KdaInputError(f"{op}: `corr` window Q must be 1..{MAX_TREE_WINDOW}, got {window}")
    device = corr.device
    check_tensor(op, "corr", corr, dims=[rows, heads, window, 128],
                 dtypes=[torch.bfloat16, torch.float32, torch.float64], device=device)  # fmt: skip
    check_tensor(op, "kg", kg, dims=[rows, heads, window, 2 * K], dtypes=[torch.bfloat16],
                 device=device)  # fmt: skip
    return (
        window,
        torch.zeros(rows, heads, 1, 128, dtype=corr.dtype, device=device),
        torch.zeros(rows, heads, 1, 2 * K, dtype=torch.bfloat16, device=device),
    )


def check_tree_verify(args: VerifyArgs, parents: Tensor, op: str = VERIFY_TREE_OP) -> None:
    """The run-time's verify checks with the window lifted to 16: the records, conv state and
    gate at the real window here, the rest by ``check_verify`` on window-1 stand-ins (shared
    with the tree emulation, whose ``op`` the messages name)."""
    window, corr, kg = _check_records(op, args.corr, args.kg)
    stand_in = args.with_(corr=corr, kg=kg, lower_bound=None, parents=None,
                          conv_state=_conv_stand_in(args, window))  # fmt: skip
    check_verify(stand_in, op=op, require_cuda=False, float_results=True)
    gate_of(op, args.lower_bound)  # fp64 needs no window bound; the docs say what kernels need
    device = args.corr.device
    if args.conv_state is not None:
        check_tensor(op, "conv_state", args.conv_state,
                     dims=[args.state.shape[0], *_conv_rows_shape(args, window)],
                     dtypes=[torch.bfloat16], device=device)  # fmt: skip
    check_tensor(op, "parents", parents, dims=[args.q.shape[0]], dtypes=[torch.int32],
                 device=device)  # fmt: skip


def _conv_rows_shape(args: VerifyArgs, window: int) -> list[int]:
    channels = 3 * args.state.shape[1] * K
    return [channels, window + 2] if args.conv_dim_first else [window + 2, channels]


def _conv_stand_in(args: VerifyArgs, window: int) -> Tensor | None:
    """A window-1 conv state for ``check_verify`` (the real one is checked at its window)."""
    if args.conv_state is None:
        return None
    shape = [args.state.shape[0], *_conv_rows_shape(args, 1)]
    return torch.zeros(shape, dtype=torch.bfloat16, device=args.conv_state.device)


# --------------------------------------------------------------------------- verify


def verify_tree(
    args: VerifyArgs, parents: Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> None:
    """``kdagen.reference.verify`` on token trees: writes ``out``, ``corr`` and ``kg`` per
    node (the same elements as for a chain) and, with conv, rolls the conv state exactly as
    the chain does (rows 0, 1 = history rows 1, 2; row 2 + t = raw token t), reading the
    history at ``accepted[b] - 1`` (1 after a tree commit, which compacts it to rows 0..2).
    ``parents [T]`` int32: see the module docstring."""
    check_tree_verify(args, parents)
    qkv, state, conv_state = args.qkv, args.state, args.conv_state
    heads, window, batch = args.a_log.shape[0], args.corr.shape[2], args.slots.shape[0]
    req = request_layout(
        args.query_start, args.slots, args.null_slot, window, qkv.shape[0], state.shape[0]
    )
    if batch == 0 or not req.tokens.any():
        return
    tree = check_parents(VERIFY_TREE_OP, "parents", parents, req.qlen, req.rows)
    here = req.tokens[:, :, None]

    raw = torch.where(here, qkv[req.rows], 0.0)
    mixed = raw
    if conv_state is not None:
        check_live_slots("slots", req.slot, req.live, conv_state.shape[0], unique=True)
        mixed = torch.where(here, _convolve_tree(raw, req, tree, args), 0.0)
    mixed = mixed.view(batch, window, 3, heads, K)
    k_raw = mixed[:, :, 1]
    g_raw = torch.where(here, args.raw_g[req.rows], 0.0).view(batch, window, heads, K)
    g = gate(g_raw, args.a_log, args.dt_bias, args.lower_bound, compute_dtype)
    g_path = _path_sums(torch.where(here[..., None], g, 0.0), tree)
    beta = torch.where(here, torch.sigmoid(args.raw_beta[req.rows].to(compute_dtype)), 0.0)

    def heads_first(x: Tensor) -> Tensor:
        return x.transpose(1, 2)

    u, o = solve_window(
        state[req.slot].to(compute_dtype),
        heads_first(l2_normalise(k_raw, compute_dtype)),
        heads_first(l2_normalise(mixed[:, :, 0], compute_dtype, scale=K**-0.5)),
        heads_first(mixed[:, :, 2].to(compute_dtype)),
        heads_first(beta),
        heads_first(g_path),
        ancestors=ancestor_table(tree)[:, None],
    )
    _store_verify(req, u, o, k_raw, g_raw, args.out, args.corr, args.kg)


def _path_sums(g: Tensor, parents: Tensor) -> Tensor:
    """Each node's log decay along its root path: its parent's plus its own gate.
    ``g [B, Q, ...]``, ``parents [B, Q]``."""
    sums = [g[:, 0]]
    for t in range(1, g.shape[1]):
        p = parents[:, t]
        above = torch.stack(sums, dim=1)[torch.arange(g.shape[0]), p.clamp(min=0)]
        mask = (p >= 0).view(-1, *([1] * (g.dim() - 2)))
        sums.append(g[:, t] + torch.where(mask, above, 0.0))
    return torch.stack(sums, dim=1)


def _convolve_tree(raw: Tensor, req: Requests, parents: Tensor, args: VerifyArgs) -> Tensor:
    """Each node's conv over its own path, then the chain's roll of the conv state."""
    conv_state, dim_first, window = args.conv_state, args.conv_dim_first, raw.shape[1]
    assert conv_state is not None and args.accepted is not None
    first = torch.where(req.live, args.accepted.long() - 1, 0)
    if req.live.any() and (first[req.live].min() < 0 or first[req.live].max() >= window):
        raise KdaInputError(
            f"{VERIFY_TREE_OP}: `accepted` must be in [1, {window}] for live requests, got "
            f"{args.accepted[req.live].tolist()}"
        )
    rows = first[:, None] + torch.arange(HISTORY, device=raw.device)
    hist = (
        conv_state[req.slot[:, None], :, rows] if dim_first else conv_state[req.slot[:, None], rows]
    )
    y = conv_window_outputs(_path_windows(raw, hist, parents).flatten(0, 1), args.conv_w)
    roll_conv_state(conv_state, req, hist, raw, dim_first)  # the chain's roll, by position
    return y.view(*raw.shape[:2], -1)


# --------------------------------------------------------------------------- commit


def gather_path(records: Tensor, path: Tensor) -> Tensor:
    """``records [B, H, Q, X]`` rows at ``path [B, Q]`` positions: the accepted path as a
    chain (entries past its length are gathered too; the fold selects them away)."""
    index = path[:, None, :, None].expand(-1, records.shape[1], -1, records.shape[-1])
    return torch.gather(records, 2, index)


def commit_path_layers(
    states: list[Tensor],
    corrs: list[Tensor],
    kgs: list[Tensor],
    a_log: Tensor,
    dt_bias: Tensor,
    slots: Tensor,
    path: Tensor,
    accepted: Tensor,
    *,
    lower_bound: float | None,
    null_slot: int,
    conv_states: list[Tensor] | None = None,
    conv_dim_first: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> None:
    """Every layer's commit of the accepted root paths, in place: request b (records row b,
    state slot ``slots[b]``) folds the nodes ``path[b, :accepted[b]]``. ``a_log`` [L, H],
    ``dt_bias`` [L, H*K]. With ``conv_states``, rows 0..2 of the slot become the path's last
    three tokens (history rows 1, 2 then the path's raw tokens), so the next verify reads its
    history with ``accepted = 1``."""
    window, batch = corrs[0].shape[2], slots.shape[0]
    plan = commit_plan(slots, accepted, null_slot=null_slot, slot_count=states[0].shape[0],
                       window=window, rows=corrs[0].shape[0])  # fmt: skip
    check_live_slots("slots", plan.source, plan.live, states[0].shape[0], unique=True)
    steps = check_path(COMMIT_PATH_OP, path, plan.count, plan.live, window)
    rows = plan.record.clamp(max=corrs[0].shape[0] - 1)
    chain_corrs = [gather_path(c[rows], steps) for c in corrs]
    chain_kgs = [gather_path(g[rows], steps) for g in kgs]
    chain_plan = dataclasses.replace(plan, record=torch.arange(batch, device=slots.device))
    commit_layers(states, chain_corrs, chain_kgs, a_log, dt_bias, chain_plan,
                  lower_bound=lower_bound, compute_dtype=compute_dtype)  # fmt: skip
    for conv in conv_states or []:
        compact_history(conv, plan.source[plan.live], steps[plan.live], plan.count[plan.live],
                        conv_dim_first)  # fmt: skip


def compact_history(
    conv: Tensor, slot: Tensor, steps: Tensor, count: Tensor, dim_first: bool
) -> None:
    """Rows 0..2 of each slot <- the last three of (rows 0, 1, then rows 2 + path)."""
    sequence = torch.cat([torch.zeros_like(steps[:, :1]), torch.ones_like(steps[:, :1]),
                          steps + 2], dim=1)  # fmt: skip
    index = (count - 1)[:, None] + torch.arange(HISTORY, device=steps.device)
    rows = torch.gather(sequence, 1, index)  # [N, 3] conv rows, oldest first
    target = torch.arange(HISTORY, device=steps.device).expand_as(rows)
    if dim_first:
        kept = conv[slot[:, None], :, rows]
        conv[slot[:, None], :, target] = kept
    else:
        kept = conv[slot[:, None], rows]
        conv[slot[:, None], target] = kept


def commit_path(
    args: CommitArgs,
    path: Tensor,
    *,
    conv_state: Tensor | None = None,
    conv_dim_first: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> None:
    """``kdagen.reference.commit`` for a tree: folds ``path[b, :accepted[b]]`` (node positions,
    root first) of records row b into ``state[slots[b]]``; with ``conv_state`` also compacts
    the path's last three tokens into rows 0..2 (see ``commit_path_layers``)."""
    window, corr, kg = _check_records(COMMIT_PATH_OP, args.corr, args.kg)
    check_commit(args.with_(corr=corr, kg=kg), op=COMMIT_PATH_OP, require_cuda=False,
                 float_results=True)  # fmt: skip
    if conv_state is not None:
        channels = 3 * args.state.shape[1] * K
        rows = [channels, window + 2] if conv_dim_first else [window + 2, channels]
        check_tensor(COMMIT_PATH_OP, "conv_state", conv_state,
                     dims=[args.state.shape[0], *rows], dtypes=[torch.bfloat16],
                     device=args.state.device)  # fmt: skip
    commit_path_layers(
        [args.state], [args.corr], [args.kg], args.a_log[None], args.dt_bias[None], args.slots,
        path, args.accepted, lower_bound=args.lower_bound, null_slot=args.null_slot,
        conv_states=None if conv_state is None else [conv_state], conv_dim_first=conv_dim_first,
        compute_dtype=compute_dtype,
    )  # fmt: skip

"""The small-CTA Hopper verify's arithmetic (path ``sm90_mma``), emulated in torch.

The kernel regroups the closed form so that each output is one product with the state plus
one with the window's values (``T = (I + diag(beta) C)^-1 diag(beta)``; ``C``, ``D`` the
couplings; ``P``, ``R`` the decayed k and q rows):

    U = T V - (T P) S0^T          (corrections)
    O = (R - D T P) S0^T + (D T) V  (outputs)

with the couplings from k and q rebased by ``SHIFT = -Q lower_bound / 2`` in bf16 hi / lo
halves (three products each), every left operand split into hi / lo halves before its bf16
product with the state or the values, fp32 elsewhere. Like :mod:`kdagen.emulate` it is the
yardstick a GPU run is judged by (fp32-rounding agreement, not bitwise: the tensor cores'
order within an MMA, the GPU's exp). The bounded gate's chains and token trees (``parents``:
each node's G its parent's plus its own gate, the couplings kept on root paths) without the
conv, as the kernel."""

from __future__ import annotations

import torch
from torch import Tensor

from kdagen.emulate import (
    F32,
    _bf16_split,
    _f32,
    _gates,
    _log_decay,
    _store,
    _window_tokens,
    relative_errors,
)
from kdagen.emulate_tree import ancestor_bits, ancestor_matrix, tree_log_decay, window_parents
from kdagen.reference import request_layout
from kdagen.serve.contract import VerifyArgs, check_verify
from kdagen.tree import check_parents

__all__ = ["regrouped_outputs", "relative_errors", "verify_like_sm90_mma"]

OP = "kdagen.emulate_mma.verify_like_sm90_mma"


def _hi_lo_product(left: Tensor, right: Tensor) -> Tensor:
    """``left @ right`` with ``left`` in bf16 hi / lo halves and ``right`` exact in bf16 (the
    state, the values): two bf16 products accumulated in fp32."""
    hi, lo = _bf16_split(left)
    return hi.float() @ right + lo.float() @ right


def _couplings(
    near_k: Tensor, near_q: Tensor, far_k: Tensor, on_path: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``C`` (i < t) and ``D`` (i <= t) from the rebased operands, each product from three
    bf16 ones (hi hi, hi lo, lo hi) as the kernel's two coupling warps form them; ``on_path``
    (bool ``[..., Q, Q]``, i an ancestor of t or t itself) keeps a tree's root paths."""
    window = near_k.shape[-2]
    far_hi, far_lo = (h.float().transpose(-1, -2) for h in _bf16_split(far_k))

    def product(left: Tensor) -> Tensor:
        hi, lo = (h.float() for h in _bf16_split(left))
        return hi @ far_hi + hi @ far_lo + lo @ far_hi

    pos = torch.arange(window, device=near_k.device)
    below, keep_d = pos[:, None] > pos[None, :], pos[:, None] >= pos[None, :]
    if on_path is not None:
        below, keep_d = below & on_path, keep_d & on_path
    return torch.where(below, product(near_k), 0.0), torch.where(keep_d, product(near_q), 0.0)


def _solve(c: Tensor, beta: Tensor) -> Tensor:
    """``T = (I + diag(beta) C)^-1 diag(beta)`` by forward substitution, column by column as
    the kernel's lanes do, in fp32."""
    window = c.shape[-1]
    eye = torch.eye(window, dtype=F32, device=c.device).expand(c.shape).clone()
    rows: list[Tensor] = []
    for t in range(window):
        total = torch.zeros_like(eye[..., 0, :])
        for i in range(t):
            total = total + c[..., t, i, None] * rows[i]
        rows.append(eye[..., t, :] - beta[..., t, None] * total)
    return torch.stack(rows, dim=-2) * beta[..., None, :]


def regrouped_outputs(
    s0: Tensor, v: Tensor, beta: Tensor, p: Tensor, r: Tensor, c: Tensor, d: Tensor
) -> tuple[Tensor, Tensor]:
    """``(U, O)`` [..., Q, V] from the state ``s0`` [..., V, K] (bf16), the values ``v``
    [..., Q, V] (bf16 values), ``beta`` [..., Q], the state's operands ``p``, ``r``
    [..., Q, K] and the couplings ``c``, ``d`` [..., Q, Q], as the kernel groups them."""
    t = _solve(c, beta)
    dt = d @ t  # fp32 (the kernel's lanes sum i <= t in order; fp32 rounding apart)
    state = s0.float().transpose(-1, -2)
    values = v.float()
    u = _hi_lo_product(t, values) + _hi_lo_product(-(t @ p), state)
    o = _hi_lo_product(dt, values) + _hi_lo_product(r - dt @ p, state)
    return u, o


def verify_like_sm90_mma(args: VerifyArgs) -> None:
    """Same contract, checks and in-place writes as ``kdagen.reference.verify``, computed the
    way the ``sm90_mma`` kernel does (see the module docstring); the bounded gate's chains
    and trees (``args.parents``) without the conv. ``state`` must be bf16."""
    check_verify(args, op=OP, require_cuda=False, float_results=True)
    if args.lower_bound is None or args.conv_state is not None:
        raise ValueError(
            f"{OP}: the sm90_mma kernel computes the bounded gate's chains and trees without "
            "the conv (lower_bound set, conv_state None)"
        )
    state, slots, corr = args.state, args.slots, args.corr
    if state.dtype != torch.bfloat16:
        raise ValueError(f"state: expected bf16 (the kernel's pool dtype), got {state.dtype}")
    window, batch = corr.shape[2], slots.shape[0]
    req = request_layout(
        args.query_start, slots, args.null_slot, window, args.qkv.shape[0], state.shape[0]
    )
    if batch == 0 or not req.tokens.any():
        return
    tok = _window_tokens(args, req, args.qkv[req.rows])
    on_path = None
    if args.parents is None:
        logs, decay = _log_decay(tok.g_raw, args.a_log, args.dt_bias, args.lower_bound)
    else:
        tree = check_parents(OP, "parents", args.parents, req.qlen, req.rows)
        tree = window_parents(tree, req.tokens)
        gates = _gates(tok.g_raw, args.a_log, args.dt_bias, args.lower_bound, 0.0)
        logs = tree_log_decay(gates, tree)
        decay = torch.exp(logs)
        on_path = ancestor_matrix(ancestor_bits(tree))[:, None]  # [B, 1, Q, Q]
    shift = _f32(-0.5 * window, logs) * _f32(args.lower_bound, logs)
    near, far = torch.exp(logs + shift), torch.exp(-(logs + shift))
    c, d = _couplings(tok.k_n * near, tok.q_n * near, tok.k_n * far, on_path)
    u, o = regrouped_outputs(
        state[req.slot], tok.v, tok.beta, decay * tok.k_n, decay * tok.q_n, c, d
    )
    _store(req, u, o, tok.record, args.out, corr, args.kg)

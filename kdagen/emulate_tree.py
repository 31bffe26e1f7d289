"""Tree verify (issue 31) computed the way a tensor-core kernel would, on CPU.

``kdagen.tree.verify_tree`` states *what* tree verify computes (fp64); this module computes it
with the sm100 chain kernel's arithmetic (``kdagen.emulate``: fp32, bf16 hi/lo probes, warp
reduction trees, the seed's forward solve) and only what a kernel can add to it:

- an ancestor bitmask per node (``bits[t] = bits[parent(t)] | 1 << t``, 16 bits for Q <= 16),
  the parent's entry found by a select over earlier positions, never an indexed load;
- each node's log decay ``G_t = G_parent(t) + gate_t``, by the same select;
- the coupling matrices masked to ancestor pairs (``c``: strict ancestors, ``d``: ancestors or
  self) by a select, so the forward solve and the output sums are the chain's, with zeros;
- the coupling factors ``exp(M - G_i) k_i`` and ``exp(G_t - M) k_t`` taken relative to one
  per-channel reference ``M`` clamped into ``[max G - R, min G + R]`` (``R = REBASE_RANGE``),
  so every factor lies within ``exp(+-R)`` whatever the tree's shape; or (``banded``, the
  Hopper softplus kernels past Q = 8) relative to one of two constants by the token's band of
  log decay, each band's couplings a pass of their own (:func:`banded_couplings`).

A chain (``parents[t] = t - 1``) gives exactly ``emulate.verify_like_sm100``'s bits for Q <= 8:
the selects reproduce the cumulative sum, the masks the causal triangles, and the clamp leaves
the chain's reference (0 for the bounded gate, ``G_MID`` for softplus) where it is.
The fused convolution is not emulated in tree mode (refused).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdagen.dsl.bands import FAR_LOG_EDGE, FAR_REF, NEAR_REF
from kdagen.dsl.bands import GATE_FLOOR as BANDED_FLOOR
from kdagen.emulate import (
    BF16,
    _activations,
    _bf16_split,
    _channel_products,
    _couplings,
    _f32,
    _gates,
    _project,
    _solve,
    _store,
    _window_tokens,
    softplus_gate_floor,
)
from kdagen.reference import request_layout
from kdagen.serve.contract import VerifyArgs
from kdagen.serve.validate import KdaInputError
from kdagen.tree import check_parents, check_tree_verify

__all__ = [
    "REBASE_RANGE",
    "window_parents",
    "ancestor_bits",
    "ancestor_matrix",
    "banded_couplings",
    "banded_couplings_sm100",
    "rebase_reference",
    "shifted_reference",
    "tree_log_decay",
    "tree_softplus_floor",
    "verify_tree_like_sm100",
]

OP = "kdagen.emulate_tree.verify_tree_like_sm100"

# Every coupling factor stays within exp(+-R): exp(80) = 5.5e34 leaves fp32 headroom for the
# k products, and exp(-80) k (k >= 1e-2) is still a normal number. A window whose log decays
# span at most 2R per channel always has a valid reference: the softplus floor keeps the span
# <= 128 for any tree (each node's depth < Q), the bounded gate needs Q |lower_bound| <= 2R.
REBASE_RANGE = 80.0


def tree_softplus_floor(window: int) -> float:
    """The softplus gate's floor per token in tree mode: the chain kernels' for Q <= 8 (so a
    chain keeps their bits), else ``2R / Q``, the weakest floor that keeps any tree's log decays
    (a node's depth is < Q) within the ``2R`` span the rebase holds: 10 at Q = 16, where the
    chain's ``softplus_gate_floor`` (8) would drop weights up to exp(-8) = 3.4e-4."""
    if window <= 8:
        return softplus_gate_floor(window)
    return 2 * REBASE_RANGE / window


def window_parents(parents: Tensor, tokens: Tensor) -> Tensor:
    """``[B, Q]`` int64 parents with positions past ``qlen`` continuing a chain from the last
    node (``t - 1``): they are nobody's ancestor, and a ragged chain then cumulates its padding
    gates exactly as the chain kernel does (its softplus reference may be a padding token)."""
    pos = torch.arange(parents.shape[-1], device=parents.device)
    return torch.where(tokens, parents, pos - 1)


def _select_earlier(parent: Tensor, earlier: list[Tensor], fill: Tensor) -> Tensor:
    """``earlier[parent]`` (``fill`` for -1) as a kernel unrolls it: one select per earlier
    position. ``parent`` broadcasts against each entry (``[B]`` viewed to the entry's rank)."""
    picked = fill
    for s, value in enumerate(earlier):
        picked = torch.where(parent == s, value, picked)
    return picked


def ancestor_bits(parents: Tensor) -> Tensor:
    """``[B, Q]`` int32: bit i of entry t set where i is t or an ancestor of t."""
    batch, window = parents.shape
    zero = torch.zeros(batch, dtype=torch.int32, device=parents.device)
    rows: list[Tensor] = []
    for t in range(window):
        rows.append(_select_earlier(parents[:, t], rows, zero) | (1 << t))
    return torch.stack(rows, dim=1)


def ancestor_matrix(bits: Tensor) -> Tensor:
    """``[B, Q, Q]`` bool from :func:`ancestor_bits`: ``[t, i] = bit i of bits[t]``."""
    pos = torch.arange(bits.shape[-1], device=bits.device, dtype=torch.int32)
    return ((bits[..., :, None] >> pos) & 1).bool()


def tree_log_decay(gates: Tensor, parents: Tensor) -> Tensor:
    """``G_t = G_parent(t) + gate_t`` (fp32, ``gates [B, H, Q, K]``, ``parents [B, Q]``), the
    parent's G selected among earlier positions; a root adds its gate to 0, as the chain's
    cumulation starts."""
    zero = torch.zeros_like(gates[..., 0, :])
    logs: list[Tensor] = []
    for t in range(gates.shape[-2]):
        parent = parents[:, t].view(-1, 1, 1)
        logs.append(_select_earlier(parent, logs, zero) + gates[..., t, :])
    return torch.stack(logs, dim=-2)


def rebase_reference(logs: Tensor, lower_bound: float | None) -> Tensor:
    """The coupling factors' per-channel reference ``M [B, H, 1, K]``: the chain kernel's
    (0, or ``G`` of position MID for softplus) clamped into ``[max_t G - R, min_t G + R]``,
    which keeps ``exp(G_t - M)`` and ``exp(M - G_i)`` within ``exp(+-R)`` for every node."""
    window = logs.shape[-2]
    if lower_bound is None:
        ref = logs[..., (window - 1) // 2, None, :]
    else:
        ref = torch.zeros_like(logs[..., :1, :])
    rng = _f32(REBASE_RANGE, logs)
    low = logs.amax(dim=-2, keepdim=True) - rng
    high = logs.amin(dim=-2, keepdim=True) + rng
    return torch.minimum(torch.maximum(ref, low), high)


def shifted_reference(logs: Tensor, floor: float) -> Tensor:
    """The reference of the Hopper kernels that shift their couplings (``NEAR_SHIFT`` in their
    templates: softplus trees at Q <= 8, the bounded gate past Q = 8): the constant ``-Q floor /
    2`` (``floor``: the softplus floor, or ``|lower_bound|``). Every node's G lies in ``[-Q
    floor, 0]`` (its depth is at most Q), so each factor stays within ``exp(+-Q floor / 2)``, at
    most exp(64) within the contract's bounds."""
    return torch.full_like(logs[..., :1, :], -logs.shape[-2] * floor / 2)


def _hopper_operand(x: Tensor) -> Tensor:
    """``x`` as the coupling MMAs see it: bf16 hi + lo, each half flushed below the smallest
    normal bf16 (the tensor cores' inputs; the low halves of the smallest factors go first)."""
    tiny = torch.finfo(BF16).tiny
    halves = [torch.where(h.float().abs() < tiny, 0.0, h.float()) for h in _bf16_split(x)]
    return halves[0] + halves[1]


def banded_couplings(
    logs: Tensor, k_n: Tensor, q_n: Tensor, ancestors: Tensor
) -> tuple[Tensor, Tensor]:
    """The couplings ``c``, ``d`` as the Hopper softplus kernels past Q = 8 take them: per
    channel, a near token's probes relative to ``NEAR_REF`` and a far one's (G < FAR_LOG_EDGE)
    relative to ``FAR_REF``, zero in the other band; ``w_i`` in both bands (zero for a far token
    in the near band). An ancestor is never farther than its descendant, so each ancestor pair
    is whole in one band: both near, or the descendant far, where a near ancestor's far-band w
    is at most exp(-64) and flushes only where the true coupling is below exp(-23). The two
    bands' sums (bf16 hi / lo operands, as the MMAs read them) are added."""
    far = logs < _f32(FAR_LOG_EDGE, logs)
    c_total = d_total = None
    for band_far, ref in ((False, NEAR_REF), (True, FAR_REF)):
        rows = far if band_far else ~far
        near = torch.where(rows, torch.exp(logs - _f32(ref, logs)), 0.0)
        w = torch.exp(_f32(ref, logs) - logs)
        if not band_far:
            w = torch.where(far, 0.0, w)
        operands = [_hopper_operand(x) for x in (w * k_n, near * k_n, near * q_n)]
        c, d = _couplings(*operands, ancestors)
        c_total = c if c_total is None else c_total + c
        d_total = d if d_total is None else d_total + d
    return c_total, d_total


def banded_couplings_sm100(
    logs: Tensor, k_n: Tensor, q_n: Tensor, ancestors: Tensor
) -> tuple[Tensor, Tensor]:
    """The bands as the Blackwell kernel takes them (per-thread fp32 products, one pass): each
    token's factors relative to its own band; a far t's product with a near i is
    ``(w_i 2^-92)(p_t 2^-92)``, i's w moved into t's band (each factor scaled first: the plain
    product may pass fp32's range). A near t never has a far ancestor."""
    far = logs < _f32(FAR_LOG_EDGE, logs)
    ref = torch.where(far, _f32(FAR_REF, logs), _f32(NEAR_REF, logs))
    near = torch.exp(logs - ref)
    w = torch.exp(ref - logs) * k_n
    half = _f32(2.0**-92, logs)
    cross = far[..., :, None, :] & ~far[..., None, :, :]  # [..., t, i, K]: t far, i near

    def products(weights: Tensor, probe: Tensor) -> Tensor:
        plain = _channel_products(weights, probe)
        return torch.where(cross, _channel_products(weights * half, probe * half), plain)

    return _couplings(w, near * k_n, near * q_n, ancestors, products)


def verify_tree_like_sm100(
    args: VerifyArgs, parents: Tensor, *, softplus_floor: float | None = None,
    shifted: bool = False, banded: str | None = None,
) -> None:  # fmt: skip
    """``kdagen.tree.verify_tree``'s contract and in-place writes (no conv), computed like a
    tree kernel built on the sm100 chain kernel (see the module docstring); windows up to 16.
    ``softplus_floor`` overrides ``tree_softplus_floor(Q)`` (a study knob, not a contract);
    ``shifted``: the couplings relative to ``shifted_reference``, as both archs' kernels take
    them (softplus trees at Q <= 8; the bounded gate, chains too, past Q = 8); ``banded``
    (``"sm90"`` or ``"sm100"``): the softplus gate past Q = 8 as that arch's kernels take it
    (floor 16, two bands of couplings)."""
    check_tree_verify(args, parents, op=OP)
    if args.conv_state is not None:
        raise KdaInputError(f"{OP}: the fused convolution is not emulated in tree mode")
    state, lower_bound, window = args.state, args.lower_bound, args.corr.shape[2]
    if state.dtype != BF16:  # the tensor cores read the pool as it is
        raise KdaInputError(f"{OP}: `state` must be bf16 (the kernel's pool), got {state.dtype}")
    if shifted and lower_bound is not None and window <= 8:
        raise KdaInputError(f"{OP}: `shifted` with the bounded gate is the Hopper kernels' "
                            f"reference past Q = 8; got Q {window}")  # fmt: skip
    if banded and (lower_bound is not None or window <= 8):
        raise KdaInputError(f"{OP}: `banded` is the softplus gate's scheme past Q = 8; got "
                            f"lower_bound {lower_bound}, Q {window}")  # fmt: skip
    if lower_bound is not None and window * lower_bound < -2 * REBASE_RANGE:
        raise KdaInputError(
            f"{OP}: `lower_bound` x Q must be >= -{2 * REBASE_RANGE:g} (the log decays' span "
            f"the rebased couplings hold in fp32), got {lower_bound:g} x {window}"
        )
    batch = args.slots.shape[0]
    req = request_layout(
        args.query_start, args.slots, args.null_slot, window, args.qkv.shape[0], state.shape[0]
    )
    if batch == 0 or not req.tokens.any():
        return
    tree = window_parents(check_parents(OP, "parents", parents, req.qlen, req.rows), req.tokens)

    tok = _window_tokens(args, req, _activations(args.qkv, req, None, False))
    floor = tree_softplus_floor(window) if softplus_floor is None else softplus_floor
    if banded:
        floor = BANDED_FLOOR
    gates = _gates(tok.g_raw, args.a_log, args.dt_bias, lower_bound, floor)
    logs = tree_log_decay(gates, tree)
    decay = torch.exp(logs)
    proj = _project(state[req.slot], torch.cat([decay * tok.k_n, decay * tok.q_n], dim=-2))
    ancestors = ancestor_matrix(ancestor_bits(tree))[:, None]  # [B, 1, Q, Q]
    if banded:
        couple = banded_couplings if banded == "sm90" else banded_couplings_sm100
        c, d = couple(logs, tok.k_n, tok.q_n, ancestors)
        u, o = _solve(tok.v, tok.beta, proj, c, d)
        _store(req, u, o, tok.record, args.out, args.corr, args.kg)
        return
    if shifted:
        ref = shifted_reference(logs, floor if lower_bound is None else -lower_bound)
    else:
        ref = rebase_reference(logs, lower_bound)
    near = torch.exp(logs - ref)
    c, d = _couplings(torch.exp(ref - logs) * tok.k_n, near * tok.k_n, near * tok.q_n, ancestors)
    u, o = _solve(tok.v, tok.beta, proj, c, d)
    _store(req, u, o, tok.record, args.out, args.corr, args.kg)

"""The sm100 tensor-core verify kernel's arithmetic, emulated in torch (any device).

``kdagen.reference.verify`` states *what* verify computes (fp64 by default); this module computes
the same outputs *the way* ``shared/seed/kda_tc_verify_sm100.py`` does: fp32 throughout, the
closed form with one projection ``S0 @ [p | r]`` of bf16 hi/lo probe halves, the kernel's warp
reduction trees and its operation order in the forward solve. It is the yardstick for the first
Blackwell run: the GPU kernel should land within fp32 rounding of :func:`verify_like_sm100`, and
both should sit within :func:`expected_error` of the fp64 reference, measured by
:func:`relative_errors`. A GPU result much worse than that points at a kernel bug, not at the
algorithm (the tests measure the algorithm's own error here, on CPU).

Not bit-exact with the GPU, on purpose and unavoidably:

- the tensor cores accumulate each 16-deep MMA in their own order (and internal width); here each
  MMA is an fp32 matmul, accumulated MMA by MMA in the kernel's issue order;
- ``exp``/``rsqrt``/``sigmoid`` use torch's fp32 functions, not the GPU's approximate units;
- ptxas may contract a ``mul`` + ``add`` pair the seed writes separately into one fma.

So agreement with the GPU is to fp32 rounding, not bitwise. The bf16 ``kg`` record and the conv
state are exact on both sides (they only move or round bf16 data through the contract's fixed
rounding points).

Token trees (issue 31) are ``kdagen.emulate_tree``, built on this module's stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kdagen.reference import (
    CONV_WIDTH,
    NORM_EPS,
    K,
    Requests,
    check_live_slots,
    conv_window_outputs,
    fma_f32,
    request_layout,
    roll_conv_state,
)
from kdagen.serve.contract import VerifyArgs, check_verify

__all__ = [
    "EXPECTED_ERROR",
    "expected_error",
    "relative_errors",
    "verify_like_sm100",
]

WARP = 32  # lanes per warp; thread c owns channel c, so warp w sums channels 32w..32w+31
MMA_K = 16  # K depth of one bf16 UMMA; the kernel issues K / MMA_K steps x (hi, lo)
F32 = torch.float32
BF16 = torch.bfloat16

# Error of the sm100 algorithm against the fp64 reference (``relative_errors`` metrics, over the
# written elements), as tests/test_emulate.py measures it (12 cases x 5 seeds: ragged windows,
# null slots, conv layouts and tap dtypes, no-decay gates), with 2-4x margin. ``out`` is set by
# its bf16 store: half an ulp is 2^-8 relative at worst, 2^-9 at best. ``corr`` is fp32; its
# floor is the hi/lo split (hi + lo keeps x to ~2^-17), worst with no decay, where the state term
# S0 p is largest. bf16 probes alone (hi only) measure 3e-4 rel L2, 0.1 max.
EXPECTED_ERROR: dict[str, float] = {
    "out_rel_l2": 3e-3,  # the contract's bound; measured <= 2.0e-3
    "out_max_rel": 8e-3,  # measured <= 3.9e-3 (= 2^-8)
    "corr_rel_l2": 2e-6,  # measured <= 4.5e-7
    "corr_max_rel": 4e-4,  # measured <= 1.1e-4 (near-zero elements, 1% rms floor)
    "corr_max_rms": 1e-4,  # the GPU check's element-wise corr bound
}


def expected_error() -> dict[str, float]:
    """Bounds the tensor-core path should meet against the fp64 ``reference.verify``.

    Keys ``out_rel_l2, out_max_rel, corr_rel_l2, corr_max_rel, corr_max_rms``, each to compare with
    :func:`relative_errors` over the written elements. A copy, so callers may edit it.
    """
    return dict(EXPECTED_ERROR)


def relative_errors(got: Tensor, want: Tensor) -> dict[str, float]:
    """``rel_l2 = ||got - want|| / ||want||``, ``max_rel = max |got - want| / (|want| + 0.01 rms)``
    and ``max_rms = max |got - want| / rms`` (rms of ``want``).

    ``max_rel`` is the one ``kdagen.check`` uses: a small floor (1% of the rms) keeps elements
    near zero from turning rounding noise into huge relative errors; ``max_rms`` is the verify
    check's element-wise bound on corr. Computed in fp64.
    """
    got, want = got.double().flatten(), want.double().flatten()
    if want.numel() == 0:
        return {"rel_l2": 0.0, "max_rel": 0.0, "max_rms": 0.0}
    diff = (got - want).abs()
    rms = want.pow(2).mean().sqrt()
    return {
        "rel_l2": float(diff.norm() / want.norm().clamp_min(1e-300)),
        "max_rel": float((diff / (want.abs() + 1e-2 * rms).clamp_min(1e-300)).max()),
        "max_rms": float(diff.max() / rms.clamp_min(1e-300)),
    }


# --------------------------------------------------------------------------- fp32 pieces


def _f32(value: float, like: Tensor) -> Tensor:
    """A kernel ``Float32(value)`` constant: rounded to fp32 once, so torch never widens it."""
    return torch.tensor(value, dtype=F32, device=like.device)


def _sigmoid(x: Tensor) -> Tensor:
    """``1 / (1 + exp(-x))`` in fp32, the form the kernels write (not torch's fused sigmoid)."""
    return 1.0 / (1.0 + torch.exp(-x))


def _warp_sum(x: Tensor) -> Tensor:
    """Sum over the last dim (K channels) in the kernel's order, fp32.

    Each warp reduces its 32 channels with xor-butterfly shuffles at offsets 16, 8, 4, 2, 1 (both
    ``warp_sum`` and the coupling reduce-scatter): lanes l and l^16 add, then l^8, ..., i.e. the
    vector is folded in half five times. fp32 addition is commutative, so every lane of a pair
    gets the same bits. The four warp partials are then added as ``(w0 + w1) + (w2 + w3)``.
    """
    x = x.unflatten(-1, (x.shape[-1] // WARP, WARP))
    width = WARP
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width : 2 * width]
    w = x[..., 0]
    return (w[..., 0] + w[..., 1]) + (w[..., 2] + w[..., 3])


def _bf16_split(x: Tensor) -> tuple[Tensor, Tensor]:
    """``hi = bf16(x)``, ``lo = bf16(x - hi)``: ``x - hi`` is exact, so ``hi + lo`` keeps ~16 bits."""
    hi = x.to(BF16)
    return hi, (x - hi.float()).to(BF16)


def _project(s0: Tensor, probes: Tensor) -> Tensor:
    """``S0 @ probes^T`` as the UMMAs compute it: ``[..., V, K] x [..., N, K] -> [..., V, N]``.

    bf16 x bf16 products are exact in fp32; each 16-deep MMA is an fp32 matmul here, accumulated in
    the kernel's issue order (K step 0 hi, step 0 lo, step 1 hi, ...). Within one MMA the tensor
    core's order differs, so this matches the GPU to fp32 rounding, not bitwise.
    """
    halves = _bf16_split(probes)
    state = s0.float()
    acc = torch.zeros(*s0.shape[:-1], probes.shape[-2], dtype=F32, device=s0.device)
    for kt in range(0, K, MMA_K):
        a = state[..., kt : kt + MMA_K]
        for half in halves:
            acc = acc + a @ half[..., kt : kt + MMA_K].float().transpose(-1, -2)
    return acc


# --------------------------------------------------------------------------- stages


def _activations(
    qkv: Tensor,
    req: Requests,
    conv: tuple[Tensor, Tensor, Tensor] | None,
    dim_first: bool,
) -> Tensor:
    """The window's q, k, v channels, ``[B, Q, 3HK]`` bf16, post-conv when ``conv`` is given.

    Positions past ``qlen`` repeat the last token, as the seed loads them; their outputs are
    masked later (q = k = 0, beta = 0), never read by positions before them.
    """
    raw = qkv[req.rows]
    if conv is None:
        return raw
    conv_state, conv_w, accepted = conv
    window = raw.shape[1]
    first = torch.where(req.live, accepted.long() - 1, 0)
    if req.live.any() and (first[req.live].min() < 0 or first[req.live].max() >= window):
        raise ValueError(f"accepted: expected live values in [1, {window}], got {accepted}")
    rows = first[:, None] + torch.arange(CONV_WIDTH - 1, device=raw.device)  # [B, 3]
    slot = req.slot[:, None]
    hist = conv_state[slot, :, rows] if dim_first else conv_state[slot, rows]  # [B, 3, C]
    mixed = conv_window_outputs(torch.cat([hist, raw], dim=1), conv_w)
    roll_conv_state(conv_state, req, hist, raw, dim_first)
    return mixed


def softplus_gate_floor(window: int) -> float:
    """The kernels' floor under each token's log decay with the softplus gate: exp(G_t - G_MID)
    and its inverse (MID = (Q - 1) // 2) then stay within exp(+-64) for any input, and a weight
    below exp(-floor) <= 1.2e-7 is all that is dropped."""
    return 64.0 / ((window - 1) // 2 + 1)


def _gates(
    g_raw: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float | None, floor: float
) -> Tensor:
    """Each token's log decay ``gate_t`` (fp32, ``[B, H, Q, K]`` from bf16 ``g_raw``), as the
    kernel computes it; ``lower_bound`` None: the softplus gate held at ``-floor`` (the bounded
    gate ignores ``floor``). Shared by the chain and the tree emulation, which cumulate it."""
    heads = a_log.shape[0]
    rate = torch.exp(a_log.float())[:, None, None]  # [H, 1, 1]
    bias = dt_bias.float().view(heads, 1, K)
    if lower_bound is None:
        x = g_raw.float() + bias
        soft = torch.nn.functional.softplus(x, beta=1.0, threshold=20.0)
        return torch.maximum(-rate * soft, _f32(-floor, g_raw))
    return _f32(lower_bound, g_raw) * _sigmoid(rate * (g_raw.float() + bias))


def _log_decay(
    g_raw: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float | None
) -> tuple[Tensor, Tensor]:
    """``logs[..., t, :] = G_t`` (fp32, cumulated one token at a time like the kernel) and the
    matching ``exp(G_t)``. ``g_raw`` is ``[B, H, Q, K]`` bf16; ``lower_bound`` None: the
    softplus gate, each token's log decay held at ``-softplus_gate_floor(Q)``.

    Not ``torch.cumsum``: on CPU it accumulates fp32 in double.
    """
    floor = softplus_gate_floor(g_raw.shape[-2])
    gates = _gates(g_raw, a_log, dt_bias, lower_bound, floor)
    cum = torch.zeros_like(gates[..., 0, :])
    logs = []
    for t in range(gates.shape[-2]):
        cum = cum + gates[..., t, :]
        logs.append(cum)
    logs = torch.stack(logs, dim=-2)
    return logs, torch.exp(logs)


def _normalise(x: Tensor, scale: float | None = None) -> Tensor:
    """``x * rsqrt(sum x^2 + 1e-6) [* scale]`` over channels, fp32, the kernel's reduction tree."""
    x = x.float()
    sq = _warp_sum(x * x)[..., None]
    y = x * torch.rsqrt(sq + _f32(NORM_EPS, x))
    return y if scale is None else y * _f32(scale, x)


def _channel_products(w: Tensor, probe: Tensor) -> Tensor:
    """``[..., t, i, K]``: each channel's fp32 product of ``w_i`` and ``probe_t``."""
    return w[..., None, :, :] * probe[..., :, None, :]


def _couplings(
    w: Tensor, p: Tensor, r: Tensor, ancestors: Tensor | None = None,
    products: Callable[[Tensor, Tensor], Tensor] = _channel_products,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``c[..., t, i] = w_i . p_t`` (i < t) and ``d[..., t, i] = w_i . r_t`` (i <= t), fp32.

    Each channel's product is rounded to fp32 (``products``: how a kernel forms them), then
    summed over channels with the kernel's tree; entries outside the triangles are zeroed (the
    kernel never computes them). ``ancestors`` (bool ``[..., Q, Q]``, ``[t, i]``: i is t or an
    ancestor of t) narrows both to a token tree's root paths: a select, not a product, so a
    non-ancestor pair's overflow (its factors are not bounded by the rebase) is dropped, never
    turned into NaN.
    """
    window = w.shape[-2]
    pos = torch.arange(window, device=w.device)
    below = pos[:, None] > pos[None, :]
    keep_d = below | (pos[:, None] == pos[None, :])
    if ancestors is not None:
        below, keep_d = below & ancestors, keep_d & ancestors
    c = _warp_sum(products(w, p))
    d = _warp_sum(products(w, r))
    return torch.where(below, c, 0.0), torch.where(keep_d, d, 0.0)


def _solve(v: Tensor, beta: Tensor, proj: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    """The forward solve every thread runs on its state row, vectorised over rows: ``(u, o)``.

    ``v [..., Q, V]``, ``beta [..., Q]``, ``proj [..., V, 2Q]`` (S0 p_t, then S0 r_t),
    ``c, d [..., Q, Q]``. Operation order as the seed: ``acc = v - S0 p``, subtract
    ``c_ti * u_i`` (fp32 mul, then sub) for i < t, ``u = beta * acc``, then
    ``o = fma(d_ti, u_i, o)`` from ``o = S0 r`` for i <= t (``fma_f32`` is a correctly rounded
    fp32 fma, like ``fma.rn.f32``).
    """
    window = v.shape[-2]
    us: list[Tensor] = []
    os: list[Tensor] = []
    for t in range(window):
        acc = v[..., t, :] - proj[..., t]
        for i in range(t):
            acc = acc - c[..., t, i, None] * us[i]
        us.append(beta[..., t, None] * acc)
        o = proj[..., window + t]
        for i in range(t + 1):
            o = fma_f32(d[..., t, i, None], us[i], o)
        os.append(o)
    return torch.stack(us, dim=-2), torch.stack(os, dim=-2)


def _store(
    req: Requests,
    u: Tensor,
    o: Tensor,
    record: Tensor,
    out: Tensor,
    corr: Tensor,
    kg: Tensor,
) -> None:
    """Write only what the contract allows: ``out`` rows of every token (zeros for padding
    requests), ``corr`` / ``kg`` rows of live requests' tokens. ``u, o`` are ``[B, H, Q, V]``,
    ``record`` ``[B, Q, H, 2K]``."""
    b_idx, t_idx = torch.nonzero(req.tokens, as_tuple=True)
    rows = o[b_idx, :, t_idx]  # [N, H, V]
    rows = torch.where(req.valid[b_idx, None, None], rows, 0.0)
    out[req.bos[b_idx] + t_idx] = rows.reshape(rows.shape[0], -1).to(out.dtype)
    b_idx, t_idx = torch.nonzero(req.tokens & req.live[:, None], as_tuple=True)
    corr[b_idx, :, t_idx] = u[b_idx, :, t_idx].to(corr.dtype)
    kg[b_idx, :, t_idx] = record[b_idx, t_idx]


# --------------------------------------------------------------------------- verify


def verify_like_sm100(args: VerifyArgs) -> None:
    """Same contract, checks and in-place writes as ``kdagen.reference.verify``, computed
    like the sm100 kernel: fp32 throughout, gates cumulated token by token, norms and
    coupling scalars summed with the kernel's warp trees, ``S0 @ [p | r]`` from bf16 hi/lo probe
    halves accumulated in fp32, and the seed's forward solve. ``state`` must be bf16 (the kernel
    feeds it to the tensor cores as is). See the module docstring for what is not bit-exact."""
    check_verify(args, op="kdagen.emulate.verify_like_sm100", require_cuda=False,
                 float_results=True)  # fmt: skip
    qkv, state, slots, corr = args.qkv, args.state, args.slots, args.corr
    a_log, lower_bound = args.a_log, args.lower_bound
    conv = (args.conv_state, args.conv_w, args.accepted)
    window, batch = corr.shape[2], slots.shape[0]
    if state.dtype != BF16:  # the tensor cores read the pool as it is
        raise ValueError(f"state: expected bf16 (the kernel's pool dtype), got {state.dtype}")
    req = request_layout(
        args.query_start, slots, args.null_slot, window, qkv.shape[0], state.shape[0]
    )
    if batch == 0 or not req.tokens.any():
        return
    if conv[0] is not None:
        check_live_slots("slots", req.slot, req.live, conv[0].shape[0], unique=True)
    mixed = _activations(qkv, req, None if conv[0] is None else conv, args.conv_dim_first)

    tok = _window_tokens(args, req, mixed)
    logs, decay = _log_decay(tok.g_raw, a_log, args.dt_bias, lower_bound)
    p, r = decay * tok.k_n, decay * tok.q_n
    proj = _project(state[req.slot], torch.cat([p, r], dim=-2))
    if lower_bound is None:  # the coupling's factors relative to token MID
        mid = logs[..., (window - 1) // 2, None, :]
        near = torch.exp(logs - mid)
        c, d = _couplings(torch.exp(mid - logs) * tok.k_n, near * tok.k_n, near * tok.q_n)
    else:
        c, d = _couplings(torch.exp(-logs) * tok.k_n, p, r)
    u, o = _solve(tok.v, tok.beta, proj, c, d)
    _store(req, u, o, tok.record, args.out, corr, args.kg)


@dataclass(frozen=True)
class WindowTokens:
    """A window's per-token kernel inputs, heads first: ``q_n, k_n, v [B, H, Q, K]`` fp32
    (normalised, zero past ``qlen``), ``beta [B, H, Q]`` fp32 (zero past ``qlen``), ``g_raw``
    ``[B, H, Q, K]`` bf16 and the bf16 ``kg`` record ``[B, Q, H, 2K]``."""

    q_n: Tensor
    k_n: Tensor
    v: Tensor
    beta: Tensor
    g_raw: Tensor
    record: Tensor


def _window_tokens(args: VerifyArgs, req: Requests, mixed: Tensor) -> WindowTokens:
    """Everything per token that the chain and the tree kernels compute alike (from the
    post-conv ``mixed [B, Q, 3HK]``): the closed form starts from these."""
    heads = args.a_log.shape[0]

    def heads_first(x: Tensor) -> Tensor:  # [B, Q, H*K] -> [B, H, Q, K]
        return x.unflatten(-1, (heads, K)).transpose(1, 2)

    here = req.tokens[:, None, :, None]  # [B, 1, Q, 1]
    q, k, v = (heads_first(x) for x in mixed.chunk(3, dim=-1))
    g_raw = heads_first(args.raw_g[req.rows])
    beta = _sigmoid(args.raw_beta[req.rows].float()).transpose(1, 2)  # [B, H, Q]
    return WindowTokens(
        q_n=_normalise(torch.where(here, q, 0.0), scale=K**-0.5),
        k_n=_normalise(torch.where(here, k, 0.0)),
        v=v.float(),
        beta=torch.where(req.tokens[:, None, :], beta, 0.0),
        g_raw=g_raw,
        record=torch.cat([k, g_raw], dim=-1).transpose(1, 2),  # [B, Q, H, 2K], bf16
    )

"""A drop-in for vLLM's ``kda_recoverssm_verify`` (Kimi-K3 RecoverSSM), on kdagen's verify.

Same signature and layouts as vLLM's Triton kernel (and FlashInfer's CuTe-DSL one): q, k, v,
raw_g [1, T, H, 128], raw_beta [1, T, H], the correction and key/gate caches indexed by state
block (``state_indices[b]``, not by request), null block 0, conv done upstream.
"""

from __future__ import annotations

import torch

from kdagen.runtime import launch_verify, validate_verify
from kdagen.validate import KdaInputError

OP = "kdagen.vllm.kda_recoverssm_verify"
NULL_BLOCK_ID = 0  # vLLM's padding block


def _tokens_view(name: str, t: object, heads: int | None = None) -> torch.Tensor:
    """[1, T, H, 128] (or [1, T, H]) -> [T, H*128] (or [T, H]) without a copy."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4) or t.shape[0] != 1:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise KdaInputError(f"{OP}: `{name}` must have shape [1, T, H, 128] or [1, T, H], "
                            f"got {shape}")  # fmt: skip
    flat = t[0]
    if flat.dim() == 2:
        return flat
    if flat.stride(1) != flat.shape[2] or flat.stride(2) != 1:
        raise KdaInputError(f"{OP}: `{name}` heads must be contiguous (strides [.., "
                            f"{flat.shape[2]}, 1]), got {list(t.stride())}")  # fmt: skip
    return flat.as_strided((flat.shape[0], flat.shape[1] * flat.shape[2]), (flat.stride(0), 1))


def kda_recoverssm_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803 (vLLM's parameter name)
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    checkpoint_state: torch.Tensor,
    correction_cache: torch.Tensor,
    kg_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    spec_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify each request's window from its checkpoint without writing the checkpoint;
    fills ``correction_cache`` / ``kg_cache`` rows ``state_indices[b]`` for the commit and
    returns ``out`` [1, T, H, 128] (allocated when None, like vLLM)."""
    if lower_bound is None:
        raise KdaInputError(f"{OP}: `lower_bound` must be a negative float (Kimi-K3's bounded "
                            "gate); the unbounded softplus gate is not implemented")  # fmt: skip
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if (
        not isinstance(correction_cache, torch.Tensor)
        or correction_cache.dim() != 4
        or (correction_cache.shape[2] != spec_query_len)
    ):
        shape = list(correction_cache.shape) if isinstance(correction_cache, torch.Tensor) else None
        raise KdaInputError(f"{OP}: `correction_cache` must have shape [blocks, H, "
                            f"spec_query_len={spec_query_len}, 128], got {shape}")  # fmt: skip
    flat_out = _tokens_view("out", out)
    if flat_out.stride(0) != flat_out.shape[1]:
        raise KdaInputError(f"{OP}: `out` must be contiguous, got strides {list(out.stride())}")
    flat_g, flat_beta = _tokens_view("raw_g", raw_g), _tokens_view("raw_beta", raw_beta)
    launch = validate_verify(
        _tokens_view("q", q), _tokens_view("k", k), _tokens_view("v", v), flat_g, flat_beta,
        A_log, dt_bias, checkpoint_state, query_start_loc, state_indices, flat_out,
        correction_cache, kg_cache, lower_bound=float(lower_bound), null_slot=NULL_BLOCK_ID,
        records_by_slot=True, op=OP,
    )  # fmt: skip
    launch_verify(
        launch, flat_g, flat_beta, A_log, dt_bias, checkpoint_state, query_start_loc,
        state_indices, flat_out, correction_cache, kg_cache, None, None, None, None,
        float(lower_bound), NULL_BLOCK_ID,
    )  # fmt: skip
    return out

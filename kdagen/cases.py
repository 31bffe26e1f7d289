"""Random commit inputs for checks and benchmarks: realistic values, never zeros.

Each case gives the ``CommitArgs`` of one ``kdagen.serve.runtime.commit``, built on any device
from a seed. Edge cases are switches, so the check can name what it covered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdagen.serve.contract import CommitArgs

K = 128
POOL_PAD = 512  # elements of padding after each slot, as in a vLLM cache page


@dataclass(frozen=True)
class CommitCase:
    """What a commit case exercises."""

    name: str
    batch: int
    null_fraction: float = 0.0  # requests on the null slot
    zero_accept_fraction: float = 0.0  # live requests with accepted == 0
    full_accept: bool = False  # every request accepts the whole window (the benchmark case)
    null_slot: int = 0
    extra_rows: int = 3  # corr/kg rows beyond B (vLLM sizes them for the max batch)
    outside: bool = False  # two requests' slots outside the pool (padding: never touched)
    # (std, mean) of the recorded raw gates instead of N(0, 1.5^2): with the softplus gate,
    # per-channel log decays from ~0 to a few hundred a token, which forget the state.
    gate_logits: tuple[float, float] | None = None
    tree: bool = False  # the accepted tokens as a token tree's path (``along_a_path``)


CHECK_CASES = (
    CommitCase("random", 48),
    CommitCase("single", 1),
    CommitCase("edges", 37, null_fraction=0.25, zero_accept_fraction=0.2),
    CommitCase("pad-slot-1", 9, null_fraction=0.3, null_slot=-1),
    CommitCase("full-window", 70, full_accept=True),
    CommitCase("outside-pool", 12, outside=True),
    # a null slot below -1: slot -3 (outside) lies between it and 0, and must pad too
    CommitCase("null-below-pool", 12, null_fraction=0.25, null_slot=-4, outside=True),
    CommitCase("tree-path", 24, null_fraction=0.2, tree=True),
)
# The softplus gate's extra cases: log decays far beyond the bounded gate's (-1000 and less
# over a window), and every token forgetting everything before it.
SOFTPLUS_CASES = (
    CommitCase("forget", 40, gate_logits=(200.0, 100.0)),
    CommitCase("forget-all", 16, gate_logits=(0.0, 1e4)),
)


def make_commit_inputs(
    case: CommitCase,
    heads: int,
    window: int,
    slot_dtype: torch.dtype = torch.int32,
    seed: int = 0,
    device: str | torch.device = "cuda",
    lower_bound: float | None = -5.0,
) -> CommitArgs:
    """Arguments for ``commit``: a padded-stride bf16 pool with more slots than requests, slots a
    random permutation (out of order), rows t >= accepted of corr/kg poisoned with NaN (the
    kernel must not read them)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)  # drawn where used: fast for big pools

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev) * std

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, device=dev)

    b = case.batch
    slots_total = b + 4 + max(0, case.null_slot)
    pool = randn(slots_total, heads * K * K + POOL_PAD, std=0.1).bfloat16()
    state = pool[:, : heads * K * K].view(slots_total, heads, K, K)
    first = 1 if case.null_slot >= 0 else 0  # slot 0 is the null slot in vLLM
    order = torch.randperm(slots_total - first, generator=g, device=dev)
    slots = (order[:b] + first).to(slot_dtype)
    if case.null_fraction:
        slots[rand(b) < case.null_fraction] = case.null_slot
    if case.outside:
        slots[0], slots[-1] = -3, slots_total + 2
    if case.full_accept:
        accepted = torch.full((b,), window, dtype=torch.int32, device=dev)
    else:
        accepted = torch.randint(1, window + 1, (b,), generator=g, device=dev, dtype=torch.int32)
        if case.zero_accept_fraction:
            accepted[rand(b) < case.zero_accept_fraction] = 0
    rows = b + case.extra_rows
    corr = randn(rows, heads, window, K)
    std, mean = case.gate_logits or (1.5, 0.0)
    gates = randn(rows, heads, window, K, std=std) + mean
    kg = torch.cat([randn(rows, heads, window, K), gates], -1)
    kg = kg.bfloat16()
    # Rows t >= accepted (and the spare rows) were never written by verify: poison them.
    spare = torch.zeros(case.extra_rows, dtype=torch.int32, device=dev)
    row_accepted = torch.cat([accepted, spare])
    unused = torch.arange(window, device=dev)[None, :] >= row_accepted[:, None]  # [rows, Q]
    corr[unused[:, None, :, None].expand_as(corr)] = float("nan")
    kg[unused[:, None, :, None].expand_as(kg)] = float("nan")
    return CommitArgs(
        state, corr, kg, rand(heads) * 2 - 1, randn(heads * K, std=0.5), slots, accepted,
        lower_bound, case.null_slot,
    )  # fmt: skip


def along_a_path(args: CommitArgs, seed: int) -> tuple[CommitArgs, torch.Tensor]:
    """The commit of ``args`` as a token tree's: ``args`` scattered along random root paths
    (``scatter_along``), and the paths [B, Q] int32. Folding the paths must give ``args``'
    chain commit."""
    path = random_root_paths(args.accepted, args.corr.shape[2], seed).to(args.slots.device)
    corr, kg = scatter_along(args.corr, args.kg, args.accepted, path)
    return args.with_(corr=corr, kg=kg), path


def random_root_paths(accepted: torch.Tensor, window: int, seed: int) -> torch.Tensor:
    """Per request b a random root path of ``accepted[b]`` (clamped into the window) increasing
    positions from 0, as [B, Q] int32 on the host (0 past its length)."""
    gen = torch.Generator().manual_seed(seed)
    path = torch.zeros(accepted.shape[0], window, dtype=torch.int32)
    for b, n in enumerate(accepted.clamp(0, window).tolist()):
        if n > 1:
            path[b, 1:n] = (
                torch.randperm(window - 1, generator=gen)[: n - 1].sort().values + 1
            ).int()
    return path


def scatter_along(
    corr: torch.Tensor, kg: torch.Tensor, accepted: torch.Tensor, path: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the records ``corr``, ``kg`` with records row b's positions 0 .. a - 1
    (a = ``accepted[b]``) moved to positions ``path[b, :a]``, every other position NaN
    (never read)."""
    window = corr.shape[2]
    out_corr, out_kg = torch.full_like(corr, float("nan")), torch.full_like(kg, float("nan"))
    done = accepted.clamp(0, window).to(corr.device)
    at_path = path.to(corr.device).long()
    for j in range(window):
        rows = (done > j).nonzero().flatten()
        at = at_path[rows, j]
        out_corr[rows, :, at] = corr[rows, :, j]
        out_kg[rows, :, at] = kg[rows, :, j]
    return out_corr, out_kg


def pool_of(state: torch.Tensor) -> torch.Tensor:
    """The whole padded pool behind a state view (to check the padding is untouched)."""
    slots_total = state.shape[0]
    return torch.as_strided(state, (slots_total, state.stride(0)), (state.stride(0), 1))

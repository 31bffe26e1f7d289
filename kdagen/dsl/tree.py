"""A token tree's per-token pieces both verify kernels share (docs/tree-semantics.md): the
parent's running value and ancestor bits, and the solve's couplings masked to the root path.
``ancestors[t]``: bit i set when token i is on token t's root path (t itself excluded)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def from_parent(
    parent: Int32, t: cutlass.Constexpr[int], values: cute.Tensor, root: Float32,
    ancestors: cute.Tensor,
) -> Float32:  # fmt: skip
    """Token t's parent's entry of ``values`` (``root`` when the parent is not an earlier
    token: t is a root); sets ``ancestors[t]`` to the parent's bits and the parent. Selects
    over the earlier tokens: the parent is a run-time value, the registers are not indexable."""
    value = root
    bits = Int32(0)
    for i in cutlass.range_constexpr(t):
        hit = parent == i
        value = cutlass.select_(hit, values[i], value)
        bits = cutlass.select_(hit, ancestors[i] | Int32(1 << i), bits)
    ancestors[t] = bits
    return value


@cute.jit
def on_root_path(
    coupling: Float32, ancestors: cute.Tensor, t: cutlass.Constexpr[int], i: cutlass.Constexpr[int]
) -> Float32:
    """``coupling`` of token t to the earlier token i, or 0 where i is not on t's root path."""
    return cutlass.select_((ancestors[t] >> i) & 1 != 0, coupling, Float32(0))

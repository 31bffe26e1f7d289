"""The root paths of the Hopper token trees past 8 tokens (docs/tree-semantics.md).

Every thread of the verify needs its parent's running decay product, a value of its own
channel: it stages its products in its own shared-memory row and loads the parent's by index.
The ancestor bits are the same for all threads: one warp puts them in shared memory, where the
coupling scalars are masked to the root paths before the solve, so the solve runs the chain's
sums. At Q = 16 no thread holds 16 ancestor words or selects 120 parents and 240 couplings, as
``kdagen.dsl.tree`` does per thread for the windows up to 8.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def staged_parent(
    row: cute.Tensor, parent: Int32, t: cutlass.Constexpr[int], root: Float32
) -> Float32:
    """The parent's entry of this thread's staged ``row`` (entries 0..t-1 written by this
    thread), or ``root`` when the parent is not an earlier token (t is a root): one load by
    index where selects over the earlier tokens would take 2 t instructions."""
    if cutlass.const_expr(t == 0):
        return root
    earlier = (parent >= 0) & (parent < t)
    value = row[cutlass.min(cutlass.max(parent, Int32(0)), Int32(t - 1))]
    return cutlass.select_(earlier, value, root)


@cute.jit
def parent_bit(parent: Int32, t: cutlass.Constexpr[int]) -> Int32:
    """Bit ``parent`` where the parent is an earlier token, else 0."""
    earlier = (parent >= 0) & (parent < t)
    return cutlass.select_(earlier, Int32(1) << cutlass.max(parent, Int32(0)), Int32(0))


@cute.jit
def store_root_paths(links: cute.Tensor, root_paths: cute.Tensor, lane: Int32):
    """Warp-wide: ``root_paths[t]`` gets bit i set when token i is on token t's root path
    (t excluded), from each token's parent (``links``; one that is not an earlier token makes
    t a root). Lane t takes token t's path by pointer doubling: after round r its bits hold
    the ancestors up to 2^(r + 1) generations back, so 4 rounds of shuffles cover 16 tokens
    where one thread's selects would take 120."""
    window = cute.size(links)
    parent = Int32(-1)
    for t in cutlass.range_constexpr(window):
        parent = cutlass.select_(lane == t, links[t], parent)
    earlier = (parent >= 0) & (parent < lane)
    jump = cutlass.select_(earlier, parent, lane)  # a root points at itself
    bits = cutlass.select_(earlier, Int32(1) << cutlass.max(parent, Int32(0)), Int32(0))
    for _ in cutlass.range_constexpr((window - 1).bit_length()):
        bits = bits | cute.arch.shuffle_sync(bits, jump)
        jump = cute.arch.shuffle_sync(jump, jump)
    if lane < window:
        root_paths[lane] = bits

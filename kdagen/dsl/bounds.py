"""A verify kernel's rows named by device values it cannot check on the host (the run-time
never reads them: that would synchronise): each is cut to the rows its tensor holds, so a bad
``query_start`` or ``accepted`` gives wrong rows, never an access outside the tensors. Values
inside the contract (docs/kda-verify-semantics.md) pass unchanged."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def window_rows(
    query_start: cute.Tensor, request: Int32, rows: Int32, window: cutlass.Constexpr[int]
) -> tuple:
    """Request ``request``'s window as (first row, token count), cut to rows [0, ``rows``) of
    the token tensors (a start or end outside them, or an end before the start, leaves the
    part inside, maybe none) and to its first ``window`` tokens: every ``t < count`` then also
    holds ``t < window``, the size of the kernel's per-token registers and records."""
    bos = cutlass.min(cutlass.max(query_start[request], Int32(0)), rows)
    end = cutlass.min(cutlass.max(query_start[request + 1], bos), rows)
    return bos, cutlass.min(end - bos, Int32(window))


@cute.jit
def history_row(accepted: cute.Tensor, request: Int32, window: cutlass.Constexpr[int]) -> Int32:
    """The first of the three conv history rows of ``request``'s slot, ``accepted - 1``, cut to
    [0, window - 1]: the slot holds window + 2 rows."""
    return cutlass.min(cutlass.max(accepted[request] - Int32(1), Int32(0)), Int32(window - 1))

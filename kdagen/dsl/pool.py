"""Which state slots a verify kernel may touch: a slot past the pool (``slot_count`` slots)
is a padding request's, as the null slot is, so a kernel reads and writes nothing for it."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64


@cute.jit
def pool_slot(slot: Int64, null_slot: Int64, slot_count: Int32) -> Int64:
    """``slot``, or ``null_slot`` where it lies at or past the pool's end. Negative slots pad
    through ``null_slot`` itself (the run-time passes at least -1)."""
    return cutlass.select_(slot < Int64(slot_count), slot, null_slot)

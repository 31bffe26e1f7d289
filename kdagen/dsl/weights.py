"""Loads of a model's weights (never written while serving) that may run before
``griddepcontrol.wait``."""

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64


@cute.jit
def load_weight(weights: cute.Tensor, index: Int32) -> Float32:
    """Element ``index`` of a flat fp32 weight tensor by a load the compiler keeps where it
    stands: issued before ``griddepcontrol.wait``, its latency hides under the wait (a plain
    load is sunk to its first use)."""
    address = Int64((weights.iterator + index).toint())
    return cute.arch.inline_ptx(
        "ld.global.nc.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[address]
    )

"""The launch configuration a compiled module's host code passes to the driver, read from
its final IR without a GPU.

CuTe DSL sizes a kernel's dynamic shared memory from its allocations at compile time
(``cute.kernel_smem_size``) and stores the figure into the launch configuration, a
``{grid, block, i64 shared bytes, stream, attributes, count}`` struct, as a constant. The
templates' ``SHARED_BYTES`` is an upper bound with alignment slack; this is the figure the
GPU reserves, which decides how many CTAs an SM holds.
"""

from __future__ import annotations

import re

_LAUNCH_CONFIG = re.escape("!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>")
_FUNCTION = re.compile(r"^\s*llvm\.func ", re.MULTILINE)
_CONSTANT = re.compile(r"(%\w+) = llvm\.mlir\.constant\((\d+) : i64\) : i64")
_SHARED_FIELD = re.compile(
    r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, " + _LAUNCH_CONFIG
)
_STORE_I64 = re.compile(r"llvm\.store (%\w+), (%\w+) : i64, !llvm\.ptr")


def launch_dynamic_smem(host_ir: str) -> int | None:
    """The dynamic shared memory bytes of the module's kernel launch (the largest, if several
    launch), or None where no launch stores a constant there."""
    found = []
    for function in _FUNCTION.split(host_ir):  # SSA names are local to a function
        constants = dict(_CONSTANT.findall(function))
        fields = set(_SHARED_FIELD.findall(function))
        found += [
            int(constants[value])
            for value, target in _STORE_I64.findall(function)
            if target in fields and value in constants
        ]
    return max(found, default=None)

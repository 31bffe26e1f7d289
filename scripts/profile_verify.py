"""Launch one verify variant a few times on benchmark-like inputs, for a profiler to attach
(e.g. ``ncu --launch-skip 2 --launch-count 1 python scripts/profile_verify.py NAME BATCH``).
The inputs are the benchmark's (full windows, random slots, padded pool)."""

from __future__ import annotations

import sys

import torch

from kdagen import first_use
from kdagen.bench import verify_inputs
from kdagen.serve.runtime import run_verify
from kdagen.serve.variant import Variant
from kdagen.testing import verify_args


def main(name: str, batch: int, launches: int = 4) -> None:
    first_use.enable()
    variant = Variant.parse(name)
    inputs = verify_inputs(variant, batch)
    args = verify_args(inputs)
    for _ in range(launches):
        run_verify(args, variant=variant)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

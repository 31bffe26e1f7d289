"""Launch one verify variant a few times on benchmark-like inputs, for a profiler to attach
(e.g. ``ncu --launch-skip 2 --launch-count 1 python scripts/profile_verify.py NAME BATCH``).
The inputs are the benchmark's (full windows, random slots, padded pool). ``--peer
flashinfer`` launches FlashInfer's ``kda_recoverssm_verify`` on the same inputs instead (the
bench's peer call, from ``.peers/``), so both kernels are profiled on one workload."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kdagen import first_use
from kdagen.bench import flashinfer_args, verify_inputs, verify_launch
from kdagen.serve.variant import Variant


def launcher(name: str, batch: int, peer: str | None) -> Callable[[], None]:
    """One launch of the variant, or of the peer on the variant's inputs."""
    variant = Variant.parse(name)
    inputs = verify_inputs(variant, batch)
    if peer is None:
        return verify_launch(inputs, variant)
    from kdagen.peers import flashinfer_verify

    load = flashinfer_verify()
    if load.fn is None:
        raise SystemExit(f"--peer flashinfer: {load.note}")
    args = flashinfer_args(inputs)
    return lambda: load.fn(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", help="a verify variant (its contract sets the workload)")
    parser.add_argument("batch", type=int)
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--peer", choices=["flashinfer"], default=None)
    opts = parser.parse_args()
    first_use.enable()
    launch = launcher(opts.name, opts.batch, opts.peer)
    for _ in range(opts.launches):
        launch()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Eager all-layer commit launches for a profiler (GPU): ``ncu -k regex:commit`` over them.

python scripts/profile_model_commit.py [--layers 69] [--heads 12] [--window 8]
                                       [--batch 1] [--launches 3] [--variant NAME]
"""

from __future__ import annotations

import argparse

import torch

from kdagen import bench_model
from kdagen.space import Space


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=69)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument(
        "--variant", default=None, help="a commit variant's name (default: dispatched)"
    )
    args = parser.parse_args()
    s = bench_model.model_set(args.heads, args.window, args.layers, args.batch, 0, False)
    m = bench_model.model_commit(s, conv=True)
    variant = None
    if args.variant:
        variant = next(
            v for v in Space.load("commit.yaml").expand().variants if v.name == args.variant
        )
    for _ in range(args.launches):
        m.commit(s.step["state_indices"], s.step["num_accepted_tokens"],
                 query_start=s.step["query_start_loc"], variant=variant)  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

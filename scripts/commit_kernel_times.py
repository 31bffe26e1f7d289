"""Per-kernel CUDA times of kdagen's and vLLM 0.33's all-layer commit (GPU).

For each batch: ``kdagen bench --layers``'s input sets, both commits through vLLM's commit
context (conv compacted), the graph-replay time per launch as the bench takes it, and each
kernel's CUDA time per commit from ``torch.profiler`` over 20 replays of the same graph (vLLM
launches a plan, a conv compaction and a fold; with PDL kdagen's one kernel starts inside the
previous launch, so its kernel time can exceed its time per launch).

    python scripts/commit_kernel_times.py [--layers 69] [--heads 12] [--window 8]
                                          [--batches 1,16]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from kdagen import bench, bench_model
from kdagen.peers import vllm_commit
from kdagen.serve.vllm import KDARecoverSSMCommitContext

REPLAYS = 20


def kernel_times(launches: list) -> list[tuple[float, str]]:
    """(us per replay, kernel name) of one graph holding ``launches``."""
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    return [(e.device_time_total / REPLAYS, e.key) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=69)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    peer = vllm_commit().fn
    factories = [("kdagen", KDARecoverSSMCommitContext)] + ([("vllm", peer)] if peer else [])
    for batch in (int(b) for b in args.batches.split(",")):
        shape = (args.heads, args.window, args.layers, batch)
        sets = bench_model.model_sets(*shape, 0, False)
        count = len(sets)
        for name, factory in factories:
            launches = [partial(factory.create(s.layers, spec_query_len=args.window,
                                               max_num_reqs=batch).commit, **s.step)
                        for s in sets]  # fmt: skip
            per_launch = bench.time_graph(launches).median_us
            print(
                f"== B={batch} sets={count} {name}: graph replay / launches = {per_launch:.2f} us"
            )
            for us, kernel in kernel_times(launches):
                print(f"   {us / count:9.2f} us per commit  {kernel[:90]}")
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Every commit variant of one contract key on a model's all-layer commit (GPU).

For each batch: the input sets of ``kdagen bench --layers`` (vLLM 0.33's layout), each
variant of the shipped commit space for the key timed through ``ModelCommit`` with the conv
state compacted (and the best without it), vLLM's Triton commit when ``.peers`` holds it.
The fastest per batch (``--top``) are printed with their share of the HBM floor, beside one
plain copy of the same bytes timed the same way (what streaming them alone costs at this size). With
``--bound no-fold`` every variant is built as that measurement bound (``kdagen.render.BOUNDS``:
the plan, copies and stores alone; wrong outputs), in the compile cache beside the product's.

    python scripts/sweep_model_commit.py [--layers 69] [--heads 12] [--window 8]
                                         [--batches 1,16,64,256] [--top 4] [--match S]
                                         [--no-prefix-caching] [--bound no-fold]
                                         [--prefetch-state] [--lead-us 3,6] [--space FILE]
                                         [--trace] [--pieces-early]

``--prefetch-state`` builds every kernel with ``kdagen.render.COMMIT_STATE_PREFETCH`` on (each
PDL commit fetches its state into L2 before griddepcontrol.wait); run the sweep once without and
once with it, back to back. ``--pieces-early`` builds with ``COMMIT_PIECES_EARLY`` (the PDL
ring's first pieces copied before the wait).

``--lead-us X,Y`` puts a kernel of about X us before every commit (one warp an SM spinning on
the global timer, which lets the commit start at once under PDL) and prints each variant's
time over the lead's own: with ``--prefetch-state``, how fast the commit streams when its
states have X us to reach L2 under the kernel before it. That is what a commit split into a
factor kernel and a streaming kernel launched under it could gain (docs/history/model-commit.md).

``--trace`` builds every kernel with per-CTA trace records (``kdagen.render.RenderOptions``,
the bulk and bulk_ring paths: a few stores a CTA, so the times are the traced builds') and
prints, for each variant and batch, when the CTAs of the graph's last launch pass each stage
(the copies issued, the records landed, the factors, each state piece, the fold, the exit:
us from the first CTA's entry) and how their exits spread over SMs holding more or fewer CTAs.

``--space`` sweeps another commit space (a YAML path, e.g. the shipped one with a tuning value
added): a variant need not be in the shipped space or the table to be timed.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from functools import partial

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_stream

import kdagen.compile as kcompile
import kdagen.render as krender
from kdagen import bench, bench_model
from kdagen.peers import vllm_commit
from kdagen.serve.model_commit import ModelCommit
from kdagen.space import Space, name_matches


class Lead:
    """A kernel of about ``ns`` nanoseconds of one warp an SM spinning on the global timer; it
    lets the next launch start at once (griddepcontrol.launch_dependents first)."""

    @cute.jit
    def __call__(self, ns: cutlass.Int64, sms: cutlass.Int32, stream: cuda.CUstream):
        self.kernel(ns).launch(grid=(sms, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, ns: cutlass.Int64):
        cute.arch.griddepcontrol_launch_dependents()
        start = cute.arch.globaltimer()
        now = start
        while now - start < ns:
            now = cute.arch.globaltimer()


def lead_launch(us: float) -> Callable[[], None]:
    """A launch of ``Lead`` for ``us`` microseconds on the current stream."""
    compiled = cute.compile(Lead(), cutlass.Int64(0), cutlass.Int32(1), make_fake_stream())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ns = cutlass.Int64(int(us * 1000))

    def launch() -> None:
        compiled(ns, cutlass.Int32(sms), cuda.CUstream(torch.cuda.current_stream().cuda_stream))

    return launch


def time_variant(sets: list, built: list[ModelCommit], variant: object,
                 lead: Callable[[], None] | None = None) -> bench.Timing:  # fmt: skip
    """The commit's time per input set, with ``lead`` launched before each commit (then the
    pair's time)."""

    def launch(m: ModelCommit, s: object) -> None:
        if lead is not None:
            lead()
        m.commit(s.step["state_indices"], s.step["num_accepted_tokens"],
                 query_start=s.step["query_start_loc"], variant=variant)  # fmt: skip

    return bench.time_graph([partial(launch, m, s) for m, s in zip(built, sets, strict=True)])


TRACE_STAGES = (("entry", 0), ("griddepcontrol.wait", 1), ("copies issued", 4),
                ("records landed", 5), ("factors ready", 6))  # fmt: skip


def summarise_trace(records: torch.Tensor, ctas: int) -> None:
    """The stages of one launch's CTAs (fields of ``templates/commit/bulk.py.j2``'s trace),
    us from the first entry; a stage a CTA did not pass in that launch (no tokens to fold)
    holds an earlier launch's time, outside its own entry and exit, and is left out."""
    rows = records.view(-1, krender.TRACE_SLOTS)[:ctas].tolist()
    base = min(r[0] for r in rows)

    def stage(field: int) -> list[float]:
        return [(r[field] - base) * 1e-3 for r in rows if r[0] <= r[field] <= r[2]]

    stages = [*TRACE_STAGES]
    stages += [(f"piece {p} landed", krender.TRACE_HEADER + p) for p in range(16)
               if stage(krender.TRACE_HEADER + p)]  # fmt: skip
    stages += [("fold done", 7), ("exit", 2)]
    print("    (min / median / p90 / max, us from the first CTA's entry)")
    for label, field in stages:
        print(f"    {label:<20} {bench.quantiles_text(stage(field))}")
    exits: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        exits[r[3]].append((r[2] - base) * 1e-3)
    by_load: dict[int, list[float]] = defaultdict(list)  # CTAs an SM held -> its last exit
    for times in exits.values():
        by_load[len(times)].append(max(times))
    for held, last in sorted(by_load.items()):
        print(
            f"    SMs holding {held:3d} CTAs: {len(last):3d}, last exit {bench.quantiles_text(last)}"
        )


def render_with(options: krender.RenderOptions) -> None:
    """Every kernel this process builds rendered with ``options`` (its digest differs from
    the product render's, so both builds keep their own cache entries)."""
    product = krender.render
    krender.render = kcompile.render = lambda v: product(v, options)


def time_copy(nbytes: int, count: int, on_sms: bool) -> bench.Timing:
    """One device-to-device copy moving ``nbytes`` (half read, half written), timed as the
    variants are (``count`` buffer pairs rotated in one graph): the time the commit's bytes
    take to stream at this size, launch, ramp and tail included. ``copy_`` is captured as a
    graph memcpy node; ``on_sms`` streams the bytes through an elementwise kernel instead
    (16-byte accesses, every SM), the copy a kernel could do."""
    words = nbytes // 8
    pairs = [(torch.empty(words, dtype=torch.int32, device="cuda").random_(),
              torch.empty(words, dtype=torch.int32, device="cuda")) for _ in range(count)]  # fmt: skip
    if on_sms:
        return bench.time_graph([partial(torch.bitwise_not, src, out=dst) for src, dst in pairs])
    return bench.time_graph([partial(dst.copy_, src) for src, dst in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=69)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--top", type=int, default=4, help="rows printed per batch")
    parser.add_argument("--match", default="",
                        help="only variants whose name contains this (or one of a,b,...)")  # fmt: skip
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="sweep the key's build without prefix caching")  # fmt: skip
    parser.add_argument("--bound", choices=["no-fold"], help="build every variant as this "
                        "measurement bound (its outputs are wrong)")  # fmt: skip
    parser.add_argument("--space", default="commit.yaml", help="the commit space to sweep")
    parser.add_argument("--prefetch-state", action="store_true",
                        help="build with kdagen.render.COMMIT_STATE_PREFETCH on")  # fmt: skip
    parser.add_argument("--pieces-early", action="store_true",
                        help="build with kdagen.render.COMMIT_PIECES_EARLY on")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="per-CTA timelines of the graph's last launch (traced builds)")  # fmt: skip
    parser.add_argument("--lead-us", default="",
                        help="also time each variant behind a kernel of these us (comma list)")  # fmt: skip
    args = parser.parse_args()
    if args.prefetch_state:
        krender.COMMIT_STATE_PREFETCH = True  # before anything renders
    if args.pieces_early:
        krender.COMMIT_PIECES_EARLY = True
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    build = "-noprefix" if args.no_prefix_caching else ""
    key = f"commit-h{args.heads}-q{args.window}{build}-i32"
    candidates = [v for v in Space.load(args.space).expand().variants
                  if v.contract_key == key and name_matches(v.name, args.match or None)]  # fmt: skip
    records = None
    if args.trace:  # one buffer for every launch: its address is built into the kernels
        ctas = args.layers * max(int(b) for b in args.batches.split(",")) * args.heads
        ctas *= max(v.row_split for v in candidates)
        records = torch.zeros(ctas * krender.TRACE_SLOTS, dtype=torch.int64, device="cuda")
    if args.bound or args.trace:
        render_with(krender.RenderOptions(records.data_ptr() if args.trace else 0, args.bound))
    peer = vllm_commit().fn
    for batch in (int(b) for b in args.batches.split(",")):
        sets = bench_model.model_sets(args.heads, args.window, args.layers, batch, 0, False)
        count = len(sets)
        floor = bench_model.commit_bytes(sets[0], True) / bw * 1e6
        floor_plain = bench_model.commit_bytes(sets[0], False) / bw * 1e6
        with_conv = [bench_model.model_commit(s, conv=True) for s in sets]
        plain = [bench_model.model_commit(s, conv=False) for s in sets]
        timed = [(time_variant(sets, with_conv, v), v.name) for v in candidates]
        rows = sorted(timed, key=lambda row: row[0].median_us)
        best_plain = min((time_variant(sets, plain, v).median_us, v.name) for v in candidates)
        peer_us = None
        if peer is not None:
            contexts = [peer.create(s.layers, spec_query_len=args.window, max_num_reqs=batch)
                        for s in sets]  # fmt: skip
            peer_us = bench.time_graph([partial(c.commit, **s.step)
                                        for c, s in zip(contexts, sets, strict=True)]).median_us  # fmt: skip
        peer_text = "-" if peer_us is None else f"{peer_us:.2f}"
        nbytes = bench_model.commit_bytes(sets[0], True)
        copy, sm_copy = (time_copy(nbytes, count, on_sms).median_us for on_sms in (False, True))
        print(f"B={batch} sets={count} floor={floor:.2f} (no conv {floor_plain:.2f}) "
              f"copy of its bytes: memcpy node {copy:.2f}, on the SMs {sm_copy:.2f}; "
              f"vllm={peer_text}")  # fmt: skip
        for t, name in rows[: args.top]:
            print(f"   {t.median_us:9.2f} us  {100 * floor / t.median_us:5.1f}% floor  "
                  f"spread {t.spread_pct:.1f}%  {name}")  # fmt: skip
        print(
            f"   worst {rows[-1][0].median_us:.2f} {rows[-1][1]}; no conv best "
            f"{best_plain[0]:.2f} ({100 * floor_plain / best_plain[0]:.1f}%) {best_plain[1]}"
        )
        for _, name in rows[: args.top] if records is not None else ():
            variant = next(v for v in candidates if v.name == name)
            records.zero_()
            time_variant(sets, with_conv, variant)
            print(f"   trace of {name}:")
            summarise_trace(records, args.layers * batch * args.heads * variant.row_split)
        for us in (float(x) for x in args.lead_us.split(",") if x):
            lead = lead_launch(us)
            alone = bench.time_graph([lead] * count).median_us
            behind = sorted((time_variant(sets, with_conv, v, lead).median_us - alone, v.name)
                            for v in candidates)  # fmt: skip
            print(f"   behind a lead of {us:g} us (measured {alone:.2f}): over the lead "
                  + ", ".join(f"{t:.2f} {name}" for t, name in behind[: args.top]))  # fmt: skip
        del sets, with_conv, plain
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

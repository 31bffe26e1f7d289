"""Per-CTA timeline and measurement bounds of one sm90 verify variant under the benchmark
(a perf-work tool).

The variant is rendered with ``kdagen.render.RenderOptions``: with ``--trace`` thread 0 of
every CTA records %globaltimer at kernel entry, the return of griddepcontrol.wait, and per unit
the loop top, the state's arrival, the projections barrier and the unit's end, then the exit;
for the first unit also its norms barrier, the issue of its look-ahead loads and its coupling
barrier. The records of the last launch of the benchmark's CUDA graph are summarised: when the
CTAs start, when the first states land, how long a unit takes in steady state, and the tail.

Usage (GPU host, the devkit sourced):
    python scripts/trace_verify.py VARIANT BATCH [BATCH ...] [--trace] [--check] [--config=NAME ...]
prints us per launch (the benchmark's method) for each ``--config`` (a key of ``CONFIGS``:
``prologue``, the kernel as it is, or a measurement bound, whose outputs are wrong), with
``--trace`` the timeline of each, and with ``--check`` first runs ``kdagen check``'s cases on
each build. The experiments measured with it and not kept (source patches of the render) were
deleted: git has them (this file as of commit 6711b07), their results docs/history/verify-sm90.md.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile

os.environ["KDAGEN_CACHE"] = tempfile.mkdtemp(prefix="kdagen-trace-")  # option builds only

import torch  # noqa: E402

import kdagen.compile as kcompile  # noqa: E402
import kdagen.render as krender  # noqa: E402
from kdagen.bench import (  # noqa: E402
    copy_bandwidth,
    floor_us,
    quantiles_text,
    time_graph,
    verify_launch,
    verify_sets,
)
from kdagen.render import BOUNDS, TRACE_HEADER, TRACE_SLOTS, RenderOptions  # noqa: E402
from kdagen.serve.variant import Variant  # noqa: E402

UNITS = (TRACE_SLOTS - TRACE_HEADER) // 4  # units with their own records (the rest share the last)
ORIGINAL_RENDER = krender.render
# --config name -> bound (None: the kernel as it is); io-only is loads-stores-only's name in
# docs/history.
CONFIGS: dict[str, str | None] = {"prologue": None, **{b: b for b in BOUNDS}}
CONFIGS["io-only"] = "loads-stores-only"


def summarise(records: torch.Tensor, ctas: int, period_us: float, floor: float) -> None:
    rows = records.view(-1, TRACE_SLOTS)[:ctas].tolist()
    base = min(r[0] for r in rows)
    us = lambda t: (t - base) * 1e-3  # noqa: E731
    counts = [min(r[3], UNITS) for r in rows]
    units = [
        [r[TRACE_HEADER + 4 * i : TRACE_HEADER + 4 * i + 4] for i in range(n)]
        for r, n in zip(rows, counts, strict=True)
    ]
    ready = [us(u[1]) for cta in units for u in cta if u[1]]  # none where no state was waited on
    steady = [(cta[i][3] - cta[i - 1][3]) * 1e-3 for cta in units for i in range(1, len(cta))]
    waits = [(u[1] - u[0]) * 1e-3 for cta in units for u in cta if u[1]]
    solve = [(u[3] - u[2]) * 1e-3 for cta in units for u in cta]
    exits = [us(r[2]) for r in rows]
    print(
        f"  period (graph time per launch) {period_us:.2f} us, floor {floor:.2f} us, "
        f"span (first entry -> last exit) {max(exits):.2f} us"
    )
    print("  (min / median / p90 / max, us from the first CTA's entry)")
    print(f"  entry                 {quantiles_text([us(r[0]) for r in rows])}")
    print(f"  griddepcontrol.wait   {quantiles_text([us(r[1]) for r in rows])}")
    for label, field in (("meta arrived", 8), ("window issued", 9)):
        if any(r[field] for r in rows):
            print(f"  {label:<21} {quantiles_text([us(r[field]) for r in rows if r[field]])}")
    print(f"  first loop top        {quantiles_text([us(c[0][0]) for c in units if c])}")
    working = [r for r, c in zip(rows, units, strict=True) if c]  # CTAs with a first unit
    for label, field in (("norms barrier  ", 5), ("next loads out ", 7), ("coupling barr. ", 6)):
        if any(r[field] for r in working):  # recorded where the render has the stage
            print(f"  first {label} {quantiles_text([us(r[field]) for r in working])}")
    print(
        f"  first state ready     {quantiles_text([us(c[0][1]) for c in units if c and c[0][1]])}"
    )
    print(f"  first unit end        {quantiles_text([us(c[0][3]) for c in units if c])}")
    print(
        f"  last state ready      {quantiles_text([us(c[-1][1]) for c in units if c and c[-1][1]])}"
    )
    print(f"  exit                  {quantiles_text(exits)}")
    print(f"  units per CTA         {min(counts)} / {statistics.median(counts)} / {max(counts)}")
    print(f"  unit period (end to end, us)        {quantiles_text(steady)}")
    print(f"  loop top -> state ready (us)        {quantiles_text(waits)}")
    print(f"  projections -> unit end (us)        {quantiles_text(solve)}")
    bins = [0] * (int(max(ready, default=0)) + 1)
    for t in ready:
        bins[int(t)] += 1
    print("  states ready per us: " + " ".join(str(b) for b in bins))


def use_config(variant: Variant, config: str, records: torch.Tensor, trace: bool) -> None:
    """Build ``variant`` rendered with ``config``'s bound (and the trace records): the
    renders that compile and digest see, in this process's scratch cache."""
    from kdagen.serve.runtime import launcher

    options = RenderOptions(records.data_ptr() if trace else 0, CONFIGS[config])

    def with_options(v: Variant) -> str:
        return ORIGINAL_RENDER(v, options) if v == variant else ORIGINAL_RENDER(v)

    krender.render = kcompile.render = with_options
    launcher.cache_clear()
    # The dropped kernel's DSL module unloads its CUDA library when it is freed, which a
    # reference cycle can defer to a garbage collection; one inside the next CUDA-graph
    # capture invalidates it (cudaErrorStreamCaptureInvalidated, seen at B = 16, whose many
    # input sets make the capture long). Collect now, outside any capture.
    gc.collect()


def check_configs(variant: Variant, configs: list[str], records: torch.Tensor) -> None:
    """``kdagen check``'s cases (fp64 reference, edge cases) on each build (a bound's outputs
    are wrong by design)."""
    from kdagen.check import check_variant

    for config in configs:
        use_config(variant, config, records, trace=False)
        cases = check_variant(variant, seed=0)
        passed = sum(c.passed for c in cases)
        worst = max(cases, key=lambda c: (not c.passed, c.score))
        out_max = max(c.out_max_rel for c in cases)
        print(f"check {config}: {passed}/{len(cases)} cases passed, out max element {out_max:.2e}")
        print(f"  worst ({worst.case}): {worst.summary()}")


def main(name: str, batches: list[int], configs: list[str], trace: bool, check: bool) -> None:
    variant = Variant.parse(name)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"trace: unknown --config {unknown} (known: {', '.join(CONFIGS)})")
    for config in configs:
        try:
            RenderOptions(bound=CONFIGS[config]).check(variant)
        except ValueError as err:
            raise SystemExit(f"trace: {err}") from None
    records = torch.zeros(variant.ctas * TRACE_SLOTS, dtype=torch.int64, device="cuda")
    if check:
        check_configs(variant, configs, records)
    bandwidth = copy_bandwidth()
    table = []
    for batch in batches:
        sets = verify_sets(variant, batch)
        row = [batch, floor_us(variant, batch, bandwidth)]
        for config in configs:
            use_config(variant, config, records, trace)
            records.zero_()
            timing = time_graph([verify_launch(s, variant) for s in sets])
            torch.cuda.synchronize()
            row.append(timing.median_us)
            if trace:
                ctas = min(variant.ctas, batch * variant.heads * variant.row_split)
                print(f"{name} B={batch} {config} (H200 trace, last launch of the graph)")
                summarise(records.cpu(), ctas, timing.median_us, row[1])
        table.append(row)
    print(f"{name}: us per launch (bench method{', traced builds' if trace else ''})")
    print("B      floor  " + "  ".join(f"{c:>12}" for c in configs))
    for row in table:
        print(f"{row[0]:<5} {row[1]:6.2f}  " + "  ".join(f"{t:12.2f}" for t in row[2:]))


if __name__ == "__main__":
    args = sys.argv[1:]
    configs = [a.split("=", 1)[1] for a in args if a.startswith("--config=")] or ["prologue"]
    rest = [a for a in args if not a.startswith("--")]
    main(rest[0], [int(b) for b in rest[1:]], configs, "--trace" in args, "--check" in args)

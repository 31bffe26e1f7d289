"""Time the same kdagen bench in two checkouts, alternating processes (GPU).

For a refactor or a kernel change: ``kdagen bench ARGS`` runs in tree A and tree B, in turn
first (A B, B A, ...: an A/A run found the two 1-2 % apart at some rows, either way), for
``--rounds`` rounds, each in its own process on the same GPU; per row (batch, variant) the
median of the rounds' medians of A and B, B / A, the rows' spread (p10..p90 of the replays),
and the range of B / A over the rounds (slowest B round against fastest A round, and the
other way round): a difference is real only where that range excludes 1, every B round
slower (or faster) than every A round; an A/A run (B an unchanged copy of A) gives the
harness's own bias. JSON of every run under ``--out``; ``--summarize DIR`` prints a finished
comparison's table again.

    python scripts/bench_ab.py OLD_TREE NEW_TREE --rounds 3 --out DIR -- --heads 12 --window 8 \\
        --batches 1,64,512 --match t128-r1-c396-s1 --no-peers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_bench(tree: Path, args: list[str], out: Path) -> None:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    }
    cmd = [sys.executable, "-m", "kdagen.cli", "bench", *args, "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # then kdagen bench's options
    opts, bench = parser.parse_args(argv[:split]), argv[split + 1 :]
    opts.out = opts.out.resolve()  # each tree's bench runs in that tree: one folder for both
    opts.out.mkdir(parents=True, exist_ok=True)
    sides = (("a", opts.a), ("b", opts.b))
    for n in range(opts.rounds):  # A B, then B A: neither tree always runs first
        for side, tree in sides if n % 2 == 0 else sides[::-1]:
            run_bench(tree.resolve(), bench, opts.out / f"{side}{n}.json")
    summarize(opts.out)


def summarize(out: Path) -> None:
    """The table of a finished comparison from its JSON files (``a0.json``, ``b0.json``...)."""
    runs = {side: [json.loads(p.read_text())["rows"] for p in sorted(out.glob(f"{side}*.json"))]
            for side in ("a", "b")}  # fmt: skip
    print(f"{'batch':>6} {'A us':>9} {'B us':>9} {'B/A':>6} {'spread %':>8} "
          f"{'rounds B/A':>13}  within  variant")  # fmt: skip
    for i, row in enumerate(runs["a"][0]):
        a_rounds = [r[i]["median_us"] for r in runs["a"]]
        b_rounds = [r[i]["median_us"] for r in runs["b"]]
        a, b = statistics.median(a_rounds), statistics.median(b_rounds)
        spread = max(100 * (r[i]["p90_us"] - r[i]["p10_us"]) / r[i]["median_us"]
                     for side in runs.values() for r in side)  # fmt: skip
        low, high = min(b_rounds) / max(a_rounds), max(b_rounds) / min(a_rounds)
        within = low <= 1 <= high
        print(f"{row['batch']:>6} {a:9.2f} {b:9.2f} {b / a:6.3f} {spread:8.1f} "
              f"{low:6.3f}-{high:.3f}  {'yes' if within else 'NO':>6}  {row['variant']}")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summarize"]:  # a finished comparison's folder
        summarize(Path(sys.argv[2]))
    else:
        main()

"""Where a kernel's warps wait, from Nsight Compute's warp-state sampling (a perf-work tool).

Collect on the GPU host (the devkit sourced), then export the source page as CSV:
    ncu -k "regex:KdaWgmma" --launch-skip 2 --launch-count 1 --section SourceCounters \\
        --warp-sampling-interval 0 -f -o /tmp/b64 python scripts/profile_verify.py VARIANT 64
    ncu --import /tmp/b64.ncu-rep --page source --csv --print-source sass > b64.csv
Then (anywhere):
    python scripts/stall_map.py b64.csv [--split N ...] [--top K]
prints each phase's share of all warp samples and its leading stall reasons, then the K
most-sampled instructions. Phases run between SASS instruction indexes: by default the
kernel's CTA barriers (``BAR.SYNC``), or the ``--split`` indexes given (a phase starts at
each). A warp waiting at a barrier is sampled on the instruction after it, so a phase's
samples include the wait that ends it only when the split is one past the barrier.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class Instruction:
    index: int  # position in the kernel's SASS (16-byte instructions from the first)
    text: str
    samples: int
    stalls: dict[str, int]  # stall reason -> samples


def read_source_page(path: str) -> list[Instruction]:
    """The instructions of the one kernel in an ``ncu --page source --csv`` export."""
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    header_at = next((i for i, row in enumerate(rows) if row[:2] == ["Address", "Source"]), None)
    if header_at is None:  # e.g. ncu's error text when the report was not written
        first = " ".join(rows[0])[:120] if rows else "nothing"
        raise SystemExit(f"stall_map: {path} is not an ncu source page (it begins: {first})")
    header, body = rows[header_at], rows[header_at + 1 :]
    column = {name: i for i, name in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    base = int(body[0][0], 16)

    def count(row: list[str], name: str) -> int:
        return int(row[column[name]] or 0)

    return [
        Instruction(
            (int(row[0], 16) - base) // 16,
            row[1].strip(),
            count(row, SAMPLES),
            {reason[len("stall_") :]: count(row, reason) for reason in reasons},
        )
        for row in body
    ]


def leading(stalls: dict[str, int], n: int) -> str:
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} {value}" for name, value in top if value)


def phases(code: list[Instruction], splits: list[int]) -> list[tuple[int, int]]:
    """[start, end) index ranges: from 0, a new one at each split."""
    starts = sorted({0, *splits})
    return list(zip(starts, [*starts[1:], code[-1].index + 1], strict=True))


def main(path: str, splits: list[int], top: int) -> None:
    code = read_source_page(path)
    if not splits:
        splits = [i.index for i in code if i.text.startswith("BAR.SYNC")]
    total = sum(i.samples for i in code)
    print(f"{path}: {len(code)} instructions, {total} warp samples")
    for start, end in phases(code, splits):
        part = [i for i in code if start <= i.index < end]
        stalls = {r: sum(i.stalls[r] for i in part) for r in part[0].stalls} if part else {}
        share = sum(i.samples for i in part) / max(total, 1)
        print(f"  [{start:5d}, {end:5d})  {100 * share:5.1f} %  {leading(stalls, 3)}")
    print(f"top {top} instructions:")
    for i in sorted(code, key=lambda i: -i.samples)[:top]:
        share = 100 * i.samples / max(total, 1)
        print(f"  {i.index:5d} {share:5.1f} %  {i.text[:56]:56s}  {leading(i.stalls, 2)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="the source page: ncu --page source --csv --print-source sass")
    parser.add_argument("--split", type=int, nargs="*", default=[], help="phase starts")
    parser.add_argument("--top", type=int, default=20, help="instructions to list")
    args = parser.parse_args()
    main(args.csv, args.split, args.top)

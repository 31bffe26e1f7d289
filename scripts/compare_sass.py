"""Compare what two kdagen trees' verify kernels execute: compile a variant list in each tree
(GPU-less) and diff the normalised SASS and the register counts.

A template re-cut must not change the tuned kernels. Run ``build`` once per tree, with that
tree on PYTHONPATH (and KDAGEN_TEMPLATES at its templates), then ``compare``:

    python scripts/compare_sass.py names --arch sm_90a > /tmp/names90
    git archive BASE | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base KDAGEN_TEMPLATES=/tmp/base/templates \
        python scripts/compare_sass.py build /tmp/sass-base /tmp/names90 --arch sm_90a
    PYTHONPATH=. python scripts/compare_sass.py build /tmp/sass-new /tmp/names90 --arch sm_90a
    python scripts/compare_sass.py compare /tmp/sass-base /tmp/sass-new
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import tempfile
from pathlib import Path

DISPATCH = Path(__file__).resolve().parents[1] / "generated/nvidia-h200-sm90-132sm/dispatch.json"
# The H200 table's keys whose winners are compared besides the covering.
WINNER_KEYS = ("verify-h12-q8-i32", "verify-h12-q8-i64", "verify-h32-q4-i32",
               "verify-h12-q8-conv-tm-bf16-i32")  # fmt: skip
SPACES = {"sm_90a": "verify_sm90.yaml", "sm_100a": "verify_sm100.yaml"}


def names(arch: str) -> list[str]:
    """The space's branch covering (what CI compiles), plus the table's winners on sm_90a."""
    from kdagen.coverage import branch_cover
    from kdagen.space import Space

    picked = [v.name for v in branch_cover(Space.load(SPACES[arch]).expand().variants)]
    if arch == "sm_90a":
        entries = json.loads(DISPATCH.read_text())["entries"]
        picked += sorted({e["variant"] for key in WINNER_KEYS for e in entries[key]})
    return list(dict.fromkeys(picked))


_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_COMMENT = re.compile(r"/\*.*?\*/")
_SYMBOL = re.compile(r"kdagen_[0-9a-f]{16}|\b\w*kernel\w*\b")


def normalise(sass: str) -> list[str]:
    """The instruction lines: no addresses, encodings, comments, labels or symbol names."""
    out = []
    for line in sass.splitlines():
        line = _ADDRESS.sub("", line)
        line = _COMMENT.sub("", line).strip()
        if not line or line.startswith(("//", ".")) or line.endswith(":"):
            continue
        out.append(_SYMBOL.sub("SYM", line.rstrip(" ;")))
    return out


def build(out: Path, names_file: Path, arch: str) -> None:
    """Compile each named variant into a private cache; write its normalised SASS and figures."""
    from kdagen.compile import compile_variant, variant_dir
    from kdagen.cubin import kernel_resources
    from kdagen.sass import disassemble
    from kdagen.serve.variant import Variant

    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="kdagen-sass-"))
    for name in names_file.read_text().split():
        variant = Variant.parse(name)
        record = compile_variant(variant, arch, cache)
        cubin = variant_dir(variant, cache) / arch / "kernel.cubin"
        if not record.ok:
            print(f"{name}: {record.error}", file=sys.stderr)
            (out / f"{name}.json").write_text(json.dumps({"error": record.error}))
            continue
        lines = normalise(disassemble(cubin))
        (out / f"{name}.sass").write_text("\n".join(lines) + "\n")
        regs = kernel_resources(cubin.read_bytes())
        figures = {"instructions": len(lines), "registers": regs.registers,
                   "frame": regs.frame_bytes, "seconds": record.seconds}  # fmt: skip
        (out / f"{name}.json").write_text(json.dumps(figures))
        print(name, figures, flush=True)


def compare(before: Path, after: Path, diff: int) -> int:
    """A table per variant; the exit status is 1 where any SASS differs."""
    differs = 0
    print("| variant | instr before | instr after | regs before | regs after | identical |")
    print("|---|---|---|---|---|---|")
    for figures in sorted(before.glob("*.json")):
        name = figures.stem
        a, b = json.loads(figures.read_text()), json.loads((after / figures.name).read_text())
        if "error" in a or "error" in b:
            print(f"| {name} | {a.get('error', '')[:30]} | {b.get('error', '')[:30]} | | | no |")
            differs += 1
            continue
        sa = (before / f"{name}.sass").read_text().splitlines()
        sb = (after / f"{name}.sass").read_text().splitlines()
        same = sa == sb and a["registers"] == b["registers"]
        differs += not same
        print(f"| {name} | {a['instructions']} | {b['instructions']} | {a['registers']} "
              f"| {b['registers']} | {'yes' if same else 'no'} |")  # fmt: skip
        if not same and diff:
            lines = difflib.unified_diff(sa, sb, "before", "after", n=2, lineterm="")
            print("\n".join(list(lines)[:diff]), file=sys.stderr)
    return int(differs > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("names")
    p.add_argument("--arch", default="sm_90a", choices=sorted(SPACES))
    p = sub.add_parser("build")
    p.add_argument("out", type=Path)
    p.add_argument("names_file", type=Path)
    p.add_argument("--arch", default="sm_90a", choices=sorted(SPACES))
    p = sub.add_parser("compare")
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--diff", type=int, default=0, help="print up to N diff lines per variant")
    args = parser.parse_args()
    if args.command == "names":
        print("\n".join(names(args.arch)))
    elif args.command == "build":
        build(args.out, args.names_file, args.arch)
    else:
        return compare(args.before, args.after, args.diff)
    return 0


if __name__ == "__main__":
    sys.exit(main())

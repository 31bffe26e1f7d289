"""Which lines of the device helpers (kdagen/dsl) CI's covering never compiles.

The covering (kdagen/coverage.py) reaches every pair of fields and template flags and every
line of the renders; a helper's ``const_expr`` branch on its arguments is none of those. This
compiles the covering GPU-less in one process under line tracing (``pip install coverage``;
about 15 minutes on 2 cores) and prints, per helper module, the statements no compile ran:
the switched-off modules whole, and any branch the covering misses (add the pair of flags that
selects it to ``render.template_flags``'s context, or a variant to a test's ``INSPECTED``).

    python scripts/helper_reach.py [--match NAME,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

# The helpers of the kdagen that compiles (found without importing it, so the tracer starts
# before they load).
DSL = Path(importlib.util.find_spec("kdagen").submodule_search_locations[0]) / "dsl"


def unreached(match: str | None) -> dict[str, list[int]]:
    """Helper module -> the statements that the covering's compiles did not execute."""
    try:
        import coverage
        from coverage.parser import PythonParser
    except ImportError:
        raise SystemExit(
            "helper_reach.py needs the coverage package: pip install coverage"
        ) from None

    tracer = coverage.Coverage(include=[f"{DSL}/*"], data_file=None)
    tracer.start()
    from kdagen import compile as kcompile
    from kdagen.coverage import branch_cover
    from kdagen.space import default_variants, name_matches

    root = Path(tempfile.mkdtemp(prefix="kdagen-reach-"))
    for variant in branch_cover(default_variants()):
        if not name_matches(variant.name, match):
            continue
        for arch in variant.spec.archs:
            record = kcompile.compile_variant(variant, arch, root=root, force=True)
            print(f"{record.status:5} {arch} {variant.name}", flush=True)
    tracer.stop()
    data = tracer.get_data()
    out: dict[str, list[int]] = {}
    for path in sorted(DSL.glob("*.py")):
        parser = PythonParser(filename=str(path))
        parser.parse_source()
        out[path.name] = sorted(parser.statements - set(data.lines(str(path)) or ()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", help="only covered variants whose name contains this")
    args = parser.parse_args()
    for module, lines in unreached(args.match).items():
        print(f"{module}: {len(lines)} statements not run" + (f" {lines}" if lines else ""))


if __name__ == "__main__":
    main()

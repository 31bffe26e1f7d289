"""The ``kdagen`` command line: space -> variants -> render -> compile -> check -> bench.

Each command is a thin shell over one module: ``variants`` (kdagen.space), ``render``
(kdagen.render, templates/), ``compile`` (kdagen.compile), ``check`` (kdagen.check),
``bench`` (kdagen.bench).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import typer

from kdagen.space import DEFAULT_SPACES, Space, SpaceError
from kdagen.variant import Variant, VariantError

app = typer.Typer(
    help="Generate, compile, check and time KDA speculative verify/commit kernels (CuTe DSL).",
    no_args_is_help=True,
    add_completion=False,
)

SPACE_HELP = "search-space YAML (a path, or a name in search_spaces/); default: every shipped space"


def _variants(space: list[str] | None) -> list[Variant]:
    out: list[Variant] = []
    try:
        for name in space or DEFAULT_SPACES:
            out += Space.load(name).expand().variants
    except SpaceError as err:
        raise typer.BadParameter(str(err)) from None
    return out


def _filter(variants: list[Variant], match: str | None) -> list[Variant]:
    return [v for v in variants if match is None or match in v.name]


@app.command()
def variants(
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    names: bool = typer.Option(True, help="list every variant name"),
) -> None:
    """What a search space expands to: the variants, and what each constraint removed."""
    for name in space or DEFAULT_SPACES:
        try:
            loaded = Space.load(name)
        except SpaceError as err:
            raise typer.BadParameter(str(err)) from None
        expansion = loaded.expand()
        typer.echo(
            f"space {loaded.name} ({loaded.kernel}): {len(expansion.variants)} variants "
            f"from {expansion.points} points"
        )
        if expansion.variants and all(v.spec.archs == ("sm_100a",) for v in expansion.variants):
            typer.echo(
                "  sm_100a only: statically verified (compiled and inspected), untuned defaults"
            )
        for reason, count in expansion.removed.most_common():
            typer.echo(f"  removed {count:4d}: {reason}")
        if names:
            for v in expansion.variants:
                typer.echo(f"  {v.name}")


@app.command()
def render(
    variant: str = typer.Argument(..., help="a variant name, as `kdagen variants` prints"),
) -> None:
    """Print the CuTe-DSL module a variant renders to."""
    from kdagen.render import render as render_source

    try:
        v = Variant.parse(variant)
    except VariantError as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(render_source(v), nl=False)


@app.command()
def compile(
    arch: list[str] = typer.Option(["sm_90a"], "--arch", "-a", help="sm_90a and/or sm_100a"),
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    jobs: int = typer.Option(0, "--jobs", "-j", help="worker processes (0: one per CPU)"),
    match: str = typer.Option(None, help="only variants whose name contains this"),
    force: bool = typer.Option(False, help="ignore the compile cache"),
) -> None:
    """Compile every variant without a GPU, in worker processes, with an on-disk cache."""
    from kdagen.compile import ARCHS, compile_many

    bad = [a for a in arch if a not in ARCHS]
    if bad:
        raise typer.BadParameter(f"--arch {bad[0]!r} is not supported; allowed: {list(ARCHS)}")
    selected = _filter(_variants(space), match)
    typer.echo(f"compiling {len(selected)} variants for {', '.join(arch)}", err=True)
    done = [0]

    def progress(record: object) -> None:
        done[0] += 1
        if done[0] % 10 == 0:
            typer.echo(f"  {done[0]} compiled", err=True)

    records = compile_many(selected, arch, jobs=jobs, force=force, on_result=progress)
    width = max((len(r.variant) for r in records), default=7)
    typer.echo(
        f"{'variant':<{width}}  {'arch':<7} {'sec':>6} {'regs':>5} {'frame':>5} {'smem':>6}  status"
    )
    for r in records:
        if r.status == "skipped":
            continue
        status = ("ok (cached)" if r.cached else "ok") if r.ok else "FAILED"
        if r.static_only:
            status += ", static only"
        typer.echo(
            f"{r.variant:<{width}}  {r.arch:<7} {r.seconds:>6.2f} {_num(r.registers):>5} "
            f"{_num(r.frame_bytes):>5} {_num(r.smem_bytes):>6}  {status}"
        )
    failed = [r for r in records if r.failed]
    skipped = [r for r in records if r.status == "skipped"]
    for r in failed:
        typer.echo(f"\n{r.variant} [{r.arch}] failed:\n{r.error}", err=True)
    summary = f"{len(records) - len(failed) - len(skipped)} ok, {len(failed)} failed"
    if skipped:
        summary += f", {len(skipped)} skipped (their path targets another arch)"
    typer.echo(summary)
    if any(r.static_only for r in records):
        typer.echo(
            "static only: no sm_100 GPU has run the sm_100a builds; they are compiled and "
            "inspected (tests/test_sm100.py), untuned defaults"
        )
    if failed:
        raise typer.Exit(1)


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _runnable(variants: list[Variant]) -> tuple[str, list[Variant]]:
    """The variants this GPU can run; the others are listed as refused, with why. Exits with
    status 2 when none is left."""
    from kdagen import runtime
    from kdagen.check import gpu_refusal

    arch = runtime.device_arch()
    refusals = [(v, gpu_refusal(v, arch)) for v in variants]
    refused = [why for _, why in refusals if why]
    for why in refused[:5]:
        typer.echo(why)
    if len(refused) > 5:
        typer.echo(f"... and {len(refused) - 5} more refused for the same reasons")
    runnable = [v for v, why in refusals if not why]
    if not runnable:
        typer.echo(f"kdagen: nothing to run on this {arch} GPU", err=True)
        raise typer.Exit(2)
    return arch, runnable


def _require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        typer.echo("kdagen: this command needs a CUDA GPU; none is visible", err=True)
        raise typer.Exit(2)


@app.command()
def check(
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    match: str = typer.Option(None, help="only variants whose name contains this"),
    seed: int = typer.Option(None, help="input seed (default: random, printed)"),
    json_out: Path = typer.Option(None, "--json", help="write every case result here"),
) -> None:
    """Run every variant on the GPU against the fp64 reference, edge cases included."""
    _require_gpu()
    from kdagen.check import check_variant

    seed = random.randrange(1 << 30) if seed is None else seed
    arch, selected = _runnable(_filter(_variants(space), match))
    typer.echo(f"checking {len(selected)} variants on {arch}, seed {seed}")
    results = []
    failed = set()
    for v in selected:
        cases = check_variant(v, seed)
        results += cases
        worst = max(cases, key=lambda c: (not c.passed, c.max_rel))
        ok = all(c.passed for c in cases)
        if not ok:
            failed.add(v.name)
        detail = worst.error or (
            f"max_rel {worst.max_rel:.2e} rel_l2 {worst.rel_l2:.2e} max_abs {worst.max_abs:.2e}"
            f" untouched {'ok' if worst.untouched_ok else 'CHANGED'}"
            f" repeat {'same' if worst.deterministic else 'DIFFERS'}"
        )
        typer.echo(
            f"{'PASS' if ok else 'FAIL'}  {v.name}  ({len(cases)} cases; worst {worst.case}: {detail})"
        )
    if json_out:
        json_out.write_text(json.dumps([c.__dict__ for c in results], indent=1))
    typer.echo(f"{len(selected) - len(failed)} passed, {len(failed)} failed")
    if failed:
        raise typer.Exit(1)


@app.command()
def bench(
    space: list[str] = typer.Option(["commit.yaml"], "--space", "-s", help=SPACE_HELP),
    heads: int = typer.Option(12, help="heads H"),
    window: int = typer.Option(8, help="window Q"),
    batches: str = typer.Option("1,4,16,64,256,512", help="comma-separated batch sizes"),
    match: str = typer.Option(None, help="only variants whose name contains this"),
    no_torch: bool = typer.Option(False, help="skip the plain-torch baseline"),
    out: Path = typer.Option(None, help="write the rows as JSON here"),
) -> None:
    """Time commit variants of one contract key over a batch sweep (cold L2, CUDA graphs)."""
    _require_gpu()
    from kdagen.bench import bench_commit, copy_bandwidth, rows_as_dicts

    candidates = [
        v for v in _filter(_variants(space), match)
        if v.heads == heads and v.window == window and v.slot_dtype == "int32"
    ]  # fmt: skip
    if not candidates:
        raise typer.BadParameter(f"no variants with H={heads}, Q={window} in the space")
    _, chosen = _runnable(candidates)
    bw = copy_bandwidth()
    typer.echo(f"copy bandwidth {bw / 1e12:.3f} TB/s; {len(chosen)} variants")
    rows = bench_commit(chosen, [int(b) for b in batches.split(",")], bw, with_torch=not no_torch)
    if out:
        out.write_text(json.dumps({"copy_bandwidth": bw, "rows": rows_as_dicts(rows)}, indent=1))
    best: dict[int, object] = {}
    for r in rows:
        if r.batch not in best or r.median_us < best[r.batch].median_us:  # type: ignore[attr-defined]
            best[r.batch] = r
    typer.echo(
        f"{'B':>5} {'B*H':>6} {'floor us':>9} {'best us':>9} {'spread%':>8} {'%floor':>7} {'torch us':>9}  best variant"
    )
    for b, r in sorted(best.items()):
        spread = 100 * (r.p90_us - r.p10_us) / r.median_us  # type: ignore[attr-defined]
        typer.echo(
            f"{b:>5} {b * heads:>6} {r.floor_us:>9.2f} {r.median_us:>9.2f} {spread:>8.1f} "  # type: ignore[attr-defined]
            f"{r.pct_of_floor:>7.1f} {r.torch_us or float('nan'):>9.2f}  {r.variant}"  # type: ignore[attr-defined]
        )


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

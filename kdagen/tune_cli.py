"""The ``kdagen tune`` command (registered on the app in kdagen/cli.py).

Kept out of cli.py so the command stays a thin shell over kdagen.tune, and light to import:
Optuna and the tuner load only when the command runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from kdagen.report import StudyResult

SPACE_HELP = "search-space YAML (a path, or a name in search_spaces/); default: every shipped space"


def tune(
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    workloads: Path = typer.Option(
        Path("workloads.yaml"), help="workloads YAML (a path, or a name in search_spaces/)"
    ),
    trials: int = typer.Option(
        None, "--trials", "-n", min=1, help="candidates scored per study by TPE [default: 32]"
    ),
    exhaustive: bool = typer.Option(False, help="score every candidate (small spaces)"),
    storage: str = typer.Option(
        None,
        help="Optuna storage URL that tune processes on several GPUs or hosts share: "
        "sqlite:///PATH, journal:///PATH (a journal file: one host, or a shared file system) or "
        "a database URL such as postgresql://user@host/db [default: "
        "`sqlite:///<out>/<gpu>/studies.db`, kept packed beside it as studies.db.xz]",
    ),
    devices: str = typer.Option(
        "all",
        help="GPUs to tune on, one worker each: all (every visible one) or indices such as 0,1",
    ),
    claim_timeout: float = typer.Option(
        60.0,
        min=1.0,
        help="seconds a study claimed by a silent tune process (on this storage) waits before "
        "another process takes it over",
    ),
    out: Path = typer.Option(
        None,
        help="output root; results go to `<out>/<gpu-fingerprint>/` [default: the tables the "
        "run-time reads: $KDAGEN_GENERATED, else `generated/` of the checkout or, installed "
        "without -e, of the installed package (a reinstall replaces it)]",
    ),
    match: str = typer.Option(None, help="only contract keys containing this (or one of a,b,...)"),
    jobs: int = typer.Option(0, "--jobs", "-j", min=0, help="compile processes (0: one per CPU)"),
    timeout: float = typer.Option(
        120.0, help="seconds one GPU call (check, or one timing) may take before it fails"
    ),
    rounds: int = typer.Option(5, min=1, help="interleaved re-timing rounds of the finalists"),
    seed: int = typer.Option(0, help="sampler seed (and check input seed)"),
    repick: Path = typer.Option(
        None,
        help="a tuned folder (`generated/<gpu>`): pick its stored finals again under the current "
        "rule and rewrite its outputs; no GPU, nothing re-timed",
    ),
    restamp: Path = typer.Option(
        None,
        help="a tuned folder (`generated/<gpu>`): after a refactor, keep the studies whose "
        "kernels compile to the machine code they measured and rewrite its outputs (planned "
        "from --space if given, else its last run's spaces; a carried kernel stays carried); "
        "no GPU, compiles only, refused if any kernel's code changed",
    ),
    checked: list[Path] = typer.Option(
        None,
        help="kdagen check --json files: a candidate that passed there at the kernel it "
        "renders to now is timed without checking it again (a sharded check first is faster)",
    ),
    refresh: bool = typer.Option(
        False,
        help="a study whose kernels changed since it was measured (same GPU and candidates) "
        "checks and times again only its 6 best candidates, its finalists and the default, "
        "then re-picks: a re-tune after a kernel fix in a fraction of the time; a later run "
        "without --refresh completes its search",
    ),
    simulate: bool = typer.Option(
        False,
        hidden=True,
        envvar="KDAGEN_TUNE_SIMULATE",
        help="for tests and CI: a simulated GPU and compiler, nothing is measured",
    ),
) -> None:
    """Tune: an Optuna study per (contract key, batch bucket); dispatch table, winners and
    report.md in `<out>/<gpu-fingerprint>/`. A killed run resumes where it stopped; after a
    template edit only the studies whose kernels render differently are measured again.
    Studies are spread over the GPUs of --devices, and over every tune process given the same
    --storage (on this host or others): each study is measured once, and each process writes
    the same table when all are done."""
    if exhaustive and trials is not None:
        raise typer.BadParameter("give --trials N or --exhaustive, not both")
    if repick is not None:
        _repick(repick)
        return
    if restamp is not None:
        _restamp(restamp, jobs, space)
        return
    from kdagen.tune import run

    result = _run_tuner("tune", run, simulate, space, workloads=workloads, trials=trials or 32,
                        exhaustive=exhaustive, storage=storage, out=out, match=match, jobs=jobs,
                        timeout_s=timeout, rounds=rounds, seed=seed, devices=devices,
                        claim_timeout_s=claim_timeout, checked=tuple(checked or ()),
                        refresh=refresh)  # fmt: skip
    typer.echo(summary_table(result.results, result.simulated))
    typer.echo(f"wrote {result.folder} (dispatch.json, winners.json, report.md, plots/)")


def regenerate(
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    workloads: Path = typer.Option(
        Path("workloads.yaml"), help="workloads YAML (a path, or a name in search_spaces/)"
    ),
    out: Path = typer.Option(
        None,
        help="tables root; this GPU's goes to `<out>/<gpu-fingerprint>/` [default: as `kdagen "
        "tune`'s, the tables the run-time reads]",
    ),
    jobs: int = typer.Option(0, "--jobs", "-j", min=0, help="compile processes (0: one per CPU)"),
    rounds: int = typer.Option(5, min=1, help="interleaved re-timing rounds of the finalists"),
    refresh: bool = typer.Option(
        False,
        help="studies whose kernels changed time again only their leaders (kdagen tune "
        "--refresh); the rest of the table as without it",
    ),
    simulate: bool = typer.Option(
        False,
        hidden=True,
        envvar="KDAGEN_TUNE_SIMULATE",
        help="for tests and CI: a simulated GPU and compiler, nothing is measured",
    ),  # fmt: skip
) -> None:
    """What CI runs on a GPU runner: `kdagen doctor`; when this GPU's table is missing, stale
    or incomplete, `kdagen tune` (every point of each study, resuming the committed studies),
    a check of every winner and `<out>/<gpu>/regenerate.md` (the pull request's body). Exit 0
    when nothing failed, 1 when a winner failed its check."""
    from kdagen.regenerate import regenerate as run_regenerate

    done = _run_tuner("regenerate", run_regenerate, simulate, space, workloads=workloads,
                      exhaustive=True, out=out, jobs=jobs, rounds=rounds,
                      refresh=refresh)  # fmt: skip
    if done.tuned is None:
        return
    typer.echo(f"wrote {done.tuned.folder} ({len(done.checks)} winners checked, "
               f"{len(done.failed)} failed)")  # fmt: skip
    if done.failed:
        raise typer.Exit(1)


def _run_tuner(command: str, fn: Any, simulate: bool, space: list[str] | None,
               **fields: Any) -> Any:  # fmt: skip
    """``fn(TuneOptions(**fields), echo)`` on the GPU (or the simulated one), its errors as one
    line and exit 2, an interrupt as exit 130."""
    if not simulate:
        from kdagen.cli import _require_gpu  # loaded already: cli registers this command

        _require_gpu(command)
    from kdagen.space import DEFAULT_SPACES, SpaceError
    from kdagen.tune import TuneError, TuneOptions

    options = TuneOptions(spaces=tuple(space or DEFAULT_SPACES), **fields)
    if simulate:
        from kdagen.simulate import DEFAULT_FAILURES

        options.simulate = DEFAULT_FAILURES
    try:
        return fn(options, echo=lambda line: typer.echo(line, err=True))
    except (TuneError, SpaceError) as err:
        typer.echo(f"kdagen {command}: {err}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(f"kdagen {command}: interrupted; run the same command again to resume",
                   err=True)  # fmt: skip
        raise typer.Exit(130) from None


def summary_table(results: Sequence[StudyResult], simulated: bool) -> str:
    """One row per study: winner, its time, the default's, speedup, margin, why it won."""
    from kdagen.report import fmt, short_name

    rows = [("contract key", "B", "trials", "failed", "winner", "us", "default us", "speedup",
             "vs runner-up", "pick")]  # fmt: skip
    for r in sorted(results, key=lambda r: (r.key, r.batch)):
        f = r.final
        rows.append((
            r.key, str(r.batch), str(r.trials), str(len(r.failures)),
            short_name(f.get("winner"), r.key), fmt(f.get("time_us")), fmt(f.get("default_us")),
            f"{fmt(r.speedup, '.3f')}x", f"{fmt(f.get('margin_runner_up_pct'), '+.1f')} %",
            str(f.get("pick", "-")),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    if simulated:
        lines.insert(0, "SIMULATED (kdagen/simulate.py): no time below was measured")
    return "\n".join(lines)


def _repick(folder: Path) -> None:
    from kdagen.tune import TuneError, repick

    try:
        result = repick(folder)
    except TuneError as err:
        typer.echo(f"kdagen tune: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(summary_table(result.results, result.simulated))
    if result.notes:
        typer.echo(f"{result.folder}: {'; '.join(result.notes)}")
        return
    typer.echo(f"picked again and rewrote {result.folder} (nothing re-timed)")


def _restamp(folder: Path, jobs: int, spaces: list[str] | None) -> None:
    from kdagen.tune import TuneError, restamp

    try:
        result = restamp(folder, jobs, echo=lambda line: typer.echo(line, err=True), spaces=spaces)
    except TuneError as err:
        typer.echo(f"kdagen tune: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{result.folder}: {'; '.join(result.notes)} (same machine code; nothing timed)")

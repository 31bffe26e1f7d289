"""``kdagen regenerate``: what CI runs on a GPU runner to keep that GPU's table current.

1. ``kdagen doctor`` for the runner's GPU: a fresh table of its own with every study of the
   workloads tuned is left alone, byte for byte.
2. Otherwise ``kdagen tune`` into ``<out>/<fingerprint>/``, resuming the committed studies
   (only those whose kernels render differently, or that are missing, are measured).
3. Every winner of the new table is checked once more on the GPU (fresh inputs).
4. ``<out>/<fingerprint>/regenerate.md`` says what happened: the pull request's body.

The workflow in ``.github/workflows/regenerate.yml`` calls this and opens the pull request
when ``generated/`` changed.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kdagen.doctor import SERVED, Diagnosis, diagnose
from kdagen.tune import TuneOptions, TuneResult, run
from kdagen.worker import Worker, WorkerFailure

SUMMARY = "regenerate.md"


@dataclass
class Regeneration:
    fingerprint: str
    before: Diagnosis
    tuned: TuneResult | None = None
    after: Diagnosis | None = None
    checks: dict[str, str | None] = field(default_factory=dict)  # winner -> failure or None

    @property
    def failed(self) -> list[str]:
        return sorted(name for name, why in self.checks.items() if why)


def regenerate(options: TuneOptions, echo: Callable[[str], None] = print) -> Regeneration:
    """Doctor, then tune and check when the GPU's table is missing, stale or incomplete."""
    worker = _evaluator(options)
    try:
        device = worker.call("device", timeout=options.start_timeout_s)
        fingerprint = str(device["fingerprint"])
        root = Path(options.out) if options.out else None
        before = diagnose(fingerprint, options.workloads, options.spaces, root)
        echo("\n".join(before.lines()))
        done = Regeneration(fingerprint, before)
        if before.code == SERVED:
            echo(f"{fingerprint}: nothing to regenerate")
            return done
        done.tuned = run(options, echo)
        done.after = diagnose(fingerprint, options.workloads, options.spaces, root)
        for name in _winners(done.tuned.folder):
            done.checks[name] = _check(worker, name, options)
        _write_summary(done)
        return done
    finally:
        worker.close()


def _evaluator(options: TuneOptions) -> Worker:
    if options.simulate is not None:
        return Worker("kdagen.simulate:SimulatedEvaluator", {"failures": options.simulate},
                      options.start_timeout_s)  # fmt: skip
    return Worker("kdagen.worker:GpuEvaluator", {}, options.start_timeout_s)


def _winners(folder: Path) -> list[str]:
    rows = json.loads((folder / "winners.json").read_text())
    return sorted({row["winner"] for row in rows if row.get("winner")})


def _check(worker: Worker, name: str, options: TuneOptions) -> str | None:
    """The check's failure for one winner, or None when it passes (seed: the tune's + 1)."""
    try:
        return worker.call("check", name, options.seed + 1, timeout=options.timeout_s)
    except WorkerFailure as failure:
        return failure.reason


def _write_summary(done: Regeneration) -> Path:
    assert done.tuned is not None and done.after is not None
    folder = done.tuned.folder
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# Regenerated dispatch table for {done.fingerprint} ({stamp})",
        "",
        "## Before (kdagen doctor)",
        "",
        *[f"    {line}" for line in done.before.lines()],
        "",
        "## Tune",
        "",
        f"{len(done.tuned.results)} studies in `{folder.name}/`, {done.tuned.wall_s:.0f} s"
        f"{' (SIMULATED: nothing was measured)' if done.tuned.simulated else ''}.",
        "",
        "## Check of every winner",
        "",
        f"{len(done.checks)} winners, {len(done.failed)} failed"
        + "".join(f"\n- `{name}`: {done.checks[name]}" for name in done.failed),
        "",
        "## After (kdagen doctor)",
        "",
        *[f"    {line}" for line in done.after.lines()],
        "",
    ]
    path = folder / SUMMARY
    path.write_text("\n".join(lines))
    return path

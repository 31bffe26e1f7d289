"""What a tuning run leaves in ``generated/<fingerprint>/``: dispatch table, winners, report.

- ``dispatch.json``: (contract key, batch bucket) -> tuning fields, stamped with the
  fingerprint, DSL version and template hashes (``kdagen.serve.dispatch``), plus a per-GPU default
  per kernel and bucket: the config that won the most studies there.
- ``winners.json``: per study the winner, its interleaved time, margins over the runner-up
  and the default, the finalists' round times, trials, and every failure with its reason.
- ``report.md`` with a log-log SVG plot per contract key (``plots/``): winner and default
  latency against batch, the HBM floor, and peers (FlashInfer) when the GPU side timed them.
- ``runs.json``: wall time and options of every run into this folder.

Everything is built from the studies in the storage, so a resumed run, or runs on different
``--match`` subsets, add up to one table. The plots are plain SVG (no matplotlib on the GPU
host).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from kdagen.render import kernels_digest
from kdagen.search import recorded
from kdagen.serve.dispatch import DispatchTable, Entry, write_table


@dataclass
class StudyResult:
    """One (contract key, batch bucket) study as the outputs need it."""

    key: str
    kernel: str
    batch: int
    workloads: list[str]
    trials: int  # distinct candidates scored
    candidates: int
    failures: dict[str, str]  # variant -> reason
    final: dict[str, Any]
    wall_s: float
    efficiency: dict[str, Any] | None = None
    failure_kinds: dict[str, int] = field(default_factory=dict)
    scored: list[str] = field(default_factory=list)  # every variant measured (or failed)
    refreshed: bool = False  # re-timed its leaders after a kernel change (tune --refresh)

    @property
    def speedup(self) -> float | None:
        """Untuned default time over tuned winner time (interleaved re-timing)."""
        t, d = self.final.get("time_us"), self.final.get("default_us")
        return d / t if t and d else None


def result_of(study: optuna.Study) -> StudyResult:
    attrs = study.user_attrs
    scored = recorded(study)
    failures = {n: str(o.attrs.get("reason", "")) for n, o in scored.items() if not o.ok}
    kinds = Counter(str(o.attrs.get("kind", "error")) for o in scored.values() if not o.ok)
    return StudyResult(
        key=attrs["key"], kernel=attrs["kernel"], batch=int(attrs["batch"]),
        workloads=list(attrs.get("workloads", [])), trials=len(scored),
        candidates=int(attrs.get("candidates", 0)), failures=failures,
        final=dict(attrs.get("final") or {}), wall_s=float(attrs.get("wall_s", 0.0)),
        efficiency=attrs.get("efficiency"), failure_kinds=dict(kinds), scored=sorted(scored),
        refreshed=bool(attrs.get("refresh_set")),
    )  # fmt: skip


# ---- dispatch table ----


def build_table(
    results: Sequence[StudyResult],
    stamp: dict[str, Any],
    device: dict[str, Any],
    space: dict[str, dict[str, list[str]]] | None = None,
    carried: dict[str, dict[str, str]] | None = None,
) -> DispatchTable:
    """The dispatch table of ``results``; ``space``: kernel -> contract key -> every variant of
    the search spaces tuned from (the lookup stays inside it); ``carried``: the carry records
    (``kdagen carry``) of kernels whose entries hold timings of an earlier render."""
    entries: dict[str, list[Entry]] = defaultdict(list)
    for r in sorted(results, key=lambda r: (r.key, r.batch)):
        f = r.final
        if not f.get("winner"):
            continue
        entries[r.key].append(
            Entry(
                batch=r.batch, tuning=dict(f["tuning"]), time_us=f.get("time_us"),
                margin_runner_up_pct=f.get("margin_runner_up_pct"),
                margin_default_pct=f.get("margin_default_pct"), variant=f["winner"],
                note=f.get("pick", ""),
            )
        )  # fmt: skip
    defaults = gpu_defaults(results)
    covered = {r.kernel for r in results if r.key in entries} | set(defaults)
    measured = measured_variants(results, covered)
    return DispatchTable(
        fingerprint=stamp["fingerprint"],
        dsl_version=stamp["dsl_version"],
        template_hashes={k: h for k, h in stamp["template_hashes"].items() if k in covered},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        entries=dict(entries),
        defaults=defaults,
        device={k: v for k, v in device.items() if k != "fingerprint"},
        measured=measured,
        render_hashes={k: kernels_digest(names) for k, names in measured.items()},
        space={k: v for k, v in (space or {}).items() if k in covered},
        carried={k: dict(v) for k, v in (carried or {}).items() if k in covered},
    )


def measured_variants(results: Sequence[StudyResult], kernels: set[str]) -> dict[str, list[str]]:
    """Per kernel, every variant its studies scored: what the table's winners were chosen
    among, so what its freshness depends on."""
    found: dict[str, set[str]] = defaultdict(set)
    for r in results:
        if r.kernel in kernels:
            found[r.kernel].update(r.scored)
    return {k: sorted(v) for k, v in sorted(found.items())}


def gpu_defaults(results: Sequence[StudyResult]) -> dict[str, list[Entry]]:
    """Per kernel and bucket, the tuning config that won the most studies (ties: the one
    whose wins were fastest on average): what an untuned contract key of this GPU gets."""
    wins: dict[tuple[str, int], Counter[str]] = defaultdict(Counter)
    times: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    for r in results:
        if r.final.get("winner"):
            config = json.dumps(r.final["tuning"], sort_keys=True)
            wins[(r.kernel, r.batch)][config] += 1
            times[(r.kernel, r.batch, config)].append(float(r.final["time_us"]))
    out: dict[str, list[Entry]] = defaultdict(list)
    for (kernel, batch), counts in sorted(wins.items()):
        config, n = min(
            counts.items(),
            key=lambda kv: (-kv[1], statistics.mean(times[(kernel, batch, kv[0])]), kv[0]),
        )
        out[kernel].append(
            Entry(batch=batch, tuning=json.loads(config),
                  note=f"won {n} of {sum(counts.values())} studies at this bucket")
        )  # fmt: skip
    return dict(out)


# ---- winners.json, runs.json ----


def winners(results: Sequence[StudyResult]) -> list[dict[str, Any]]:
    return [
        {"key": r.key, "batch": r.batch, "workloads": r.workloads, "trials": r.trials,
         "candidates": r.candidates, "wall_s": r.wall_s, **r.final, "failures": r.failures,
         "efficiency": r.efficiency} | ({"refreshed": True} if r.refreshed else {})
        for r in sorted(results, key=lambda r: (r.key, r.batch))
    ]  # fmt: skip


def append_run(folder: Path, wall_s: float, options: dict[str, Any]) -> list[dict[str, Any]]:
    path = folder / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append({"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "wall_s": round(wall_s, 1), "options": options})  # fmt: skip
    path.write_text(json.dumps(runs, indent=1) + "\n")
    return runs


# ---- plots ----


def key_series(key: str, results: Sequence[StudyResult]) -> dict[str, list[tuple[float, float]]]:
    """Latency against batch for one contract key: the tuned winner and the untuned default
    (both from the interleaved re-timing), the HBM floor, and each peer the GPU side timed."""
    rows = sorted(
        (r for r in results if r.key == key and r.final.get("winner")), key=lambda r: r.batch
    )

    def points(get: Any) -> list[tuple[float, float]]:
        return [(float(r.batch), float(v)) for r in rows if (v := get(r.final)) is not None]

    series = {
        "tuned winner": points(lambda f: f.get("time_us")),
        "untuned default": points(lambda f: f.get("default_us")),
    }
    for peer in sorted({p for r in rows for p in (r.final.get("peers") or {})}):
        series[peer] = points(lambda f, p=peer: (f.get("peers") or {}).get(p))
    series["HBM floor"] = points(lambda f: f.get("floor_us"))
    return {name: pts for name, pts in series.items() if pts}


def plot_key(key: str, results: Sequence[StudyResult], path: Path, simulated: bool) -> Path | None:
    from kdagen.plot import loglog_svg

    series = key_series(key, results)
    if not series:
        return None
    title = f"{key}{' (SIMULATED)' if simulated else ''}"
    return loglog_svg(series, title, "batch B (requests)", "latency (us)", path)


# ---- report.md ----


def geomean(values: Sequence[float]) -> float | None:
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else None


def fmt(value: Any, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def short_name(name: str | None, key: str) -> str:
    if not name:
        return "-"
    return name[len(key) + 1 :] if name.startswith(key + "-") else name


def report_md(
    results: Sequence[StudyResult],
    stamp: dict[str, Any],
    device: dict[str, Any],
    runs: Sequence[dict[str, Any]],
) -> str:
    simulated = bool(device.get("simulated"))
    keys = sorted({r.key for r in results})
    lines = [f"# Tuning report: {stamp['fingerprint']}", ""]
    if simulated:
        lines += ["**SIMULATED: no GPU ran anything. Times come from the toy model of "
                  "`kdagen/simulate.py`; this folder only shows what a real run writes.**", ""]  # fmt: skip
    hashes = ", ".join(f"{k} `{v}`" for k, v in stamp["template_hashes"].items())
    lines += [
        f"Device: {device.get('name', '?')}, compute capability {device.get('compute_capability', '?')}, "
        f"{device.get('sms', '?')} SMs, CUDA {device.get('cuda', '?')}, torch {device.get('torch', '?')}. "
        f"nvidia-cutlass-dsl {stamp['dsl_version']}; template hashes: {hashes}.",
        "",
        "## Summary",
        "",
    ]
    trials = [r.trials for r in results]
    kinds: Counter[str] = Counter()
    for r in results:
        kinds.update(r.failure_kinds)
    total_wall = sum(float(run.get("wall_s", 0)) for run in runs)
    lines += [
        f"- Tuning wall time: {total_wall / 60:.1f} min over {len(runs)} run(s) "
        f"(studies alone: {sum(r.wall_s for r in results) / 60:.1f} min).",
        f"- Studies (contract key x batch bucket): {len(results)}; trials per study (distinct "
        f"candidates scored): median {fmt(statistics.median(trials) if trials else None, 'g')}, "
        f"min {min(trials, default=0)}, max {max(trials, default=0)}, of "
        f"{max((r.candidates for r in results), default=0)} candidates at most"
        + refreshed_note(results)
        + ".",
        "- Failed candidates by reason (per study, a variant failing everywhere counts in each): "
        + (", ".join(f"{k} {n}" for k, n in kinds.most_common()) or "none")
        + ".",
        "",
        "Speedup of the tuned winner over the untuned default (the run-time heuristic), both "
        "re-timed together, interleaved; geometric mean over the batch buckets:",
        "",
        "| workload | contract key | buckets | geomean speedup | max speedup |",
        "|---|---|---|---|---|",
    ]
    for workload, key in sorted({(w, r.key) for r in results for w in r.workloads}):
        ups = [r.speedup for r in results if r.key == key and r.speedup]
        lines.append(f"| {workload} | `{key}` | {len(ups)} | {fmt(geomean(ups), '.3f')}x | "
                     f"{fmt(max(ups, default=None), '.3f')}x |")  # fmt: skip
    lines += ["", *efficiency_md(results), "", "## Per contract key", ""]
    for key in keys:
        lines += key_md(key, [r for r in results if r.key == key])
    return "\n".join(lines) + "\n"


def efficiency_md(results: Sequence[StudyResult]) -> list[str]:
    lines = ["## Search efficiency", ""]
    done = [r for r in results if r.efficiency]
    if not done:
        return lines + [
            "Not measured: no study of this folder scored every candidate. Run "
            "`kdagen tune --exhaustive --match KEY` on a small contract key into this folder.",
        ]
    lines += [
        "Every study that scored all its candidates is replayed on the CPU against its recorded "
        "times: TPE as the tuner configures it, 11 seeds, counting distinct candidates scored "
        'until one is within 3 % of that study\'s best. "TPE" starts from nothing; "TPE + '
        'default" enqueues the default config first, as the tuner does; "random" is the '
        "expected count of uniform draws without replacement.",
        "",
        "| study | candidates | TPE (median) | TPE per seed | TPE + default (median) | random |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(done, key=lambda r: (r.key, r.batch)):
        e = r.efficiency or {}
        lines.append(f"| `{r.key}` b{r.batch} | {e['candidates']} | {e['median']:g} | "
                     f"{' '.join(map(str, e['trials']))} | {e['seeded_median']:g} | "
                     f"{e['random_expected']:g} |")  # fmt: skip
    tpe = statistics.median(float((r.efficiency or {})["median"]) for r in done)
    seeded = statistics.median(float((r.efficiency or {})["seeded_median"]) for r in done)
    lines += ["", f"Median over these studies: **TPE {tpe:g} trials** to come within 3 % of the "
                  f"exhaustive best ({seeded:g} with the default seeded first)."]  # fmt: skip
    return lines


def refreshed_note(results: Sequence[StudyResult]) -> str:
    """The summary's word on studies re-timed after a kernel change instead of searched."""
    n = sum(r.refreshed for r in results)
    if not n:
        return ""
    return (f"; {n} refreshed after a kernel change (their leaders, finalists and default timed "
            "again, no new search: a run without --refresh completes them)")  # fmt: skip


def key_md(key: str, rows: Sequence[StudyResult]) -> list[str]:
    rows = sorted(rows, key=lambda r: r.batch)
    workloads = sorted({w for r in rows for w in r.workloads})
    lines = [
        f"### `{key}` (workloads: {', '.join(workloads)})",
        "",
        f"![{key}](plots/{key}.svg)",
        "",
        "| B | winner | us | default | default us | speedup | vs runner-up | vs default | "
        "noise | pick | floor us | % floor | trials | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r.final
        floor, t = f.get("floor_us"), f.get("time_us")
        pct_floor = 100 * floor / t if floor and t else None
        lines.append(
            f"| {r.batch} | `{short_name(f.get('winner'), key)}` | {fmt(t)} | "
            f"`{short_name(f.get('default'), key)}` | {fmt(f.get('default_us'))} | "
            f"{fmt(r.speedup, '.3f')}x | {fmt(f.get('margin_runner_up_pct'), '+.1f')} % | "
            f"{fmt(f.get('margin_default_pct'), '+.1f')} % | {fmt(f.get('noise_pct'), '.1f')} % | "
            f"{f.get('pick', '-')} | {fmt(floor)} | {fmt(pct_floor, '.0f')} | "
            f"{r.trials}{' (refreshed)' if r.refreshed else ''} | "
            f"{len(r.failures)} |"
        )
    failures = sorted({(n, why) for r in rows for n, why in r.failures.items()})
    if failures:
        lines += ["", "Failed candidates:", ""]
        lines += [f"- `{short_name(n, key)}`: {why.splitlines()[0][:200]}" for n, why in failures]
    return [*lines, ""]


# ---- everything ----


def write_all(
    folder: Path,
    results: Sequence[StudyResult],
    stamp: dict[str, Any],
    device: dict[str, Any],
    wall_s: float,
    options: dict[str, Any],
    space: dict[str, dict[str, list[str]]] | None = None,
    carried: dict[str, dict[str, str]] | None = None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_table(folder, build_table(results, stamp, device, space, carried))
    (folder / "winners.json").write_text(json.dumps(winners(results), indent=1) + "\n")
    runs = append_run(folder, wall_s, options)
    for key in sorted({r.key for r in results}):
        plot_key(key, results, folder / "plots" / f"{key}.svg", bool(device.get("simulated")))
    (folder / "report.md").write_text(report_md(results, stamp, device, runs))

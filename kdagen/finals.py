"""Finalists: the top three of a study and the default config, re-timed together, interleaved.

Timing one config after another lets drift (clocks, temperature, a neighbour on the host)
pass for a difference between configs; interleaving A B C D A B C D ... spreads it over all
of them. The winner is picked by ``pick_winner``: noise is the larger of 1 % and the fastest's
round-to-round range; within noise of the fastest, the default config wins if it is there (a
tuned entry must earn its place), else the simplest config; only the study's candidates can
win (the points ``kdagen check`` verifies, which the run-time keeps its choices inside). A
stored final is picked again from its recorded times when that rule changes (``pick_again``),
without re-timing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import optuna

from kdagen.evaluate import CandidateEvaluator
from kdagen.search import recorded
from kdagen.serve.dispatch import nearest_point
from kdagen.serve.variant import Variant

MIN_NOISE_PCT = 1.0  # margins below this never count as a win
# The version of pick_winner's rule a final was picked under. Rule 1 also counted the second
# fastest's range as noise, so one slow round of a slower default excused its whole gap (v19's
# table: H12 Q8 B = 512 kept a default 3.5 % slower by median, and in every round). Rule 2
# let a run-time heuristic outside the study's candidates win (int64 keys, checked at one
# point, picked the heuristic's row split and grid in 30 H200 entries), which the run-time
# then refused as outside the table's space.
PICK_RULE = 3
FINALISTS = 3
# "Simpler", compared in this order: fewer CTAs per item, a shallower pipeline, a smaller
# persistent grid, smaller blocks.
SIMPLER = ("row_split", "stages", "ctas", "threads")


@dataclass(frozen=True)
class Pick:
    winner: str
    pick: str  # why: fastest, default within noise, simplest within noise
    medians: dict[str, float]
    noise_pct: float
    runner_up: str | None
    margin_runner_up_pct: float | None
    margin_default_pct: float | None


def _pct(slower: float, faster: float) -> float:
    return round(100.0 * (slower - faster) / faster, 2)


def pick_winner(
    times: dict[str, list[float]],
    default: str | None,
    simplicity: Callable[[str], tuple[Any, ...]],
) -> Pick:
    """The winner of interleaved re-timing (name -> per-round medians).

    Noise = max(1 %, the fastest's round-to-round range): how well the time to beat is known.
    Among the configs within noise of the fastest, the default wins if it is one of them,
    else the simplest.
    """
    medians = {n: statistics.median(ts) for n, ts in times.items() if ts}
    order = sorted(medians, key=lambda n: medians[n])
    fastest = order[0]

    def spread(n: str) -> float:
        return 100.0 * (max(times[n]) - min(times[n])) / medians[n]

    noise = max(MIN_NOISE_PCT, spread(fastest))
    near = [n for n in order if _pct(medians[n], medians[fastest]) <= noise]
    if default in near:
        winner, why = (
            default,
            "fastest (the default)" if default == fastest else "default within noise",
        )
    else:
        winner = min(near, key=lambda n: (simplicity(n), medians[n]))
        why = "fastest" if winner == fastest else "simplest within noise"
    runner = next((n for n in order if n != winner), None)
    return Pick(
        winner, why, medians, round(noise, 2), runner,
        _pct(medians[runner], medians[winner]) if runner else None,
        _pct(medians[default], medians[winner]) if default in medians else None,
    )  # fmt: skip


def simplicity(variant: Variant) -> tuple[Any, ...]:
    return tuple(variant.tuning.get(f, 0) for f in SIMPLER)


def run_finals(
    ev: CandidateEvaluator,
    study: optuna.Study,
    known: dict[str, Variant],
    default: Variant,
    batch: int,
    rounds: int,
) -> dict[str, Any]:
    """Re-time the top three and the default together, A B C D A B C D ..., and pick.
    ``known``: the study's candidates by name, ``default`` one of them."""
    scored = recorded(study)
    best = sorted((o.value, n) for n, o in scored.items() if o.ok and n in known)
    contenders = [n for _, n in best[:FINALISTS]]
    default_ok = ev.ready(default) is None  # compiled and checked
    if default_ok and default.name not in contenders:
        contenders.append(default.name)
    times: dict[str, list[float]] = {n: [] for n in contenders}
    dropped: dict[str, str] = {}
    for _ in range(rounds):
        for name in contenders:
            if name in dropped:
                continue
            t = ev.time(known[name], batch)
            if isinstance(t, str):
                dropped[name] = t
            else:
                times[name].append(t["median_us"])
    times = {n: ts for n, ts in times.items() if ts and n not in dropped}
    final: dict[str, Any] = {"scored": len(scored), "rounds": rounds, "default": default.name,
                             "default_tuning": default.tuning, "dropped": dropped}  # fmt: skip
    if not times:
        return final | {"winner": None, "pick": "every candidate failed"}
    # Picked from the times as stored (ns), so that pick_again on them gives the same pick.
    times = {n: [round(t, 3) for t in ts] for n, ts in times.items()}
    pick = pick_winner(times, default.name if default_ok else None,
                       lambda n: simplicity(known[n]))  # fmt: skip
    winner = known[pick.winner]
    return (
        final
        | _picked(pick, default.name, times)
        | {
            "floor_us": ev.extra("floor", winner, batch),
            "peers": ev.extra("peers", winner, batch) or {},
        }
    )


def _picked(pick: Pick, default: str, times: dict[str, list[float]]) -> dict[str, Any]:
    """A final's fields that follow from its pick (``times`` as stored)."""
    return {
        "pick_rule": PICK_RULE,
        "winner": pick.winner,
        "tuning": Variant.parse(pick.winner).tuning,
        "time_us": round(pick.medians[pick.winner], 3),
        "pick": pick.pick,
        "noise_pct": pick.noise_pct,
        "runner_up": pick.runner_up,
        "margin_runner_up_pct": pick.margin_runner_up_pct,
        "default_us": round(pick.medians[default], 3) if default in pick.medians else None,
        "margin_default_pct": pick.margin_default_pct,
        "times": times,
    }


def pick_again(final: dict[str, Any], candidates: Collection[str] | None) -> dict[str, Any]:
    """A final picked under an earlier rule, picked again from its stored times (no GPU
    time) among the study's ``candidates`` (None: a study stored without their names, every
    timed config); a stored default outside them gives way to the candidate the run-time
    would run in its place (``dispatch.nearest_point``). The floor and peers are the
    contract's, whichever config wins. A final without times (every candidate failed) only
    takes the rule's number; one whose times are all of configs outside the candidates has
    no winner."""
    stored = final.get("times") or {}
    if not stored:
        return final | {"pick_rule": PICK_RULE}
    names = stored if candidates is None else candidates
    times = {n: ts for n, ts in stored.items() if n in names}
    if not times:
        return final | {"pick_rule": PICK_RULE, "winner": None, "pick": "no candidate timed"}
    default = nearest_point(Variant.parse(final["default"]), names)
    pick = pick_winner(
        times, default.name if default.name in times else None,
        lambda n: simplicity(Variant.parse(n)),
    )  # fmt: skip
    return (
        final
        | {"default": default.name, "default_tuning": default.tuning}
        | _picked(pick, default.name, times)
        | {"times": stored}
    )

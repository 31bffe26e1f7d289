"""Optuna over a list of candidate variants: the search space, the sampler, the trial loop.

One categorical parameter per tuning field (``path`` first, then the fields that path reads),
so TPE can learn which values of a field pay; a suggested point that is not a candidate (a
space constraint or ``Variant`` rejects it) is scored as a failure. Failures are told as
``FAILURE_SCORE``, a COMPLETE value above every real time, not as FAIL trials: TPE ignores
FAIL trials and would keep proposing the same broken region, while it splits COMPLETE trials
into good and bad by rank, so any value above the real ones marks a failure "bad".

``drive`` is the loop the tuner and the search-efficiency replay share: a window of asked
trials (the tuner compiles them while the GPU evaluates the head), never evaluating a
variant twice (TPE re-suggests points, Optuna issue #2021: a repeat is told the recorded
value), and falling back to an unseen candidate when the sampler keeps repeating itself.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from kdagen.serve.variant import PATHS, Variant, VariantError

FAILURE_SCORE = 1e9  # us; above any kernel time, so TPE ranks failures last
STALE_ASKS = 8  # repeated or invalid suggestions in a row before an unseen one is enqueued


@dataclass(frozen=True)
class Outcome:
    """What one candidate scored: the value told to the study and the trial's user attrs."""

    value: float
    attrs: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.attrs.get("status") == "ok"


class SearchSpace:
    """The candidates of one contract key as categorical Optuna parameters."""

    def __init__(self, candidates: Sequence[Variant]) -> None:
        if not candidates:
            raise ValueError("a search space needs at least one candidate")
        self.candidates = list(candidates)
        self.by_name = {v.name: v for v in self.candidates}
        self.base = self.candidates[0]
        self.paths = sorted({v.path for v in self.candidates})
        fields: dict[str, set[Any]] = {}
        for v in self.candidates:
            for name, value in v.tuning.items():
                if name != "path":
                    fields.setdefault(name, set()).add(value)
        self.choices = {name: sorted(values) for name, values in fields.items()}

    def params_of(self, variant: Variant) -> dict[str, Any]:
        return dict(variant.tuning)

    def distributions_of(self, variant: Variant) -> dict[str, CategoricalDistribution]:
        """The distributions ``variant_of`` suggests ``variant``'s parameters from."""
        fields = PATHS[self.base.kernel][variant.path].tuning
        return {"path": CategoricalDistribution(self.paths)} | {
            f: CategoricalDistribution(self.choices[f]) for f in fields
        }

    def variant_of(self, trial: optuna.Trial) -> Variant | str:
        """The candidate a trial suggests, or why the point is not one."""
        path = trial.suggest_categorical("path", self.paths)
        fields = PATHS[self.base.kernel][path].tuning
        values = {f: trial.suggest_categorical(f, self.choices[f]) for f in fields}
        try:
            variant = self.base.replace(path=path, **values)
        except VariantError as err:
            return f"invalid: {err}"
        if variant.name not in self.by_name:
            return "invalid: removed by a constraint of the search space"
        return self.by_name[variant.name]


def make_sampler(seed: int, n_candidates: int) -> optuna.samplers.BaseSampler:
    """TPE, multivariate (fields interact: threads x vec x row_split), with a short random
    start: the default config is enqueued first, and small spaces must not be spent on
    random draws."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=max(3, min(10, n_candidates // 5)),
            multivariate=True,
            group=True,
            constant_liar=True,
        )


@dataclass
class _Pending:
    trial: optuna.Trial
    variant: Variant
    repeats: list[optuna.Trial] = field(default_factory=list)


def recorded(study: optuna.Study) -> dict[str, Outcome]:
    """Variant name -> its outcome, from the study's COMPLETE candidate trials."""
    out: dict[str, Outcome] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("status") in ("ok", "failed") and "variant" in t.user_attrs:
            out.setdefault(t.user_attrs["variant"], Outcome(float(t.value), dict(t.user_attrs)))
    return out


def waiting(study: optuna.Study) -> set[str]:
    """Variant names enqueued and not yet asked."""
    return {
        str(t.user_attrs.get("variant"))
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    }


def carry_over(study: optuna.Study, space: SearchSpace, outcomes: dict[str, Outcome]) -> None:
    """Scores of an earlier study of fewer candidates (``recorded``), added to ``study`` as
    finished trials of this space's parameters, so they count and TPE learns from them."""
    for name, outcome in outcomes.items():
        if variant := space.by_name.get(name):
            study.add_trial(
                optuna.trial.create_trial(
                    params=space.params_of(variant),
                    distributions=space.distributions_of(variant),
                    value=outcome.value,
                    user_attrs=outcome.attrs | {"variant": name},
                )
            )


def enqueue(study: optuna.Study, space: SearchSpace, variants: Sequence[Variant]) -> None:
    """Enqueue the candidates among ``variants`` that the study has neither scored nor queued."""
    done, queued = recorded(study), waiting(study)
    for v in variants:
        if v.name in space.by_name and v.name not in done and v.name not in queued:
            study.enqueue_trial(space.params_of(v), user_attrs={"variant": v.name})
            queued.add(v.name)


def drive(
    study: optuna.Study,
    space: SearchSpace,
    budget: int,
    evaluate: Callable[[Variant], Outcome],
    prepare: Callable[[Variant], None] = lambda v: None,
    lookahead: int = 1,
    on_told: Callable[[Variant, Outcome], None] | None = None,
    rng: random.Random | None = None,
) -> int:
    """Score candidates until ``budget`` distinct ones are scored (earlier runs count) or
    every candidate is. ``prepare`` sees a candidate when it is asked (start compiling it),
    ``evaluate`` when its turn comes. Returns the number of candidates scored now."""
    rng = rng or random.Random(0)
    seen = recorded(study)
    budget = min(budget, len(space.candidates))
    window: deque[_Pending] = deque()
    scored = stale = 0
    while True:
        while len(window) < lookahead and len(seen) + len(window) < budget:
            if stale >= STALE_ASKS:
                _enqueue_unseen(study, space, seen, window, rng)
                stale = 0
            trial = study.ask()
            point = space.variant_of(trial)
            if isinstance(point, str):
                _tell(study, trial, Outcome(FAILURE_SCORE, {"status": "invalid", "reason": point}))
                stale += 1
            elif point.name in seen:
                _tell(study, trial, _repeat(seen[point.name], point.name))
                stale += 1
            elif pending := next((p for p in window if p.variant == point), None):
                pending.repeats.append(trial)
                stale += 1
            else:
                prepare(point)
                window.append(_Pending(trial, point))
                stale = 0
        if not window:
            return scored
        head = window.popleft()
        outcome = evaluate(head.variant)
        outcome.attrs["variant"] = head.variant.name
        _tell(study, head.trial, outcome)
        seen[head.variant.name] = outcome
        scored += 1
        for trial in head.repeats:
            _tell(study, trial, _repeat(outcome, head.variant.name))
        if on_told:
            on_told(head.variant, outcome)


def _repeat(outcome: Outcome, name: str) -> Outcome:
    return Outcome(outcome.value, {"status": "repeat", "variant": name})


def _tell(study: optuna.Study, trial: optuna.Trial, outcome: Outcome) -> None:
    for key, value in outcome.attrs.items():
        trial.set_user_attr(key, value)
    study.tell(trial, outcome.value)


def _enqueue_unseen(
    study: optuna.Study,
    space: SearchSpace,
    seen: dict[str, Outcome],
    window: deque[_Pending],
    rng: random.Random,
) -> None:
    taken = set(seen) | {p.variant.name for p in window} | waiting(study)
    unseen = [v for v in space.candidates if v.name not in taken]
    if unseen:
        enqueue(study, space, [rng.choice(unseen)])


# ---- search efficiency, replayed from an exhaustive study ----


@dataclass(frozen=True)
class Efficiency:
    """Trials TPE needed to reach ``within`` of the exhaustive best, over replay seeds."""

    candidates: int
    best_us: float
    within: float
    trials: list[int]  # per seed
    random_expected: float  # the same target by uniform draws without replacement

    @property
    def median(self) -> float:
        return statistics.median(self.trials)


def replay_efficiency(
    candidates: Sequence[Variant],
    values: dict[str, float],
    first: Variant | None = None,
    within: float = 0.03,
    seeds: Sequence[int] = tuple(range(11)),
    lookahead: int = 1,
) -> Efficiency:
    """Replay TPE against recorded values (name -> us; failures at ``FAILURE_SCORE``) of an
    exhaustive study: no GPU needed. ``first`` is enqueued first, as the tuner does with the
    default config. Counts distinct candidates scored until one is within ``within`` of the
    best."""
    space = SearchSpace(candidates)
    real = [t for t in values.values() if t < FAILURE_SCORE]
    if not real:
        raise ValueError("no successful candidate to measure search efficiency against")
    best = min(real)
    target = best * (1 + within)
    trials = [_replay_once(space, values, target, first, seed, lookahead) for seed in seeds]
    good = sum(1 for t in real if t <= target)
    n = len(space.candidates)
    return Efficiency(n, best, within, trials, (n + 1) / (good + 1))


class _Reached(Exception):
    """The replay found a candidate within the target: stop the study."""


def _replay_once(
    space: SearchSpace,
    values: dict[str, float],
    target: float,
    first: Variant | None,
    seed: int,
    lookahead: int,
) -> int:
    """Candidates one seeded TPE study scores until one reaches ``target``."""
    study = optuna.create_study(sampler=make_sampler(seed, len(space.candidates)))
    if first is not None:
        enqueue(study, space, [first])
    count = 0

    def evaluate(v: Variant) -> Outcome:
        nonlocal count
        count += 1
        value = values.get(v.name, FAILURE_SCORE)
        if value <= target:
            raise _Reached
        return Outcome(value, {"status": "ok" if value < FAILURE_SCORE else "failed"})

    with contextlib.suppress(_Reached):
        drive(study, space, len(space.candidates), evaluate, lookahead=lookahead,
              rng=random.Random(seed))  # fmt: skip
    return count

"""``kdagen tune``: an Optuna study per (contract key, batch bucket), winners to ``generated/``.

The plan: every workload (search_spaces/workloads.yaml) maps to the contract keys of each
space whose variants match it; each key gets one study per batch bucket, so the dispatch
table's (key, bucket) -> winner is the study's result. Compilation and the reference check
do not depend on the batch: a variant is compiled once (on-disk cache, shared with every run)
and checked once per run (a failure, or a pass, is remembered across the key's studies and
across resumed runs, read back from the storage); only timing is per bucket.

A candidate's life (kdagen.evaluate): compile in the pool, started as soon as the study asks
for it, so it overlaps the GPU work on earlier candidates -> check on the GPU worker -> time
(cold-L2 CUDA graphs). Any failure is recorded with its reason, told to the study as
``search.FAILURE_SCORE`` and never run again. Then the top three and the default config are
re-timed together, interleaved (kdagen.finals). The default config is the run-time heuristic's
choice, enqueued as each study's first trial.

Past one GPU (kdagen.devices, kdagen.schedule): a supervised worker per GPU of the host
(``--devices``, default every visible one), each pinned to its GPU, and a thread per worker
that takes the next study and runs it to the end on that GPU (its finalists are interleaved
on one GPU); the compile pool is shared. Past one process (kdagen.claims): tune processes on
several hosts name one Optuna storage (``--storage``: kdagen.storage) and claim studies on
it, so that each study is measured by one process; a process that finds a study claimed by a
live process takes the next, waits at the end for the studies others hold (taking over those
whose holder died), and writes the table from the storage: every process writes the same one.

Storage is Optuna's SQLite in the output folder by default; ``load_if_exists`` resumes a killed
run: scored trials stay scored, trials left RUNNING by the kill are marked failed (and their
candidates asked again), finished finals are kept (picked again from their stored times
when the pick rule has changed since).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import optuna

from kdagen import devices, report
from kdagen.claims import STALE_S, Claim, Claims, is_claim
from kdagen.compile import CompilePool
from kdagen.evaluate import CandidateEvaluator, Compiler, Ledger, Progress
from kdagen.finals import PICK_RULE, pick_again, run_finals
from kdagen.first_use import staleness
from kdagen.machine_code import machine_hash
from kdagen.schedule import Schedule, Slot
from kdagen.search import (
    Outcome,
    SearchSpace,
    carry_over,
    drive,
    enqueue,
    make_sampler,
    recorded,
    replay_efficiency,
)
from kdagen.serve.dispatch import generated_root, load_table, nearest_point
from kdagen.serve.variant import PATHS, Variant
from kdagen.space import DEFAULT_SPACES, Space, load_workloads, name_matches
from kdagen.storage import describe, folder_url, open_storage, pack_folder
from kdagen.studies import (
    Stamp,
    TuneError,
    candidate_attrs,
    fail_interrupted,
    folder_lock,
    fresh_studies,
    grown_study,
    keep_if_same_machine,
    make_stamp,
    refresh_set,
    render_changed_only,
    restart_stale,
    stale_studies,
    stored_attrs,
)
from kdagen.worker import Worker, WorkerFailure

__all__ = ["TuneError", "TuneOptions", "TuneResult", "StudyPlan", "plan_studies", "run"]

# Contract fields a kernel never reads, so any workload value matches (variant.py's rules).
IGNORED_BY_KERNEL = {"commit": ("conv", "conv_layout", "conv_weight_dtype")}
# ``--refresh``: a study whose kernels changed times again its best this many candidates (and
# its finalists and the default) instead of searching anew. Finals take the top three, so
# three more leave room for a change that reorders the leaders.
REFRESH_TOP = 6  # (kdagen tune --help says six)


@dataclass
class TuneOptions:
    """What ``kdagen tune`` was asked (the CLI's options)."""

    spaces: Sequence[str] = DEFAULT_SPACES
    workloads: str | Path = "workloads.yaml"
    trials: int = 32
    exhaustive: bool = False
    storage: str | None = None
    out: Path | None = None  # results in <out>/<fingerprint>/; default generated/ (out/ simulated)
    match: str | None = None
    jobs: int = 0
    timeout_s: float = 120.0
    rounds: int = 5
    seed: int = 0
    lookahead: int = 0  # candidates asked ahead (compiling) of the one on the GPU; 0: auto
    simulate: dict[str, list[str]] | None = None  # failure patterns: simulated GPU/compiler
    start_timeout_s: float = 600.0
    devices: str = devices.ALL  # the GPUs: "all" (every visible one) or indices "0,2"
    claim_timeout_s: float = STALE_S  # a silent process's claim is taken over after this
    checked: tuple[Path, ...] = ()  # kdagen check --json files: what passed is not checked again
    refresh: bool = False  # studies whose kernels changed: re-time their leaders, no new search


# ---- the plan ----


@dataclass(frozen=True)
class StudyPlan:
    """The studies of one contract key: its candidates and batch buckets."""

    key: str
    kernel: str
    candidates: tuple[Variant, ...]
    batches: tuple[int, ...]
    workloads: tuple[str, ...]

    def study_name(self, batch: int) -> str:
        return f"{self.key}/b{batch}"

    @property
    def space_hash(self) -> str:
        names = "\n".join(sorted(v.name for v in self.candidates))
        return hashlib.sha256(names.encode()).hexdigest()[:12]


def plan_studies(
    spaces: Sequence[str], workloads_file: str | Path, arch: str, match: str | None = None
) -> tuple[list[StudyPlan], list[str]]:
    """Studies for every (workload, space) pair with candidates for ``arch``; notes say what
    was left out and why."""
    workloads = load_workloads(workloads_file)
    by_key: dict[str, dict[str, Any]] = {}
    notes = []
    for space_name in spaces:
        space = Space.load(space_name)
        variants = space.expand().variants
        runnable = [v for v in variants if arch in v.spec.archs]
        if variants and not runnable:
            notes.append(f"space {space.name}: no path targets {arch}; not tuned here")
        for w in workloads:
            for v in runnable:
                if not _fits(v, w.contract) or not name_matches(v.contract_key, match):
                    continue
                entry = by_key.setdefault(
                    v.contract_key,
                    {"kernel": v.kernel, "candidates": [], "batches": set(), "workloads": []},
                )
                if v not in entry["candidates"]:
                    entry["candidates"].append(v)
                entry["batches"].update(w.batches)
                if w.name not in entry["workloads"]:
                    entry["workloads"].append(w.name)
    plans = [
        StudyPlan(key, e["kernel"], tuple(e["candidates"]), tuple(sorted(e["batches"])),
                  tuple(e["workloads"]))
        for key, e in by_key.items()
    ]  # fmt: skip
    return plans, notes


def space_points(spaces: Sequence[str], arch: str) -> dict[str, dict[str, list[str]]]:
    """Kernel -> contract key -> every variant of ``spaces`` for ``arch``: the points
    `kdagen check` verifies, which the dispatch table keeps its lookup inside."""
    points: dict[str, dict[str, list[str]]] = {}
    for space_name in spaces:
        for v in Space.load(space_name).expand().variants:
            if arch in v.spec.archs:
                points.setdefault(v.kernel, {}).setdefault(v.contract_key, []).append(v.name)
    return {k: {key: sorted(names) for key, names in sorted(keys.items())}
            for k, keys in sorted(points.items())}  # fmt: skip


def _fits(variant: Variant, contract: dict[str, Any]) -> bool:
    """Whether ``variant`` serves the workload: every field the workload names matches (a
    field it leaves out matches any value, e.g. both slot dtypes), except ``tree``: a workload
    that does not say ``tree: true`` speculates chains, whose kernels are not tree kernels; and
    the tree commit kernel only serves a tree with the fused conv (a tree without it commits
    through the chain commit's studies)."""
    if variant.tree != contract.get("tree", False):
        return False
    if variant.kernel == "commit" and variant.tree and not contract.get("conv", False):
        return False
    ignored = IGNORED_BY_KERNEL.get(variant.kernel, ())
    return all(getattr(variant, k) == v for k, v in contract.items() if k not in ignored)


# ---- the run ----


@dataclass
class TuneResult:
    folder: Path
    results: list[report.StudyResult]
    notes: list[str]
    wall_s: float
    simulated: bool


def run(
    options: TuneOptions,
    echo: Callable[[str], None] = print,
    default_for: Callable[[Variant, int], Variant] | None = None,
) -> TuneResult:
    """The whole tuning run; outputs written to ``<out>/<fingerprint>/``. ``default_for``
    overrides the run-time heuristic (asked of the GPU worker) as each study's default."""
    started = time.time()
    logging.getLogger("optuna").setLevel(logging.WARNING)
    indices = devices.select(options.devices, devices.visible_count(options.simulate is not None))
    storage = open_storage(options.storage) if options.storage else None  # before the GPUs
    slots = [Slot(devices.label(i), _worker(options, i)) for i in indices]
    compiler = None
    try:
        device = devices.start([s.worker for s in slots], indices, options.start_timeout_s)
        compiler = _compiler(options, device["arch"])
        return _run(options, echo, default_for, slots, compiler, device, storage, started)
    finally:
        if compiler is not None:
            compiler.close()
        for slot in slots:
            slot.worker.close()


def _worker(options: TuneOptions, index: int) -> Worker:
    """The supervised worker of GPU ``index``, pinned to it."""
    env = devices.child_env(index)
    if options.simulate is not None:
        return Worker("kdagen.simulate:SimulatedEvaluator", {"failures": options.simulate},
                      options.start_timeout_s, env)  # fmt: skip
    return Worker("kdagen.worker:GpuEvaluator", {}, options.start_timeout_s, env)


def _compiler(options: TuneOptions, arch: str) -> Compiler:
    if options.simulate is not None:
        from kdagen.simulate import SimulatedCompiler

        return SimulatedCompiler(arch, options.simulate)
    return CompilePool(arch, options.jobs)


def _run(
    options: TuneOptions,
    echo: Callable[[str], None],
    default_for: Callable[[Variant, int], Variant] | None,
    slots: Sequence[Slot],
    compiler: Compiler,
    device: dict[str, Any],
    storage: optuna.storages.BaseStorage | None,
    started: float,
) -> TuneResult:
    plans, notes = plan_studies(options.spaces, options.workloads, device["arch"], options.match)
    for note in notes:
        echo(note)
    if not plans:
        raise TuneError("nothing to tune: no workload matches a candidate of the given spaces")
    # a simulated run never lands in the committed generated/ by default (out/ is ignored)
    root = options.out or (Path("out") if device.get("simulated") else generated_root())
    folder = root / device["fingerprint"]
    storage_url = options.storage or _folder_storage(folder)
    storage = storage or open_storage(storage_url)
    planned = {p.study_name(b): (p, b) for p in plans for b in p.batches}
    gpus = f"{len(slots)} GPU{'s' if len(slots) > 1 else ''} ({', '.join(s.label for s in slots)})"
    echo(
        f"tuning {len(plans)} contract keys, {len(planned)} studies on "
        f"{device['fingerprint']}{' (SIMULATED)' if device.get('simulated') else ''}, {gpus}; "
        f"storage {describe(storage_url)}"
    )
    stamp = make_stamp(device["fingerprint"], list(PATHS))  # every kernel: see fresh_studies
    stale = stale_studies(storage, {n: p.space_hash for n, (p, _) in planned.items()}, stamp)
    _say_restarts(stale, echo)  # deleted by whichever process claims each (run_one)
    ledger = Ledger(checked=passed_checks(options.checked))
    fresh = fresh_studies(storage, stamp)
    if options.match:  # a full run re-times every key it can; a partial one may drop some
        every, _ = plan_studies(options.spaces, options.workloads, device["arch"])
        _refuse_dropping_carried(folder, {p.key for p in every} - {p.key for p in plans}, fresh)
    for study in fresh:
        ledger.add_study(study)
    progress = Progress(echo)
    checkout = stamp.digest
    claims = Claims(storage, checkout, options.claim_timeout_s, warn=echo)

    def goal(name: str) -> str:
        return _goal(checkout, planned[name][0], options)

    complete = {study.study_name for study in fresh if study.study_name in planned
                and _finished(study, planned[study.study_name][0], options)}  # fmt: skip
    if complete:
        echo(f"{len(complete)} of {len(planned)} studies already complete for this run's "
             "kernels, candidates, trials and pick rule: not run again")  # fmt: skip
    schedule = Schedule(list(planned), claims, goal, echo, complete)

    def run_one(slot: Slot, claim: Claim, label: str) -> None:
        plan, batch = planned[claim.study]
        carried = None  # what a study whose candidates only grew measured, for its successor
        refresh = None  # what --refresh times again of a study whose kernels changed
        # by its holder only: kept where a refactor compiled to the same code or the candidates
        # only grew, else restarted
        if claim.study in stale and keep_if_same_machine(
            storage, claim.study, plan.space_hash, stamp, partial(machine_code_of, compiler)
        ):
            echo(f"[{label}{claim.study}] kept: its kernels render differently but compile "
                 "to the machine code it measured")  # fmt: skip
        elif claim.study in stale and (
            grown := grown_study(
                storage, claim.study, [v.name for v in plan.candidates], plan.space_hash, stamp
            )
        ):
            carried = (recorded(grown), grown.user_attrs.get("wall_s", 0.0))
            echo(f"[{label}{claim.study}] kept: its candidates only grew; the new ones are "
                 "measured and the finals re-timed")  # fmt: skip
        elif (
            claim.study in stale
            and options.refresh
            and (refresh := refresh_set(storage, claim.study, plan.space_hash, stamp, REFRESH_TOP))
        ):
            echo(f"[{label}{claim.study}] refreshed: its kernels changed; its {len(refresh)} "
                 "leaders and the default are measured again, no new search")  # fmt: skip
        restart_stale(storage, {claim.study: plan.space_hash}, stamp)
        # What this key's other studies checked (other processes' included), read by name.
        names = [plan.study_name(b) for b in plan.batches]
        for study in fresh_studies(storage, stamp, plan.key, names):
            ledger.add_study(study)
        ev = CandidateEvaluator(compiler, slot.worker, ledger, progress, options.timeout_s,
                                options.seed, guard=lambda: schedule.guard(claim))  # fmt: skip
        try:
            run_study(ev, storage, plan, batch, stamp, options, default_for, label, carried,
                      refresh)  # fmt: skip
        except WorkerFailure as failure:  # only a worker that cannot start again gets here
            where = f"{slot.label}: " if len(slots) > 1 else ""
            raise TuneError(where + failure.reason) from None

    schedule.run(slots, run_one)
    others = len(planned) - schedule.ran_here - len(complete)
    echo(f"all {len(planned)} studies done ({schedule.ran_here} here"
         f"{f', {others} by other tune processes' if others else ''}); on {gpus}: "
         f"{progress.totals()}")  # fmt: skip
    wall = time.time() - started
    with folder_lock(folder):  # processes that share the folder write it in turn
        results = [report.result_of(s) for s in fresh_studies(storage, stamp)]
        report.write_all(folder, results, stamp.as_dict(), device, wall, _jsonable(options),
                         space_points(options.spaces, device["arch"]))  # fmt: skip
        if not options.storage:
            pack_folder(folder)
    return TuneResult(folder, results, notes, wall, bool(device.get("simulated")))


def _refuse_dropping_carried(
    folder: Path, skipped: set[str], fresh: Sequence[optuna.Study]
) -> None:
    """The table is written from fresh studies only, so a ``--match`` run that skips keys of a
    carried kernel (``kdagen carry``) whose studies are not fresh would write the table without
    them: refused before any GPU time is spent. ``skipped``: the keys a run without ``--match``
    would plan and this one does not."""
    table = load_table(folder)
    if table is None or not table.carried:
        return
    fresh_keys = {s.user_attrs.get("key") for s in fresh}
    for kernel, record in sorted(table.carried.items()):
        dropped = sorted(k for k in table.entries
                         if k.startswith(f"{kernel}-") and k in skipped and k not in fresh_keys)  # fmt: skip
        if dropped:
            raise TuneError(
                f"{folder / 'dispatch.json'} carries {kernel} ({record.get('reason')}): this run "
                f"does not re-time {len(dropped)} of its keys (e.g. {dropped[0]}), so the table "
                "it writes would lose them; tune them too (without --match, or a --match that "
                "names them)"
            )


def passed_checks(paths: Sequence[Path]) -> set[str]:
    """Variants whose every case passed in ``kdagen check --json`` files at the kernel they
    render to now (the tuner runs the same check before timing a candidate: an earlier
    sharded check, whose processes overlap their host-side work, spares it that)."""
    if not paths:
        return set()
    from kdagen.check import check_verdicts  # imports torch: only when asked
    from kdagen.render import digest

    verdicts = check_verdicts(paths)
    return {name for (name, at), ok in verdicts.items() if ok and at == digest(Variant.parse(name))}


def _folder_storage(folder: Path) -> str:
    """The folder's own SQLite database (unpacked from the repository's copy where needed):
    processes that share the folder unpack it in turn."""
    with folder_lock(folder):
        return folder_url(folder)


def _finished(study: optuna.Study, plan: StudyPlan, options: TuneOptions) -> bool:
    """Whether running ``study`` (fresh) again would measure, re-time, re-pick and re-stamp
    nothing: the planned candidates (a space that lost some restarts it), its budget of them
    scored, its finals over exactly those at this run's rounds and pick rule, and this run's
    workloads recorded. Such a study is not claimed: a claim and a run of the study still
    cost storage reads and writes (about 0.2 s on a table of 1600 studies), which a resumed
    tune of a few studies would otherwise spend walking the ones it already has."""
    attrs = study.user_attrs
    final = attrs.get("final") or {}
    n = len(plan.candidates)
    scored = len(recorded(study))
    return (attrs.get("space") == plan.space_hash and scored >= _study_budget(attrs, n, options)
            and final.get("scored") == scored
            and final.get("rounds") == options.rounds and final.get("pick_rule") == PICK_RULE
            and (scored < n or "efficiency" in attrs)
            and set(plan.workloads) <= set(attrs.get("workloads", ())))  # fmt: skip


def _budget(candidates: int, options: TuneOptions) -> int:
    """Candidates a study scores: all of them (``exhaustive``), else ``trials`` at most."""
    return candidates if options.exhaustive else min(options.trials, candidates)


def _study_budget(attrs: dict[str, Any], candidates: int, options: TuneOptions) -> int:
    """``_budget``, except under ``refresh`` for a refreshed study: its refresh set. Without
    ``refresh`` a refreshed study's search goes on to the full budget."""
    refreshed = attrs.get("refresh_set") if options.refresh else None
    return len(refreshed) if refreshed else _budget(candidates, options)


def _say_restarts(stale: dict[str, str], echo: Callable[[str], None]) -> None:
    if stale:
        n = len(stale)
        listed = "; ".join(f"{name}: {why}" for name, why in list(stale.items())[:3])
        echo(f"{n} stud{'y' if n == 1 else 'ies'} whose kernels or candidates changed, kept "
             "where the kernels compile to the machine code measured or the candidates only "
             "grew, else started again: "
             f"{listed}{f'; and {n - 3} more' if n > 3 else ''}")  # fmt: skip


def _goal(checkout: str, plan: StudyPlan, options: TuneOptions) -> str:
    """What a finished study was finished for (kernels, candidates, trials, rounds, pick rule):
    a process with the same goal takes it as done; one with another runs it again (more
    trials, say)."""
    budget = _budget(len(plan.candidates), options)
    goal = [checkout, plan.space_hash, budget, options.rounds, PICK_RULE]
    text = json.dumps(goal + ["refresh"] if options.refresh else goal)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_study(
    ev: CandidateEvaluator,
    storage: optuna.storages.BaseStorage,
    plan: StudyPlan,
    batch: int,
    stamp: Stamp,
    options: TuneOptions,
    default_for: Callable[[Variant, int], Variant] | None = None,
    label: str = "",
    carried: tuple[dict[str, Outcome], float] | None = None,
    refresh: Sequence[str] | None = None,
) -> None:
    """One (contract key, batch bucket) study: trials until the budget, then the finals.
    ``label`` starts its progress lines (which study of how many, on which GPU); ``carried``:
    the scores and wall time of the study it replaces, whose candidates only grew;
    ``refresh``: the candidates of the study it replaces to score, and no others (under
    ``options.refresh``, kept in the study's ``refresh_set`` for a resumed run)."""
    name = plan.study_name(batch)
    space = SearchSpace(plan.candidates)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="minimize", load_if_exists=True,
        sampler=make_sampler(_seed(options.seed, name), len(space.candidates)),
    )  # fmt: skip
    _stamp_study(study, plan, batch, stamp)
    if carried and not study.trials:
        carry_over(study, space, carried[0])
        study.set_user_attr("wall_s", carried[1])
    fail_interrupted(storage, study)
    # What the run-time runs for this key untuned: its heuristic, kept inside the space.
    default = nearest_point((default_for or ev.default)(plan.candidates[0], batch),
                            space.by_name)  # fmt: skip
    if refresh and not study.trials:
        study.set_user_attr("refresh_set", sorted({*refresh, default.name}))
    chosen = study.user_attrs.get("refresh_set") if options.refresh else None
    budget = _study_budget(study.user_attrs, len(space.candidates), options)
    if chosen:
        first = [default, *(space.by_name[n] for n in chosen if n in space.by_name)]
    elif budget >= len(space.candidates):  # every candidate is scored: nothing for TPE to pick
        first = [default, *plan.candidates]
    else:
        first = [default]
    enqueue(study, space, first)
    started = time.perf_counter()
    best = [(o.value, name) for name, o in recorded(study).items() if o.ok]

    def told(variant: Variant, outcome: Outcome) -> None:
        if outcome.ok:
            best.append((outcome.value, variant.name))
        ev.progress.show(label + name, len(recorded(study)), budget, min(best) if best else None)

    lookahead = options.lookahead or max(2, min(options.jobs or os.cpu_count() or 1, 4))
    measured = drive(study, space, budget, lambda v: ev.score(v, batch), ev.prepare, lookahead,
                     told, random.Random(_seed(options.seed, name)))  # fmt: skip
    final = study.user_attrs.get("final") or {}
    retime = final.get("scored") != len(recorded(study)) or final.get("rounds") != options.rounds
    if retime:
        ev.progress.echo(
            f"[{label}{name}] re-timing finalists, {options.rounds} interleaved rounds"
        )
        study.set_user_attr(
            "final", run_finals(ev, study, space.by_name, default, batch, options.rounds)
        )
    else:
        _pick_under_current_rule(study)
    if not chosen and study.user_attrs.get("refresh_set") and len(recorded(study)) >= budget:
        study.set_user_attr("refresh_set", None)  # searched in full since it was refreshed
    measured_all = set(recorded(study)) >= set(space.by_name)
    replayed = study.user_attrs.get("efficiency", False)  # None: nothing succeeded
    if measured_all and (
        replayed is False or (replayed and replayed["candidates"] != len(space.candidates))
    ):
        study.set_user_attr("efficiency", _efficiency(study, space, default, lookahead))
    if measured or retime:  # a complete study run again (another process, a resume) took none
        wall = study.user_attrs.get("wall_s", 0.0) + time.perf_counter() - started
        study.set_user_attr("wall_s", round(wall, 2))
    stamp_machine_code(study, ev.compiler, [v.name for v in plan.candidates])


def stamp_machine_code(study: optuna.Study, compiler: Compiler, names: list[str]) -> bool:
    """Record the machine hash of ``study``'s candidates ``names`` (what lets a later
    refactor keep it); False when one has no machine digest (not compiled, simulated)."""
    digests = machine_code_of(compiler, names)
    if digests is None:
        return False
    hashed = machine_hash(digests)
    if study.user_attrs.get("machine_hash") != hashed:
        study.set_user_attr("machine_hash", hashed)
    return True


def machine_code_of(compiler: Compiler, names: list[str]) -> dict[str, str] | None:
    """Each candidate's machine digest (compiled now, or from the compile cache); None when
    one does not compile or has none (a simulated compiler)."""
    variants = [Variant.parse(n) for n in names]
    for v in variants:
        compiler.submit(v)
    records = {v.name: compiler.result(v) for v in variants}
    if not all(r.ok and r.machine for r in records.values()):
        return None
    return {name: r.machine for name, r in records.items()}


def _stamp_study(study: optuna.Study, plan: StudyPlan, batch: int, stamp: Stamp) -> None:
    attrs = {"key": plan.key, "batch": batch, "space": plan.space_hash,
             "candidates": len(plan.candidates)} | stamp.attrs(plan.kernel)  # fmt: skip
    attrs |= candidate_attrs([v.name for v in plan.candidates])
    attrs["workloads"] = sorted(set(study.user_attrs.get("workloads", [])) | set(plan.workloads))
    # "kernel" last: a study is judged (fresh, stale, another GPU's) only once it has one, so
    # a process reading it while its holder stamps it never sees half a stamp
    attrs["kernel"] = plan.kernel
    for key, value in attrs.items():
        if study.user_attrs.get(key) != value:
            study.set_user_attr(key, value)


def repick(folder: Path) -> TuneResult:
    """Pick the stored finals of a tuned folder again under the current rule
    (``finals.PICK_RULE``) and rewrite its table, winners, plots and report from them: no GPU,
    nothing compiled or timed. Refused where a study does not match the kernels this checkout
    renders (or the folder's GPU): those need ``kdagen tune`` on that GPU."""
    started = time.time()
    table, last_run = _tuned_folder(folder)
    device = table["device"] | {"fingerprint": table["fingerprint"]}
    spaces = tuple(last_run.get("spaces") or DEFAULT_SPACES)
    with folder_lock(folder):
        storage = open_storage(folder_url(folder))
        stamp = make_stamp(device["fingerprint"], list(PATHS))
        studies = fresh_studies(storage, stamp)
        planned = _planned(spaces, last_run, device["arch"])
        stale = stale_studies(storage, {n: p.space_hash for n, p in planned.items()}, stamp)
        kept, carried = _carried_studies(folder, storage, planned, stale, stamp)
        studies += [optuna.load_study(study_name=n, storage=storage) for n in kept]
        stored = [s for s in storage.get_all_studies() if not is_claim(s.study_name)]
        unusable = len(stored) - len(studies)
        if unusable:
            raise TuneError(
                f"{unusable} stud{'y' if unusable == 1 else 'ies'} in {folder} do not match the "
                "kernels this checkout renders: run kdagen tune on the GPU instead"
            )
        again = {s.study_name: _picked_again(s) for s in studies}
        changed = {name: final for name, final in again.items() if final is not None}
        if not changed:  # every pick stands: the folder is left as it is, byte for byte
            results = [report.result_of(s) for s in studies]
            note = "no pick changed under the current rule: nothing rewritten"
            return TuneResult(folder, results, [note], time.time() - started,
                              bool(device.get("simulated")))  # fmt: skip
        for study in studies:
            _pick_under_current_rule(study)
        results = [report.result_of(s) for s in studies]
        report.write_all(folder, results, stamp.as_dict(), device, time.time() - started,
                         {"repick": True, "spaces": list(spaces)},
                         space_points(spaces, device["arch"]), carried)  # fmt: skip
        pack_folder(folder)
    return TuneResult(folder, results, [], time.time() - started, bool(device.get("simulated")))


def restamp(folder: Path, jobs: int = 0, echo: Callable[[str], None] = print,
            compiler: Compiler | None = None,
            spaces: Sequence[str] | None = None) -> TuneResult:  # fmt: skip
    """Carry a tuned folder through a refactor without a GPU: compile the candidates of every
    study whose kernels render differently, re-stamp those whose machine code is what they
    measured (``keep_if_same_machine``), and rewrite the table from them; nothing is timed.
    ``spaces``: the spaces to plan from (default: the folder's last run's), so the finished
    studies of a tune of more spaces (a killed one included) can be shipped. A kernel the
    table carries (``kdagen carry``) for the kernels this checkout renders stays carried: its
    studies of an earlier render keep their measurements. Refused, the table left as it was,
    when another study's code changed (or its candidates, or it recorded none): that study
    needs ``kdagen tune`` on its GPU."""
    started = time.time()
    table, last_run = _tuned_folder(folder)
    device = table["device"] | {"fingerprint": table["fingerprint"]}
    spaces = tuple(spaces or last_run.get("spaces") or DEFAULT_SPACES)
    planned = _planned(spaces, last_run, device["arch"])
    with folder_lock(folder):
        storage = open_storage(folder_url(folder))
        stamp = make_stamp(device["fingerprint"], list(PATHS))
        stale = stale_studies(storage, {n: p.space_hash for n, p in planned.items()}, stamp)
        kept_carried, carried = _carried_studies(folder, storage, planned, stale, stamp)
        to_compile = [n for n in stale if n not in kept_carried]
        echo(f"{len(stale)} of {len(planned)} studies render differently ({len(kept_carried)} "
             f"of a carried kernel, kept as measured); compiling {len(to_compile)}")  # fmt: skip
        pool = compiler or CompilePool(device["arch"], jobs)
        try:
            for name in to_compile:
                for candidate in planned[name].candidates:
                    pool.submit(candidate)
            changed = [name for name in to_compile if not keep_if_same_machine(
                storage, name, planned[name].space_hash, stamp, partial(machine_code_of, pool)
            )]  # fmt: skip
        finally:
            pool.close()
        if changed:
            listed = "; ".join(f"{n}: {stale[n]}" for n in changed[:3])
            raise TuneError(
                f"{len(changed)} stud{'y' if len(changed) == 1 else 'ies'} changed machine code "
                f"or candidates ({listed}{'; ...' if len(changed) > 3 else ''}): run kdagen tune "
                "on the GPU"
            )
        studies = [s for s in fresh_studies(storage, stamp) if s.study_name in planned]
        studies += [optuna.load_study(study_name=n, storage=storage) for n in kept_carried]
        results = [report.result_of(s) for s in studies]
        report.write_all(folder, results, stamp.as_dict(), device, time.time() - started,
                         {"restamp": True, "spaces": list(spaces)},
                         space_points(spaces, device["arch"]), carried)  # fmt: skip
        pack_folder(folder)
    return TuneResult(folder, results, [f"re-stamped {len(to_compile)} studies"],
                      time.time() - started, bool(device.get("simulated")))  # fmt: skip


def _planned(spaces: Sequence[str], last_run: dict[str, Any], arch: str) -> dict[str, StudyPlan]:
    """Study name -> its plan, for the spaces and the workloads of a folder's last run."""
    plans, _ = plan_studies(spaces, last_run.get("workloads") or "workloads.yaml", arch)
    return {p.study_name(b): p for p in plans for b in p.batches}


def _carried_studies(
    folder: Path,
    storage: optuna.storages.BaseStorage,
    planned: dict[str, StudyPlan],
    stale: dict[str, str],
    stamp: Stamp,
) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The stale studies a ``kdagen carry`` of the folder's table keeps as measured (stale
    only because a carried kernel renders differently), and the carries they stand on. A
    carry covers the render it measured: one more change since is not carried."""
    loaded = load_table(folder)
    carries = {k: record for k, record in loaded.carried.items() if staleness(loaded, k) is None}
    attrs = stored_attrs(storage, list(stale))
    kept = [n for n in stale if planned[n].kernel in carries
            and render_changed_only(attrs[n], planned[n].space_hash, stamp)]  # fmt: skip
    return kept, {k: carries[k] for k in {planned[n].kernel for n in kept}}


def _tuned_folder(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tuned folder's table and its last run's options."""
    try:
        table = json.loads((folder / "dispatch.json").read_text())
        last_run = json.loads((folder / "runs.json").read_text())[-1]["options"]
    except (OSError, ValueError, IndexError, KeyError) as err:
        raise TuneError(
            f"{folder} is not a tuned folder (dispatch.json, runs.json): {err}"
        ) from None
    return table, last_run


def _picked_again(study: optuna.Study) -> dict[str, Any] | None:
    """The study's final picked again under the current rule, when its winner changes."""
    final = study.user_attrs.get("final")
    if not final or final.get("pick_rule") == PICK_RULE:
        return None
    again = pick_again(final, study.user_attrs.get("candidate_names"))
    return again if again.get("winner") != final.get("winner") else None


def _pick_under_current_rule(study: optuna.Study) -> None:
    """A stored final picked under an earlier rule, picked again from its times (no GPU)."""
    final = study.user_attrs.get("final")
    if final and final.get("pick_rule") != PICK_RULE:
        names = study.user_attrs.get("candidate_names")
        study.set_user_attr("final", pick_again(final, names))


def _seed(seed: int, name: str) -> int:
    """A sampler seed per study: reproducible, different across studies."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31)


def _efficiency(
    study: optuna.Study, space: SearchSpace, default: Variant, lookahead: int
) -> dict[str, Any] | None:
    """Trials TPE needs to come within 3 % of this exhaustive study's best, replayed: on its
    own (the search's efficiency) and with the default enqueued first (as the tuner runs)."""
    values = {n: o.value for n, o in recorded(study).items()}
    try:
        alone = replay_efficiency(space.candidates, values, None, lookahead=lookahead)
        seeded = replay_efficiency(space.candidates, values, default, lookahead=lookahead)
    except ValueError:  # nothing succeeded
        return None
    return {"candidates": alone.candidates, "best_us": round(alone.best_us, 3),
            "within": alone.within, "trials": alone.trials, "median": alone.median,
            "seeded_trials": seeded.trials, "seeded_median": seeded.median,
            "random_expected": round(alone.random_expected, 2)}  # fmt: skip


def _jsonable(options: TuneOptions) -> dict[str, Any]:
    """The options as JSON (the run log in the output folder), without a storage password."""
    fields = vars(options) | {"storage": options.storage and describe(options.storage)}
    return json.loads(json.dumps(fields, default=str))

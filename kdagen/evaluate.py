"""One candidate through the pipeline: compile -> check -> time, each failure recorded once.

Compilation and the reference check do not depend on the batch, so a variant is compiled once
(the on-disk cache is shared with every run) and checked once; the ``Ledger`` remembers both
across the studies of a contract key and, read back from the storage, across resumed runs.
Failures (compile error, launch error, wrong result, timeout, worker death) become a reason
string and a ``search.FAILURE_SCORE`` outcome; a failed variant is never run again.

Studies run in threads, one per GPU worker, sharing the compiler, the ledger and the progress
counts: a variant is checked by one of them at a time (a second study of its key waits for
that check's result instead of checking again).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import optuna

from kdagen.compile import CompileRecord
from kdagen.search import FAILURE_SCORE, Outcome, recorded
from kdagen.serve.variant import Variant
from kdagen.worker import Worker, WorkerFailure


class Compiler(Protocol):
    """``compile.CompilePool`` or ``simulate.SimulatedCompiler``."""

    def submit(self, variant: Variant) -> None: ...
    def result(self, variant: Variant) -> CompileRecord: ...
    def close(self) -> None: ...


class Stopped(Exception):
    """The study must stop before its next GPU call: the run is stopping, or another tune
    process took the study over. Nothing is recorded for the candidate in flight."""


@dataclass
class Ledger:
    """Per variant, across the studies of a run and resumed runs: failed (never run again)
    or checked (not checked again)."""

    failed: dict[str, dict[str, str]] = field(default_factory=dict)
    checked: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _checks: dict[str, threading.Lock] = field(default_factory=dict, repr=False, compare=False)

    def add_study(self, study: optuna.Study) -> None:
        scored = recorded(study)
        final = study.user_attrs.get("final") or {}
        with self._lock:
            for name, outcome in scored.items():
                if outcome.ok:
                    self.checked.add(name)
                elif not outcome.attrs.get("known"):
                    self.failed.setdefault(name, _failure(outcome.attrs))
            for name, reason in (final.get("dropped") or {}).items():
                self.failed.setdefault(name, {"kind": kind_of(reason), "reason": reason})

    @contextlib.contextmanager
    def checking(self, name: str) -> Iterator[None]:
        """Held while ``name`` is checked: one check of a variant at a time."""
        with self._lock:
            lock = self._checks.setdefault(name, threading.Lock())
        with lock:
            yield


def _failure(attrs: dict[str, Any]) -> dict[str, str]:
    return {"kind": str(attrs.get("kind", "")), "reason": str(attrs.get("reason", ""))}


def kind_of(reason: str) -> str:
    """compile, launch, wrong, timeout, died, refused or error: the first words of a reason."""
    for prefix, kind in (
        ("compile", "compile"), ("launch", "launch"), ("wrong", "wrong"),
        ("timeout", "timeout"), ("worker died", "died"), ("refused", "refused"),
    ):  # fmt: skip
        if reason.startswith(prefix):
            return kind
    return "error"


@dataclass
class Progress:
    """Counts for the progress line, over every GPU of this process: compiled / checked /
    timed / failed; and the study's own scored count and best so far."""

    echo: Callable[[str], None]
    compiled: set[str] = field(default_factory=set)
    checked: int = 0
    timed: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, event: str, name: str = "") -> None:
        """compiled (``name``), checked, timed, or a failure kind."""
        with self._lock:
            if event == "compiled":
                self.compiled.add(name)
            elif event == "checked":
                self.checked += 1
            elif event == "timed":
                self.timed += 1
            else:
                self.failed[event] += 1

    def totals(self) -> str:
        """compiled N checked N timed N failed N (per kind)."""
        with self._lock:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.failed.items()))
            return (f"compiled {len(self.compiled)} checked {self.checked} timed {self.timed} "
                    f"failed {sum(self.failed.values())}{f' ({kinds})' if kinds else ''}")  # fmt: skip

    def show(self, label: str, scored: int, budget: int, best: tuple[float, str] | None) -> None:
        best_text = f"best {best[0]:.2f} us {best[1]}" if best else "best -"
        self.echo(f"[{label}] {scored}/{budget} scored | {self.totals()} | {best_text}")


class CandidateEvaluator:
    """compile -> check -> time for one candidate, every failure recorded once."""

    def __init__(
        self,
        compiler: Compiler,
        worker: Worker,
        ledger: Ledger,
        progress: Progress,
        timeout_s: float,
        seed: int,
        guard: Callable[[], None] = lambda: None,
    ) -> None:
        self.compiler, self.worker, self.ledger = compiler, worker, ledger
        self.progress, self.timeout_s, self.seed = progress, timeout_s, seed
        self.guard = guard  # raises Stopped when the study must stop
        self._failed_now = False

    def prepare(self, variant: Variant) -> None:
        if variant.name not in self.ledger.failed:
            self.compiler.submit(variant)

    def ready(self, variant: Variant) -> str | None:
        """None once the variant is compiled and has passed the check, else why not."""
        if variant.name in self.ledger.failed:
            return self.ledger.failed[variant.name]["reason"]
        record = self.compiler.result(variant)
        self.guard()  # a compiler process killed by an interrupt is no compile error
        if not record.ok:
            first = (record.error or "").strip().splitlines()[-1:] or ["(no message)"]
            return self._fail(variant, f"compile error: {first[0][:300]}")
        self.progress.count("compiled", variant.name)
        with self.ledger.checking(variant.name):
            if variant.name in self.ledger.failed:  # another GPU's check failed it meanwhile
                return self.ledger.failed[variant.name]["reason"]
            if variant.name in self.ledger.checked:
                return None
            why = self._gpu("check", variant.name, self.seed)
            if isinstance(why, WorkerFailure):
                return self._fail(variant, _reason(why, "check"))
            if why:
                return self._fail(variant, str(why))
            self.ledger.checked.add(variant.name)
        self.progress.count("checked")
        return None

    def time(self, variant: Variant, batch: int) -> dict[str, float] | str:
        """One cold-L2 timing at ``batch``, or the failure (recorded) as a reason."""
        result = self._gpu("time", variant.name, batch, self.seed)
        if isinstance(result, WorkerFailure):
            return self._fail(variant, _reason(result, "timing"))
        self.progress.count("timed")
        return result

    def score(self, variant: Variant, batch: int) -> Outcome:
        self._failed_now = False
        why = self.ready(variant)
        timing = self.time(variant, batch) if why is None else why
        if isinstance(timing, str):
            known = not self._failed_now  # recorded before: by another study, or an earlier run
            attrs = {"status": "failed", "kind": kind_of(timing), "reason": timing, "known": known}
            return Outcome(FAILURE_SCORE, attrs)
        return Outcome(timing["median_us"], {"status": "ok", **timing})

    def default(self, base: Variant, batch: int) -> Variant:
        """The run-time heuristic's choice for ``base``'s contract at ``batch`` (asked of the
        GPU worker, where the heuristic can read the device)."""
        name = self.worker.call("default", base.name, batch, timeout=self.timeout_s)
        return Variant.parse(name)

    def extra(self, method: str, variant: Variant, batch: int) -> Any:
        """floor / peers for the report; None when the GPU side cannot say."""
        result = self._gpu(method, variant.name, batch)
        return None if isinstance(result, WorkerFailure) else result

    def _gpu(self, method: str, *args: Any) -> Any:
        """The worker's answer, or the ``WorkerFailure`` (a worker that cannot even start
        ends the run: raised). The guard runs before and after: an answer that comes back
        while the study is stopping (its worker killed by the stop) is not recorded."""
        self.guard()
        try:
            answer = self.worker.call(method, *args, timeout=self.timeout_s)
        except WorkerFailure as failure:
            self.guard()
            if failure.kind == "stopped":
                raise Stopped(failure.reason) from None
            if failure.kind == "start":
                raise
            return failure
        self.guard()
        return answer

    def _fail(self, variant: Variant, reason: str) -> str:
        self.ledger.failed[variant.name] = {"kind": kind_of(reason), "reason": reason}
        self.progress.count(kind_of(reason))
        self._failed_now = True
        return reason


def _reason(failure: WorkerFailure, stage: str) -> str:
    """A worker failure as a candidate's reason (timeouts and deaths name their call)."""
    if failure.kind == "error":
        return f"launch error: {failure.reason} ({stage})"
    return failure.reason

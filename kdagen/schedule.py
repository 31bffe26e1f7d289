"""Studies to GPU workers: a thread per worker takes the next study it can claim, runs it to the
end on its GPU and releases it; the run is over when every planned study is done, here or by
another tune process on the same storage (``kdagen.claims``).

A thread that raises stops the run: the others stop before their next GPU call, every claim
still held is released (not done) so that another process may take it at once, and the error
is raised in the caller. An interrupt does the same. A study whose claim another process took
over (this one fell silent too long) is left to that process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kdagen.claims import HELD, RELEASED, Claim, Claims, ClaimView
from kdagen.evaluate import Stopped
from kdagen.studies import TuneError
from kdagen.worker import Worker


@dataclass
class Slot:
    """One GPU of this process: its label and its supervised worker."""

    label: str
    worker: Worker


RunOne = Callable[[Slot, Claim, str], None]  # the slot, the claim, the label for its lines
PACE_AFTER = 3  # studies run here before the progress lines estimate the time left


class Schedule:
    """Which study each GPU runs next, across this process's threads and other processes."""

    def __init__(
        self,
        names: Sequence[str],
        claims: Claims,
        done_for: Callable[[str], str],
        echo: Callable[[str], None],
        complete: Collection[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``complete``: studies an earlier run finished for this run's goal, never claimed."""
        self.names, self.claims, self.done_for, self.echo = list(names), claims, done_for, echo
        self.poll_s = min(1.0, claims.beat_s)  # how often a waiting slot reads the claims
        self.done: set[str] = set(complete) & set(self.names)
        self.ran_here = 0
        self.here: dict[str, Claim] = {}
        self.error: BaseException | None = None
        self.stopping: str | None = None
        self._slots: list[Slot] = []
        self._cond = threading.Condition()
        self._waiting: tuple[str, ...] = ()
        self._index: dict[str, int] = {}  # study -> its number in this run's progress lines
        self.clock = clock
        self._started = clock()  # the run starts as it is scheduled (tune.py builds, then runs)

    def run(self, slots: Sequence[Slot], run_one: RunOne) -> None:
        """Every study done, by a thread per slot; raises the first error of any thread."""
        self._slots = list(slots)
        ended = [threading.Event() for _ in slots]
        threads = [threading.Thread(target=self._work, args=(slot, run_one, end), daemon=True,
                                    name=f"kdagen-{slot.label}")
                   for slot, end in zip(slots, ended, strict=True)]  # fmt: skip
        self.claims.start()
        try:
            for thread in threads:
                thread.start()
            for end in ended:  # not Thread.join: an interrupt inside it can leave the thread
                while not end.wait(0.5):  # marked stopped while it still runs (Python 3.11)
                    pass
        except KeyboardInterrupt:
            self.stop("interrupted")
            for end in ended:  # each releases its claim as it stops
                end.wait(30)
            raise
        finally:
            self.claims.close()
        if self.error is not None:
            raise self.error

    def guard(self, claim: Claim) -> None:
        """Raise ``Stopped`` when the study must stop: the run is stopping, or its claim was
        taken over. Called before and after every GPU call of the study."""
        if self.stopping:
            raise Stopped(self.stopping)
        if claim.lost:
            raise Stopped(f"claim lost: {claim.lost}")

    def stop(self, reason: str) -> None:
        """Stop every thread at its next GPU call; kill the workers so that none waits for a
        call in flight (its answer is dropped: the candidate is asked again next run)."""
        with self._cond:
            self.stopping = self.stopping or reason
            self._cond.notify_all()
        for slot in self._slots:
            slot.worker.stop()

    # ---- a slot's thread ----

    def _work(self, slot: Slot, run_one: RunOne, ended: threading.Event) -> None:
        try:
            while (claim := self._next(slot)) is not None:
                label = self._label(slot, claim)
                ok = False
                try:
                    run_one(slot, claim, label)
                    ok = True
                except Stopped:
                    pass
                except Exception:
                    if claim.lost is None:  # else a late write of a study taken over
                        raise
                finally:
                    self._finish(claim, ok, label)
        except BaseException as err:
            with self._cond:
                self.error = self.error or err
            self.stop(f"stopped: {type(err).__name__}")
        finally:
            ended.set()

    def _label(self, slot: Slot, claim: Claim) -> str:
        device = f" {slot.label}" if len(self._slots) > 1 else ""
        return f"study {self._index[claim.study]}/{len(self.names)}{device} "

    def _next(self, slot: Slot) -> Claim | None:
        """The next study this slot claims; None once every study is done or the run stops.
        Waits while the studies left are held by other processes (or other slots)."""
        with self._cond:
            while not self.stopping:
                pending = [n for n in self.names if n not in self.done and n not in self.here]
                if not pending and not self.here:
                    return None
                if pending and (claim := self._claim_one(slot, pending)) is not None:
                    return claim
                self._cond.wait(self.poll_s)
            return None

    def _claim_one(self, slot: Slot, pending: list[str]) -> Claim | None:
        views = self.claims.recent(self.claims.beat_s)  # the heartbeat's scan, if that recent
        held: list[ClaimView] = []
        for name in pending:
            view = views.get(name)
            verdict = self.claims.judge(view)
            if verdict == RELEASED and self._done_elsewhere(view):
                self.done.add(view.study)
                continue
            if view is not None and verdict == HELD:
                if why := self.claims.conflict(view):
                    raise TuneError(why)
                held.append(view)
                continue
            claim = self.claims.acquire(name, view, slot.label)
            if claim is not None:
                self.here[name] = claim
                self._index[name] = len(self.done) + len(self.here)  # done or started, with it
                return claim
        self._say_waiting(held)
        return None

    def _done_elsewhere(self, view: ClaimView | None) -> bool:
        """Released done, for this run's goal, by a process seen holding it during this run.
        A claim released before (an earlier run's) and not among the caller's ``complete`` is
        claimed again: the study is run here, which measures nothing when it is complete but
        re-picks, re-stamps and the like."""
        if view is None or view.name not in self.claims.seen_held:
            return False
        return (view.released or {}).get("done_for") == self.done_for(view.study)

    def _say_waiting(self, held: list[ClaimView]) -> None:
        names = tuple(sorted(v.study for v in held))
        if names and names != self._waiting:
            listed = "; ".join(f"{v.study} ({v.holder})" for v in held[:3])
            more = f"; and {len(held) - 3} more" if len(held) > 3 else ""
            self.echo(f"waiting for {len(held)} stud{'y' if len(held) == 1 else 'ies'} other "
                      f"tune processes hold: {listed}{more}")  # fmt: skip
        self._waiting = names

    def _finish(self, claim: Claim, ok: bool, label: str) -> None:
        self.claims.release(claim, self.done_for(claim.study) if ok else None)
        with self._cond:
            self.here.pop(claim.study, None)
            if ok:
                self.done.add(claim.study)
                self.ran_here += 1
            done, ran = len(self.done), self.ran_here
            self._cond.notify_all()
        if claim.lost:
            self.echo(f"[{label}{claim.study}] another tune process took it over "
                      f"({claim.lost}); left to it")  # fmt: skip
        elif ok:
            self.echo(f"[{label}{claim.study}] done; {done}/{len(self.names)} studies done"
                      f"{self.time_left(done, ran)}")  # fmt: skip

    def time_left(self, done: int, ran: int) -> str:
        """What the studies left (of ``done``) would take at this process's pace so far, ``ran``
        studies since it started (all its GPUs together; other processes on the storage only
        shorten it), once it has run a few; "" before."""
        left = len(self.names) - done
        if ran < PACE_AFTER or left <= 0:
            return ""
        seconds = left * (self.clock() - self._started) / ran
        return f", about {duration(seconds)} left at this run's pace"


def duration(seconds: float) -> str:
    """A rough span for a person: seconds under two minutes, minutes under two hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

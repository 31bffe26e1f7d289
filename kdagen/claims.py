"""Study claims: tune processes, on one host or several, that share one Optuna storage measure
each study once.

A claim on study S is a study of its own in the same storage, named ``kdagen-claim:S#E``; E,
the epoch, counts the claims S has had. Creating a study is the one write that every Optuna
storage makes atomic across processes and hosts, because names are unique (a UNIQUE column in
an RDB, the first CREATE_STUDY record in a journal file): of the processes that create epoch E
at once, exactly one succeeds and the others get ``DuplicatedStudyError``. A process measures S
only while it holds S's newest epoch.

The holder writes who it is (host, pid namespace, pid, a random token) and beats: it counts up
the claim's ``beat`` attribute every ``stale_s / 6`` seconds. Another process judges a claim
stale when its beat has not moved for ``stale_s`` seconds of its own clock (no two hosts'
clocks are compared; the longer of its own and the holder's ``stale_s``, so that a process
with a short timeout never takes a live claim of one that beats slowly), or at once when the
holder ran on this host and its pid is gone. A
released claim (``released``: done, and for which goal) or a stale one is taken by creating the
next epoch; the taker then checks that no newer epoch exists (a slow reader may re-create an
epoch that was deleted: the check backs it off) and deletes the older epochs.

A holder that stayed silent longer than ``stale_s`` (storage unreachable, process stopped) and
lost its claim learns it at its next beat (its epoch is gone or a newer one exists) and stops
the study before its next GPU call; the new holder has by then failed the trials the old one
left RUNNING, so a late tell of the old holder is refused by the storage as well.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.exceptions import DuplicatedStudyError

PREFIX = "kdagen-claim:"
STALE_S = 60.0  # a claim whose beat has not moved this long is taken over

# What ``Claims.judge`` says of a study's newest claim.
FREE = "free"  # never claimed
RELEASED = "released"  # its holder is done with it (finished, or stopped)
HELD = "held"  # by another live process
STALE = "stale"  # its holder is gone, or silent for stale_s
MINE = "mine"  # this process's (a claim it failed to release)


def is_claim(study_name: str) -> bool:
    """Whether a study of the storage is a claim (not a tuning study)."""
    return study_name.startswith(PREFIX)


def claim_name(study: str, epoch: int) -> str:
    return f"{PREFIX}{study}#{epoch}"


def _parse(name: str) -> tuple[str, int] | None:
    if not is_claim(name):
        return None
    study, _, epoch = name[len(PREFIX) :].rpartition("#")
    return (study, int(epoch)) if study and epoch.isdigit() else None


@dataclass(frozen=True)
class ClaimView:
    """A study's newest claim, as read from the storage."""

    study: str
    epoch: int
    attrs: dict[str, Any]
    older: tuple[str, ...]  # the names of its superseded epochs still stored

    @property
    def name(self) -> str:
        return claim_name(self.study, self.epoch)

    @property
    def owner(self) -> dict[str, Any]:
        return dict(self.attrs.get("owner") or {})

    @property
    def released(self) -> dict[str, Any] | None:
        return self.attrs.get("released")

    @property
    def holder(self) -> str:
        o = self.owner
        where = f"{o.get('host', '?')}:{o.get('pid', '?')}" if o else "a process starting"
        return f"{where} {self.attrs.get('device', '')}".strip()


@dataclass
class Claim:
    """A claim this process holds."""

    study: str
    epoch: int
    study_id: int
    beats: int = 0
    lost: str | None = None  # why, once another process has taken the study over


def owner_identity() -> dict[str, Any]:
    """Who holds a claim: host and pid namespace (a pid means something only inside both),
    pid, and a token no other process has."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return {"host": socket.gethostname(), "pidns": namespace, "pid": os.getpid(),
            "token": uuid.uuid4().hex[:16]}  # fmt: skip


class Claims:
    """This process's claims on one storage: take, beat, judge others', release."""

    def __init__(
        self,
        storage: optuna.storages.BaseStorage,
        checkout: str,
        stale_s: float = STALE_S,
        warn: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage, self.checkout, self.stale_s = storage, checkout, stale_s
        self.beat_s = stale_s / 6
        self.warn, self.clock = warn, clock
        self.owner = owner_identity()
        self.held: dict[str, Claim] = {}
        self._seen: dict[str, tuple[Any, float]] = {}  # claim name -> (beat, seen since)
        self.seen_held: set[str] = set()  # claims seen held by another process, by name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, dict[str, ClaimView]] | None = None  # (when, views): last scan

    # ---- reading ----

    def recent(self, max_age: float) -> dict[str, ClaimView]:
        """The last scan's views when at most ``max_age`` seconds old, else a new ``scan``. A
        scan reads every study's attributes (about 0.6 s on a storage of 1600 studies): the
        heartbeat scans every ``beat_s``, and a choice of study made on older views only
        costs a refused ``acquire`` (creating a claim is what decides)."""
        with self._lock:
            last = self._last
        if last is not None and self.clock() - last[0] <= max_age:
            return last[1]
        return self.scan()

    def scan(self) -> dict[str, ClaimView]:
        """Each claimed study's newest claim. Notes when each beat was first seen (staleness)
        and marks the claims of this process that another one has taken over."""
        with self._lock:  # judged below: only claims held before the storage is read
            held = dict(self.held)
        epochs: dict[str, list[tuple[int, optuna.study.FrozenStudy]]] = {}
        for frozen in self.storage.get_all_studies():
            if parsed := _parse(frozen.study_name):
                epochs.setdefault(parsed[0], []).append((parsed[1], frozen))
        views = {}
        for study, found in epochs.items():
            found.sort(key=lambda pair: pair[0])
            epoch, newest = found[-1]
            older = tuple(f.study_name for _, f in found[:-1])
            views[study] = ClaimView(study, epoch, dict(newest.user_attrs), older)
        now = self.clock()
        with self._lock:
            for view in views.values():
                beat = view.attrs.get("beat")
                if self._seen.get(view.name, (object(),))[0] != beat:
                    self._seen[view.name] = (beat, now)
                if view.released is None and view.owner.get("token") != self.owner["token"]:
                    self.seen_held.add(view.name)
            for study, claim in held.items():
                view = views.get(study)
                if claim.lost is None and (view is None or view.epoch != claim.epoch):
                    claim.lost = f"now held by {view.holder}" if view else "its claim was deleted"
            self._last = (now, views)
        return views

    def judge(self, view: ClaimView | None) -> str:
        """FREE, RELEASED, HELD, STALE or MINE (module constants)."""
        if view is None:
            return FREE
        if view.released is not None:
            return RELEASED
        if view.owner.get("token") == self.owner["token"]:
            return MINE
        if self._gone(view.owner):
            return STALE
        with self._lock:
            _, since = self._seen.get(view.name, (None, self.clock()))
        patience = max(self.stale_s, float(view.attrs.get("stale_s") or 0))  # the longer one
        return STALE if self.clock() - since >= patience else HELD

    def conflict(self, view: ClaimView) -> str | None:
        """Why a live claim's holder measures other kernels than this process (another
        checkout, templates or DSL), or None."""
        theirs = view.attrs.get("checkout")
        if theirs is None or theirs == self.checkout:
            return None
        return (f"{view.study} is being measured by {view.holder} with other kernels (templates "
                "or DSL version differ from this checkout's): run one checkout per storage")  # fmt: skip

    def _gone(self, owner: dict[str, Any]) -> bool:
        """The holder ran on this host (same pid namespace) and its pid is gone, or is this
        process's pid with another token (a process before this one)."""
        me = self.owner
        if (owner.get("host"), owner.get("pidns")) != (me["host"], me["pidns"]):
            return False
        pid = owner.get("pid")
        if not isinstance(pid, int):
            return False
        if pid == me["pid"]:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    # ---- taking and giving back ----

    def acquire(self, study: str, view: ClaimView | None, device: str = "") -> Claim | None:
        """The claim on ``study`` after ``view`` (its newest claim as last read; None: none),
        or None when another process took it first."""
        epoch = 0 if view is None else view.epoch + 1
        try:
            study_id = self.storage.create_new_study(
                [optuna.study.StudyDirection.MINIMIZE], claim_name(study, epoch)
            )
        except DuplicatedStudyError:
            return None
        attrs = {"owner": self.owner, "device": device, "checkout": self.checkout,
                 "stale_s": self.stale_s, "since": _now(), "beat": 0}  # fmt: skip
        for key, value in attrs.items():
            self.storage.set_study_user_attr(study_id, key, value)
        claim = Claim(study, epoch, study_id)
        if not self._newest(study, epoch):  # ours re-created a deleted epoch, or was taken
            self._mark_released(claim, None)
            return None
        with self._lock:
            self.held[study] = claim
        for name in (*view.older, view.name) if view is not None else ():
            self._delete(name)
        return claim

    def release(self, claim: Claim, done_for: str | None) -> None:
        """Give ``claim`` back: done for ``done_for`` (a goal others compare with theirs), or
        None: stopped, for any process to take at once."""
        with self._lock:
            self.held.pop(claim.study, None)
        if claim.lost is None:
            self._mark_released(claim, done_for)

    def _mark_released(self, claim: Claim, done_for: str | None) -> None:
        try:
            self.storage.set_study_user_attr(
                claim.study_id, "released", {"done_for": done_for, "at": _now()}
            )
        except KeyError:  # deleted: taken over meanwhile
            pass
        except Exception as err:  # the storage is down: the claim goes stale instead
            self.warn(f"claims: could not release {claim.study} ({_line(err)})")

    def _newest(self, study: str, epoch: int) -> bool:
        """Whether ``study``'s claim of ``epoch`` is stored and no newer one is, by name: a
        newer epoch follows a takeover of the one before, each after ``stale_s`` of silence,
        so looking a few epochs ahead covers every race of one ``acquire``."""
        return self._exists(claim_name(study, epoch)) and not any(
            self._exists(claim_name(study, later)) for later in range(epoch + 1, epoch + 4)
        )

    def _exists(self, name: str) -> bool:
        try:
            self.storage.get_study_id_from_name(name)
        except KeyError:
            return False
        return True

    def _delete(self, name: str) -> None:
        with contextlib.suppress(KeyError):  # another process deleted it first
            self.storage.delete_study(self.storage.get_study_id_from_name(name))

    # ---- the heartbeat ----

    def beat(self) -> None:
        """Count up every held claim's beat, then notice the ones taken over."""
        with self._lock:
            held = list(self.held.values())
        for claim in held:
            claim.beats += 1
            with contextlib.suppress(KeyError):  # deleted by a taker: the scan says who
                self.storage.set_study_user_attr(claim.study_id, "beat", claim.beats)
        self.scan()

    def start(self) -> None:
        """Beat in a thread of its own until ``close``."""
        self._thread = threading.Thread(target=self._beat_loop, name="kdagen-claims", daemon=True)
        self._thread.start()

    def _beat_loop(self) -> None:
        failing = False
        while not self._stop.wait(self.beat_s):
            try:
                self.beat()
            except Exception as err:  # the storage hiccupped: beat again next time
                if not failing:  # once per outage, not once per beat
                    self.warn(f"claims: a heartbeat failed ({_line(err)}); trying again")
                failing = True
            else:
                if failing:
                    self.warn("claims: heartbeats go through again")
                failing = False

    def close(self) -> None:
        """Stop beating and release what is still held (not done)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for claim in list(self.held.values()):
            self.release(claim, None)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0][:200]

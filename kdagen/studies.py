"""The Optuna storage of a tuning run: stamps, staleness, resume, one tuner per folder.

Each study records what its results depend on: the GPU fingerprint, the DSL version, its
candidates (their names and a hash of them) and a hash of their rendered kernels
(``kdagen.render.kernels_digest``; studies of older runs have only their kernel's template
hash) and of their compiled machine code (``kdagen.machine_code``). A run resumes the studies
whose kernels are unchanged and starts again those whose kernels or candidates changed: after
a template edit only the affected studies are measured again, and no study mixes measurements
of two kernels. A study whose space only gained candidates keeps what it measured and scores
the new ones. A study whose kernels render differently but compile to the machine code it
measured (a refactor) is kept, re-stamped with the new renders. A study measured on another GPU is
refused. Trials a killed run left RUNNING are marked FAIL on resume (TPE ignores FAIL
trials), so their candidates are asked again and scored properly: a study is only touched by
the process holding its claim (``kdagen.claims``), so its RUNNING trials are a dead run's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from kdagen.search import recorded


class TuneError(RuntimeError):
    """The run cannot start or go on (a storage of another GPU, no GPU worker); the message
    says why."""


# Past this many study names one read of every study's attributes is cheaper than a lookup each.
FEW_STUDIES = 16


@dataclass(frozen=True)
class Stamp:
    """What a run's studies depend on besides their candidates."""

    fingerprint: str
    dsl_version: str
    template_hashes: dict[str, str]  # per kernel: the tables and the report record them

    def attrs(self, kernel: str) -> dict[str, str]:
        return {
            "fingerprint": self.fingerprint,
            "dsl_version": self.dsl_version,
            "template_hash": self.template_hashes[kernel],
        }

    def as_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "dsl_version": self.dsl_version,
                "template_hashes": dict(self.template_hashes)}  # fmt: skip

    @property
    def digest(self) -> str:
        """A short hash of the stamp: what tune processes sharing a storage must agree on."""
        text = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_stamp(fingerprint: str, kernels: Sequence[str]) -> Stamp:
    from kdagen.render import template_digest
    from kdagen.serve.fingerprint import dsl_version

    return Stamp(fingerprint, dsl_version(), {k: template_digest(k) for k in sorted(set(kernels))})


def candidate_attrs(names: Sequence[str]) -> dict[str, Any]:
    """A study's candidates as its user attributes: their names and their kernels' hash."""
    from kdagen.render import kernels_digest

    return {"candidate_names": sorted(names), "render_hash": kernels_digest(names)}


def staleness(attrs: dict[str, Any], stamp: Stamp) -> str | None:
    """Why a stored study's measurements are not of the kernels this run builds (None: they
    are). Judged on its candidates' renders where it recorded them, else on its template hash.
    A study of another GPU is not stale but foreign (``foreign``)."""
    from kdagen.render import kernels_digest

    kernel = attrs.get("kernel")
    if kernel not in stamp.template_hashes:
        return None
    bad = []
    if attrs.get("dsl_version") != stamp.dsl_version:
        bad.append(f"dsl_version {attrs.get('dsl_version')!r} (now {stamp.dsl_version!r})")
    names = attrs.get("candidate_names")
    if names and attrs.get("render_hash"):
        try:
            now = kernels_digest(names)
        except Exception as err:  # a candidate that no longer parses or renders
            now = f"none ({type(err).__name__}: {err})"
        if now != attrs["render_hash"]:
            bad.append(f"its kernels render differently (render_hash {attrs['render_hash']!r}, "
                       f"now {now!r})")  # fmt: skip
    elif attrs.get("template_hash") != stamp.template_hashes[kernel]:
        bad.append(f"template_hash {attrs.get('template_hash')!r} "
                   f"(now {stamp.template_hashes[kernel]!r})")  # fmt: skip
    return ", ".join(bad) or None


def foreign(attrs: dict[str, Any], stamp: Stamp) -> str | None:
    """A study measured on another GPU (fingerprint) than this run's, or None."""
    if attrs.get("kernel") not in stamp.template_hashes:
        return None
    if attrs.get("fingerprint") != stamp.fingerprint:
        return f"fingerprint {attrs.get('fingerprint')!r} (now {stamp.fingerprint!r})"
    return None


def fresh_studies(
    storage: optuna.storages.BaseStorage,
    stamp: Stamp,
    key: str | None = None,
    names: Sequence[str] | None = None,
) -> list[optuna.Study]:
    """Studies of this storage measured on this GPU with the kernels this run builds (of one
    contract key: ``key``; of these study names only: ``names``, read one by one, which a
    tune does per study instead of reading every study's attributes)."""
    out = []
    for name, attrs in stored_attrs(storage, names).items():
        if key is not None and attrs.get("key") != key:
            continue
        mine = "kernel" in attrs and attrs["kernel"] in stamp.template_hashes
        if mine and not foreign(attrs, stamp) and not staleness(attrs, stamp):
            out.append(optuna.load_study(study_name=name, storage=storage))
    return out


def stored_attrs(
    storage: optuna.storages.BaseStorage, names: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Study name -> user attributes: of every study (``names`` None), else of those of
    ``names`` the storage holds. A few names are looked up one by one; more (or all) take one
    read of every study's attributes (about 0.6 s on a table of 1600 studies and claims)."""
    if names is None or len(names) > FEW_STUDIES:
        every = {f.study_name: f.user_attrs for f in storage.get_all_studies()}
        return every if names is None else {n: every[n] for n in names if n in every}
    found = {}
    for name in names:
        study_id, attrs = _stored(storage, name)
        if study_id is not None:
            found[name] = attrs
    return found


def stale_studies(
    storage: optuna.storages.BaseStorage, planned: dict[str, str], stamp: Stamp
) -> dict[str, str]:
    """The planned studies whose kernels or candidates changed (name -> why), refusing
    (``TuneError``) a storage whose planned studies were measured on another GPU.
    ``planned``: study name -> the hash of its candidates now. Reads only."""
    foreign_studies, stale = [], {}
    for name, attrs in stored_attrs(storage, list(planned)).items():
        if why := foreign(attrs, stamp):
            foreign_studies.append(f"{name}: {why}")
            continue
        why = staleness(attrs, stamp)
        if attrs.get("space") not in (None, planned[name]):
            why = (why + ", " if why else "") + "the candidates (search space) changed"
        if why:
            stale[name] = why
    if foreign_studies:
        listed = "; ".join(foreign_studies[:4])
        more = len(foreign_studies) - 4
        raise TuneError(
            f"the storage holds studies measured on another GPU ({listed}"
            f"{f'; and {more} more' if more > 0 else ''}). Refusing to mix them: use another "
            "--out/--storage for this GPU."
        )
    return stale


def restart_stale(
    storage: optuna.storages.BaseStorage, planned: dict[str, str], stamp: Stamp
) -> list[str]:
    """Delete the planned studies whose kernels or candidates changed (``stale_studies``), so
    that they are measured again from scratch. Returns "name: why" per deleted study."""
    stale = stale_studies(storage, planned, stamp)
    for name in stale:
        optuna.delete_study(study_name=name, storage=storage)
    return [f"{name}: {why}" for name, why in stale.items()]


def render_changed_only(attrs: dict[str, Any], space_hash: str, stamp: Stamp) -> bool:
    """Whether a stored study (its user attributes ``attrs``) is stale only because its kernels
    render differently: the same GPU, DSL and candidates, its measurements of an earlier
    render of them."""
    return not (not attrs.get("candidate_names") or attrs.get("space") != space_hash
                or foreign(attrs, stamp) or attrs.get("dsl_version") != stamp.dsl_version
                or staleness(attrs, stamp) is None)  # fmt: skip


def keep_if_same_machine(
    storage: optuna.storages.BaseStorage,
    name: str,
    space_hash: str,
    stamp: Stamp,
    machine_of: Callable[[list[str]], dict[str, str] | None],
) -> bool:
    """Keep study ``name`` when it is stale only because its kernels render differently (same
    GPU, DSL and candidates) and ``machine_of`` (its candidates compiled now: name -> machine
    digest, None if any did not compile) matches the machine code it recorded: re-stamped
    with the new renders, its measurements stand. True when kept."""
    from kdagen.machine_code import machine_hash
    from kdagen.render import kernels_digest

    study_id, attrs = _stored(storage, name)
    names = attrs.get("candidate_names")
    if (study_id is None or not attrs.get("machine_hash")
            or not render_changed_only(attrs, space_hash, stamp)):  # fmt: skip
        return False
    digests = machine_of(list(names))
    if digests is None or machine_hash(digests) != attrs["machine_hash"]:
        return False
    storage.set_study_user_attr(study_id, "render_hash", kernels_digest(names))
    storage.set_study_user_attr(study_id, "template_hash", stamp.template_hashes[attrs["kernel"]])
    return True


def grown_study(
    storage: optuna.storages.BaseStorage,
    name: str,
    planned: Sequence[str],
    space_hash: str,
    stamp: Stamp,
) -> optuna.Study | None:
    """Study ``name`` when its candidates only grew (a space gained a tuning value): same GPU
    and DSL, every candidate it had still ``planned`` and rendering to the kernel it measured.
    Its scores stand (``carry_over`` them into the study that replaces it: Optuna keeps a
    parameter's values fixed within a study); None otherwise."""
    study_id, attrs = _stored(storage, name)
    names = attrs.get("candidate_names")
    if (study_id is None or not names or not attrs.get("render_hash") or attrs.get("space") in (None, space_hash)
            or foreign(attrs, stamp) or staleness(attrs, stamp) is not None
            or not set(names) < set(planned)):  # fmt: skip
        return None
    return optuna.load_study(study_name=name, storage=storage)


def refresh_set(
    storage: optuna.storages.BaseStorage, name: str, space_hash: str, stamp: Stamp, top: int
) -> list[str] | None:
    """What ``kdagen tune --refresh`` times again of study ``name`` when only its kernels
    changed (same GPU and candidates): its ``top`` best candidates by score and the configs
    its final re-timed. None when it is not such a study or scored nothing."""
    study_id, attrs = _stored(storage, name)
    if (study_id is None or attrs.get("space") != space_hash or foreign(attrs, stamp)
            or staleness(attrs, stamp) is None):  # fmt: skip
        return None
    scored = recorded(optuna.load_study(study_name=name, storage=storage))
    best = sorted((o.value, n) for n, o in scored.items() if o.ok)
    timed = (attrs.get("final") or {}).get("times") or {}
    return sorted({n for _, n in best[:top]} | set(timed)) or None


def _stored(storage: optuna.storages.BaseStorage, name: str) -> tuple[int | None, dict[str, Any]]:
    """Study ``name``'s id and user attributes ((None, {}) when the storage has no such study)."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None, {}
    return study_id, storage.get_study_user_attrs(study_id)


def fail_interrupted(storage: optuna.storages.BaseStorage, study: optuna.Study) -> int:
    """Trials left RUNNING by a killed run: marked FAIL (TPE ignores them), asked again."""
    study_id = storage.get_study_id_from_name(study.study_name)
    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in stale:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "status", "interrupted")
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
    return len(stale)


@contextlib.contextmanager
def folder_lock(folder: Path, wait: bool = True) -> Iterator[None]:
    """One writer of an output folder's table, winners and report at a time: tune processes
    that share a folder write it in turn (an exclusive ``flock``, which other processes and
    other open files of this one respect). ``wait=False``: refuse when it is taken."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".tune.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise TuneError(f"another kdagen tune is writing {folder}") from None
        yield

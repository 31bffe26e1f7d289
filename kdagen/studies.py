"""The Optuna storage of a tuning run: stamps, staleness, resume, one tuner per folder.

Each study records what its results depend on besides its candidates (GPU fingerprint, DSL
version, template hash of its kernel) and a hash of its candidate list. Resuming a study
whose stamp or candidates changed would mix measurements of different kernels: refused.
Trials a killed run left RUNNING are marked FAIL on resume (TPE ignores FAIL trials), so
their candidates are asked again and scored properly.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState


class TuneError(RuntimeError):
    """The run cannot start or go on (stale storage, no GPU worker); the message says why."""


@dataclass(frozen=True)
class Stamp:
    """What a study's results depend on besides the candidates: refused when it changes."""

    fingerprint: str
    dsl_version: str
    template_hashes: dict[str, str]

    def attrs(self, kernel: str) -> dict[str, str]:
        return {
            "fingerprint": self.fingerprint,
            "dsl_version": self.dsl_version,
            "template_hash": self.template_hashes[kernel],
        }

    def as_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "dsl_version": self.dsl_version,
                "template_hashes": dict(self.template_hashes)}  # fmt: skip

    def mismatch(self, attrs: dict[str, Any]) -> str | None:
        kernel = attrs.get("kernel")
        if kernel not in self.template_hashes:
            return None
        want = self.attrs(kernel)
        bad = [f"{k} {attrs.get(k)!r} (now {v!r})" for k, v in want.items() if attrs.get(k) != v]
        return ", ".join(bad) or None


def make_stamp(fingerprint: str, kernels: Sequence[str]) -> Stamp:
    from kdagen.fingerprint import dsl_version
    from kdagen.render import template_digest

    return Stamp(fingerprint, dsl_version(), {k: template_digest(k) for k in sorted(set(kernels))})


def open_storage(url: str) -> optuna.storages.BaseStorage:
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.RDBStorage(url)


def fresh_studies(storage: optuna.storages.BaseStorage, stamp: Stamp) -> list[optuna.Study]:
    """Studies of this storage made with the current templates, DSL and GPU."""
    out = []
    for frozen in storage.get_all_studies():
        attrs = frozen.user_attrs
        if (
            "kernel" in attrs
            and attrs.get("kernel") in stamp.template_hashes
            and not stamp.mismatch(attrs)
        ):
            out.append(optuna.load_study(study_name=frozen.study_name, storage=storage))
    return out


def refuse_stale(
    storage: optuna.storages.BaseStorage, planned: dict[str, str], stamp: Stamp
) -> None:
    """Resuming a study made with other templates, DSL or candidates would mix kernels.
    ``planned``: study name -> the hash of its candidates now."""
    bad = []
    for frozen in storage.get_all_studies():
        if frozen.study_name not in planned:
            continue
        why = stamp.mismatch(frozen.user_attrs)
        if frozen.user_attrs.get("space") not in (None, planned[frozen.study_name]):
            why = (why + ", " if why else "") + "the candidates (search space) changed"
        if why:
            bad.append(f"{frozen.study_name}: {why}")
    if bad:
        listed = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise TuneError(
            f"the storage holds studies made with other kernels or candidates ({listed}). "
            "Refusing to resume them: use another --out/--storage, or delete the old studies.db."
        )


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
def folder_lock(folder: Path) -> Iterator[None]:
    """One tuner per output folder: resuming assumes RUNNING trials belong to a dead run."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".tune.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TuneError(f"another kdagen tune is writing {folder}") from None
        yield

"""Optuna storage URLs: where a tune's studies live, shared by every tune process that names it.

- ``sqlite:///PATH``: one SQLite file (the default: ``<out>/<gpu>/studies.db``). Processes of
  one host may share it: SQLite locks the file, and a write waits up to ``SQLITE_TIMEOUT_S``.
- ``journal:///PATH``: Optuna's journal file (``JournalFileBackend``: every change appended
  under a lock file), for the processes of one host, or of several on a shared file system.
- any other SQLAlchemy database URL (``postgresql://user@host/db``, ``mysql+pymysql://...``):
  tune processes on several hosts. Its driver (psycopg2, ...) must be installed.

PATH reads as in SQLAlchemy's sqlite URLs: relative after the three slashes, so an absolute
path takes four (``journal:////shared/tune.log``).

A tuned folder's own database (``<gpu>/studies.db``) is kept in the repository packed,
``studies.db.xz`` (a few MiB of Optuna rows pack ~10x): ``folder_url`` unpacks it where it is
newer than the working copy and holds other data, ``pack_folder`` writes it after a run.
"""

from __future__ import annotations

import filecmp
import lzma
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna

from kdagen.studies import TuneError

FOLDER_DB, PACKED_DB = "studies.db", "studies.db.xz"
SQLITE_TIMEOUT_S = 60.0  # how long a write waits for another process's lock on the file
OPEN_ATTEMPTS = 4  # processes that start together race to create a new storage's tables
FORMS = "sqlite:///PATH, journal:///PATH or a database URL such as postgresql://user@host/db"


def kind_of(url: str) -> str:
    """sqlite, journal or rdb; ``TuneError`` for anything else."""
    for kind in ("sqlite", "journal"):
        if url.startswith(f"{kind}:"):
            if not url.startswith(f"{kind}:///") or not url[len(kind) + 4 :]:
                raise TuneError(f"--storage {url}: write {kind}:///PATH (four slashes before "
                                "an absolute path)")  # fmt: skip
            return kind
    if "://" not in url:
        raise TuneError(f"--storage {url}: not a storage URL; give {FORMS}")
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise TuneError(f"--storage {url}: {err}") from None
    try:
        parsed.get_dialect()  # an unknown database or driver name: say so before any retry
    except ArgumentError as err:
        raise TuneError(f"--storage {parsed.render_as_string(hide_password=True)}: {err}") from None
    return "rdb"


def describe(url: str) -> str:
    """The URL as it may be printed or written to runs.json: without its password."""
    if kind_of(url) != "rdb":
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The storage behind ``url`` (created when new); ``TuneError`` naming why it cannot open."""
    kind = kind_of(url)
    last: Exception | None = None
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return _open(kind, url)
        except ImportError as err:  # a database driver that is not installed: no retry helps
            why = _line(err.__cause__ or err)
            raise TuneError(f"cannot open --storage {describe(url)}: {why} (install the "
                            "database's Python driver)") from None  # fmt: skip
        except Exception as err:
            last = err
            time.sleep(0.2 * 2**attempt * (1 + random.random()))
    raise TuneError(f"cannot open --storage {describe(url)}: {_line(last)}")


def _open(kind: str, url: str) -> optuna.storages.BaseStorage:
    if kind == "journal":
        path = Path(url[len("journal:///") :])
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(_journal_backend(str(path)))
    if kind == "sqlite":
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(
            url, engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        )
    return optuna.storages.RDBStorage(url)


def _journal_backend(path: str) -> Any:
    try:
        from optuna.storages.journal import JournalFileBackend  # Optuna >= 4.0
    except ImportError:
        return optuna.storages.JournalFileStorage(path)  # its name before 4.0
    return JournalFileBackend(path)


def _line(err: BaseException | None) -> str:
    text = f"{type(err).__name__}: {err}" if err is not None else "unknown error"
    return text.strip().splitlines()[0][:300]


def folder_url(folder: Path) -> str:
    """The SQLite URL of a tuned folder's own database, first unpacked from ``studies.db.xz``
    when that is the newer file and holds other data (a fresh checkout, a pulled re-tune); a
    working copy written since (a killed run to resume) is left as it is. Processes that
    unpack at once (``kdagen check`` shards resuming from a folder) each write their own copy and
    rename it into place."""
    db, packed = folder / FOLDER_DB, folder / PACKED_DB
    if packed.exists() and (not db.exists() or packed.stat().st_mtime > db.stat().st_mtime):
        with (
            lzma.open(packed) as src,
            tempfile.NamedTemporaryFile(dir=folder, prefix=FOLDER_DB, delete=False) as dst,
        ):
            shutil.copyfileobj(src, dst)
        unpacked = Path(dst.name)
        if db.exists() and filecmp.cmp(unpacked, db, shallow=False):
            unpacked.unlink()
        else:
            unpacked.replace(db)
    return f"sqlite:///{db}"


def pack_folder(folder: Path) -> None:
    """Write ``studies.db.xz`` from the folder's database: the copy the repository keeps."""
    db = folder / FOLDER_DB
    if not db.exists():
        return
    partial = folder / (PACKED_DB + ".partial")
    with open(db, "rb") as src, lzma.open(partial, "wb", preset=9) as dst:
        shutil.copyfileobj(src, dst)
    partial.replace(folder / PACKED_DB)

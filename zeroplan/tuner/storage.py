"""Where a tuning study lives: SQLite in the output folder, any Optuna RDB URL, or a journal file.

Every way storage can fail to open (not a database, a damaged journal, a lock held past the
timeout, an unreachable server) becomes one :class:`StorageError` line; the CLI exits 2 on it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from zeroplan.spec import SpecError

__all__ = [
    "StorageError",
    "STUDY_NAME",
    "DEFAULT_LOCK_TIMEOUT_S",
    "open_storage",
    "open_study",
    "storage_url",
    "this_worker",
]

#: Name of the study inside the storage (one study per storage unless --study-name says otherwise).
STUDY_NAME = "zeroplan"

#: How long a SQLite connection waits for another process's write lock before giving up.
DEFAULT_LOCK_TIMEOUT_S = 20.0

_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


class StorageError(SpecError):
    """The study storage cannot be opened or used (corrupt, locked, unreachable)."""


def storage_url(storage: str | None, output_dir: Path) -> str:
    """The storage as given (``--storage``) or the default ``sqlite:///OUTPUT/study.db``.

    A plain path ending in ``.db``/``.sqlite`` is a SQLite file; any other plain path is an Optuna
    journal file (JournalFileBackend); anything with ``://`` is an SQLAlchemy/Optuna RDB URL.
    """
    if storage is None:
        return f"sqlite:///{(output_dir / 'study.db').resolve()}"
    if "://" in storage:
        return storage
    path = Path(storage).expanduser()
    if path.suffix in _SQLITE_SUFFIXES:
        return f"sqlite:///{path.resolve()}"
    return f"journal:{path.resolve()}"


def _describe(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_storage(url: str, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Any:
    """Open the Optuna storage at ``url`` (see :func:`storage_url`); StorageError if it cannot be used."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = Path(url[len("journal:"):])
        if not path.parent.exists():
            raise StorageError(f"--storage {path}: folder {path.parent} does not exist")
        if path.is_dir():
            raise StorageError(f"--storage {path} is a directory; give a journal file path or an RDB URL")
        try:
            return JournalStorage(JournalFileBackend(str(path)))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise StorageError(
                f"--storage {path}: the journal file cannot be read ({_describe(exc)}); it is damaged or "
                "not an Optuna journal — move it away or choose another --storage"
            ) from None
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        if not path.parent.exists():
            raise StorageError(f"--storage {path}: folder {path.parent} does not exist")
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": lock_timeout_s}}
    else:
        engine_kwargs = {}
    for attempt in range(3):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, skip_compatibility_check=False)
            if url.startswith("sqlite:"):
                _use_wal(storage.engine)
            return storage
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy/driver errors of every kind become one line
            # Two workers creating the schema at the same moment: the loser sees "table ... already
            # exists" or a duplicate alembic version row; the winner's schema is then complete.
            detail = _describe(exc)
            if ("already exists" in detail or "UNIQUE constraint failed" in detail) and attempt < 2:
                time.sleep(0.5)
                continue
            raise StorageError(_rdb_message(url, exc)) from None
    raise AssertionError("unreachable")


def _use_wal(engine: Any) -> None:
    """SQLite in write-ahead-log mode: readers never block the writer (several workers), and a
    commit is one append instead of an fsync'd rewrite (every trial writes a dozen attributes).
    ``synchronous=NORMAL`` keeps every commit across a process crash (the case --resume handles)."""
    import sqlalchemy

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(engine, "connect", on_connect)
    engine.dispose()  # connections opened while creating the schema reconnect with the pragmas


def _rdb_message(url: str, exc: BaseException) -> str:
    detail = _describe(exc)
    shown = url if not url.startswith("sqlite:///") else url[len("sqlite:///"):]
    if "locked" in detail:
        return f"--storage {shown}: the study storage is locked by another process ({detail}); retry when it is free"
    if "not a database" in detail or "malformed" in detail or "corrupt" in detail:
        return f"--storage {shown}: the study storage is corrupt ({detail}); move it away or choose another --storage"
    return f"--storage {shown}: cannot open the study storage ({detail})"


def open_study(url: str, *, resume: bool, sampler: Any, study_name: str = STUDY_NAME, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Any:
    """Load or create the study (maximize measured throughput).

    Without ``resume`` an existing study that already holds trials is refused (so a second run
    never mixes into the first by accident); with ``resume`` it is continued, or created if new.
    """
    import optuna

    storage = open_storage(url, lock_timeout_s=lock_timeout_s)
    try:
        study = optuna.create_study(
            storage=storage, study_name=study_name, direction="maximize", sampler=sampler, load_if_exists=True
        )
        n_trials = len(study.get_trials(deepcopy=False))
    except Exception as exc:  # noqa: BLE001 - storage failures of every kind become one line
        raise StorageError(_rdb_message(url, exc)) from None
    if n_trials and not resume:
        shown = url.replace("sqlite:///", "").replace("journal:", "")
        raise StorageError(
            f"the study in {shown} already holds {n_trials} trials; pass --resume to continue it "
            "or choose another --output/--storage"
        )
    return study


def this_worker() -> str:
    """``host:pid`` of this process, recorded on every trial it claims."""
    return f"{os.uname().nodename}:{os.getpid()}"

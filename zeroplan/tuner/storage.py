"""Where a tuning study lives: SQLite in the output folder, any Optuna RDB URL, or a journal file.

``--storage PATH`` (a plain file path) is Optuna's journal storage (``JournalFileBackend``): an
append-only file that several workers on several nodes can share on NFS, where SQLite's locking
is unreliable (optuna#815). ``sqlite:///...`` and other URLs are Optuna's ``RDBStorage``; those
get Optuna's heartbeat: a trial whose worker stops beating for :data:`GRACE_PERIOD_S` is failed by
the next worker that looks (:func:`fail_stale_trials`) and retried once
(``RetryHeartbeatStaleTrialCallback``). The journal backend has no heartbeat in Optuna 5; there
the claims ledger's own rule (dead pid on the same host, else the probe deadline) applies.

Every way storage can fail to open (not a database, a damaged journal, a lock held past the
timeout, an unreachable server) becomes one :class:`StorageError` line; the CLI exits 2 on it.
"""

from __future__ import annotations

import os
import time
import warnings
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
    "HEARTBEAT_INTERVAL_S",
    "GRACE_PERIOD_S",
    "fail_stale_trials",
    "heartbeat",
]

#: Seconds between heartbeats of a running trial (RDB storages; Optuna's ``heartbeat_interval``).
HEARTBEAT_INTERVAL_S = 30
#: Seconds without a heartbeat after which a running trial counts as stale (``grace_period``).
GRACE_PERIOD_S = 120

#: Name of the study inside the storage (one study per storage unless --study-name says otherwise).
STUDY_NAME = "zeroplan"

#: How long a SQLite connection waits for another process's write lock before giving up.
DEFAULT_LOCK_TIMEOUT_S = 20.0



class StorageError(SpecError):
    """The study storage cannot be opened or used (corrupt, locked, unreachable)."""


def storage_url(storage: str | None, output_dir: Path) -> str:
    """The storage as given (``--storage``) or the default ``sqlite:///OUTPUT/study.db``.

    A plain file path is an Optuna journal file (JournalFileBackend), whatever its suffix: a path
    is what several workers on a shared file system give, and SQLite must not be shared there.
    Anything with ``://`` is an SQLAlchemy/Optuna RDB URL (``sqlite:///x.db`` for SQLite).
    """
    if storage is None:
        return f"sqlite:///{(output_dir / 'study.db').resolve()}"
    if "://" in storage:
        return storage
    return f"journal:{Path(storage).expanduser().resolve()}"


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
        if path.is_file() and path.read_bytes()[:16] == b"SQLite format 3\x00":
            raise StorageError(
                f"--storage {path} is a SQLite database; a plain path is an Optuna journal file: "
                f"give --storage sqlite:///{path} to use it (not on a shared file system)"
            )
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
            with warnings.catch_warnings():  # heartbeat_interval is "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    skip_compatibility_check=False,
                    heartbeat_interval=HEARTBEAT_INTERVAL_S,
                    grace_period=GRACE_PERIOD_S,
                    # One retry of a trial whose worker died; the retry carries ``failed_trial``.
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
                )
            if url.startswith("sqlite:"):
                _configure_sqlite(storage.engine)
            # zeroplan runs ask/tell and beats the heartbeat itself (see heartbeat()); Optuna's
            # warning on every ask() is about callers that do not.
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize", category=UserWarning)
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


def _configure_sqlite(engine: Any) -> None:
    """SQLite in write-ahead-log mode: readers never block the writer (several workers), and a
    commit is one append instead of an fsync'd rewrite (every trial writes a dozen attributes).
    ``synchronous=NORMAL`` keeps every commit across a process crash (the case --resume handles).

    Every transaction also starts with ``BEGIN IMMEDIATE``, which takes SQLite's write lock before
    its first read. Optuna changes a trial's state by reading it and writing only if the read allows
    it (``RDBStorage.set_trial_state_values``: pop an enqueued trial only if it is WAITING, finish
    one only if it is RUNNING), and counts on ``SELECT ... FOR UPDATE`` to keep another process out
    in between; SQLite has no FOR UPDATE, and pysqlite runs the read outside the transaction it
    opens for the write. Two workers could then both pop one enqueued trial, probe it twice and
    fail at the second ``tell`` ("Cannot tell a COMPLETE trial", "Trial#N has already finished"),
    which test_shared_study.py forces. With the lock taken first the read and the write are one
    transaction, and the other worker waits (up to the lock timeout) and then reads the new state:
    SQLAlchemy's recipe for pysqlite (disable the driver's own BEGIN, emit ours on ``begin``)."""
    import sqlalchemy

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN; ``on_begin`` does
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    def on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    sqlalchemy.event.listen(engine, "connect", on_connect)
    sqlalchemy.event.listen(engine, "begin", on_begin)
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
        try:
            # A journal: load first, which writes nothing (create_study(load_if_exists=True) appends
            # a create-study record even when the study exists). An RDB: create_study's failed
            # insert is rolled back, and it is the write that finds a locked database early.
            if not url.startswith("journal:"):
                raise KeyError(study_name)
            study = optuna.load_study(storage=storage, study_name=study_name, sampler=sampler)
        except KeyError:
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


def fail_stale_trials(study: Any) -> None:
    """Optuna's stale-trial sweep: RUNNING trials of a heartbeat storage whose worker stopped
    beating become FAIL and are retried once (a no-op for the journal storage)."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def heartbeat(study: Any, trial: Any) -> Any:
    """Context manager beating ``trial``'s heartbeat while its probe runs (Optuna's own
    heartbeat thread, as ``Study.optimize`` uses it; a null context for the journal storage)."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    return get_heartbeat_thread(trial._trial_id, study._storage)

"""Opening a store: the engine for its URL, the schema brought up to date, and the sessions every table family's
methods write and read through."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, InterfaceError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from miles_control.job.redact import mask_credentials
from miles_control.job.status import FencedOut
from miles_control.service.store.migrate import ensure_schema
from miles_control.service.store.models import Attempt


class StoreError(ValueError):
    """A store that cannot be opened: a URL of no known database, a server that does not answer, a file that
    cannot be created. The message names the URL (without its password) and the cause."""


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    # the busy timeout first: switching a new database to WAL takes an exclusive lock, and a process opening the
    # store at the same moment as another would otherwise fail at once with "database is locked"
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def shown_url(url: str) -> str:
    """`url` as it may be printed: without its password."""
    return mask_credentials(url)


def make_engine(url: str) -> Engine:
    """An engine for `url` (a SQLite file's folder is created; SQLite gets WAL, foreign keys and a busy timeout);
    StoreError when the URL names no database Miles can open."""
    try:
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, pool_pre_ping=not url.startswith("sqlite"))
    except (ArgumentError, NoSuchModuleError) as exc:
        raise StoreError(
            f"store {shown_url(url)}: not a database URL Miles can open ({exc}); use sqlite:///PATH or "
            "postgresql+psycopg://USER:PASSWORD@HOST/DB"
        ) from None
    except OSError as exc:
        raise StoreError(f"store {shown_url(url)}: cannot create its folder ({exc})") from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


class StoreBase:
    """An open store: its URL, its engine and a session factory. The table families (`store/jobs.py`,
    `store/records.py`, `store/bench_reports.py`) build on it; `Store` composes them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        try:
            ensure_schema(self.engine)
        except (OperationalError, InterfaceError) as exc:
            raise StoreError(
                f"store {shown_url(url)}: cannot open it ({' '.join(str(exc.orig or exc).split())})"
            ) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.fence: int | None = None  # the attempt whose lease every write checks (a driver's view), or None

    def session(self) -> Session:
        """A new session; every write of the store commits at once (`with self.session() as s, s.begin()`)."""
        return self._sessions()

    def fenced(self, attempt_id: int) -> Self:
        """This store as the driver of `attempt_id` writes to it: every write of a job's records or lifecycle first
        checks, in its own transaction, that the attempt is live and its job's newest (FencedOut otherwise). A
        driver judged lost, or outlived by a resume, cannot write over the attempt that replaced it."""
        view = copy.copy(self)
        view.fence = attempt_id
        return view

    @contextmanager
    def writing(self, job_id: int) -> Iterator[Session]:
        """A write transaction on `job_id`'s records, checked against the fence first (the attempt's row is locked
        until commit on PostgreSQL, so ending the attempt waits for a write under way)."""
        with self.session() as s, s.begin():
            if self.fence is not None:
                self._check_lease(s, job_id, self.fence)
            yield s

    @staticmethod
    def _check_lease(s: Session, job_id: int, attempt_id: int) -> None:
        attempt = s.scalars(select(Attempt).where(Attempt.id == attempt_id).with_for_update()).one_or_none()
        if attempt is None or attempt.job_id != job_id:
            raise FencedOut(job_id, attempt_id, "it is not an attempt of this job")
        if attempt.status == "ended":
            raise FencedOut(job_id, attempt_id, f"it was ended: {attempt.exit_reason}")
        newest = s.scalar(select(func.max(Attempt.number)).where(Attempt.job_id == job_id))
        if newest != attempt.number:
            raise FencedOut(job_id, attempt_id, f"attempt {newest} replaced it")

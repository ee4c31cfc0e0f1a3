"""Schema migrations of the job store (Alembic), run in code: `Store` brings every database it opens to
the newest revision. A store made before migrations existed (tables of revision 0001, no version table)
is stamped 0001 first, so nothing stored is lost."""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).parent / "migrations"
_ADVISORY_KEY = 0x6D696C6573  # "miles": the PostgreSQL advisory lock that serialises migrations


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False))
    return config


def head_revision() -> str:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(config).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _run(engine: Engine, action, *args) -> None:
    config = alembic_config(engine)
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:  # a table copy (batch mode) must not cascade deletes; the pragma works outside a transaction
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                config.attributes["connection"] = conn
                action(config, *args)
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


def upgrade(engine: Engine, revision: str = "head") -> None:
    _run(engine, command.upgrade, revision)


def downgrade(engine: Engine, revision: str) -> None:
    _run(engine, command.downgrade, revision)


class StoreSchemaError(RuntimeError):
    """The store's schema cannot be brought to the head revision safely; the message says what to do."""


@contextmanager
def migration_lock(engine: Engine) -> Iterator[None]:
    """Serialise migrations of one store across processes: on SQLite an exclusive lock on a file beside the
    database (`<db>.migrate.lock`), on PostgreSQL a session advisory lock; elsewhere (an in-memory database)
    nothing to serialise."""
    if engine.dialect.name == "sqlite":
        database = engine.url.database
        if not database or database == ":memory:":
            yield
            return
        with open(f"{database}.migrate.lock", "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    elif engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _ADVISORY_KEY})
            conn.commit()
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _ADVISORY_KEY})
                conn.commit()
    else:
        yield


def _version_rows(engine: Engine) -> list[str]:
    if "alembic_version" not in inspect(engine).get_table_names():
        return []
    with engine.connect() as conn:
        return [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]


def _matches_models(engine: Engine) -> bool:
    from alembic.autogenerate import compare_metadata

    from miles_control.service.store.models import Base

    with engine.connect() as conn:
        return not compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)


def _repair_versions(engine: Engine) -> None:
    """A store whose version table holds several rows (two migrations that ran at once, before they were
    serialised): when its tables are exactly the head revision's, keep one head row; otherwise refuse with
    what to do, so nothing is migrated twice."""
    rows = _version_rows(engine)
    if len(rows) <= 1:
        return
    head = head_revision()
    if _matches_models(engine):
        log.warning("store %s: version table held %s; its tables are revision %s: repaired", engine.url, rows, head)
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM alembic_version"))
            conn.execute(text("INSERT INTO alembic_version (version_num) VALUES (:v)"), {"v": head})
        return
    raise StoreSchemaError(
        f"store {engine.url.render_as_string(hide_password=True)}: the alembic_version table holds {len(rows)} rows "
        f"({', '.join(rows)}), left by migrations that ran at once, and the tables are not those of the newest "
        f"revision ({head}). Back the store up, find the revision its tables match, keep only that row "
        "(DELETE FROM alembic_version WHERE version_num <> '<revision>'), then start Miles again to migrate."
    )


def ensure_schema(engine: Engine) -> None:
    """Bring the database to the head revision (a no-op, two queries, when it is there already). Migrations of
    one store are serialised across processes (`migration_lock`): two `miles serve` started together on a new
    store migrate it once."""
    head = head_revision()
    try:
        if _version_rows(engine) == [head]:
            return
    except Exception:  # noqa: BLE001 - a table being created by another process right now: take the lock and look again
        pass
    with migration_lock(engine):
        _repair_versions(engine)
        current = current_revision(engine)
        if current == head:
            return
        if current is None and "jobs" in inspect(engine).get_table_names():
            log.info("store %s predates migrations: stamping revision 0001", engine.url)
            _run(engine, command.stamp, "0001")
        upgrade(engine)

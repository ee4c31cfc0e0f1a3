"""Schema migrations of the job store (Alembic), run in code: `Store` brings every database it opens to
the newest revision. A store made before migrations existed (tables of revision 0001, no version table)
is stamped 0001 first, so nothing stored is lost."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).parent / "migrations"


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


def ensure_schema(engine: Engine) -> None:
    """Bring the database to the head revision (a no-op, one query, when it is there already)."""
    current = current_revision(engine)
    if current == head_revision():
        return
    if current is None and "jobs" in inspect(engine).get_table_names():
        log.info("store %s predates migrations: stamping revision 0001", engine.url)
        _run(engine, command.stamp, "0001")
    try:
        upgrade(engine)
    except Exception:
        # Another process (the API and a job's driver open the same store) may have just done it.
        if current_revision(engine) != head_revision():
            raise

"""Alembic migrations: upgrade from empty, downgrade, upgrade again; the models agree with them; a store
made before migrations existed is adopted without losing rows."""

import os
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from miles_control.service.store import Base, Store
from miles_control.service.store.migrate import current_revision, downgrade, head_revision, upgrade
from miles_control.service.store.store import make_engine

TABLES = {"jobs", "attempts", "steps", "spans", "metrics", "events", "checkpoints", "schedule_changes", "samples"}


def tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade(store_url):
    engine = make_engine(store_url)
    assert current_revision(engine) is None and tables(engine) == set()
    upgrade(engine)
    assert current_revision(engine) == head_revision() == "0004"
    assert TABLES | {"api_tokens"} <= tables(engine)
    assert {"num_tokens", "logprobs", "turns", "images"} <= {c["name"] for c in inspect(engine).get_columns("samples")}
    downgrade(engine, "0003")  # a sample's images go
    assert "images" not in {c["name"] for c in inspect(engine).get_columns("samples")}
    downgrade(engine, "0002")  # the detail columns of samples go
    assert "logprobs" not in {c["name"] for c in inspect(engine).get_columns("samples")}
    downgrade(engine, "0001")
    assert "attempts" not in tables(engine) and "jobs" in tables(engine)
    assert "source" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    downgrade(engine, "base")
    assert tables(engine) == set() and current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == "0004" and TABLES <= tables(engine)
    engine.dispose()


def test_models_match_the_migrations(store_url):
    engine = make_engine(store_url)
    upgrade(engine)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diffs == []
    engine.dispose()


def test_a_store_from_before_migrations_is_adopted(store_url):
    engine = make_engine(store_url)
    upgrade(engine, "0001")
    with engine.begin() as conn:  # what `create_all` of the first store left: tables, no version table
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(
            text("INSERT INTO jobs (name, status, spec, created_at) VALUES ('old', 'succeeded', '{}', '2026-01-01')")
        )
        conn.execute(text("INSERT INTO metrics (job_id, step, name, value, wall_time) VALUES (1, 3, 'loss', 0.5, 0)"))
        conn.execute(
            text(
                "INSERT INTO events (job_id, kind, message, data, created_at) VALUES (1, 'x', 'y', '{}', '2026-01-01')"
            )
        )
    engine.dispose()
    store = Store(store_url)
    assert current_revision(store.engine) == head_revision()
    [job] = store.jobs()[0]
    assert job.name == "old" and job.source == "cli" and job.cancel_requested is False
    assert store.metric_series(job.id, "loss") == [(3, 0.5)]  # the rows of the old store's tables survive
    assert [e.kind for e in store.events(job.id)] == ["x"]
    downgrade(store.engine, "0001")  # and a downgrade (a table copy on SQLite) keeps them too
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM metrics")).scalar() == 1
    store.engine.dispose()


_OPEN_AT_ONCE = """
import sys, time
from pathlib import Path
from miles_control.service.store import Store
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.005)
Store(sys.argv[1])
"""


def _open_at_once(url: str, go: Path, processes: int) -> list[subprocess.CompletedProcess]:
    import sys

    procs = [
        subprocess.Popen([sys.executable, "-c", _OPEN_AT_ONCE, url, str(go)], stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    time.sleep(1.5)  # every process has imported the store and waits at the barrier
    go.touch()
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), None, p.stderr.read()) for p in procs]


def test_stores_opened_at_once_migrate_once(store_url, tmp_path):
    """Several processes (two `miles serve`, `miles tokens create`) opening one new store at the same moment:
    every one succeeds and the store ends with one version row. Repeated, since a race shows only sometimes."""
    from miles_control.testing.servers import PG_ENV, fresh_pg_database

    for round_ in range(6):
        sqlite = store_url.startswith("sqlite")
        fresh = (
            nullcontext(f"sqlite:///{tmp_path}/race{round_}.db") if sqlite else fresh_pg_database(os.environ[PG_ENV])
        )
        with fresh as url:
            results = _open_at_once(url, tmp_path / f"go{round_}", processes=3)
            assert [r.returncode for r in results] == [0, 0, 0], [r.stderr[-2000:] for r in results]
            engine = make_engine(url)
            with engine.connect() as conn:
                versions = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            engine.dispose()
            assert versions == [head_revision()]


def test_a_version_table_with_two_rows_is_repaired_or_refused(store_url):
    """What an unserialised race left behind: the tables at head with two version rows are repaired; the
    tables of an older revision with two rows are refused with what to do, and nothing is migrated."""
    from miles_control.service.store.migrate import StoreSchemaError

    engine = make_engine(store_url)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO alembic_version (version_num) VALUES ('0001')"))
    Store(store_url).engine.dispose()  # repaired: the tables are the head revision's
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head_revision()]
    downgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO alembic_version (version_num) VALUES ('0002')"))
    with pytest.raises(StoreSchemaError, match=r"holds 2 rows \(0001, 0002\).*DELETE FROM alembic_version"):
        Store(store_url)
    assert "attempts" not in tables(engine)  # nothing was migrated
    engine.dispose()

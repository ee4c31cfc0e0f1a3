"""Alembic migrations: upgrade from empty, downgrade, upgrade again; the models agree with them; a store
made before migrations existed is adopted without losing rows."""

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from miles_control.store import Base, Store
from miles_control.store.migrate import current_revision, downgrade, head_revision, upgrade
from miles_control.store.store import make_engine

TABLES = {"jobs", "attempts", "steps", "spans", "metrics", "events", "checkpoints", "schedule_changes", "samples"}


def tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade(store_url):
    engine = make_engine(store_url)
    assert current_revision(engine) is None and tables(engine) == set()
    upgrade(engine)
    assert current_revision(engine) == head_revision() == "0002"
    assert TABLES | {"api_tokens"} <= tables(engine)
    downgrade(engine, "0001")
    assert "attempts" not in tables(engine) and "jobs" in tables(engine)
    assert "source" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    downgrade(engine, "base")
    assert tables(engine) == set() and current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == "0002" and TABLES <= tables(engine)
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

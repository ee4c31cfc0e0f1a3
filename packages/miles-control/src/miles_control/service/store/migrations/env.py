"""Alembic environment of the job store. Run through `miles_control.service.store.migrate`, which passes the
connection; `alembic -c <ini>` with `sqlalchemy.url` works too."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from miles_control.service.store.models import Base

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        render_as_batch=conn.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    with create_engine(config.get_main_option("sqlalchemy.url")).connect() as conn:
        _run(conn)

"""Runs: jobs, steps, stage spans, metrics, events and schedule changes (the store of `miles run`).

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def _job_fk() -> sa.Column:
    return sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
    )
    op.create_table(
        "steps",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("weight_version", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float, nullable=False),
    )
    op.create_index("ix_steps_job_step", "steps", ["job_id", "step"], unique=True)
    op.create_table(
        "spans",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("stage", sa.String(40), nullable=False),
        sa.Column("worker", sa.String(80), nullable=False),
        sa.Column("start", sa.Float, nullable=False),
        sa.Column("end", sa.Float, nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("num_bytes", sa.Integer, nullable=False),
        sa.Column("attrs", sa.JSON, nullable=False),
    )
    op.create_index("ix_spans_job_step", "spans", ["job_id", "step"])
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("name", sa.String(80), nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("wall_time", sa.Float, nullable=False),
    )
    op.create_index("ix_metrics_job_name_step", "metrics", ["job_id", "name", "step"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("step", sa.Integer, nullable=True),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "schedule_changes",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("patch", sa.JSON, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("applied_step", sa.Integer, nullable=True),
        sa.Column("requested_at", TS, nullable=False),
    )


def downgrade() -> None:
    for table in ("schedule_changes", "events", "metrics", "spans", "steps", "jobs"):
        op.drop_table(table)

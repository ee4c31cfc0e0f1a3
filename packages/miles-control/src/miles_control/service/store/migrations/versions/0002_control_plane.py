"""Control plane: attempts, checkpoints, a sample of generations, API tokens; job source and cancel flag.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def _job_fk() -> sa.Column:
    return sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    # Plain ADD COLUMN (no table copy on SQLite: a copy drops `jobs`, which would cascade to its rows).
    op.add_column("jobs", sa.Column("source", sa.String(20), nullable=False, server_default="cli"))
    op.add_column("jobs", sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("jobs", sa.Column("updated_at", TS, nullable=True))
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_events_job_id", "events", ["job_id", "id"])
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("number", sa.Integer, nullable=False),
        sa.Column("launcher", sa.String(20), nullable=False),
        sa.Column("resume_step", sa.Integer, nullable=False),
        sa.Column("driver_pid", sa.Integer, nullable=True),
        sa.Column("driver_host", sa.String(255), nullable=True),
        sa.Column("submission_id", sa.String(255), nullable=True),
        sa.Column("log_path", sa.Text, nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("exit_reason", sa.Text, nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("ended_at", TS, nullable=True),
    )
    op.create_index("ix_attempts_job_number", "attempts", ["job_id", "number"], unique=True)
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("weight_version", sa.Integer, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_checkpoints_job_step", "checkpoints", ["job_id", "step"])
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer, primary_key=True),
        _job_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("label", sa.Text, nullable=True),
        sa.Column("reward", sa.Float, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("weight_versions", sa.JSON, nullable=False),
    )
    op.create_index("ix_samples_job_step", "samples", ["job_id", "step"])
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("scope", sa.String(20), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("last_used_at", TS, nullable=True),
        sa.Column("revoked_at", TS, nullable=True),
    )


def downgrade() -> None:
    for table in ("api_tokens", "samples", "checkpoints", "attempts"):
        op.drop_table(table)
    op.drop_index("ix_events_job_id", "events")
    op.drop_index("ix_jobs_status", "jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite copies the table: the migration runs with FKs off
        batch.drop_column("updated_at")
        batch.drop_column("cancel_requested")
        batch.drop_column("source")

"""Samples people can inspect (the response's length in tokens, its per-token logprobs, a multi-turn episode's
turns) and bench reports stored with their runs (the markdown, the job ids, the plots).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN, nullable: samples stored before have none of these (the dashboard says so).
    op.add_column("samples", sa.Column("num_tokens", sa.Integer, nullable=True))
    op.add_column("samples", sa.Column("logprobs", sa.JSON, nullable=True))
    op.add_column("samples", sa.Column("turns", sa.JSON, nullable=True))
    op.create_table(
        "reports",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("title", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("markdown", sa.Text, nullable=False),
        sa.Column("job_ids", sa.JSON, nullable=False),
    )
    op.create_table(
        "report_files",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("report_id", sa.Integer, sa.ForeignKey("reports.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("report_id", "name", name="uq_report_files_name"),
    )


def downgrade() -> None:
    op.drop_table("report_files")
    op.drop_table("reports")
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("turns")
        batch.drop_column("logprobs")
        batch.drop_column("num_tokens")

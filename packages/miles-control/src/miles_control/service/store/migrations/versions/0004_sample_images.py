"""A sample's images (a vision-language model's prompt), as small PNG data URIs the dashboard shows beside its text.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN, nullable: samples stored before, and text samples, have none.
    op.add_column("samples", sa.Column("images", sa.JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("images")

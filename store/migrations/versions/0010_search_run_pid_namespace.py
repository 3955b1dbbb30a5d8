"""search run worker pid namespace

Revision ID: 0010_store
Revises: 0009_store
Create Date: 2026-12-06 09:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0010_store'
down_revision = '0009_store'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_search_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('pid_ns', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('pgc_search_runs', schema=None) as batch_op:
        batch_op.drop_column('pid_ns')

"""search run policy snapshot

Revision ID: 0006_store
Revises: 0005_compiler
Create Date: 2026-12-01 09:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0006_store'
down_revision = '0005_compiler'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_search_runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('policy', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('pgc_search_runs', schema=None) as batch_op:
        batch_op.drop_column('policy')

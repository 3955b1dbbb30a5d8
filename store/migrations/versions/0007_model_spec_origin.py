"""model spec origin

Revision ID: 0007_store
Revises: 0006_store
Create Date: 2026-12-01 12:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0007_store'
down_revision = '0006_store'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_models', schema=None) as batch_op:
        batch_op.add_column(sa.Column('spec_origin', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('pgc_models', schema=None) as batch_op:
        batch_op.drop_column('spec_origin')

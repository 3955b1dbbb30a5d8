"""layer sensitivity: the judgments behind a top-1 drop

Revision ID: 0011_store
Revises: 0010_store
Create Date: 2026-12-06 16:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0011_store'
down_revision = '0010_store'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_layer_sensitivity', schema=None) as batch_op:
        batch_op.add_column(sa.Column('samples', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('pgc_layer_sensitivity', schema=None) as batch_op:
        batch_op.drop_column('samples')

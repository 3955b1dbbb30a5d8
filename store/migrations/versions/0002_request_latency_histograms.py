"""request latency histograms

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 07:45:09.351090
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_request_stats', schema=None) as batch_op:
        batch_op.add_column(sa.Column('histogram', sa.JSON(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('pgc_request_stats', schema=None) as batch_op:
        batch_op.drop_column('histogram')


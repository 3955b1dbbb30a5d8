"""deployment build and warm-up seconds

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 07:45:58.901736
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('build_s', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('warm_s', sa.Float(), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('pgc_deployments', schema=None) as batch_op:
        batch_op.drop_column('warm_s')
        batch_op.drop_column('build_s')


"""variant profile artifact

Revision ID: 0009_store
Revises: 0008_store
Create Date: 2026-12-02 14:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0009_store'
down_revision = '0008_store'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_variants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('profile_artifact', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('pgc_variants', schema=None) as batch_op:
        batch_op.drop_column('profile_artifact')

"""replicas and artifacts

Revision ID: 0008_store
Revises: 0007_store
Create Date: 2026-12-01 13:00:00.000000
"""

from alembic import op
import sqlalchemy as sa


revision = '0008_store'
down_revision = '0007_store'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('pgc_variants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('artifact', sa.String(length=64), nullable=True))
    with op.batch_alter_table('pgc_deployments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('owner', sa.String(length=200), nullable=True))
    op.create_table(
        'pgc_replicas',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('model_id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('host', sa.String(length=200), nullable=False),
        sa.Column('pid', sa.Integer(), nullable=False),
        sa.Column('started_at', sa.Float(), nullable=False),
        sa.Column('seen_at', sa.Float(), nullable=False),
        sa.Column('stopped_at', sa.Float(), nullable=True),
        sa.Column('variant_id', sa.Integer(), nullable=True),
        sa.Column('deployment_id', sa.Integer(), nullable=True),
        sa.Column('state', sa.String(length=20), nullable=False),
        sa.Column('message', sa.Text(), nullable=True),
        sa.Column('calls', sa.BigInteger(), nullable=False),
        sa.Column('live_ms', sa.Float(), nullable=True),
        sa.Column('compiles', sa.Integer(), nullable=False),
        sa.Column('loads', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['variant_id'], ['pgc_variants.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('name'),
    )
    op.create_index('ix_pgc_replicas_model_seen', 'pgc_replicas', ['model_id', 'seen_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_pgc_replicas_model_seen', table_name='pgc_replicas')
    op.drop_table('pgc_replicas')
    with op.batch_alter_table('pgc_deployments', schema=None) as batch_op:
        batch_op.drop_column('owner')
    with op.batch_alter_table('pgc_variants', schema=None) as batch_op:
        batch_op.drop_column('artifact')

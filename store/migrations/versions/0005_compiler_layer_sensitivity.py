"""layer sensitivity

Revision ID: 0005_compiler
Revises: 0003
Create Date: 2026-11-30 08:25:27.031872
"""

from alembic import op
import sqlalchemy as sa


revision = '0005_compiler'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('pgc_layer_sensitivity',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('graph_hash', sa.String(length=64), nullable=False),
    sa.Column('layer', sa.String(length=300), nullable=False),
    sa.Column('choice', sa.String(length=50), nullable=False),
    sa.Column('metric', sa.String(length=32), nullable=False),
    sa.Column('fidelity', sa.Float(), nullable=True),
    sa.Column('rms', sa.Float(), nullable=True),
    sa.Column('sqnr_db', sa.Float(), nullable=True),
    sa.Column('max_abs', sa.Float(), nullable=True),
    sa.Column('layer_sqnr_db', sa.Float(), nullable=True),
    sa.Column('status', sa.Text(), nullable=False),
    sa.Column('inputs', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('model_id', 'graph_hash', 'layer', 'choice')
    )
    with op.batch_alter_table('pgc_layer_sensitivity', schema=None) as batch_op:
        batch_op.create_index('ix_pgc_layer_sensitivity_model_graph', ['model_id', 'graph_hash'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('pgc_layer_sensitivity', schema=None) as batch_op:
        batch_op.drop_index('ix_pgc_layer_sensitivity_model_graph')

    op.drop_table('pgc_layer_sensitivity')

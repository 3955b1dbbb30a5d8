"""initial schema: models, variants, policies, statistics, reservoir, searches, deployments

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 07:06:14.753598
"""

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('pgc_models',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('spec', sa.String(length=500), nullable=True),
    sa.Column('graph_hash', sa.String(length=64), nullable=True),
    sa.Column('hardware', sa.String(length=200), nullable=True),
    sa.Column('metric', sa.String(length=32), nullable=True),
    sa.Column('input_signature', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('last_seen_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('pgc_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=True),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('level', sa.String(length=10), nullable=False),
    sa.Column('kind', sa.String(length=50), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('pgc_events', schema=None) as batch_op:
        batch_op.create_index('ix_pgc_events_model_at', ['model_id', 'at'], unique=False)

    op.create_table('pgc_policies',
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('settings', sa.JSON(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('model_id')
    )
    op.create_table('pgc_reservoirs',
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('seen', sa.Integer(), nullable=False),
    sa.Column('payload', sa.LargeBinary(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('model_id')
    )
    op.create_table('pgc_variants',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('recipe_hash', sa.String(length=64), nullable=False),
    sa.Column('recipe', sa.JSON(), nullable=False),
    sa.Column('label', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('model_id', 'recipe_hash')
    )
    op.create_table('pgc_deployments',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('variant_id', sa.Integer(), nullable=True),
    sa.Column('previous_variant_id', sa.Integer(), nullable=True),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('source', sa.String(length=20), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('expected_speedup', sa.Float(), nullable=True),
    sa.Column('expected_fidelity', sa.Float(), nullable=True),
    sa.Column('live_speedup', sa.Float(), nullable=True),
    sa.Column('live_fidelity', sa.Float(), nullable=True),
    sa.Column('swap_ms', sa.Float(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['previous_variant_id'], ['pgc_variants.id'], ),
    sa.ForeignKeyConstraint(['variant_id'], ['pgc_variants.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('pgc_deployments', schema=None) as batch_op:
        batch_op.create_index('ix_pgc_deployments_model_state', ['model_id', 'state'], unique=False)

    op.create_table('pgc_host_stats',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('variant_id', sa.Integer(), nullable=True),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('cpu_percent', sa.Float(), nullable=False),
    sa.Column('rss_bytes', sa.BigInteger(), nullable=False),
    sa.Column('threads', sa.Integer(), nullable=False),
    sa.Column('ctx_switches', sa.BigInteger(), nullable=False),
    sa.Column('extra', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['variant_id'], ['pgc_variants.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('pgc_host_stats', schema=None) as batch_op:
        batch_op.create_index('ix_pgc_host_stats_model_at', ['model_id', 'at'], unique=False)

    op.create_table('pgc_layer_stats',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('variant_id', sa.Integer(), nullable=True),
    sa.Column('window_start', sa.Float(), nullable=False),
    sa.Column('window_end', sa.Float(), nullable=False),
    sa.Column('layer', sa.String(length=300), nullable=False),
    sa.Column('op_type', sa.String(length=100), nullable=False),
    sa.Column('shape_bucket', sa.String(length=100), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('mean_ms', sa.Float(), nullable=False),
    sa.Column('p50_ms', sa.Float(), nullable=False),
    sa.Column('p95_ms', sa.Float(), nullable=False),
    sa.Column('p99_ms', sa.Float(), nullable=False),
    sa.Column('share', sa.Float(), nullable=False),
    sa.Column('counters', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['variant_id'], ['pgc_variants.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('pgc_layer_stats', schema=None) as batch_op:
        batch_op.create_index('ix_pgc_layer_stats_model_end', ['model_id', 'window_end'], unique=False)

    op.create_table('pgc_request_stats',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('variant_id', sa.Integer(), nullable=True),
    sa.Column('window_start', sa.Float(), nullable=False),
    sa.Column('window_end', sa.Float(), nullable=False),
    sa.Column('shape_bucket', sa.String(length=100), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.Column('errors', sa.Integer(), nullable=False),
    sa.Column('fallbacks', sa.Integer(), nullable=False),
    sa.Column('mean_ms', sa.Float(), nullable=False),
    sa.Column('p50_ms', sa.Float(), nullable=False),
    sa.Column('p95_ms', sa.Float(), nullable=False),
    sa.Column('p99_ms', sa.Float(), nullable=False),
    sa.Column('sampled', sa.Integer(), nullable=False),
    sa.Column('overhead', sa.Float(), nullable=False),
    sa.Column('dropped', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['variant_id'], ['pgc_variants.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('pgc_request_stats', schema=None) as batch_op:
        batch_op.create_index('ix_pgc_request_stats_model_end', ['model_id', 'window_end'], unique=False)

    op.create_table('pgc_search_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('study_name', sa.String(length=300), nullable=False),
    sa.Column('policy_version', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('trigger', sa.String(length=200), nullable=False),
    sa.Column('trials_budget', sa.Integer(), nullable=False),
    sa.Column('trials_done', sa.Integer(), nullable=False),
    sa.Column('best_speedup', sa.Float(), nullable=True),
    sa.Column('best_fidelity', sa.Float(), nullable=True),
    sa.Column('chosen_variant_id', sa.Integer(), nullable=True),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('host', sa.String(length=255), nullable=True),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('heartbeat_at', sa.Float(), nullable=False),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['chosen_variant_id'], ['pgc_variants.id'], ),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('pgc_deployment_transitions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('deployment_id', sa.Integer(), nullable=False),
    sa.Column('from_state', sa.String(length=20), nullable=True),
    sa.Column('to_state', sa.String(length=20), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['deployment_id'], ['pgc_deployments.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('pgc_trials',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('model_id', sa.Integer(), nullable=False),
    sa.Column('variant_id', sa.Integer(), nullable=True),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=True),
    sa.Column('baseline_ms', sa.Float(), nullable=True),
    sa.Column('speedup', sa.Float(), nullable=True),
    sa.Column('fidelity', sa.Float(), nullable=True),
    sa.Column('accuracy_drop', sa.Float(), nullable=True),
    sa.Column('feasible', sa.Boolean(), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('duration_s', sa.Float(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['model_id'], ['pgc_models.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['pgc_search_runs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['variant_id'], ['pgc_variants.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'number')
    )


def downgrade() -> None:
    op.drop_table('pgc_trials')
    op.drop_table('pgc_deployment_transitions')
    op.drop_table('pgc_search_runs')
    with op.batch_alter_table('pgc_request_stats', schema=None) as batch_op:
        batch_op.drop_index('ix_pgc_request_stats_model_end')

    op.drop_table('pgc_request_stats')
    with op.batch_alter_table('pgc_layer_stats', schema=None) as batch_op:
        batch_op.drop_index('ix_pgc_layer_stats_model_end')

    op.drop_table('pgc_layer_stats')
    with op.batch_alter_table('pgc_host_stats', schema=None) as batch_op:
        batch_op.drop_index('ix_pgc_host_stats_model_at')

    op.drop_table('pgc_host_stats')
    with op.batch_alter_table('pgc_deployments', schema=None) as batch_op:
        batch_op.drop_index('ix_pgc_deployments_model_state')

    op.drop_table('pgc_deployments')
    op.drop_table('pgc_variants')
    op.drop_table('pgc_reservoirs')
    op.drop_table('pgc_policies')
    with op.batch_alter_table('pgc_events', schema=None) as batch_op:
        batch_op.drop_index('ix_pgc_events_model_at')

    op.drop_table('pgc_events')
    op.drop_table('pgc_models')

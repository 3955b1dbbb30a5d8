"""Alembic environment for the pgc store. The store passes its open connection in
``config.attributes["connection"]``; there is no alembic.ini."""

from alembic import context

from store._engine import VERSION_TABLE
from store._schema import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - only when someone runs alembic by hand
    raise RuntimeError("open the store with store.open_store(url); it applies migrations itself")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=True,
    version_table=VERSION_TABLE,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()

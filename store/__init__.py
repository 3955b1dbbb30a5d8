"""pgc's store: per-layer and request statistics, variants, policies, searches and
deployments in SQLite (one file) or PostgreSQL (a fleet), through SQLAlchemy 2.0."""

from store import repo
from store._engine import DEFAULT_URL, Store, open_store
from store._errors import NotFound, StoreConfigError, StoreConflict, StoreError, StoreUnavailable
from store._states import RUN_FINISHED, RUN_OPEN, DeploymentState, RunState
from store.rows import HostStatRow, LayerStatRow, RequestStatRow
from store._schema import (
    Deployment,
    Event,
    HostStat,
    LayerStat,
    Model,
    Policy,
    Replica,
    RequestStat,
    SearchRun,
    Transition,
    Trial,
    Variant,
)

__all__ = [
    "RUN_FINISHED",
    "RUN_OPEN",
    "DeploymentState",
    "RunState",
    "DEFAULT_URL",
    "Deployment",
    "Event",
    "HostStat",
    "HostStatRow",
    "LayerStat",
    "LayerStatRow",
    "Model",
    "NotFound",
    "Policy",
    "Replica",
    "RequestStat",
    "RequestStatRow",
    "SearchRun",
    "Store",
    "StoreConfigError",
    "StoreConflict",
    "StoreError",
    "StoreUnavailable",
    "Transition",
    "Trial",
    "Variant",
    "open_store",
    "repo",
]

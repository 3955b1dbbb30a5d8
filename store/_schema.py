"""Typed SQLAlchemy 2.0 tables. Every table is prefixed ``pgc_`` so that the store can share a
PostgreSQL database with other applications; Optuna keeps its own tables in its own storage.

Times are UTC seconds since the epoch (``float``): they compare and subtract without time-zone
bugs, and every backend stores them the same way. The statistics tables' optional JSON columns
store ``None`` as SQL NULL (``none_as_null``), so ``IS NULL`` finds rows without them whether the
ORM or a Core bulk insert wrote them; older rows may hold JSON ``null``, which reads back as None.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    pass


class Model(Base):
    """A served model, registered by the agent that serves it."""

    __tablename__ = "pgc_models"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    spec: Mapped[str | None] = mapped_column(String(500))
    spec_origin: Mapped[dict | None] = mapped_column(JSON)
    """Where the serving process found the spec's module (``{"root", "file", "sha256"}``): a
    search worker imports the spec only from that root and only when the file still has that
    digest, so nothing else on its ``sys.path`` (no current directory) is trusted."""
    graph_hash: Mapped[str | None] = mapped_column(String(64))
    hardware: Mapped[str | None] = mapped_column(String(200))
    metric: Mapped[str | None] = mapped_column(String(32))
    input_signature: Mapped[dict | None] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)


class Variant(Base):
    """A recipe applied to a model. The recipe is data: its JSON and its stable hash."""

    __tablename__ = "pgc_variants"
    __table_args__ = (UniqueConstraint("model_id", "recipe_hash"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    recipe_hash: Mapped[str] = mapped_column(String(64))
    recipe: Mapped[dict] = mapped_column(JSON)
    label: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float] = mapped_column(Float)
    artifact: Mapped[str | None] = mapped_column(String(64))
    """Digest of the compiled artifact a search worker built for this recipe (an AOTInductor
    package or an ONNX model in the shared artifact folder): serving processes load it
    instead of compiling. None: nothing was built outside a serving process."""
    profile_artifact: Mapped[str | None] = mapped_column(String(64))
    """Digest of this variant's profiling twin (the same recipe built with kernel events,
    ``compiler.build_profiling_twin``): serving processes run it on sampled calls, so the
    compiled variant's calls are split over its layers. None: no twin (yet, or none possible)."""


class Policy(Base):
    """What the user asks of a model: an accuracy budget, a latency target, search budgets."""

    __tablename__ = "pgc_policies"

    model_id: Mapped[int] = mapped_column(
        ForeignKey("pgc_models.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, default=1)
    settings: Mapped[dict] = mapped_column(JSON)
    updated_at: Mapped[float] = mapped_column(Float)


class LayerStat(Base):
    """Per-layer latency over one time window, for one shape bucket."""

    __tablename__ = "pgc_layer_stats"
    __table_args__ = (Index("ix_pgc_layer_stats_model_end", "model_id", "window_end"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    layer: Mapped[str] = mapped_column(String(300))
    op_type: Mapped[str] = mapped_column(String(100))
    shape_bucket: Mapped[str] = mapped_column(String(100))
    count: Mapped[int] = mapped_column(Integer)
    mean_ms: Mapped[float] = mapped_column(Float)
    p50_ms: Mapped[float] = mapped_column(Float)
    p95_ms: Mapped[float] = mapped_column(Float)
    p99_ms: Mapped[float] = mapped_column(Float)
    share: Mapped[float] = mapped_column(Float)
    counters: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))


class RequestStat(Base):
    """End-to-end request latency over one time window, for one shape bucket."""

    __tablename__ = "pgc_request_stats"
    __table_args__ = (Index("ix_pgc_request_stats_model_end", "model_id", "window_end"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    window_start: Mapped[float] = mapped_column(Float)
    window_end: Mapped[float] = mapped_column(Float)
    shape_bucket: Mapped[str] = mapped_column(String(100))
    count: Mapped[int] = mapped_column(Integer)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    fallbacks: Mapped[int] = mapped_column(Integer, default=0)
    mean_ms: Mapped[float] = mapped_column(Float)
    p50_ms: Mapped[float] = mapped_column(Float)
    p95_ms: Mapped[float] = mapped_column(Float)
    p99_ms: Mapped[float] = mapped_column(Float)
    sampled: Mapped[int] = mapped_column(Integer, default=0)
    overhead: Mapped[float] = mapped_column(Float, default=0.0)
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    histogram: Mapped[list | None] = mapped_column(JSON(none_as_null=True))
    """Request counts per latency bucket (bounds in ``profiler.LATENCY_BUCKETS_MS``)."""


class HostStat(Base):
    """Process statistics of the serving process (psutil), one row per sample."""

    __tablename__ = "pgc_host_stats"
    __table_args__ = (Index("ix_pgc_host_stats_model_at", "model_id", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    at: Mapped[float] = mapped_column(Float)
    cpu_percent: Mapped[float] = mapped_column(Float)
    rss_bytes: Mapped[int] = mapped_column(BigInteger)
    threads: Mapped[int] = mapped_column(Integer)
    ctx_switches: Mapped[int] = mapped_column(BigInteger)
    extra: Mapped[dict | None] = mapped_column(JSON(none_as_null=True))


class Reservoir(Base):
    """The latest bounded sample of live inputs of a model, serialized with ``torch.save``.

    Kept in the database rather than beside it so that a fleet on PostgreSQL shares it too.
    """

    __tablename__ = "pgc_reservoirs"

    model_id: Mapped[int] = mapped_column(
        ForeignKey("pgc_models.id", ondelete="CASCADE"), primary_key=True
    )
    count: Mapped[int] = mapped_column(Integer)
    seen: Mapped[int] = mapped_column(Integer)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[float] = mapped_column(Float)


class SearchRun(Base):
    """One search over a model's variant space, with its progress and outcome."""

    __tablename__ = "pgc_search_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    study_name: Mapped[str] = mapped_column(String(300))
    policy_version: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(20))
    trigger: Mapped[str] = mapped_column(String(200))
    trials_budget: Mapped[int] = mapped_column(Integer)
    policy: Mapped[dict | None] = mapped_column(JSON)
    """The policy snapshot the run was queued with (``{"version": …, "settings": …}``, as
    ``pgc_daemon.policy.PolicySnapshot.to_json`` writes it), so a run reads the policy it was
    started for even after someone edits it; None for runs older than the column."""
    trials_done: Mapped[int] = mapped_column(Integer, default=0)
    best_speedup: Mapped[float | None] = mapped_column(Float)
    best_fidelity: Mapped[float | None] = mapped_column(Float)
    chosen_variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    message: Mapped[str | None] = mapped_column(Text)
    pid: Mapped[int | None] = mapped_column(Integer)
    host: Mapped[str | None] = mapped_column(String(255))
    pid_ns: Mapped[str | None] = mapped_column(String(64))
    """The PID namespace ``pid`` is in (``/proc/self/ns/pid``'s link, e.g. ``pid:[4026531836]``)
    on ``host``; None where it could not be read, and for runs older than the column."""
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)


class Trial(Base):
    """One evaluated candidate of a search run (mirrors an Optuna trial)."""

    __tablename__ = "pgc_trials"
    __table_args__ = (UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("pgc_search_runs.id", ondelete="CASCADE"))
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(20))
    latency_ms: Mapped[float | None] = mapped_column(Float)
    baseline_ms: Mapped[float | None] = mapped_column(Float)
    speedup: Mapped[float | None] = mapped_column(Float)
    fidelity: Mapped[float | None] = mapped_column(Float)
    accuracy_drop: Mapped[float | None] = mapped_column(Float)
    feasible: Mapped[bool] = mapped_column(Boolean, default=False)
    params: Mapped[dict] = mapped_column(JSON)
    message: Mapped[str | None] = mapped_column(Text)
    duration_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)


class Deployment(Base):
    """A request to serve a variant, and where it got to. The agent that serves the model
    drives the state machine; everyone else only creates deployments in state ``candidate``."""

    __tablename__ = "pgc_deployments"
    __table_args__ = (Index("ix_pgc_deployments_model_state", "model_id", "state"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    previous_variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    state: Mapped[str] = mapped_column(String(20))
    source: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str | None] = mapped_column(Text)
    expected_speedup: Mapped[float | None] = mapped_column(Float)
    expected_fidelity: Mapped[float | None] = mapped_column(Float)
    live_speedup: Mapped[float | None] = mapped_column(Float)
    live_fidelity: Mapped[float | None] = mapped_column(Float)
    swap_ms: Mapped[float | None] = mapped_column(Float)
    build_s: Mapped[float | None] = mapped_column(Float)
    warm_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    owner: Mapped[str | None] = mapped_column(String(200))
    """The replica (serving process) that claimed the deployment and drives it through build,
    verification and canary; the others follow it once it is active."""

    transitions: Mapped[list[Transition]] = relationship(
        back_populates="deployment", order_by="Transition.id", cascade="all, delete-orphan"
    )


class Replica(Base):
    """One serving process of a model (a worker of ``uvicorn --workers N``, a host of a
    fleet): what it serves and how fast, refreshed every few seconds while it lives."""

    __tablename__ = "pgc_replicas"
    __table_args__ = (Index("ix_pgc_replicas_model_seen", "model_id", "seen_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    seen_at: Mapped[float] = mapped_column(Float)
    stopped_at: Mapped[float | None] = mapped_column(Float)
    variant_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_variants.id"))
    deployment_id: Mapped[int | None] = mapped_column(Integer)
    """The deployment whose variant it serves (the active one, once it follows it)."""
    state: Mapped[str] = mapped_column(String(20))
    """``starting``, ``serving``, ``loading`` (following a new active deployment),
    ``deploying`` (it owns a deployment in flight) or ``stopped``."""
    message: Mapped[str | None] = mapped_column(Text)
    calls: Mapped[int] = mapped_column(BigInteger, default=0)
    live_ms: Mapped[float | None] = mapped_column(Float)
    """Trimmed mean of its recent live latency on what it serves."""
    compiles: Mapped[int] = mapped_column(Integer, default=0)
    """Variants this process compiled itself (0 when every one came as an artifact)."""
    loads: Mapped[int] = mapped_column(Integer, default=0)
    """Artifacts it loaded."""


class Transition(Base):
    __tablename__ = "pgc_deployment_transitions"

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("pgc_deployments.id", ondelete="CASCADE")
    )
    from_state: Mapped[str | None] = mapped_column(String(20))
    to_state: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)

    deployment: Mapped[Deployment] = relationship(back_populates="transitions")


class Event(Base):
    """Something a person should see: a leak warning, an infeasible search, a failed build."""

    __tablename__ = "pgc_events"
    __table_args__ = (Index("ix_pgc_events_model_at", "model_id", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int | None] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    at: Mapped[float] = mapped_column(Float)
    level: Mapped[str] = mapped_column(String(10))
    kind: Mapped[str] = mapped_column(String(50))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON)


class LayerSensitivity(Base):
    """Per-layer sensitivity (``compiler.sensitivity``): the model's output error when only this
    layer takes this choice, for one version of the model's graph. The search orders and prunes
    its per-layer choices with it; ``pgc profile --sensitivity`` shows it."""

    __tablename__ = "pgc_layer_sensitivity"
    __table_args__ = (
        UniqueConstraint("model_id", "graph_hash", "layer", "choice"),
        Index("ix_pgc_layer_sensitivity_model_graph", "model_id", "graph_hash"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("pgc_models.id", ondelete="CASCADE"))
    graph_hash: Mapped[str] = mapped_column(String(64))
    layer: Mapped[str] = mapped_column(String(300))
    choice: Mapped[str] = mapped_column(String(50))
    metric: Mapped[str] = mapped_column(String(32))
    fidelity: Mapped[float | None] = mapped_column(Float)
    rms: Mapped[float | None] = mapped_column(Float)
    sqnr_db: Mapped[float | None] = mapped_column(Float)
    max_abs: Mapped[float | None] = mapped_column(Float)
    layer_sqnr_db: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(Text)
    inputs: Mapped[int] = mapped_column(Integer)
    #: the yes-or-no judgments behind a top-1 drop (rows compared); None: continuous metric,
    #: or measured before it was kept
    samples: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)

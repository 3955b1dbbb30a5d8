"""Reads and writes, one function per question the rest of pgc asks of the store.

Every function takes an open :class:`~sqlalchemy.orm.Session` (from ``Store.session()``) so a
caller can group several into one transaction. Rows come back as ORM objects that stay readable
after the session ends.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, selectinload

from store._errors import NotFound, StoreConflict
from store._schema import (
    Deployment,
    Event,
    HostStat,
    LayerStat,
    Model,
    Policy,
    RequestStat,
    Reservoir,
    SearchRun,
    Transition,
    Trial,
    Variant,
)

# --------------------------------------------------------------------------- models


def upsert_model(
    s: Session,
    name: str,
    *,
    spec: str | None = None,
    graph_hash: str | None = None,
    hardware: str | None = None,
    metric: str | None = None,
    input_signature: dict | None = None,
) -> Model:
    now = time.time()
    model = s.scalars(select(Model).where(Model.name == name)).one_or_none()
    if model is None:
        model = Model(name=name, created_at=now, last_seen_at=now)
        s.add(model)
    model.spec = spec if spec is not None else model.spec
    model.graph_hash = graph_hash if graph_hash is not None else model.graph_hash
    model.hardware = hardware if hardware is not None else model.hardware
    model.metric = metric if metric is not None else model.metric
    if input_signature is not None:
        model.input_signature = input_signature
    model.last_seen_at = now
    s.flush()
    return model


def get_model(s: Session, name: str) -> Model:
    model = s.scalars(select(Model).where(Model.name == name)).one_or_none()
    if model is None:
        raise NotFound(f"no model named {name!r}")
    return model


def list_models(s: Session) -> Sequence[Model]:
    return s.scalars(select(Model).order_by(Model.name)).all()


def touch_model(s: Session, model_id: int) -> None:
    s.execute(update(Model).where(Model.id == model_id).values(last_seen_at=time.time()))


# --------------------------------------------------------------------------- variants


def get_or_create_variant(
    s: Session, model_id: int, recipe_hash: str, recipe: dict, label: str
) -> Variant:
    variant = s.scalars(
        select(Variant).where(Variant.model_id == model_id, Variant.recipe_hash == recipe_hash)
    ).one_or_none()
    if variant is None:
        variant = Variant(
            model_id=model_id,
            recipe_hash=recipe_hash,
            recipe=recipe,
            label=label,
            created_at=time.time(),
        )
        s.add(variant)
        s.flush()
    return variant


def get_variant(s: Session, variant_id: int) -> Variant:
    variant = s.get(Variant, variant_id)
    if variant is None:
        raise NotFound(f"no variant {variant_id}")
    return variant


def list_variants(s: Session, model_id: int) -> Sequence[Variant]:
    return s.scalars(select(Variant).where(Variant.model_id == model_id).order_by(Variant.id)).all()


# --------------------------------------------------------------------------- policies


def get_policy(s: Session, model_id: int) -> Policy | None:
    return s.get(Policy, model_id)


def put_policy(s: Session, model_id: int, settings: Mapping[str, Any]) -> Policy:
    """Store a policy; its version goes up only when the settings change."""
    policy = s.get(Policy, model_id)
    now = time.time()
    if policy is None:
        policy = Policy(model_id=model_id, version=1, settings=dict(settings), updated_at=now)
        s.add(policy)
    elif policy.settings != dict(settings):
        policy.settings = dict(settings)
        policy.version += 1
        policy.updated_at = now
    s.flush()
    return policy


# --------------------------------------------------------------------------- statistics


def add_layer_stats(s: Session, rows: Iterable[Mapping[str, Any]]) -> int:
    objs = [LayerStat(**row) for row in rows]
    s.add_all(objs)
    return len(objs)


def add_request_stats(s: Session, rows: Iterable[Mapping[str, Any]]) -> int:
    objs = [RequestStat(**row) for row in rows]
    s.add_all(objs)
    return len(objs)


def add_host_stats(s: Session, rows: Iterable[Mapping[str, Any]]) -> int:
    objs = [HostStat(**row) for row in rows]
    s.add_all(objs)
    return len(objs)


def layer_profile(
    s: Session,
    model_id: int,
    *,
    since: float = 0.0,
    variant_id: int | None = None,
    shape_bucket: str | None = None,
) -> list[dict[str, Any]]:
    """Per-layer totals over every window since ``since``, hottest first.

    Means are weighted by call counts; a percentile over several windows is reported as the
    count-weighted mean of the windows' percentiles (an approximation, close when windows are
    alike). ``share`` is the layer's part of the summed per-layer time.
    """
    q = (
        select(
            LayerStat.layer,
            LayerStat.op_type,
            func.sum(LayerStat.count),
            func.sum(LayerStat.mean_ms * LayerStat.count),
            func.sum(LayerStat.p50_ms * LayerStat.count),
            func.sum(LayerStat.p95_ms * LayerStat.count),
            func.sum(LayerStat.p99_ms * LayerStat.count),
        )
        .where(LayerStat.model_id == model_id, LayerStat.window_end >= since)
        .group_by(LayerStat.layer, LayerStat.op_type)
    )
    if variant_id is not None:
        q = q.where(LayerStat.variant_id == variant_id)
    if shape_bucket is not None:
        q = q.where(LayerStat.shape_bucket == shape_bucket)
    rows = []
    for layer, op_type, count, tot, p50, p95, p99 in s.execute(q):
        if not count:
            continue
        rows.append(
            {
                "layer": layer,
                "op_type": op_type,
                "count": int(count),
                "mean_ms": tot / count,
                "p50_ms": p50 / count,
                "p95_ms": p95 / count,
                "p99_ms": p99 / count,
                "total_ms": tot,
            }
        )
    grand = sum(r["total_ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["total_ms"] / grand
    rows.sort(key=lambda r: r["total_ms"], reverse=True)
    return rows


def layer_counters(s: Session, model_id: int, *, since: float = 0.0) -> dict[str, dict[str, float]]:
    """Per-layer counter totals (perf events) summed over windows since ``since``."""
    out: dict[str, dict[str, float]] = {}
    q = select(LayerStat.layer, LayerStat.counters).where(
        LayerStat.model_id == model_id, LayerStat.window_end >= since, LayerStat.counters.is_not(None)
    )
    for layer, counters in s.execute(q):
        acc = out.setdefault(layer, {})
        for k, v in (counters or {}).items():
            acc[k] = acc.get(k, 0.0) + float(v)
    return out


def shape_histogram(s: Session, model_id: int, *, since: float = 0.0) -> dict[str, int]:
    """Calls per shape bucket seen by live traffic since ``since``."""
    q = (
        select(RequestStat.shape_bucket, func.sum(RequestStat.count))
        .where(RequestStat.model_id == model_id, RequestStat.window_end >= since)
        .group_by(RequestStat.shape_bucket)
    )
    return {bucket: int(n) for bucket, n in s.execute(q)}


def request_windows(
    s: Session, model_id: int, *, since: float = 0.0, variant_id: int | None = None
) -> Sequence[RequestStat]:
    q = select(RequestStat).where(
        RequestStat.model_id == model_id, RequestStat.window_end >= since
    )
    if variant_id is not None:
        q = q.where(RequestStat.variant_id == variant_id)
    return s.scalars(q.order_by(RequestStat.window_end)).all()


def request_summary(
    s: Session,
    model_id: int,
    *,
    since: float = 0.0,
    variant_id: int | None = None,
    exclude: Sequence[tuple[float, float]] = (),
) -> dict[str, float] | None:
    """Count-weighted request latency over windows since ``since`` (None without traffic).
    Windows that overlap any ``exclude`` interval (start, end) are left out."""
    windows = [
        w
        for w in request_windows(s, model_id, since=since, variant_id=variant_id)
        if not any(w.window_start < end and w.window_end > start for start, end in exclude)
    ]
    n = sum(w.count for w in windows)
    if n == 0:
        return None

    def wavg(attr: str) -> float:
        return sum(getattr(w, attr) * w.count for w in windows) / n

    busy = sum(w.mean_ms * w.count for w in windows)
    return {
        "count": n,
        "windows": len(windows),
        "errors": sum(w.errors for w in windows),
        "fallbacks": sum(w.fallbacks for w in windows),
        "mean_ms": wavg("mean_ms"),
        "p50_ms": wavg("p50_ms"),
        "p95_ms": wavg("p95_ms"),
        "p99_ms": wavg("p99_ms"),
        "sampled": sum(w.sampled for w in windows),
        "dropped": sum(w.dropped for w in windows),
        "overhead": sum(w.overhead * w.mean_ms * w.count for w in windows) / busy if busy else 0.0,
    }


def request_histogram(
    s: Session, model_id: int, *, variant_id: int | None = None, since: float = 0.0
) -> tuple[list[int], float, int]:
    """(counts per latency bucket, sum of latencies in ms, count) over windows since
    ``since``; bucket bounds are the profiler's fixed ``LATENCY_BUCKETS_MS``."""
    counts: list[int] = []
    total_ms = 0.0
    n = 0
    for w in request_windows(s, model_id, since=since, variant_id=variant_id):
        if not w.histogram:
            continue
        if len(counts) < len(w.histogram):
            counts.extend([0] * (len(w.histogram) - len(counts)))
        for i, c in enumerate(w.histogram):
            counts[i] += int(c)
        total_ms += w.mean_ms * w.count
        n += w.count
    return counts, total_ms, n


def host_stats(s: Session, model_id: int, *, since: float = 0.0) -> Sequence[HostStat]:
    q = select(HostStat).where(HostStat.model_id == model_id, HostStat.at >= since)
    return s.scalars(q.order_by(HostStat.at)).all()


def prune_stats(s: Session, older_than: float) -> int:
    """Delete statistics and events older than ``older_than`` (the retention policy)."""
    n = 0
    for table, col in (
        (LayerStat, LayerStat.window_end),
        (RequestStat, RequestStat.window_end),
        (HostStat, HostStat.at),
        (Event, Event.at),
    ):
        n += s.execute(delete(table).where(col < older_than)).rowcount or 0
    return n


# --------------------------------------------------------------------------- reservoir


def save_reservoir(s: Session, model_id: int, payload: bytes, count: int, seen: int) -> None:
    row = s.get(Reservoir, model_id)
    now = time.time()
    if row is None:
        s.add(Reservoir(model_id=model_id, payload=payload, count=count, seen=seen, updated_at=now))
    else:
        row.payload, row.count, row.seen, row.updated_at = payload, count, seen, now


def load_reservoir(s: Session, model_id: int) -> Reservoir | None:
    return s.get(Reservoir, model_id)


# --------------------------------------------------------------------------- search


def create_search_run(
    s: Session,
    model_id: int,
    *,
    study_name: str,
    policy_version: int,
    trigger: str,
    trials_budget: int,
) -> SearchRun:
    now = time.time()
    run = SearchRun(
        model_id=model_id,
        study_name=study_name,
        policy_version=policy_version,
        state="queued",
        trigger=trigger,
        trials_budget=trials_budget,
        trials_done=0,
        started_at=now,
        heartbeat_at=now,
    )
    s.add(run)
    s.flush()
    return run


def update_search_run(s: Session, run_id: int, **fields: Any) -> SearchRun:
    run = s.get(SearchRun, run_id)
    if run is None:
        raise NotFound(f"no search run {run_id}")
    for key, value in fields.items():
        setattr(run, key, value)
    run.heartbeat_at = time.time()
    s.flush()
    return run


def get_search_run(s: Session, run_id: int) -> SearchRun:
    run = s.get(SearchRun, run_id)
    if run is None:
        raise NotFound(f"no search run {run_id}")
    return run


def list_search_runs(s: Session, model_id: int, *, limit: int = 50) -> Sequence[SearchRun]:
    q = select(SearchRun).where(SearchRun.model_id == model_id)
    return s.scalars(q.order_by(SearchRun.id.desc()).limit(limit)).all()


def running_search(s: Session, model_id: int) -> SearchRun | None:
    q = select(SearchRun).where(
        SearchRun.model_id == model_id, SearchRun.state.in_(("queued", "running"))
    )
    return s.scalars(q.order_by(SearchRun.id.desc())).first()


def add_trial(s: Session, **fields: Any) -> Trial:
    fields.setdefault("created_at", time.time())
    trial = Trial(**fields)
    s.add(trial)
    s.flush()
    return trial


def list_trials(
    s: Session, model_id: int, *, run_id: int | None = None, limit: int = 2000
) -> Sequence[Trial]:
    q = select(Trial).where(Trial.model_id == model_id)
    if run_id is not None:
        q = q.where(Trial.run_id == run_id)
    return s.scalars(q.order_by(Trial.id).limit(limit)).all()


# --------------------------------------------------------------------------- deployments

def create_deployment(
    s: Session,
    model_id: int,
    variant_id: int | None,
    *,
    source: str,
    reason: str,
    expected_speedup: float | None = None,
    expected_fidelity: float | None = None,
) -> Deployment:
    now = time.time()
    dep = Deployment(
        model_id=model_id,
        variant_id=variant_id,
        state="candidate",
        source=source,
        reason=reason,
        expected_speedup=expected_speedup,
        expected_fidelity=expected_fidelity,
        created_at=now,
        updated_at=now,
    )
    dep.transitions.append(Transition(from_state=None, to_state="candidate", reason=reason, at=now))
    s.add(dep)
    s.flush()
    return dep


def transition(
    s: Session,
    deployment_id: int,
    to_state: str,
    reason: str,
    *,
    expected: Collection[str],
    **fields: Any,
) -> Deployment:
    """Move a deployment to ``to_state`` if, at this moment, it is in one of ``expected``: a
    compare-and-set (``UPDATE … WHERE state IN expected``), so of two transactions racing for
    one deployment exactly one moves it. The other gets :class:`StoreConflict`."""
    current = s.scalar(select(Deployment.state).where(Deployment.id == deployment_id))
    if current is None:
        raise NotFound(f"no deployment {deployment_id}")
    if current not in {str(e) for e in expected}:
        raise StoreConflict(f"deployment {deployment_id} cannot go from {current} to {to_state}")
    now = time.time()
    values = {"state": str(to_state), "reason": reason, "updated_at": now, **fields}
    result = s.execute(
        update(Deployment)
        .where(Deployment.id == deployment_id, Deployment.state == current)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # another transaction moved it between the read and the write
        raise StoreConflict(f"deployment {deployment_id} was moved from {current} meanwhile")
    s.add(
        Transition(
            deployment_id=deployment_id,
            from_state=current,
            to_state=str(to_state),
            reason=reason,
            at=now,
        )
    )
    s.flush()
    dep = get_deployment(s, deployment_id)
    s.refresh(dep)
    return dep


def pending_deployments(s: Session, model_id: int) -> Sequence[Deployment]:
    q = select(Deployment).where(Deployment.model_id == model_id, Deployment.state == "candidate")
    return s.scalars(q.order_by(Deployment.id)).all()


def list_deployments(s: Session, model_id: int, *, limit: int = 200) -> Sequence[Deployment]:
    q = (
        select(Deployment)
        .options(selectinload(Deployment.transitions))
        .where(Deployment.model_id == model_id)
        .order_by(Deployment.id.desc())
        .limit(limit)
    )
    return s.scalars(q).all()


def get_deployment(s: Session, deployment_id: int) -> Deployment:
    q = (
        select(Deployment)
        .options(selectinload(Deployment.transitions))
        .where(Deployment.id == deployment_id)
    )
    dep = s.scalars(q).one_or_none()
    if dep is None:
        raise NotFound(f"no deployment {deployment_id}")
    return dep


def active_deployment(s: Session, model_id: int) -> Deployment | None:
    q = select(Deployment).where(Deployment.model_id == model_id, Deployment.state == "active")
    return s.scalars(q.order_by(Deployment.id.desc())).first()


def lock_model(s: Session, model_id: int) -> Model:
    """Take the per-model decision lock until the transaction ends (``FOR UPDATE`` on
    PostgreSQL; SQLite serializes writers on its own once the transaction writes)."""
    model = s.scalars(select(Model).where(Model.id == model_id).with_for_update()).one_or_none()
    if model is None:
        raise NotFound(f"no model {model_id}")
    return model


# --------------------------------------------------------------------------- events


def add_event(
    s: Session,
    model_id: int | None,
    kind: str,
    message: str,
    *,
    level: str = "info",
    data: dict | None = None,
) -> Event:
    ev = Event(model_id=model_id, at=time.time(), level=level, kind=kind, message=message, data=data)
    s.add(ev)
    s.flush()
    return ev


def list_events(
    s: Session, model_id: int | None = None, *, kind: str | None = None, limit: int = 200
) -> Sequence[Event]:
    q = select(Event)
    if model_id is not None:
        q = q.where(Event.model_id == model_id)
    if kind is not None:
        q = q.where(Event.kind == kind)
    return s.scalars(q.order_by(Event.id.desc()).limit(limit)).all()


# --------------------------------------------------------------------------- sensitivity

from store._schema import LayerSensitivity  # noqa: E402  (appended section; see below)

_SENSITIVITY_FIELDS = (
    "metric", "fidelity", "rms", "sqnr_db", "max_abs", "layer_sqnr_db", "status", "inputs",
)


def save_sensitivity(
    s: Session, model_id: int, graph_hash: str, rows: Iterable[Mapping[str, Any]]
) -> int:
    """Store per-layer sensitivity for one graph (model version) of a model, one row per
    (layer, choice), as ``compiler.SensitivityReport.to_rows()`` gives them. A (layer, choice)
    measured again replaces its row. Returns the number of rows written."""
    existing = {
        (r.layer, r.choice): r
        for r in s.scalars(
            select(LayerSensitivity).where(
                LayerSensitivity.model_id == model_id, LayerSensitivity.graph_hash == graph_hash
            )
        )
    }
    now = time.time()
    n = 0
    for row in rows:
        key = (str(row["layer"]), str(row["choice"]))
        values = {f: row.get(f) for f in _SENSITIVITY_FIELDS}
        values["status"] = values["status"] or "ok"
        values["inputs"] = int(values["inputs"] or 0)
        rec = existing.get(key)
        if rec is None:
            rec = LayerSensitivity(
                model_id=model_id, graph_hash=graph_hash, layer=key[0], choice=key[1]
            )
            s.add(rec)
            existing[key] = rec
        for f, v in values.items():
            setattr(rec, f, v)
        rec.created_at = now
        n += 1
    s.flush()
    return n


def load_sensitivity(
    s: Session, model_id: int, graph_hash: str | None = None, *, choice: str | None = None
) -> list[LayerSensitivity]:
    """Sensitivity rows of one graph of a model (default: the graph measured last), most
    sensitive first: lowest fidelity, then lowest SQNR; rows without numbers (layers that
    cannot take the choice) last."""
    if graph_hash is None:
        graph_hash = s.scalars(
            select(LayerSensitivity.graph_hash)
            .where(LayerSensitivity.model_id == model_id)
            .order_by(LayerSensitivity.created_at.desc(), LayerSensitivity.id.desc())
            .limit(1)
        ).first()
        if graph_hash is None:
            return []
    q = select(LayerSensitivity).where(
        LayerSensitivity.model_id == model_id, LayerSensitivity.graph_hash == graph_hash
    )
    if choice is not None:
        q = q.where(LayerSensitivity.choice == choice)
    rows = list(s.scalars(q))
    rows.sort(
        key=lambda r: (
            r.fidelity is None,
            r.fidelity if r.fidelity is not None else 0.0,
            r.sqnr_db if r.sqnr_db is not None else 0.0,
            r.layer,
            r.choice,
        )
    )
    return rows


def delete_sensitivity(s: Session, model_id: int, graph_hash: str | None = None) -> int:
    """Forget a model's sensitivity (of one graph, or of every graph)."""
    q = delete(LayerSensitivity).where(LayerSensitivity.model_id == model_id)
    if graph_hash is not None:
        q = q.where(LayerSensitivity.graph_hash == graph_hash)
    return int(s.execute(q).rowcount or 0)


# --------------------------------------------------------------------------- profiler windows

from sqlalchemy import insert as _insert  # noqa: E402  (appended section)


def add_window_stats(
    s: Session,
    *,
    requests: Iterable[Mapping[str, Any]] = (),
    layers: Iterable[Mapping[str, Any]] = (),
    host: Iterable[Mapping[str, Any]] = (),
) -> int:
    """Request, layer and host rows of profiler windows, one bulk insert per table and set of
    columns (Core executemany). The profiler charges its export time to its overhead budget,
    and this takes a fraction of the CPU the ORM's unit of work needs for the same rows.
    Returns the number of rows written."""
    n = 0
    for table, rows in ((RequestStat, requests), (LayerStat, layers), (HostStat, host)):
        groups: dict[frozenset[str], list[Mapping[str, Any]]] = {}
        for row in rows:
            groups.setdefault(frozenset(row), []).append(row)
        for group in groups.values():
            s.execute(_insert(table.__table__), group)  # Core, not the ORM's bulk path
            n += len(group)
    return n

"""A fleet on one store: several serving processes of one model share one search, one
deployment decision and one build.

Real processes: ``uvicorn examples.fastapi_server:app --workers 2`` (two replicas of the
digits MLP, each a worker process with pgc attached) under HTTP client load, and one
``pgc serve`` beside them on the same store (SQLite, or PostgreSQL with ``--postgres URL``).
pgc serve searches once, a search worker builds the winner as an artifact, one replica
canaries it on its own traffic and the other follows, loading the same artifact. Once the
variant serves everywhere, a third replica (another uvicorn) starts late and must come up on
the active variant without compiling. Reported (``--json``: one object on the last line):

- ``replicas``: live replicas at the end; ``searches``: search runs of the model (1);
- ``compiles_in_replicas``: variants a serving process compiled itself (0);
- ``failed``: client requests that failed (0); ``all_active``: every live replica serves the
  active deployment's variant; ``late_replica_active_s``: seconds from the late replica's
  registration to serving that variant (target <= 10), and from its process start;
- ``first_active_s`` (from the first replica's registration), the variant and how each
  replica got it.

The policy keeps pgc's defaults except ``max_trials`` (6: the search's own quality is
measured by ``bench/search.py``; here only that it runs once).

    python bench/fleet.py [--postgres URL] [--clients 2] [--timeout 900] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import store as st  # noqa: E402
from pgc_daemon.states import OPEN  # noqa: E402

MODEL = "digits-mlp"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fresh_postgres(base_url: str) -> str:
    """A new empty database on the server (left for inspection; names are unique)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"pgc_fleet_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(base_url).set(database=name).render_as_string(hide_password=False)


@dataclass
class Fleet:
    store_url: str
    work: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PGC_STORE_URL": self.store_url,
            "PGC_WORK_DIR": str(self.work / "work"),
            "PGC_POLL_S": "0.5",
            "PGC_WINDOW_S": "2",
            "PGC_MIN_PROFILE_CALLS": "50",
            "PYTHONPATH": str(ROOT),
        }

    def start(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.work / log, "wb")  # noqa: SIM115 - kept open for the process's life
        proc = subprocess.Popen(args, cwd=ROOT, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def uvicorn(self, port: int, workers: int, log: str) -> subprocess.Popen[bytes]:
        return self.start(
            [sys.executable, "-m", "uvicorn", "examples.fastapi_server:app", "--host", "127.0.0.1",
             "--port", str(port), "--workers", str(workers), "--log-level", "warning"],
            log,
        )

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def request_bodies() -> list[bytes]:
    """``/predict`` bodies of ``examples/fastapi_server.py``: batches of 64 rows of 64 pixels
    from the digits test set (which is shaped for the CNN: flattened here)."""
    from pgc_daemon.examples import digits

    _, _, xt, _ = digits.data()
    rows = xt.reshape(len(xt), -1)
    return [json.dumps({"rows": rows[i : i + 64].tolist()}).encode() for i in range(0, len(rows) - 64, 64)]


class Clients:
    """Client threads posting batches to the servers' /predict, counting every failure."""

    def __init__(self, ports: list[int], n: int) -> None:
        self.bodies = request_bodies()
        self.ports = ports
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            port = self.ports[k % len(self.ports)]
            body = self.bodies[k % len(self.bodies)]
            k += 1
            req = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=body,
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    json.loads(resp.read())
                with self.lock:
                    self.ok += 1
            except Exception as exc:  # noqa: BLE001 - a benchmark counts failures
                with self.lock:
                    self.failed += 1
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            self.stop.wait(0.02)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=35)


def wait_http(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    raise SystemExit(f"server on port {port} did not come up in {timeout:.0f}s")


def snapshot(store: st.Store) -> dict[str, Any]:
    with store.session() as s:
        try:
            model = st.repo.get_model(s, MODEL)
        except st.NotFound:
            return {"model": None}
        active = st.repo.active_deployment(s, model.id)
        variant = st.repo.get_variant(s, active.variant_id) if active and active.variant_id else None
        live = st.repo.live_replicas(s, model.id, 15.0)
        replicas = st.repo.list_replicas(s, model.id)
        return {
            "model": model.id,
            "baseline": variant is not None and variant.recipe_hash == _base_hash(),
            "active": active.id if active else None,
            "variant_id": variant.id if variant else None,
            "label": variant.label if variant else None,
            "artifact": variant.artifact if variant else None,
            "active_at": active.updated_at if active else None,
            "searches": len(st.repo.list_search_runs(s, model.id)),
            "open": any(d.state in OPEN for d in st.repo.list_deployments(s, model.id, limit=20)),
            "live": [(r.name, r.variant_id, r.state, r.message, r.started_at) for r in live],
            "compiles": sum(r.compiles for r in replicas),
            "loads": sum(r.loads for r in replicas),
            "first_started": min((r.started_at for r in replicas), default=None),
        }


def _base_hash() -> str:
    from compiler import Recipe

    return Recipe().hash


def set_policy(store: st.Store, trials: int) -> None:
    from pgc_daemon.policy import Policy

    with store.session() as s:
        m = st.repo.get_model(s, MODEL)
        st.repo.put_policy(s, m.id, Policy(max_trials=trials).model_dump())


def run(store_url: str, *, clients: int, timeout: float, trials: int, say: Any) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="pgc-fleet-"))
    fleet = Fleet(store_url, work)
    store = st.open_store(store_url)
    out: dict[str, Any] = {"store": store.safe_url.split(":")[0]}
    load: Clients | None = None
    try:
        p1 = free_port()
        fleet.uvicorn(p1, 2, "replicas.log")
        wait_http(p1, 180)
        while snapshot(store).get("model") is None or len(snapshot(store)["live"]) < 2:
            time.sleep(0.5)
        set_policy(store, trials)
        load = Clients([p1], clients)
        fleet.start([sys.executable, "-m", "pgc_daemon.cli", "serve", "--store", store_url,
                     "--port", str(free_port())], "serve.log")
        say("2 replicas under load, pgc serve searching")
        deadline = time.monotonic() + timeout
        snap = snapshot(store)
        while time.monotonic() < deadline:
            if load.ok == 0 and load.failed >= 20:  # nothing is served: say why, now
                raise SystemExit(f"every request failed: {load.errors[:2]}")
            snap = snapshot(store)
            everywhere = snap["variant_id"] is not None and not snap["baseline"] and len(snap["live"]) >= 2 and all(
                v == snap["variant_id"] for _, v, *_ in snap["live"]
            )
            if everywhere:
                break
            time.sleep(1.0)
        else:
            raise SystemExit(f"no variant served by both replicas within {timeout:.0f}s: {snap}")
        out["first_active_s"] = round(snap["active_at"] - snap["first_started"], 1)
        out["variant"] = snap["label"]
        out["artifact"] = snap["artifact"]
        say(f"{snap['label']} serves in both replicas; starting a late replica")
        p3 = free_port()
        spawned = time.time()
        fleet.uvicorn(p3, 1, "late.log")
        late_registered, late_at = None, None
        known = {name for name, *_ in snap["live"]}
        while time.time() - spawned < 180:
            snap = snapshot(store)
            for name, variant_id, _state, _msg, started in snap["live"]:
                if name not in known:
                    late_registered = started
                    if variant_id == snap["variant_id"]:
                        late_at = time.time()
            if late_at is not None:
                break
            time.sleep(0.2)
        if late_at is None:
            raise SystemExit(f"the late replica never served the active variant: {snap}")
        out["late_replica_active_s"] = round(late_at - (late_registered or spawned), 2)
        out["late_replica_from_spawn_s"] = round(late_at - spawned, 2)
        load.ports.append(p3)
        # the search may still be deploying better variants: every replica must end up on
        # whatever is active once no deployment is in flight
        settle_by = time.monotonic() + 300
        while True:
            time.sleep(2.0)
            snap = snapshot(store)
            same = bool(snap["live"]) and all(v == snap["variant_id"] for _, v, *_ in snap["live"])
            if (same and not snap["open"]) or time.monotonic() > settle_by:
                break
        out["replicas"] = len(snap["live"])
        out["searches"] = snap["searches"]
        out["compiles_in_replicas"] = snap["compiles"]
        out["artifact_loads"] = snap["loads"]
        out["all_active"] = bool(snap["live"]) and all(v == snap["variant_id"] for _, v, *_ in snap["live"])
        out["replica_messages"] = [m for *_, m, _ in snap["live"]]
    finally:
        if load is not None:
            load.close()
            out["requests"] = load.ok + load.failed
            out["failed"] = load.failed
            out["first_failures"] = load.errors[:3]
        fleet.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--postgres", help="a PostgreSQL server URL (a fresh database is created on it)")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    say = lambda msg: print(f"[fleet] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    results = {}
    stores = [("sqlite", f"sqlite:///{tempfile.mkdtemp(prefix='pgc-fleet-db-')}/pgc.db")]
    if args.postgres:
        stores.append(("postgres", fresh_postgres(args.postgres)))
    for kind, url in stores:
        say(f"store: {kind}")
        results[kind] = run(url, clients=args.clients, timeout=args.timeout, trials=args.trials, say=say)
        r = results[kind]
        say(
            f"{kind}: {r.get('replicas')} replicas, {r.get('searches')} search, "
            f"{r.get('compiles_in_replicas')} compiles in replicas, {r.get('failed')} failed of "
            f"{r.get('requests')}, all active {r.get('all_active')}, late replica serving after "
            f"{r.get('late_replica_active_s')} s, first active at {r.get('first_active_s')} s ({r.get('variant')})"
        )
    from compiler import probe

    out = {"machine": probe().summary(), **results}
    ok = all(
        r.get("searches") == 1 and r.get("compiles_in_replicas") == 0 and r.get("failed") == 0
        and r.get("all_active") and (r.get("late_replica_active_s") or 99) <= 10
        for r in results.values()
    )
    out["targets_met"] = ok
    if args.json:
        print(json.dumps(out), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

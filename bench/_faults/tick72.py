"""CPU of one optimizer tick over 72 h of statistics (run by ``bench/faults.py``, in its own
process). Fills a fresh SQLite store with one model registered as an agent does, 25 920
request windows of 10 s (72 h), per-layer rows for every window, host samples, a full
reservoir and an active deployment that became active 72 h ago; then times
``Daemon(settings).tick()`` with ``time.process_time()``. Starting a search worker is replaced
by a stub (recorded) so a tick measures the daemon's own work, not a process spawn.

Prints one JSON line: ``tick_cpu_ms`` (median of the ticks after the first), ``first_tick_cpu_ms``
(the first also prunes), ``windows``, ``layer_rows``, ``ticks``, ``daemon`` (import path)."""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WINDOW_S = 10.0
WINDOWS = 72 * 3600 // 10  # 25 920
LAYERS = [("net.0", "Flatten"), ("net.1", "Linear"), ("net.2", "ReLU"), ("net.3", "Linear"),
          ("net.4", "ReLU"), ("net.5", "Linear")]


def main() -> int:
    import torch
    from sqlalchemy import insert, update

    import store as st
    from compiler import Recipe
    from pgc_daemon import Settings, states
    from pgc_daemon.policy import Policy
    from pgc_daemon.reservoir import InputReservoir

    try:
        from pgc_daemon.optimizer.daemon import Daemon

        where = "pgc_daemon.optimizer.daemon"
    except ImportError:
        from pgc_daemon.daemon import Daemon  # type: ignore[no-redef]

        where = "pgc_daemon.daemon"

    tmp = Path(tempfile.mkdtemp(prefix="pgc-tick72-"))
    try:
        url = f"sqlite:///{tmp / 'pgc.db'}"
        store = st.open_store(url)
        now = time.time()
        start = now - WINDOWS * WINDOW_S
        identity = Recipe()
        with store.session() as s:
            m = st.repo.upsert_model(s, "digits", spec="pgc_daemon.examples.digits:mlp",
                                     graph_hash="f" * 16, hardware="cpu-bench", metric="top1")
            mid = m.id
            v = st.repo.get_or_create_variant(s, mid, identity.hash, identity.to_dict(), identity.label())
            vid = v.id
            st.repo.put_policy(s, mid, Policy().model_dump())
            dep = st.repo.create_deployment(s, mid, vid, source="attach", reason="bench")
            states.move(s, dep.id, "active", "serving the base module")
            dep_id = dep.id
            res = InputReservoir(128)
            g = torch.Generator().manual_seed(0)
            for _ in range(512):
                res.offer((torch.rand(64, 1, 8, 8, generator=g),), {})
            st.repo.save_reservoir(s, mid, res.serialize(), len(res), res.seen)
        rng = random.Random(0)
        req_t, lay_t, host_t = st.RequestStat.__table__, st.LayerStat.__table__, st.HostStat.__table__
        trans_t = st.Transition.__table__
        n_layers = 0
        chunk = 2000
        for c0 in range(0, WINDOWS, chunk):
            reqs, lays, hosts = [], [], []
            for i in range(c0, min(c0 + chunk, WINDOWS)):
                ws, we = start + i * WINDOW_S, start + (i + 1) * WINDOW_S
                p50 = 1.0 + rng.random() * 0.2
                reqs.append(dict(model_id=mid, variant_id=vid, window_start=ws, window_end=we,
                                 shape_bucket="b64", count=1500, errors=0, fallbacks=0, mean_ms=p50 * 1.05,
                                 p50_ms=p50, p95_ms=p50 * 1.6, p99_ms=p50 * 2.2, sampled=15,
                                 overhead=0.004, dropped=0, histogram=[0] * 8 + [900, 500, 90, 10] + [0] * 8))
                for layer, op in LAYERS:
                    lays.append(dict(model_id=mid, variant_id=vid, window_start=ws, window_end=we,
                                     layer=layer, op_type=op, shape_bucket="b64", count=15,
                                     mean_ms=0.1, p50_ms=0.1, p95_ms=0.15, p99_ms=0.2, share=1 / 6,
                                     counters=None))
                hosts.append(dict(model_id=mid, variant_id=vid, at=we, cpu_percent=80.0,
                                  rss_bytes=400 * 2**20, threads=12, ctx_switches=i * 100, extra=None))
            with store.session() as s:
                s.execute(insert(req_t), reqs)
                s.execute(insert(lay_t), lays)
                s.execute(insert(host_t), hosts)
            n_layers += len(lays)
        with store.session() as s:  # the deployment became active when the history began
            s.execute(update(trans_t).where(trans_t.c.deployment_id == dep_id).values(at=start))

        settings = Settings(store_url=url, work_dir=str(tmp / "work"), min_profile_calls=50)
        daemon = Daemon(settings)
        starts: list[str] = []

        def no_spawn(model_id, trigger, **kw):  # noqa: ANN001, ANN003, ANN202
            starts.append(trigger)
            return 0

        daemon.start_search = no_spawn  # type: ignore[method-assign]
        cpu = []
        for _ in range(6):
            t0 = time.process_time()
            daemon.tick()
            cpu.append((time.process_time() - t0) * 1e3)
        print(json.dumps({
            "tick_cpu_ms": round(statistics.median(cpu[1:]), 2),
            "first_tick_cpu_ms": round(cpu[0], 2),
            "all_ms": [round(c, 2) for c in cpu],
            "ticks": len(cpu) - 1,
            "windows": WINDOWS,
            "layer_rows": n_layers,
            "search_starts": starts[:1],
            "daemon": where,
        }))
        return 0
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""A small served app for the fault campaign (``bench/faults.py``): attaches an example model
with ``pgc_daemon.attach`` and serves it from N client threads inside this process.

Every request is accounted: when ``served(x)`` raises, the same input is run through a private
copy of the plain model (``model(x)``, no pgc). If the plain model fails too, the error is the
caller's own (``own``); otherwise pgc caused it (``fail``). Once a second one JSON line is
appended to ``--status``::

    {"t": wall time, "n": calls this second, "fail": pgc-caused failures this second,
     "own": the caller's own errors, "max_ms": slowest call, "p99_ms": ..., "total": calls so far,
     "fail_total": ..., "rss": bytes, "serving": label of the active slot, "pid": ...}

The process ends by itself after ``--duration`` seconds, when ``--stop-file`` exists, on
SIGTERM/SIGINT, or when its parent is gone (never an orphan that serves forever).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--name", default="digits")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "minilm"])
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--rate", type=float, default=60.0, help="total calls per second (paced)")
    p.add_argument("--malformed", type=float, default=0.0, help="share of wrong-shape inputs")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--status", required=True)
    p.add_argument("--stop-file", default=None)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--window-s", type=float, default=1.0)
    args = p.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    parent = os.getppid()

    import torch

    torch.set_num_threads(1)
    import pgc_daemon
    from pgc_daemon import Settings

    if args.model == "minilm":
        from pgc_daemon.examples import minilm

        built = minilm.build()
        spec = "pgc_daemon.examples.minilm:build"
    else:
        from pgc_daemon.examples import digits

        built = getattr(digits, args.model)()
        spec = f"pgc_daemon.examples.digits:{args.model}"
    if isinstance(built, dict):
        model, examples = built["model"], built["example_inputs"]
    else:
        model, examples = built[0], built[1]
    examples = [e if isinstance(e, (tuple, dict)) else (e,) for e in examples]
    plain = copy.deepcopy(model).eval()

    def malformed(example):  # wrong shape: the last dimension loses one element
        if isinstance(example, dict):
            return {k: v[..., :-1] if torch.is_tensor(v) else v for k, v in example.items()}
        return tuple(v[..., :-1] if torch.is_tensor(v) else v for v in example)

    settings = Settings(
        store_url=args.store,
        work_dir=args.work_dir,
        poll_s=args.poll_s,
        window_s=args.window_s,
        min_profile_calls=10,
    )
    served = pgc_daemon.attach(model, name=args.name, spec=spec, settings=settings)

    lock = threading.Lock()
    sec = {"n": 0, "fail": 0, "own": 0, "lat": []}
    totals = {"n": 0, "fail": 0, "own": 0}
    errors: list[str] = []

    def call(example):
        if isinstance(example, dict):
            return served(**example)
        return served(*example)

    def plain_ok(example) -> bool:
        try:
            with torch.inference_mode():
                plain(**example) if isinstance(example, dict) else plain(*example)
            return True
        except Exception:  # noqa: BLE001
            return False

    def client(seed: int) -> None:
        rng = random.Random(seed)
        period = max(args.clients / max(args.rate, 1e-3), 0.0)
        nxt = time.monotonic()
        while not stop.is_set():
            ex = examples[rng.randrange(len(examples))]
            if args.malformed and rng.random() < args.malformed:
                ex = malformed(ex)
            t0 = time.perf_counter()
            outcome = "ok"
            try:
                call(ex)
            except Exception as exc:  # noqa: BLE001
                outcome = "own" if not plain_ok(ex) else "fail"
                if outcome == "fail" and len(errors) < 5:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
            ms = (time.perf_counter() - t0) * 1e3
            with lock:
                sec["n"] += 1
                sec["lat"].append(ms)
                if outcome != "ok":
                    sec[outcome] += 1
            nxt += period
            delay = nxt - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            else:
                nxt = time.monotonic()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    import psutil

    proc = psutil.Process()
    started = time.monotonic()
    out = open(args.status, "a", buffering=1)  # noqa: SIM115
    try:
        while not stop.is_set():
            stop.wait(1.0)
            with lock:
                n, fail, own, lat = sec["n"], sec["fail"], sec["own"], sec["lat"]
                sec.update(n=0, fail=0, own=0, lat=[])
            totals["n"] += n
            totals["fail"] += fail
            totals["own"] += own
            lat.sort()
            try:
                status = served.status()
            except Exception:  # noqa: BLE001
                status = {}
            rec = {
                "t": time.time(),
                "n": n,
                "fail": fail,
                "own": own,
                "max_ms": round(lat[-1], 3) if lat else None,
                "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                "total": totals["n"],
                "fail_total": totals["fail"],
                "own_total": totals["own"],
                "rss": proc.memory_info().rss,
                "serving": status.get("serving"),
                "registered": status.get("registered"),
                "fallbacks": status.get("fallbacks"),
                "errors": errors[:5],
                "pid": os.getpid(),
            }
            out.write(json.dumps(rec) + "\n")
            if time.monotonic() - started > args.duration:
                break
            if args.stop_file and os.path.exists(args.stop_file):
                break
            if os.getppid() != parent:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        try:
            served.close()
        finally:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

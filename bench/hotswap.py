"""Does hot-swapping hurt live requests?

All-MiniLM-L6-v2 (batch 1, 128 tokens) served through ``pgc_daemon.attach`` under concurrent
load from client threads. Two compiled int8 variants of similar speed are deployed once (built
and compiled), then:

1. steady state: requests on the active variant with no deployment in flight;
2. swaps: 20 deployments alternating between the two variants through the real path
   (store -> swapper -> verify on live inputs -> A/B canary -> active), under the same load,
   each counted until half a second after it ended.

The two phases alternate (a steady window, a swap, a steady window, ...) so that the shared
machine's own noise falls on both alike. Reported: request count, failures, p50/p99 in each
phase and their ratio, and the swaps' own timings.

    python bench/hotswap.py [--swaps 20] [--clients 2] [--json]

With ``--cold``, every deployment is of a variant the serving process never built: a separate
process (as a search worker does) builds each recipe into an artifact first, and the serving
process loads it. The canary runs with pgc's default settings (20 s, 16 shadow samples,
tolerance 0.15), and ``serving_build_cpu_s`` is the CPU time the serving process spent
obtaining each variant (loading the artifact; compiling, had it been missing).

    python bench/hotswap.py --cold [--swaps 4] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import store as st  # noqa: E402
from compiler import Backend, Quantization, Recipe  # noqa: E402
from pgc_daemon import attach  # noqa: E402
from pgc_daemon.examples import minilm  # noqa: E402
from pgc_daemon.settings import Settings  # noqa: E402

A = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))
B = Recipe(
    quantization=Quantization.of(
        {"_default": "int8-dynamic-pc", "encoder.encoder.layer.0.output.dense": "fp32"}
    ),
    backend=Backend("inductor"),
)


#: After a deployment ends, requests are still counted as the swap's for this long.
AFTER_SWAP_S = 0.5


class Clients:
    """Client threads sending requests back to back (with a small think time), recording the
    latency each one saw and every exception."""

    def __init__(self, served: Any, n: int, think_s: float) -> None:
        self.served = served
        self.samples: list[tuple[float, float]] = []  # (finished at, latency ms)
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.think_s = think_s
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        stream = minilm.traffic(seed=500 + i)
        while not self.stop.is_set():
            ids, mask = next(stream)
            t0 = time.perf_counter()
            try:
                out = self.served(ids, mask)
                if out.shape != (1, 384) or not torch.isfinite(out).all():
                    raise ValueError("bad output")
                ms = (time.perf_counter() - t0) * 1e3
                with self.lock:
                    self.samples.append((time.monotonic(), ms))
            except Exception as exc:  # noqa: BLE001 - a benchmark counts failures
                with self.lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
            self.stop.wait(self.think_s)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)

    def within(self, windows: list[tuple[float, float]]) -> list[float]:
        """Latencies of the requests that finished inside any of ``windows``."""
        return [ms for w in windows for ms in self.between(*w)]

    def between(self, t0: float, t1: float) -> list[float]:
        with self.lock:
            return [ms for at, ms in self.samples if t0 <= at < t1]


def deploy(store: st.Store, recipe: Recipe, artifact: str | None = None) -> int:
    with store.session() as s:
        m = st.repo.get_model(s, "minilm")
        v = st.repo.get_or_create_variant(s, m.id, recipe.hash, recipe.to_dict(), recipe.label())
        if artifact:
            st.repo.set_variant_artifact(s, v.id, artifact)
        return st.repo.create_deployment(s, m.id, v.id, source="manual", reason="bench").id


def cold_recipes(n: int) -> list[Recipe]:
    """``n`` distinct int8 variants of about the same speed: all-int8 dynamic with one more
    encoder layer's output projection kept fp32 each."""
    out = [A]
    for i in range(n - 1):
        keep = {f"encoder.encoder.layer.{j}.output.dense": "fp32" for j in range(i + 1)}
        out.append(Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc", **keep}),
                          backend=Backend("inductor")))
    return out


_BUILDER = """
import json, sys, torch
from compiler import CompileCache, Recipe, build
from pgc_daemon.examples import minilm
torch.set_num_threads(int(sys.argv[3]))
cache = CompileCache(sys.argv[1])
model = minilm.load_model()
example = minilm.encode(["a sentence to compile the variant with"])
out = {}
for data in json.loads(sys.argv[2]):
    built = build(model, Recipe.from_dict(data), example=(example, {}), cache=cache)
    out[built.recipe.hash] = getattr(built, "artifact", None)
print(json.dumps(out))
"""


def build_artifacts(cache_dir: Path, recipes: list[Recipe], threads: int) -> dict[str, str]:
    """Build every recipe in a separate process, as a search worker does; returns the
    artifact digest of each recipe hash."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _BUILDER, str(cache_dir), json.dumps([r.to_dict() for r in recipes]), str(threads)],
        capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode != 0:
        raise SystemExit(f"building the artifacts failed:\n{proc.stderr[-2000:]}")
    digests = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = [r.label() for r in recipes if not digests.get(r.hash)]
    if missing:
        raise SystemExit(f"no artifact was made for: {', '.join(missing)}")
    return digests


def set_policy(store: st.Store, policy: dict[str, Any]) -> None:
    with store.session() as s:
        st.repo.put_policy(s, st.repo.get_model(s, "minilm").id, policy)


def wait_done(store: st.Store, dep: int, timeout: float = 300, *, at_least: float = 0.0) -> str:
    """Poll the deployment's state until it is final (or, with ``at_least``, for that long
    whatever it is: the steady windows poll the same way, so the harness's own store reads
    weigh on both phases alike)."""
    started = time.monotonic()
    state = "timeout"
    while time.monotonic() - started < timeout:
        with store.session() as s:
            state = st.repo.get_deployment(s, dep).state
        done = state in ("active", "failed", "rolled_back")
        if done and time.monotonic() - started >= at_least:
            return state
        time.sleep(0.1)
    return state if at_least else "timeout"


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def ratio_interval(swap: list[float], steady: list[float], resamples: int = 1000) -> tuple[float, float]:
    """90% bootstrap interval of p99(swap) / p99(steady): how far one run's ratio can be
    trusted on a machine whose tail moves with its neighbours' load."""
    if len(swap) < 100 or len(steady) < 100:
        return float("nan"), float("nan")
    rng = np.random.default_rng(0)
    a, b = np.asarray(swap), np.asarray(steady)
    ra = np.percentile(a[rng.integers(0, len(a), (resamples, len(a)))], 99, axis=1)
    rb = np.percentile(b[rng.integers(0, len(b), (resamples, len(b)))], 99, axis=1)
    low, high = np.percentile(ra / rb, [5, 95])
    return float(low), float(high)


def by_phase(clients: Clients, swaps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Latency of the requests that finished while a deployment was in each state (the
    deployment's own transitions mark the spans), to tell which step costs live traffic."""
    spans: dict[str, list[float]] = {}
    for swap in swaps:
        marks = swap["phases"]
        for (state, t0), (_next, t1) in itertools.pairwise(marks):
            spans.setdefault(state, []).extend(clients.between(t0, t1))
    return {
        state: {"requests": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99)}
        for state, ms in spans.items()
        if ms
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--swaps", type=int, default=20)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--think-ms", type=float, default=20.0)
    ap.add_argument("--steady-s", type=float, default=40.0, help="steady state in all, spread between the swaps")
    ap.add_argument("--canary-s", type=float, default=2.0)
    ap.add_argument("--shadow-samples", type=int, default=4, help="live inputs shadow-checked per canary")
    ap.add_argument("--cold", action="store_true",
                    help="deploy variants built by another process (artifacts), default canary settings")
    ap.add_argument("--no-thread-tuning", dest="thread_tuning", action="store_false",
                    help="serve every variant at the configured intra-op count (Settings.thread_tuning)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.cold:
        return cold(args)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=True)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tmp = tempfile.mkdtemp(prefix="pgc-hotswap-")
    settings = Settings(store_url=f"sqlite:///{tmp}/pgc.db", work_dir=f"{tmp}/work", poll_s=0.1)
    store = st.open_store(settings.store_url)
    policy = {"canary_s": args.canary_s, "canary_latency_tolerance": 0.5,
              "canary_shadow_samples": args.shadow_samples}
    served = attach(minilm.load_model(), name="minilm", settings=settings, metric="cosine", policy=policy)
    clients = Clients(served, args.clients, args.think_ms / 1e3)
    for t in clients.threads:
        t.start()
    swaps: list[dict[str, Any]] = []
    steady_windows: list[tuple[float, float]] = []
    swap_windows: list[tuple[float, float]] = []
    wall_minus_mono = time.time() - time.monotonic()  # transitions are stored in wall-clock time
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            prep = progress.add_task("building and compiling both variants", total=2)
            while served.model_id is None or len(served.reservoir) < 8:
                time.sleep(0.2)
            # Both built and warm, A serving at the end. Without a canary: building is not
            # what this measures, and a variant compiled on a loaded machine sometimes comes
            # out slower, which the canary would rightly reject (the swaps below have one).
            set_policy(store, {**policy, "canary_s": 0.0})
            for recipe in (B, A):
                dep = deploy(store, recipe)
                state = wait_done(store, dep)
                if state != "active":
                    raise SystemExit(f"could not deploy {recipe.label()}: {state}")
                progress.advance(prep)
            set_policy(store, policy)
            # Steady windows and swaps alternate, so that whatever else the machine does
            # (it is shared) falls on both phases alike.
            task = progress.add_task("steady windows and swaps", total=args.swaps)
            each = args.steady_s / max(1, args.swaps)
            for i in range(args.swaps):
                w0 = time.monotonic()
                wait_done(store, dep, at_least=each)  # the last deployment, final already
                steady_windows.append((w0, time.monotonic()))
                recipe = B if i % 2 == 0 else A
                started = time.monotonic()
                dep = deploy(store, recipe)
                state = wait_done(store, dep)
                time.sleep(AFTER_SWAP_S)  # what a swap leaves behind counts as the swap's
                swap_windows.append((started, time.monotonic()))
                with store.session() as s:
                    d = st.repo.get_deployment(s, dep)
                    swaps.append({"state": state, "swap_ms": d.swap_ms, "seconds": time.monotonic() - started,
                                  "reason": d.reason,
                                  "phases": [(t.to_state, t.at - wall_minus_mono) for t in d.transitions]})
                progress.advance(task)
    finally:
        clients.close()
        served.close()
    steady_ms = clients.within(steady_windows)
    swap_ms = clients.within(swap_windows)
    out = {
        "requests": len(clients.samples) + len(clients.failures),
        "failed": len(clients.failures),
        "swaps": len(swaps),
        "swaps_active": sum(s["state"] == "active" for s in swaps),
        "steady_requests": len(steady_ms),
        "steady_p50_ms": pct(steady_ms, 50),
        "steady_p99_ms": pct(steady_ms, 99),
        "swap_requests": len(swap_ms),
        "swap_p50_ms": pct(swap_ms, 50),
        "swap_p99_ms": pct(swap_ms, 99),
        "swap_reference_ms_max": max((s["swap_ms"] or 0) for s in swaps) if swaps else None,
        "deploy_seconds_median": statistics.median(s["seconds"] for s in swaps) if swaps else None,
        "clients": args.clients,
        "first_failures": clients.failures[:3],
    }
    out["p99_ratio"] = out["swap_p99_ms"] / out["steady_p99_ms"]
    out["p99_ratio_90ci"] = list(ratio_interval(swap_ms, steady_ms))
    out["by_phase"] = by_phase(clients, swaps)
    table = Table(title=f"hot-swap under load: MiniLM, {args.clients} clients, {len(swaps)} swaps")
    for col in ("phase", "requests", "failed", "p50 ms", "p99 ms"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    table.add_row("steady state", str(out["steady_requests"]), "-", f"{out['steady_p50_ms']:.2f}", f"{out['steady_p99_ms']:.2f}")
    table.add_row("during swaps", str(out["swap_requests"]), "-", f"{out['swap_p50_ms']:.2f}", f"{out['swap_p99_ms']:.2f}")
    for phase, row in out["by_phase"].items():
        table.add_row(f"  {phase}", str(row["requests"]), "-", f"{row['p50_ms']:.2f}", f"{row['p99_ms']:.2f}")
    table.add_row("all", str(out["requests"]), str(out["failed"]), "", "")
    console.print(table)
    console.print(
        f"p99 during swaps / steady: {out['p99_ratio']:.2f}x (90% CI "
        f"{out['p99_ratio_90ci'][0]:.2f}-{out['p99_ratio_90ci'][1]:.2f}) · {out['swaps_active']}/{out['swaps']} swaps active · "
        f"reference swap at most {out['swap_reference_ms_max']:.3f} ms · a deployment takes "
        f"{out['deploy_seconds_median']:.1f} s (verify + {args.canary_s:.0f} s canary)"
    )
    if args.json:
        print(json.dumps(out), flush=True)
    return 0 if out["failed"] == 0 else 1


def cold(args: argparse.Namespace) -> int:
    """Deployments of artifacts a separate process built, with the default canary."""
    from rich.console import Console

    from compiler import probe
    from pgc_daemon.policy import Policy

    console = Console(stderr=True)
    swaps = args.swaps if args.swaps != 20 else 4
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tmp = Path(tempfile.mkdtemp(prefix="pgc-hotswap-cold-"))
    settings = Settings(store_url=f"sqlite:///{tmp}/pgc.db", work_dir=f"{tmp}/work", poll_s=0.1,
                        thread_tuning=args.thread_tuning)
    recipes = cold_recipes(swaps)
    console.print(f"building {len(recipes)} artifacts in a separate process (as a search worker does)")
    t0 = time.monotonic()
    digests = build_artifacts(settings.compile_cache_path(), recipes, torch.get_num_threads())
    build_s = time.monotonic() - t0
    store = st.open_store(settings.store_url)
    defaults = Policy()
    served = attach(minilm.load_model(), name="minilm", settings=settings, metric="cosine")
    clients = Clients(served, args.clients, args.think_ms / 1e3)
    for t in clients.threads:
        t.start()
    steady_windows: list[tuple[float, float]] = []
    swap_windows: list[tuple[float, float]] = []
    rows: list[dict[str, Any]] = []
    try:
        while served.model_id is None or len(served.reservoir) < 8:
            time.sleep(0.2)
        dep = None
        for i, recipe in enumerate(recipes):
            w0 = time.monotonic()
            time.sleep(max(5.0, args.steady_s / max(1, swaps)))
            steady_windows.append((w0, time.monotonic()))
            variants = served.swapper.variants
            cpu_before, compiles_before = variants.build_cpu_s, variants.compiles
            started = time.monotonic()
            dep = deploy(store, recipe, digests[recipe.hash])
            state = wait_done(store, dep, timeout=600)
            time.sleep(AFTER_SWAP_S)
            swap_windows.append((started, time.monotonic()))
            with store.session() as s:
                d = st.repo.get_deployment(s, dep)
                reason = [t.reason for t in d.transitions]
            rows.append({"state": state, "seconds": time.monotonic() - started,
                         "serving_build_cpu_s": variants.build_cpu_s - cpu_before,
                         "compiled_in_serving": variants.compiles - compiles_before,
                         "build_s": d.build_s, "swap_ms": d.swap_ms, "transitions": reason})
            console.print(f"deployment {i + 1}/{len(recipes)}: {state} in {rows[-1]['seconds']:.1f}s, "
                          f"{rows[-1]['serving_build_cpu_s']:.2f} CPU s to obtain it")
        w0 = time.monotonic()
        time.sleep(max(5.0, args.steady_s / max(1, swaps)))
        steady_windows.append((w0, time.monotonic()))
    finally:
        clients.close()
        served.close()
    steady_ms = clients.within(steady_windows)
    swap_ms = clients.within(swap_windows)
    out = {
        "machine": probe().summary(),
        "requests": len(clients.samples) + len(clients.failures),
        "failed": len(clients.failures),
        "swaps": len(rows),
        "swaps_active": sum(r["state"] == "active" for r in rows),
        "canary": {"canary_s": defaults.canary_s, "shadow_samples": defaults.canary_shadow_samples,
                   "tolerance": defaults.canary_latency_tolerance},
        "worker_build_s": build_s,
        "serving_build_cpu_s": max((r["serving_build_cpu_s"] for r in rows), default=None),
        "compiles_in_serving": sum(r["compiled_in_serving"] for r in rows),
        "thread_tuning": args.thread_tuning,
        "threads": served.tuner.status(),
        "steady_p99_ms": pct(steady_ms, 99),
        "swap_p99_ms": pct(swap_ms, 99),
        "steady_p50_ms": pct(steady_ms, 50),
        "swap_p50_ms": pct(swap_ms, 50),
        "deployments": rows,
        "first_failures": clients.failures[:3],
    }
    out["p99_ratio"] = out["swap_p99_ms"] / out["steady_p99_ms"]
    out["p99_ratio_90ci"] = list(ratio_interval(swap_ms, steady_ms))
    console.print(
        f"cold deployments: {out['swaps_active']}/{out['swaps']} active, {out['failed']} failed requests, "
        f"at most {out['serving_build_cpu_s']:.2f} CPU s in the serving process per deployment, "
        f"p99 during swaps / steady {out['p99_ratio']:.2f}x ({out['swap_p99_ms']:.1f} / {out['steady_p99_ms']:.1f} ms) "
        f"on {out['machine']}"
    )
    if args.json:
        print(json.dumps(out), flush=True)
    ok = out["failed"] == 0 and (out["serving_build_cpu_s"] or 0) <= 5 and out["p99_ratio"] <= 1.5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

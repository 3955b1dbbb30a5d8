"""Does the GPU path of pgc's profiler work on this machine, and what does it cost?

On one CUDA GPU, in under three minutes:

1. **Attribution**: MiniLM (batch 64, 128 tokens) and the digits CNN (batch 1024) profiled
   per layer with CUDA events and CUPTI kernel records; every kernel must land in a layer
   (through CUPTI external correlation ids), and the layers must have kernels.
2. **Agreement**: per layer, CUDA-event time vs the sum of the layer's CUPTI kernel times,
   for the layers that carry at least 5% of the call (events also count the gaps between
   kernels, so they read a little higher; a large gap means launch-bound layers or lost
   records).
3. **Request path**: ``end()`` of a sampled call must not wait for the GPU (its CUDA events
   are still pending when it returns); the tracer must be off between sampling windows and
   torn down cleanly at the end.
4. **Overhead**: plain vs default profiler vs 100% sampling, interleaved call by call, wall
   time per call including the GPU work (synchronized after each call, for measuring only).

Exits 0 when every check passes, 1 when one fails, 2 when there is no GPU (or CUPTI) to
check. ``--json`` prints one JSON object as the last line.

    python bench/gpu_profiler_check.py [--json] [--calls 30] [--rounds 150]

Needs cupti-python (``pip install cupti-python``, a dependency of pgc) matching the driver's
CUDA major version; ``pgc doctor`` says whether it does.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profiler import Profiler, ProfilerConfig, cuda_status, cupti_status  # noqa: E402

DEADLINE_S = 170.0
BACKLOG_CYCLES = 100_000_000  # about 50 ms of GPU time at 2 GHz
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def load(name: str) -> tuple[torch.nn.Module, list[tuple[Any, ...]]]:
    if name == "minilm":
        from pgc_daemon.examples import minilm  # noqa: PLC0415

        stream = minilm.traffic(seed=3, batch=64)
        inputs = [tuple(t.cuda() for t in next(stream)) for _ in range(8)]
        return minilm.load_model().cuda().eval(), inputs
    from pgc_daemon.examples import digits  # noqa: PLC0415

    model = digits.cnn()["model"].cuda().eval()
    x = torch.rand(1024, 1, 8, 8, device="cuda")
    return model, [(x,), (x.flip(0),)]


def attribution(name: str, model: torch.nn.Module, inputs: list[tuple[Any, ...]], calls: int) -> dict[str, Any]:
    prof = Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None))
    prof.watch(model)
    status = prof.status()
    out: dict[str, Any] = {"gpu": status["gpu"], "cupti": status["cupti"], "checks": {}}
    checks = out["checks"]
    with torch.inference_mode():
        for i in range(3):
            model(*inputs[i % len(inputs)])
        torch.cuda.synchronize()
        for i in range(calls):
            args = inputs[i % len(inputs)]
            last_call = i == calls - 1
            if last_call:
                # Keep the GPU busy first, so this call's kernels are still queued when end()
                # returns, however fast the model: end() must return without waiting for them.
                torch.cuda._sleep(BACKLOG_CYCLES)
            token = prof.begin(model)
            run = token.module if token is not None else model
            t0 = time.perf_counter_ns()
            run(*args)
            elapsed = time.perf_counter_ns() - t0
            # A model that reads a GPU value on the host (transformers' attention-mask checks
            # do) waits for the backlog itself; then there is nothing left for end() to wait
            # for and the check does not apply (None).
            gpu_busy = last_call and not torch.cuda.current_stream().query()
            prof.end(token, 1, args, {}, elapsed)
            if last_call:
                last = prof._pending[-1].raw.gpu if prof._pending else None
                checks["end_does_not_wait_for_the_gpu"] = (
                    (last is not None and not last.end.query()) if gpu_busy else None
                )
    win = prof.close_window()
    tracer = prof._tracer
    checks["tracer_off_after_the_window"] = tracer is None or not tracer.is_open
    rows = win.layers
    total_event = sum(r.mean_ms * r.count for r in rows)
    with_kernels = [r for r in rows if (r.counters or {}).get("cupti_kernels")]
    kernel_ms = sum(r.counters["cupti_kernel_ms"] for r in with_kernels)
    out["layers"] = len(rows)
    out["layers_with_kernels"] = len(with_kernels)
    out["event_ms_per_call"] = total_event / calls
    out["kernel_ms_per_call"] = kernel_ms / calls
    out["kernels_dropped"] = tracer.dropped if tracer is not None else None
    # what CUPTI handed over, by activity kind, and any error parsing it: when no kernel
    # lands in a layer, these say whether records came at all
    out["cupti_delivered"] = dict(tracer.delivered) if tracer is not None else None
    out["cupti_error"] = tracer.error if tracer is not None else None
    out["cupti_api_records"] = tracer.api_filter if tracer is not None else None
    agreement = []
    for r in sorted(rows, key=lambda r: -r.mean_ms):
        if r.share < 0.05:
            continue
        c = r.counters or {}
        k_ms = c.get("cupti_kernel_ms", 0.0) / max(r.count, 1)
        agreement.append({
            "layer": r.layer, "op_type": r.op_type, "event_ms": r.mean_ms,
            "kernel_ms": k_ms, "gap": (r.mean_ms - k_ms) / r.mean_ms if r.mean_ms else None,
            "top_kernel": (r.kernels or [{}])[0],
        })
    out["agreement"] = agreement
    gaps = [a["gap"] for a in agreement if a["gap"] is not None]
    out["median_gap"] = statistics.median(gaps) if gaps else None
    if tracer is not None:
        checks["kernels_attributed"] = len(with_kernels) > 0 and kernel_ms > 0
        checks["events_and_kernels_agree"] = bool(gaps) and statistics.median(abs(g) for g in gaps) < 0.25
        checks["kernel_time_within_event_time"] = kernel_ms <= total_event * 1.05
    prof.stop()
    if tracer is not None:
        checks["cupti_torn_down_cleanly"] = tracer.error is None and not tracer.is_open
    return out


def overhead(name: str, model: torch.nn.Module, inputs: list[tuple[Any, ...]], rounds: int) -> dict[str, Any]:
    profs = {
        "default": Profiler(ProfilerConfig(host_interval_s=None), sink=lambda ws: None),
        "full": Profiler(ProfilerConfig(sample_every=1, budget=None, host_interval_s=None),
                         sink=lambda ws: None),
    }
    for p in profs.values():
        p.watch(model)
        p.start()
    times: dict[str, list[int]] = {"plain": [], "default": [], "full": []}
    rng = random.Random(0)
    with torch.inference_mode():
        for r in range(rounds):
            args = inputs[r % len(inputs)]
            arms = list(times)
            rng.shuffle(arms)
            for arm in arms:
                prof = profs.get(arm)
                torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                token = prof.begin(model) if prof is not None else None
                run = token.module if token is not None else model
                t1 = time.perf_counter_ns()
                run(*args)
                elapsed = time.perf_counter_ns() - t1
                if prof is not None:
                    prof.end(token, 1, args, {}, elapsed)
                torch.cuda.synchronize()  # measure the GPU work too (the profiler never does)
                times[arm].append(time.perf_counter_ns() - t0)
    for p in profs.values():
        p.stop()
    med = {a: statistics.median(v) for a, v in times.items()}
    return {
        "plain_ms": med["plain"] / 1e6,
        "default_overhead": sum(times["default"]) / sum(times["plain"]) - 1,
        "full_overhead": sum(times["full"]) / sum(times["plain"]) - 1,
        "default_overhead_median": med["default"] / med["plain"] - 1,
        "full_overhead_median": med["full"] / med["plain"] - 1,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30, help="profiled calls per model (default 30)")
    ap.add_argument("--rounds", type=int, default=150, help="interleaved overhead rounds (default 150)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    ok, why = cuda_status()
    if not ok:
        print(f"gpu_profiler_check: nothing to check here: {why}. This check needs one CUDA GPU "
              "(run pgc doctor to see what this machine has).", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": True, "reason": why}))
        return 2
    cupti_ok, cupti_why = cupti_status()
    report: dict[str, Any] = {
        "device": why, "torch": torch.__version__, "cupti": cupti_why, "models": {},
    }
    log(f"{why}; CUPTI: {cupti_why}")
    failed = []
    for name in ("minilm", "cnn"):
        if time.monotonic() - T0 > DEADLINE_S:
            log(f"{name}: skipped, out of time")
            failed.append(f"{name}: not run (time)")
            continue
        try:
            log(f"{name}: loading")
            model, inputs = load(name)
            log(f"{name}: attribution over {args.calls} profiled calls")
            res = attribution(name, model, inputs, args.calls)
            log(f"{name}: overhead, {args.rounds} interleaved rounds")
            res["overhead"] = overhead(name, model, inputs, args.rounds)
            report["models"][name] = res
            failed += [f"{name}: {k}" for k, v in res["checks"].items() if v is False]
            del model
            torch.cuda.empty_cache()
        except Exception as exc:  # noqa: BLE001 - report, and check the other model
            report["models"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                      "traceback": traceback.format_exc()}
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
    report["failed"] = failed
    report["seconds"] = round(time.monotonic() - T0, 1)
    if not cupti_ok:
        failed.append(f"CUPTI unavailable: {cupti_why}")
    print(f"GPU profiler check on {why} (torch {torch.__version__}; CUPTI: {cupti_why})")
    for name, res in report["models"].items():
        if "error" in res:
            print(f"  {name}: ERROR {res['error']}")
            continue
        o = res["overhead"]
        gap = "n/a" if res["median_gap"] is None else f"{res['median_gap']:.1%}"
        print(f"  {name}: {res['layers']} layers, {res['layers_with_kernels']} with kernels; "
              f"events {res['event_ms_per_call']:.3f} ms/call, kernels "
              f"{res['kernel_ms_per_call']:.3f} ms/call; median event-kernel gap {gap}")
        for a in res["agreement"][:5]:
            k = a["top_kernel"]
            print(f"      {a['layer']:<48} event {a['event_ms']:.3f} ms  kernels {a['kernel_ms']:.3f} ms  "
                  f"top: {str(k.get('name', '-'))[:40]} grid {k.get('grid', '-')}")
        print(f"    overhead (wall, GPU work included): default {o['default_overhead']:+.2%}, "
              f"100% sampling {o['full_overhead']:+.2%} (plain {o['plain_ms']:.2f} ms/call)")
        print("    checks: " + ", ".join(f"{k} {'n/a' if v is None else 'ok' if v else 'FAILED'}" for k, v in res["checks"].items()))
    print("PASS" if not failed else "FAIL: " + "; ".join(failed))
    if args.json:
        print(json.dumps(report, default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())

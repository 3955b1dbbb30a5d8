"""What does leaving pgc's profiler on cost a served model?

MiniLM (all-MiniLM-L6-v2, batch 1, 128 tokens) and the digits CNN (batch 16), each served
three ways **interleaved call by call in one run** (the order shuffled every round, the same
input for all three): plain (``model(*args)``), instrumented with the profiler at its default
settings (one call in 100 per layer, 0.5% budget, perf counters, host statistics, windows
exported to a SQLite store), and instrumented at 100% sampling. Then torch.profiler, the peer,
in blocks of calls interleaved with plain blocks (it cannot be switched per call), its
``key_averages()`` post-processing included, as a per-layer profile needs it.

Each profiler handles one call in three, so its time-driven work (windows every 10 s, host
samples, control ticks) runs on a clock three times slower than the defaults: per call served
it then does what it does at default settings on a server busy all the time (at lower
utilization that fixed work is a larger share of less serving; the profiler's own overhead
figure, which the API shows, says so per window).

What is compared is the serving thread's CPU time per call (one intra-op thread; ``--threads``
to change), not wall time: on a shared machine other processes preempt calls at random, which
adds tens of percent of noise to wall time and none to CPU time. The profiler's own threads
(window processing, host samples, export) are measured separately, by their own CPU clocks,
and added.

Estimators (fractions of plain serving time; 0.005 = 0.5%):
- ``*_overhead``: for calls the profiler did not sample, the only code that differs from plain
  serving is ``begin``/``end``, timed in place on every call; for sampled calls, the paired
  difference with the plain call of the same round; plus the profiler threads' CPU. This is
  exact where it can be and paired where it must be, so its noise is that of the few sampled
  pairs only.
- ``*_overhead_direct``: the plain paired ratio (sum of instrumented / sum of plain - 1) with
  a bootstrap 95% interval, as a cross-check; at the default rate its interval is wider than
  the effect on a busy machine.
- ``*_self_measured``: what the profiler itself reported (the number the API shows).

Concurrent case (``concurrent`` in the JSON, :mod:`_concurrent_sampling`): 4 request threads
while a fifth has every call sampled, the overhead on the unsampled threads.

Agent case (``agent`` in the JSON, :mod:`_agent_cost`): everything serving through
``pgc_daemon.attach`` adds to a call (the profiler's steps and the agent's own bookkeeping),
against calling the model, and the agent's threads. The CPU (name, ISA flags) is in
``settings.isa``.

    python bench/profiler_overhead.py [--rounds 300] [--cnn-rounds 6000] [--phases 6] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# kineto's "profiler_start/stop" lines on every torch.profiler block (a user's setting stands)
os.environ.setdefault("KINETO_LOG_LEVEL", "10")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import store as st  # noqa: E402
from pgc_daemon.agent.rows import window_rows  # noqa: E402
from profiler import Profiler, ProfilerConfig, Window  # noqa: E402

from _agent_cost import agent_cost  # noqa: E402
from _concurrent_sampling import REQUEST_THREADS, concurrent  # noqa: E402
from _paired import bootstrap_ci  # noqa: E402
from threads import cpu_isa  # noqa: E402

_tt = time.thread_time_ns
_pc = time.perf_counter_ns
ARMS = ("plain", "default", "full")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StoreSink:
    """Writes windows the way the agent does: one transaction per batch, into a real store."""

    def __init__(self, store: st.Store, name: str) -> None:
        self.store = store
        with store.session() as s:
            self.model_id = st.repo.upsert_model(s, name).id

    def __call__(self, windows: list[Window]) -> None:
        # the profiler's variant here (1) is no store variant: the rows go in without one
        rows = window_rows(self.model_id, windows)
        reqs = [dataclasses.replace(r, variant_id=None) for r in rows.requests]
        layers = [dataclasses.replace(r, variant_id=None) for r in rows.layers]
        host = [dataclasses.replace(r, variant_id=None) for r in rows.host]
        with self.store.session() as s:
            st.repo.add_window_stats(s, requests=reqs, layers=layers, host=host)


def thread_cpu_s(idents: list[int]) -> float:
    """CPU seconds of this process's threads with these ``threading`` idents, from each
    thread's own CPU clock (nanosecond resolution; /proc's per-thread times tick in 10 ms)."""
    total = 0
    for ident in idents:
        try:
            total += time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
        except (OSError, ProcessLookupError):
            pass  # the thread has ended
    return total / 1e9


def profiler_threads(prof: Profiler) -> list[int]:
    ids = []
    if prof._ticker is not None and prof._ticker.ident is not None:
        ids.append(prof._ticker.ident)
    if prof._exporter is not None and prof._exporter._thread.ident is not None:
        ids.append(prof._exporter._thread.ident)
    return ids


def interleaved(
    name: str, model: torch.nn.Module, inputs: list[tuple[Any, ...]], rounds: int, store: st.Store
) -> dict[str, Any]:
    """Plain, default and 100% sampling, call by call in shuffled order."""
    # Each profiler serves one call in three of this run, so its time-driven work (window
    # close and export, host samples, control ticks) runs on a clock three times slower: per
    # call it serves, it then does what the default settings do on a server busy all the time.
    k = len(ARMS)
    default = ProfilerConfig()
    clock: dict[str, Any] = {"window_s": default.window_s * k, "control_s": default.control_s * k,
             "host_interval_s": (default.host_interval_s or 10.0) * k,
             "layer_window_max_s": default.layer_window_max_s * k}
    profs = {
        "default": Profiler(ProfilerConfig(**clock), sink=StoreSink(store, f"{name}-default")),
        "full": Profiler(ProfilerConfig(sample_every=1, budget=None, **clock),
                         sink=StoreSink(store, f"{name}-full")),
    }
    for p in profs.values():
        p.watch(model)
        p.start()
    rng = random.Random(0)
    # per arm and round: thread CPU ns of the whole unit, wall ns, begin+end CPU ns, sampled?
    cpu = {a: np.zeros(rounds) for a in ARMS}
    wall = {a: np.zeros(rounds) for a in ARMS}
    bookkeeping = {a: np.zeros(rounds) for a in ARMS}
    sampled = {a: np.zeros(rounds, dtype=bool) for a in ARMS}

    def unit(arm: str, args: tuple[Any, ...]) -> tuple[int, int, int, bool]:
        """One call, with the profiler's steps inline as the agent takes them (see
        ``profiler._profiler``'s docstring)."""
        prof = profs.get(arm)
        token = mark = calls = None
        w0, c0 = _pc(), _tt()
        if prof is not None:
            calls = prof.calls
            mark = next(calls.marks)
            token = prof.sample(model) if mark else None
        run = token.module if token is not None else model
        c1 = _tt()
        t0 = _pc()
        run(*args)
        t1 = _pc()
        c2 = _tt()
        if prof is not None:
            if mark is None:
                calls.queue.append((1, None, t1 - t0, False, False, 0))
            else:
                prof.end(token, 1, args, {}, t1 - t0)
        c3, w1 = _tt(), _pc()
        return c3 - c0, w1 - w0, (c1 - c0) + (c3 - c2), token is not None

    warm = max(5, rounds // 30)
    with torch.inference_mode():
        for i in range(warm):  # caches, allocator, counter groups: not part of the measurement
            for arm in ARMS:
                unit(arm, inputs[i % len(inputs)])
    # Start-up, paid once per process and reported apart: the first window written (store
    # connection, SQL statements compiled) and the first host sample (psutil's first reads).
    startup_s = {}
    for a, p in profs.items():
        c = _tt()
        p.sample_host()
        p.flush()
        startup_s[a] = thread_cpu_s(profiler_threads(p)) + (_tt() - c) / 1e9
    bg0 = {a: thread_cpu_s(profiler_threads(p)) for a, p in profs.items()}
    with torch.inference_mode():
        t_start = time.monotonic()
        for r in range(rounds):
            args = inputs[r % len(inputs)]
            order = list(ARMS)
            rng.shuffle(order)
            for arm in order:
                c, w, b, s = unit(arm, args)
                cpu[arm][r], wall[arm][r], bookkeeping[arm][r], sampled[arm][r] = c, w, b, s
            if (r + 1) % max(1, rounds // 10) == 0:
                eta = (time.monotonic() - t_start) / (r + 1) * (rounds - r - 1)
                log(f"  {name}: {r + 1}/{rounds} interleaved rounds (~{eta:.0f} s left)")
    flush_s = {}
    for a, p in profs.items():  # the last window's processing (here) and export count too
        c = _tt()
        p.flush()
        flush_s[a] = (_tt() - c) / 1e9
    bg = {a: thread_cpu_s(profiler_threads(p)) - bg0[a] + flush_s[a] for a, p in profs.items()}
    self_measured = {a: p.status()["overhead"] for a, p in profs.items()}
    every = {a: p.sample_every for a, p in profs.items()}
    for p in profs.values():
        p.stop()
    plain = cpu["plain"]
    # rounds where any arm was hit by something big (3x its median) are left out of the pairs
    ok = np.ones(rounds, dtype=bool)
    for a in ARMS:
        ok &= cpu[a] < 3 * np.median(cpu[a])
    out: dict[str, Any] = {
        "rounds": rounds,
        "rounds_used": int(ok.sum()),
        "plain_cpu_ms": float(np.median(plain) / 1e6),
        "plain_wall_ms": float(np.median(wall["plain"]) / 1e6),
    }
    plain_sum = plain[ok].sum()
    for arm in ("default", "full"):
        smp = sampled[arm] & ok
        uns = ~sampled[arm] & ok
        # both arms read the clock at the same four points; the plain arm's readings cost
        # what reading the clock costs (cold, right after a forward pass), so the paired
        # difference is begin + end alone
        extra = ((bookkeeping[arm][uns] - bookkeeping["plain"][uns]).sum()
                 + (cpu[arm][smp] - plain[smp]).sum() + bg[arm] * 1e9)
        out[f"{arm}_overhead"] = float(extra / plain_sum)
        out[f"{arm}_parts"] = {  # where it goes, as fractions of plain serving time
            "begin_end": float((bookkeeping[arm][uns] - bookkeeping["plain"][uns]).sum() / plain_sum),
            "sampled_calls": float((cpu[arm][smp] - plain[smp]).sum() / plain_sum),
            "background": float(bg[arm] * 1e9 / plain_sum),
        }
        out[f"{arm}_overhead_direct"] = float((cpu[arm][ok].sum() + bg[arm] * 1e9) / plain_sum - 1)
        lo, hi = bootstrap_ci(cpu[arm][ok], plain[ok])
        bg_ratio = bg[arm] * 1e9 / plain_sum
        out[f"{arm}_overhead_direct_ci95"] = [lo + bg_ratio, hi + bg_ratio]
        out[f"{arm}_overhead_wall_direct"] = float(wall[arm][ok].sum() / wall["plain"][ok].sum() - 1)
        out[f"{arm}_self_measured"] = float(self_measured[arm])
        out[f"{arm}_sampled_calls"] = int(sampled[arm].sum())
        out[f"{arm}_background_ms"] = float(bg[arm] * 1e3)
        out[f"{arm}_startup_ms"] = float(startup_s[arm] * 1e3)
        out[f"{arm}_sample_every_at_end"] = every[arm]
    unsampled = ~sampled["default"]
    # the assumption behind the estimator: an unsampled call's forward pass costs what the
    # plain one does (only begin/end differ); its paired difference and interval say so
    u = ~sampled["default"] & ok
    model_plain = cpu["plain"][u] - bookkeeping["plain"][u]
    model_default = cpu["default"][u] - bookkeeping["default"][u]
    out["unsampled_forward_diff"] = float(model_default.sum() / model_plain.sum() - 1)
    out["unsampled_forward_diff_ci95"] = list(bootstrap_ci(model_default, model_plain, seed=1))
    out["begin_end_us_per_call"] = float(
        np.median(bookkeeping["default"][unsampled] - bookkeeping["plain"][unsampled]) / 1e3)
    return out


def torch_profiler(name: str, model: torch.nn.Module, inputs: list[tuple[Any, ...]], blocks: int,
                   block: int) -> dict[str, Any]:
    """Blocks of plain calls and of calls under torch.profiler (with its post-processing),
    in shuffled order; process CPU time, so any profiler threads count."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    pt = time.process_time_ns
    plain_ns = calls_ns = post_ns = 0
    rng = random.Random(1)
    with torch.inference_mode():
        for b in range(blocks + 1):
            order = ["plain", "torch"]
            rng.shuffle(order)
            for arm in order:
                start = b * block
                batch = [inputs[(start + i) % len(inputs)] for i in range(block)]
                c0 = pt()
                if arm == "plain":
                    for args in batch:
                        model(*args)
                    c1 = pt()
                    if b:  # block 0 warms both up
                        plain_ns += c1 - c0
                    continue
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for args in batch:
                        model(*args)
                c1 = pt()
                prof.key_averages()  # what a per-layer/op profile needs before it can be read
                c2 = pt()
                if b:
                    calls_ns += c1 - c0
                    post_ns += c2 - c1
            if (b + 1) % max(1, blocks // 4) == 0:
                log(f"  {name}: torch.profiler block {b + 1}/{blocks + 1}")
    return {
        "torch_profiler_overhead": (calls_ns + post_ns) / plain_ns - 1,
        "torch_profiler_calls_only_overhead": calls_ns / plain_ns - 1,
        "torch_profiler_postprocess_per_forward": post_ns / (plain_ns / (blocks * block)) / (blocks * block),
        "torch_profiler_blocks": blocks,
        "torch_profiler_block_calls": block,
    }


def load(name: str) -> tuple[torch.nn.Module, list[tuple[Any, ...]]]:
    if name == "minilm":
        from pgc_daemon.examples import minilm  # noqa: PLC0415

        stream = minilm.traffic(seed=7)
        return minilm.load_model(), [next(stream) for _ in range(32)]
    from pgc_daemon.examples import digits  # noqa: PLC0415

    spec = digits.cnn()
    return spec["model"], [tuple(ex) for ex in spec["example_inputs"]]


def render(results: dict[str, Any]) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 150)
    table = Table(title="profiler overhead vs plain serving (serving-thread CPU time, interleaved)",
                  title_justify="left")
    for col in ("model", "plain ms/call", "default (1/100, budget 0.5%)", "direct check (95% CI)",
                "self-measured", "100% sampling", "torch.profiler (+post-proc.)"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, r in results.items():
        if not isinstance(r, dict) or "default_overhead" not in r:
            continue
        lo, hi = r["default_overhead_direct_ci95"]
        table.add_row(
            name,
            f"{r['plain_cpu_ms']:.2f}",
            f"{r['default_overhead']:.3%}",
            f"{r['default_overhead_direct']:+.2%} [{lo:+.2%}, {hi:+.2%}]",
            f"{r['default_self_measured']:.3%}",
            f"{r['full_overhead']:.1%}",
            f"{r['torch_profiler_overhead']:.1%} ({r['torch_profiler_calls_only_overhead']:.1%} calls only)",
        )
    console.print(table)
    for name, r in results.items():
        for key in ("concurrent", "concurrent_process_wide"):
            c = r.get(key) if isinstance(r, dict) else None
            if not c:
                continue
            lo, hi = c["unsampled_overhead_ci95"]
            console.print(
                f"{name}, concurrent ({c['hooks']}): {c['request_threads']} request threads while another thread's every "
                f"call is sampled: {c['profiled_cpu_us_per_call']:.0f} vs {c['plain_cpu_us_per_call']:.0f} "
                f"CPU µs per call, {c['unsampled_overhead']:+.2%} [{lo:+.2%}, {hi:+.2%}] on the unsampled threads; "
                f"charged to the sampled calls {c['charged_ms']:.0f} ms against {c['measured_extra_ms']:.0f} ms "
                f"measured on the other threads"
            )
    for name, r in results.items():
        a = r.get("agent") if isinstance(r, dict) else None
        if a:
            lo, hi = a["overhead_ci95"]
            console.print(
                f"{name}, agent (served through attach vs the model): {a['us_per_call']:.1f} µs a "
                f"call (median; {a['us_per_call_ci95'][0]:.1f}-{a['us_per_call_ci95'][1]:.1f}), "
                f"{a['overhead']:+.2%} [{lo:+.2%}, {hi:+.2%}] of serving CPU, "
                f"its threads {a['background']:.2%}")
    console.print(
        "default: begin/end timed in place on unsampled calls + paired difference on sampled "
        "calls + the profiler's threads (their CPU clocks); direct: sum(instrumented)/sum(plain) "
        "- 1 over all paired rounds. Start-up (first window written, first host sample), paid "
        "once per process, is left out of the ratios: "
        + ", ".join(f"{n} {r['default_startup_ms']:.0f} ms" for n, r in results.items()
                    if isinstance(r, dict) and "default_startup_ms" in r)
        + "."
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="interleaved rounds on MiniLM (default 300)")
    ap.add_argument("--cnn-rounds", type=int, default=6000,
                    help="interleaved rounds on the CNN (default 6000: about two windows of the "
                    "profiler's scaled clock, so the last window's export is not charged to a "
                    "third of the calls it stands for)")
    ap.add_argument("--blocks", type=int, default=8, help="torch.profiler blocks per model (default 8)")
    ap.add_argument("--block", type=int, default=16, help="calls per torch.profiler block (default 16)")
    ap.add_argument("--phases", type=int, default=6, help="concurrent case: profiled/plain phase pairs (default 6)")
    ap.add_argument("--phase-s", type=float, default=2.0, help="concurrent case: seconds per phase (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--models", default="minilm,cnn", help="comma-separated: minilm, cnn")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in ("minilm", "cnn") for m in models):
        ap.error("--models takes minilm and/or cnn")
    if min(args.rounds, args.cnn_rounds, args.blocks, args.block, args.threads, args.phases) < 1 or args.phase_s <= 0:
        ap.error("--rounds, --cnn-rounds, --blocks, --block, --threads, --phases and --phase-s must be positive")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, Any] = {
        "settings": {"threads": args.threads, "torch": torch.__version__,
                     "load_avg": os.getloadavg()[0], "cores": os.cpu_count(), "isa": cpu_isa()},
    }
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        store = st.open_store(f"sqlite:///{Path(tmp) / 'bench.db'}")
        for name in models:
            log(f"{name}: loading")
            model, inputs = load(name)
            rounds = args.rounds if name == "minilm" else args.cnn_rounds
            log(f"{name}: plain / default / 100% sampling, {rounds} interleaved rounds")
            res = interleaved(name, model, inputs, rounds, store)
            log(f"{name}: torch.profiler, {args.blocks} blocks of {args.block} calls vs plain blocks")
            res.update(torch_profiler(name, model, inputs, args.blocks, args.block))
            log(f"{name}: concurrent: {REQUEST_THREADS} request threads while another is sampled, "
                f"{args.phases} pairs of {args.phase_s:.0f} s phases")
            res["concurrent"] = concurrent(model, inputs, args.phases, args.phase_s)
            log(f"{name}: the same with process-wide hooks (no twin)")
            res["concurrent_process_wide"] = concurrent(model, inputs, args.phases,
                                                        args.phase_s, hook_twin=False)
            log(f"{name}: agent: served through attach vs the model, {rounds} interleaved rounds")
            res["agent"] = agent_cost(name, model, inputs, rounds)
            results[name] = res
            log(f"{name}: default {res['default_overhead']:.3%}, 100% {res['full_overhead']:.1%}, "
                f"torch.profiler {res['torch_profiler_overhead']:.1%}")
        with store.session() as s:
            rows = sum(len(st.repo.request_windows(s, m.id)) for m in st.repo.list_models(s))
        results["settings"]["windows_exported"] = rows
        store.close()
    results["settings"]["seconds"] = round(time.monotonic() - t0, 1)
    render(results)
    if args.json:
        print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

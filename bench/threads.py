"""Does the thread a model is called from change its speed, and does pgc's serving executor
undo it?

Found while hot-swapping: with 2 cores, a forward pass called from a second thread, while
another thread that has run parallel torch work is alive, ran 1.4-2.5x slower than the same call
from that first thread, for fp32 eager and for compiled int8 alike. libgomp keeps an OpenMP team
for every thread that ran parallel torch work; with more such threads than cores its barriers
sleep instead of spinning. pgc's swapper therefore runs its torch work in threads that end, and
a served model runs on one inference thread of its own (:mod:`pgc_daemon.agent.executor`)
which the request threads hand their calls to.

Part 1 (the effect): MiniLM (batch 1, 128 tokens) fp32 eager and int8 dynamic + Inductor,
called from the thread that built and warmed them and from a fresh thread while that one lives,
interleaved in rounds.

Part 2 (the executor), once the building thread has ended, in interleaved rounds, each case in
threads of its own that end with it, so one case's OpenMP teams never slow the next one:

- ``isolated``: the int8 variant called directly from one thread, the only one with a team
  (what the building thread saw);
- ``executor`` / ``no executor``: a real ``pgc_daemon.attach``-ed model (temporary SQLite
  store) serving the int8 variant, called from 2 request threads taking turns, with and
  without the executor; ``executor_ratio`` = executor latency / isolated latency;
- throughput with 4 client threads calling as fast as answered: without the executor, with
  it, and with micro-batching allowed (``--max-batch``); ``batching_throughput_ratio`` = with
  batching allowed / executor without it. Allowed, batching serves only where the agent
  measured it raising throughput (:mod:`pgc_daemon.agent.batchchoice`): the window is measured
  after that live decision under this load, and ``batching_chosen`` says what it was. The same
  for fp32 eager served as the variant (``fp32_batching_throughput_ratio``), whose batch of 4
  costs less than 4 calls where the int8 variant's (compiled for batch 1) costs more.

Ratios are medians over rounds of the two cases' ratio in the same round. Other processes'
load slows a lone spinning OpenMP team (isolated, executor) far more than several sleeping
ones (see :mod:`pgc_daemon.agent.executor`): the 1-minute load average of each round is
printed and kept in the JSON; trust the numbers of a quiet machine.

    python bench/threads.py [--rounds 5] [--calls 20] [--seconds 3] [--max-batch 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler import Backend, Quantization, Recipe, build, warm  # noqa: E402
from pgc_daemon import attach  # noqa: E402
from pgc_daemon.agent.slot import Slot  # noqa: E402
from pgc_daemon.examples import minilm  # noqa: E402
from pgc_daemon.settings import Settings  # noqa: E402

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
WARMUP_CALLS = 3
REQUEST_THREADS = 2
CLIENTS = 4


def cpu_isa() -> dict[str, Any]:
    """The CPU's name, generation and the ISA flags that matter to int8/bf16 kernels."""
    from compiler.hardware import cpu_flags, probe

    hw, flags = probe(), cpu_flags()
    return {"cpu": hw.cpu, "generation": hw.generation,
            "flags": [f for f in ISA_FLAGS if f in flags],
            "avx2": "avx2" in flags, "avx512": "avx512f" in flags, "amx": "amx_tile" in flags}


def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread that ends when it returns (its OpenMP team ends with it)."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            err.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def per_call_ms(module: Any, inputs: list[Any], calls: int, warmup: int = 0) -> float:
    times = []
    with torch.inference_mode():
        for i in range(warmup + calls):
            ids, mask = inputs[i % len(inputs)]
            t0 = time.perf_counter()
            module(ids, mask)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def turn_taking_ms(served: Any, inputs: list[Any], calls: int, threads: int = REQUEST_THREADS) -> float:
    """Median latency of ``calls`` calls made by ``threads`` request threads in turn (one call
    in flight at a time, as a server that is not saturated): the threads live throughout."""
    turns = [threading.Semaphore(0) for _ in range(threads)]
    times: list[float] = []
    total = WARMUP_CALLS * threads + calls

    def client(k: int) -> None:
        for i in range(k, total, threads):
            turns[k].acquire()
            ids, mask = inputs[i % len(inputs)]
            t0 = time.perf_counter()
            served(ids, mask)
            if i >= WARMUP_CALLS * threads:
                times.append((time.perf_counter() - t0) * 1e3)
            turns[(k + 1) % threads].release()

    workers = [threading.Thread(target=client, args=(k,), name=f"request-{k}") for k in range(threads)]
    for w in workers:
        w.start()
    turns[0].release()
    for w in workers:
        w.join()
    return statistics.median(times)


def throughput(served: Any, inputs: list[Any], seconds: float, clients: int = CLIENTS,
               settled: Callable[[], bool] = lambda: True) -> float:
    """Calls per second answered to ``clients`` threads each calling as soon as answered,
    measured once ``settled()`` (the agent's live choices made under this load; at most 120 s)."""
    counts = [0] * clients
    stop = threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            ids, mask = inputs[i % len(inputs)]
            served(ids, mask)
            counts[k] += 1
            i += clients

    workers = [threading.Thread(target=client, args=(k,), name=f"client-{k}") for k in range(clients)]
    for w in workers:
        w.start()
    time.sleep(min(1.0, seconds / 3))  # warm-up: teams, first calls
    deadline = time.monotonic() + 120
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.05)
    n0, t0 = sum(counts), time.perf_counter()
    time.sleep(seconds)
    n1, t1 = sum(counts), time.perf_counter()
    stop.set()
    for w in workers:
        w.join()
    return (n1 - n0) / (t1 - t0)


class Serving:
    """A real attached model serving the compiled variant, for one case, closed after it."""

    def __init__(self, base: Any, variant: Any, settings: Settings, name: str,
                 inputs: list[Any], label: str = "int8 dynamic + Inductor", **kw: Any) -> None:
        # metric given: the agent need not run the base once to pick it (in its swapper thread)
        self.served = attach(base, name=name, settings=settings, metric="cosine", **kw)
        deadline = time.monotonic() + 60
        while self.served.model_id is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.served.model_id is None:
            raise RuntimeError("the agent did not register with the store")
        self.slot = Slot(variant.module, None, label, variant.hookable)
        self.served.swap(self.slot)
        self.threads = self._settle(inputs)

    def _settle(self, inputs: list[Any], at_least_s: float = 2.0) -> int | None:
        """Serve for ``at_least_s`` and until the agent has chosen the variant's intra-op
        thread count (``agent/threadtune.py``; None without the executor: nothing is tuned
        inline), so what is measured is how it serves from then on, not the probe. The agent's
        first look at the store (right after it registered) puts the store's active
        deployment, the base, back: the variant is swapped in again then; its next look is
        ``poll_s`` (an hour) away."""
        served = self.served
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < 120:
            if served.slot.module is not self.slot.module:
                served.swap(self.slot)
            # the slot's variant id: None for the int8 variant (the store does not know it), the
            # base's own id once the agent's first look put the base's slot back (fp32)
            settled = served.executor is None or served.tuner.chosen(served.slot.variant_id) is not None
            if settled and time.monotonic() - start >= at_least_s:
                break
            ids, mask = inputs[i % len(inputs)]
            served(ids, mask)
            i += 1
        if served.slot.module is not self.slot.module:
            raise RuntimeError("the variant does not serve after settling")
        return served.tuner.chosen(served.slot.variant_id)

    def __enter__(self) -> Any:
        return self.served

    def __exit__(self, *exc: object) -> None:
        self.served.close()


def build_variant(base: Any, examples: list[Any], max_batch: int) -> Any:
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))
    variant = build(base, recipe, calibration=examples, example=examples[0])
    warm(variant, examples[:2])
    for b in range(2, max_batch + 1):  # static shapes: every batch size micro-batching may form
        ids = torch.cat([examples[i % len(examples)][0][0] for i in range(b)])
        mask = torch.cat([examples[i % len(examples)][0][1] for i in range(b)])
        warm(variant, [((ids, mask), {})], rounds=1)
    return variant


def part1(base: Any, variant: Any, inputs: list[Any], rounds: int, calls: int) -> dict[str, Any]:
    """Runs in the thread that built the variant (which lives through it)."""
    modules = {"fp32": base, "int8": variant.module}
    ms: dict[str, dict[str, list[float]]] = {k: {"main": [], "new": []} for k in modules}
    for r in range(rounds):
        for key, module in modules.items():
            ms[key]["main"].append(per_call_ms(module, inputs, calls))
            ms[key]["new"].append(in_thread(per_call_ms, module, inputs, calls))
        print(f"part 1: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for key in modules:
        main_ms, new_ms = statistics.median(ms[key]["main"]), statistics.median(ms[key]["new"])
        out[f"{key}_main_ms"], out[f"{key}_new_thread_ms"] = main_ms, new_ms
        out[f"{key}_new_thread_ratio"] = new_ms / main_ms
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=3.0, help="throughput window per case and round")
    ap.add_argument("--max-batch", type=int, default=4, help="micro-batching: most calls per batch")
    ap.add_argument("--max-delay-ms", type=float, default=2.0)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1 or args.seconds <= 0 or args.max_batch < 2:
        print("--rounds, --calls and --seconds must be positive, --max-batch at least 2", file=sys.stderr)
        return 2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    isa = cpu_isa()
    print(f"CPU: {isa['cpu']}; ISA: {' '.join(isa['flags']) or 'none of ' + ', '.join(ISA_FLAGS)}; "
          f"{torch.get_num_threads()} torch threads", flush=True)
    stream = minilm.traffic(seed=1)
    inputs = [next(stream) for _ in range(16)]
    examples = [((ids, mask), {}) for ids, mask in inputs]
    print("building int8 dynamic + Inductor, batch 1 to "
          f"{args.max_batch} (a few minutes)...", file=sys.stderr, flush=True)

    def build_and_part1() -> tuple[Any, Any, dict[str, Any]]:
        # this thread plays the one that built the model; it ends before part 2
        base = minilm.load_model().eval()
        variant = build_variant(base, examples, args.max_batch)
        return base, variant, part1(base, variant, inputs, args.rounds, args.calls)

    base, variant, out = in_thread(build_and_part1)
    out = {"threads": torch.get_num_threads(), "torch": torch.__version__, "isa": isa, **out}

    keys = ("isolated", "executor", "no_executor")
    tput_keys = ("tput_no_executor", "tput_executor", "tput_batching", "tput_fp32_executor", "tput_fp32_batching")
    fp32 = types.SimpleNamespace(module=base, hookable=True)  # served as the variant
    ms: dict[str, list[float]] = {k: [] for k in keys + tput_keys}
    with tempfile.TemporaryDirectory(prefix="pgc-bench-threads-") as tmp:
        # the agent serves a variant the store does not know: with its usual 1 s poll it
        # would follow the store's active deployment (the base) and put the base back
        settings = Settings(store_url=f"sqlite:///{tmp}/pgc.db", work_dir=f"{tmp}/work", poll_s=3600)

        def serving(name: str, **kw: Any) -> Serving:
            if "fp32" in name:
                return Serving(base, fp32, settings, name, inputs, label="fp32 eager", **kw)
            return Serving(base, variant, settings, name, inputs, **kw)

        for r in range(args.rounds):
            out.setdefault("loadavg", []).append(round(os.getloadavg()[0], 2))
            ms["isolated"].append(in_thread(per_call_ms, variant.module, inputs, args.calls, WARMUP_CALLS))
            cases = [("executor", True), ("no_executor", False)]
            for key, on in cases if r % 2 == 0 else cases[::-1]:
                with serving(f"minilm-{key}", executor=on) as served:
                    ms[key].append(turn_taking_ms(served, inputs, args.calls))
                    if on:  # the intra-op count the agent chose for the variant, live
                        out.setdefault("executor_threads", []).append(served.tuner.chosen(served.slot.variant_id))
            batching = {"max_batch": args.max_batch, "max_delay_ms": args.max_delay_ms}
            for key, kw in (("tput_no_executor", {"executor": False}),
                            ("tput_executor", {"executor": True}),
                            ("tput_batching", batching),
                            ("tput_fp32_executor", {"executor": True}),
                            ("tput_fp32_batching", batching)):
                with serving(f"minilm-{key}", **kw) as served:
                    choice = served.executor.choice if served.executor is not None else None
                    ms[key].append(throughput(served, inputs, args.seconds, settled=lambda c=choice: (
                        c is None or c.chosen is not None)))
                    if served.executor is not None:
                        out.setdefault(f"{key}_threads", []).append(
                            served.tuner.chosen(served.slot.variant_id))
                    if key.endswith("_batching"):
                        status, tag = served.executor.status(), key.removeprefix("tput_")
                        out.setdefault(f"{tag}_batched_calls", []).append(status["batched_calls"])
                        out.setdefault(f"{tag}_batches", []).append(status["batches"])
                        out.setdefault(f"{tag}_chosen", []).append(status["batching"])
            print(f"part 2: round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{k} {v[-1]:.2f}" for k, v in ms.items()), file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in ms.items()}

    def paired(a: str, b: str) -> float:
        """Median over rounds of a/b measured in the same round: load that drifts between
        rounds (a shared machine) cancels out."""
        return statistics.median(x / y for x, y in zip(ms[a], ms[b], strict=True))

    out.update({
        "isolated_ms": med["isolated"], "executor_ms": med["executor"], "no_executor_ms": med["no_executor"],
        "executor_ratio": paired("executor", "isolated"),
        "no_executor_ratio": paired("no_executor", "isolated"),
        "throughput_no_executor": med["tput_no_executor"], "throughput_executor": med["tput_executor"],
        "throughput_batching": med["tput_batching"], "max_batch": args.max_batch,
        "max_delay_ms": args.max_delay_ms,
        "batching_throughput_ratio": paired("tput_batching", "tput_executor"),
        "throughput_fp32_executor": med["tput_fp32_executor"],
        "throughput_fp32_batching": med["tput_fp32_batching"],
        "fp32_batching_throughput_ratio": paired("tput_fp32_batching", "tput_fp32_executor"),
        "executor_throughput_ratio": paired("tput_executor", "tput_no_executor"),
        "rounds": args.rounds, "samples": ms,
    })
    print(f"\nCPU ISA: {' '.join(isa['flags'])}; 1-minute load average at each round: "
          f"{out['loadavg']} on {os.cpu_count()} CPUs (other processes' load slows one spinning "
          "OpenMP team most)")
    print(f"{'module':28} {'builder ms':>10} {'new thread ms':>14} {'ratio':>7}")
    for key, name in (("fp32", "fp32 eager"), ("int8", "int8 dynamic + Inductor")):
        print(f"{name:28} {out[f'{key}_main_ms']:10.2f} {out[f'{key}_new_thread_ms']:14.2f} "
              f"{out[f'{key}_new_thread_ratio']:6.2f}x")
    print(f"\nint8 dynamic + Inductor through pgc_daemon.attach, {REQUEST_THREADS} request threads in turn:")
    print(f"  isolated (one thread alone)  {med['isolated']:7.2f} ms")
    print(f"  with the executor            {med['executor']:7.2f} ms  {out['executor_ratio']:5.2f}x")
    print(f"  without the executor         {med['no_executor']:7.2f} ms  {out['no_executor_ratio']:5.2f}x")
    print(f"\nthroughput, {CLIENTS} client threads:")
    print(f"  without the executor         {med['tput_no_executor']:7.1f} calls/s")
    print(f"  with the executor            {med['tput_executor']:7.1f} calls/s")
    chosen = [c["batching"] if c else None for c in out.get("batching_chosen", [])]
    print(f"  micro-batching allowed (<= {args.max_batch}) {med['tput_batching']:7.1f} calls/s  "
          f"{out['batching_throughput_ratio']:5.2f}x  (batching chosen live: {chosen})")
    chosen = [c["batching"] if c else None for c in out.get("fp32_batching_chosen", [])]
    print(f"fp32 eager, with the executor    {med['tput_fp32_executor']:7.1f} calls/s")
    print(f"  micro-batching allowed (<= {args.max_batch}) {med['tput_fp32_batching']:7.1f} calls/s  "
          f"{out['fp32_batching_throughput_ratio']:5.2f}x  (batching chosen live: {chosen})")
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

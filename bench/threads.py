"""Does the thread a model is called from change its speed?

Found while hot-swapping: with 2 cores, a forward pass called from a second thread, while
another thread that has run parallel torch work is alive, ran 2-2.5x slower than the same call
from that first thread, for fp32 eager and for compiled int8 alike. pgc's swapper therefore
runs its torch work in threads that end; a model server with several serving threads meets the
same effect. This measures it, in one process: MiniLM (batch 1, 128 tokens) fp32 eager and
int8 dynamic + Inductor, called from the main thread (which built and warmed them) and from a
fresh thread, interleaved in rounds.

    python bench/threads.py [--rounds 5] [--calls 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler import Backend, Quantization, Recipe, build, warm  # noqa: E402
from pgc_daemon.examples import minilm  # noqa: E402


def per_call_ms(module: Any, inputs: list[Any], calls: int) -> float:
    times = []
    with torch.inference_mode():
        for i in range(calls):
            ids, mask = inputs[i % len(inputs)]
            t0 = time.perf_counter()
            module(ids, mask)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def in_new_thread(fn: Any, *args: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1:
        print("--rounds and --calls must be positive", file=sys.stderr)
        return 2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print("building int8 dynamic + Inductor (about a minute)...", file=sys.stderr, flush=True)
    base = minilm.load_model().eval()
    stream = minilm.traffic(seed=1)
    inputs = [next(stream) for _ in range(16)]
    examples = [((ids, mask), {}) for ids, mask in inputs]
    recipe = Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}), backend=Backend("inductor"))
    variant = build(base, recipe, calibration=examples, example=examples[0])
    warm(variant, examples[:2])
    modules = {"fp32 eager": base, "int8 dynamic + Inductor": variant.module}
    ms: dict[str, dict[str, list[float]]] = {k: {"main": [], "new thread": []} for k in modules}
    for r in range(args.rounds):
        for name, module in modules.items():
            ms[name]["main"].append(per_call_ms(module, inputs, args.calls))
            ms[name]["new thread"].append(in_new_thread(per_call_ms, module, inputs, args.calls))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    print(f"{'module':28} {'main ms':>9} {'new thread ms':>14} {'ratio':>7}")
    for name in modules:
        main_ms = statistics.median(ms[name]["main"])
        new_ms = statistics.median(ms[name]["new thread"])
        key = "fp32" if name.startswith("fp32") else "int8"
        out[f"{key}_main_ms"], out[f"{key}_new_thread_ms"] = main_ms, new_ms
        out[f"{key}_new_thread_ratio"] = new_ms / main_ms
        print(f"{name:28} {main_ms:9.2f} {new_ms:14.2f} {new_ms / main_ms:6.2f}x")
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

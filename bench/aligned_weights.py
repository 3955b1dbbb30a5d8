"""What does moving a loaded package's weights onto cache lines buy a served variant?

An AOTInductor library copies its weights into one heap block when it loads, which glibc
returns 16 bytes past a page, so every weight sits 16 bytes off a cache line. pgc's package
runner copies them to aligned memory (``NativePackage.align_constants``). For each model the
variant is built once into a compile cache, then its stored artifact is loaded twice in this
process, as a serving process loads it: once with the weights where the library left them,
once aligned. The two are timed **interleaved, round by round**, on the same inputs; the
figure is the paired ratio (as left / aligned) with a bootstrap 95% interval. Outputs must be
equal (``torch.equal``).

    python bench/aligned_weights.py [--models resnet,minilm] [--rounds 40] [--threads 2] [--json]

``resnet``: ResNet-18-shaped (``bench._hf_random:resnet``, batch 1), int8 static · Inductor.
``minilm``: all-MiniLM-L6-v2 at batch 1, int8 static · max-autotune + bf16 (what the demo
deploys on a CPU with AMX; plain max-autotune elsewhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._paired import bootstrap_ci  # noqa: E402
from bench.threads import cpu_isa  # noqa: E402
from compiler import Backend, CompileCache, Quantization, Recipe, build, load_artifact  # noqa: E402
from compiler._aoti_native import ALIGNMENT, NativePackage, constant_address  # noqa: E402
from compiler.hardware import probe  # noqa: E402

CALLS_PER_ROUND = 10


def _spec(name: str) -> tuple[Any, list[tuple[tuple[Any, ...], dict[str, Any]]], Recipe]:
    int8 = Quantization.of({"_default": "int8-static-pc"})
    if name == "resnet":
        from bench._hf_random import resnet

        spec = resnet()
        examples = [((), kw) for kw in spec["example_inputs"]]
        return spec["model"], examples, Recipe(quantization=int8, backend=Backend("inductor"))
    if name == "minilm":
        from pgc_daemon.examples import minilm

        spec = minilm.build()
        examples = [_example(ex) for ex in spec["example_inputs"]]
        autocast = "bf16" if probe().features.get("amx_bf16") else None
        return spec["model"], examples, Recipe(
            quantization=int8, backend=Backend("inductor", "max-autotune", autocast=autocast))
    raise SystemExit(f"aligned_weights: unknown model {name!r} (resnet, minilm)")


def _example(ex: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(ex, dict):
        return (), ex
    return (tuple(ex), {}) if isinstance(ex, (tuple, list)) else ((ex,), {})


def _natives(module: Any) -> list[NativePackage]:
    return [r.native for r in getattr(module, "runners", {}).values() if r.native is not None]


def _off_line(module: Any) -> int:
    return sum(1 for pkg in _natives(module) for _, t in pkg.constants().values()
               if constant_address(t) % ALIGNMENT)


def measure(name: str, rounds: int, folder: Path) -> dict[str, Any]:
    model, examples, recipe = _spec(name)
    cache = CompileCache(folder)
    t0 = time.perf_counter()
    built = build(model, recipe, calibration=examples[:8], example=examples[0], cache=cache)
    build_s = time.perf_counter() - t0
    if built.artifact is None:
        raise SystemExit(f"aligned_weights: {name}: no package was built ({built.report.notes})")
    aligner = NativePackage.align_constants
    NativePackage.align_constants = lambda self: (0, 0)  # type: ignore[method-assign]
    try:
        as_left = load_artifact(model, recipe, built.artifact, cache=cache).module
    finally:
        NativePackage.align_constants = aligner  # type: ignore[method-assign]
    aligned = load_artifact(model, recipe, built.artifact, cache=cache).module
    if not _natives(aligned):
        raise SystemExit(f"aligned_weights: {name}: the package does not run natively")
    args, kwargs = examples[0]
    arms = {"as_left": as_left, "aligned": aligned}
    times: dict[str, list[float]] = {k: [] for k in arms}
    with torch.inference_mode():
        outs = [m(*args, **kwargs) for m in arms.values()]
        outs = [getattr(o, "logits", o) for o in outs]
        equal = bool(torch.equal(outs[0], outs[1]))
        for m in arms.values():
            for _ in range(20):
                m(*args, **kwargs)
        for i in range(rounds):
            order = list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]
            for key, m in order:
                t = time.perf_counter()
                for _ in range(CALLS_PER_ROUND):
                    m(*args, **kwargs)
                times[key].append((time.perf_counter() - t) / CALLS_PER_ROUND * 1e3)
        print(f"  {name}: {rounds} interleaved rounds done", file=sys.stderr)
    left, ok = np.array(times["as_left"]), np.array(times["aligned"])
    lo, hi = bootstrap_ci(left, ok)
    return {
        "recipe": recipe.label(), "build_s": round(build_s, 1), "outputs_equal": equal,
        "constants_off_line_as_left": _off_line(as_left),
        "constants_off_line_aligned": _off_line(aligned),
        "as_left_ms": round(statistics.median(times["as_left"]), 3),
        "aligned_ms": round(statistics.median(times["aligned"]), 3),
        "speedup": round(float(left.sum() / ok.sum()), 3),
        "speedup_ci95": [round(1 + lo, 3), round(1 + hi, 3)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet,minilm", help="comma-separated: resnet, minilm")
    ap.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    if args.rounds < 4 or args.threads < 1:
        raise SystemExit("aligned_weights: --rounds must be at least 4 and --threads at least 1")
    torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"settings": {"threads": args.threads, "torch": torch.__version__,
                                        "rounds": args.rounds, "isa": cpu_isa()}}
    with tempfile.TemporaryDirectory(prefix="pgc-aligned-") as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            print(f"{name}: building and loading", file=sys.stderr)
            r = out[name] = measure(name, args.rounds, Path(tmp) / name)
            print(f"{name} ({r['recipe']}): as left {r['as_left_ms']} ms, aligned "
                  f"{r['aligned_ms']} ms, {r['speedup']}x ({r['speedup_ci95'][0]}-"
                  f"{r['speedup_ci95'][1]}), {r['constants_off_line_as_left']} constants off "
                  f"a cache line as left, outputs equal: {r['outputs_equal']}")
    isa = out["settings"]["isa"]
    print(f"machine: {isa['cpu']} ({isa['generation']}), {', '.join(isa['flags'])}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

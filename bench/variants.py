"""Latency and fidelity of each recipe family against fp32 eager, on all-MiniLM-L6-v2 (batch 1
and 8, 128 tokens) and on a small CNN trained here on scikit-learn's digits (batch 1 and 256),
with ONNX Runtime int8 per-channel as a peer measured in the same run.

    python bench/variants.py [--json] [--threads N] [--quick]

Every ratio is measured interleaved with fp32 eager in this process (``pgc_daemon.optimizer.search.
measure.interleaved``: short blocks in random order, median of block ratios), so load from
other processes hits both arms. MiniLM fidelity is the mean cosine of sentence embeddings
against fp32 on held-out sentences (not the calibration ones); the CNN's is test accuracy.
Static int8 calibrates on 32 live-like inputs (training images for the CNN). Which
feed-forward output projections stay out of static int8 comes from ``compiler.sensitivity``
run here. Progress goes to stderr; ``--json`` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from compiler import (
    Backend,
    Quantization,
    Recipe,
    build,
    fidelity,
    probe,
    sensitivity,
    warm,
)
from pgc_daemon.optimizer.search.measure import interleaved

STARTED = time.monotonic()


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {msg}", file=sys.stderr, flush=True)


def timed(base: torch.nn.Module, cand: Callable[..., Any], inputs: list[Any], seconds: float) -> dict[str, Any]:
    t = interleaved(base, cand, inputs, block=3, min_rounds=6, max_rounds=30, max_seconds=seconds)
    return {"speedup": t.speedup, "ci": [1 / t.ratio_high, 1 / t.ratio_low], "base_ms": t.baseline_ms["p50"],
            "ms": t.candidate_ms["p50"], "rounds": t.rounds}


def outputs(module: Callable[..., Any], inputs: list[Any]) -> list[Any]:
    with torch.inference_mode():
        return [module(*a, **k) for a, k in inputs]


# --------------------------------------------------------------------------- MiniLM


def minilm(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from pgc_daemon.examples import minilm as ml

    progress("MiniLM: loading all-MiniLM-L6-v2")
    model = ml.load_model()
    texts = list(ml.sentences())
    calib = [(ml.encode([t]), {}) for t in texts[:32]]
    held = texts[200:200 + (16 if args.quick else 48)]
    eval_b1 = [(ml.encode([t]), {}) for t in held]
    eval_b8 = [(ml.encode(held[i:i + 8]), {}) for i in range(0, len(held) - 7, 8)]
    refs_b1, refs_b8 = outputs(model, eval_b1), outputs(model, eval_b8)
    out_proj = [f"encoder.encoder.layer.{i}.output.dense" for i in range(6)]

    progress("MiniLM: sensitivity of the feed-forward output projections to static int8")
    sens = sensitivity(model, calib[:8], ["int8-static-pc"], layers=out_proj, max_inputs=8)
    ranked = sens.most_sensitive("int8-static-pc", 6)
    progress("  most sensitive first: " + ", ".join(
        f"{n.split('.')[3]}:{sens.get(n, 'int8-static-pc').fidelity:.5f}" for n in ranked))  # type: ignore[union-attr]
    keep = ranked[:2]

    static = {"_default": "int8-static-pc"}
    families: list[tuple[str, Recipe]] = [
        ("fp32 inductor", Recipe(backend=Backend("inductor"))),
        ("int8 dynamic", Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}),
                                          backend=Backend("inductor"))),
        ("int8 static (pt2e)", Recipe(quantization=Quantization.of(static), backend=Backend("inductor"))),
        (f"int8 static, {len(keep)} most sensitive fp32",
         Recipe(quantization=Quantization.of({**static, **{n: "fp32" for n in keep}}), backend=Backend("inductor"))),
        (f"int8 static, {len(keep)} most sensitive dynamic",
         Recipe(quantization=Quantization.of({**static, **{n: "int8-dynamic-pc" for n in keep}}),
                backend=Backend("inductor"))),
        ("ONNX Runtime int8 per-channel", Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}),
                                                 backend=Backend("onnxruntime"))),
    ]
    if args.quick:
        families = [families[0], families[2], families[-1]]
    result: dict[str, Any] = {"minilm_sensitive_layers": keep}
    built: dict[str, Any] = {}
    for name, recipe in families:
        progress(f"MiniLM: building {name} ({recipe.label()})")
        t0 = time.monotonic()
        variant = build(model, recipe, calibration=calib, example=eval_b1[0])
        warm(variant, eval_b1[:1], rounds=1)
        build_s = time.monotonic() - t0
        cos = fidelity("cosine", refs_b1, outputs(variant.module, eval_b1))
        progress(f"  built in {build_s:.0f}s, cosine {cos:.4f}; timing batch 1")
        tm = timed(model, variant.module, eval_b1, args.seconds)
        row = {"model": "minilm", "batch": 1, "family": name, "recipe": recipe.label(),
               "speedup": tm["speedup"], "ci": tm["ci"], "ms": tm["ms"], "fp32_ms": tm["base_ms"],
               "fidelity": cos, "metric": "cosine", "build_s": build_s,
               "kernels": variant.report.kernel_paths.get("<compiled>", ""),
               "paths": sorted({p.split("; ")[-1] for k, p in variant.report.kernel_paths.items()
                                if not k.startswith("<")})}
        rows.append(row)
        progress(f"  {tm['speedup']:.2f}x ({tm['ms']:.2f} ms vs {tm['base_ms']:.2f} ms)")
        built[name] = (recipe, variant, row)

    feasible = [r for n, (_, _, r) in built.items() if r["fidelity"] >= 0.99 and "ONNX" not in n]
    best = max(feasible, key=lambda r: r["speedup"]) if feasible else None
    ort = next((r for n, (_, _, r) in built.items() if "ONNX" in n), None)
    result.update({
        "minilm_b1_best_speedup_cos099": best["speedup"] if best else None,
        "minilm_b1_best_cosine": best["fidelity"] if best else None,
        "minilm_b1_best_recipe": best["recipe"] if best else None,
        "minilm_b1_ort_int8_speedup": ort["speedup"] if ort else None,
        "minilm_b1_ort_int8_cosine": ort["fidelity"] if ort else None,
    })
    # batch 8: fp32 compiled, the best pgc recipe, and the peer
    wanted = ["fp32 inductor"] + [best["family"]] * bool(best) + [n for n in built if "ONNX" in n]
    for name in dict.fromkeys(wanted):
        recipe, variant, _ = built[name]
        progress(f"MiniLM batch 8: {name}")
        warm(variant, eval_b8[:1], rounds=1)
        cos = fidelity("cosine", refs_b8, outputs(variant.module, eval_b8))
        tm = timed(model, variant.module, eval_b8, args.seconds)
        rows.append({"model": "minilm", "batch": 8, "family": name, "recipe": recipe.label(),
                     "speedup": tm["speedup"], "ci": tm["ci"], "ms": tm["ms"], "fp32_ms": tm["base_ms"],
                     "fidelity": cos, "metric": "cosine"})
        progress(f"  {tm['speedup']:.2f}x, cosine {cos:.4f}")
        key = "best" if best and name == best["family"] else "ort_int8" if "ONNX" in name else "fp32_inductor"
        result[f"minilm_b8_{key}_speedup"] = tm["speedup"]
        result[f"minilm_b8_{key}_cosine"] = cos
    del built
    return result


# --------------------------------------------------------------------------- digits CNN


def cnn(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from compiler.parts import Fusion, Layout
    from pgc_daemon.examples import digits

    progress("CNN: training on scikit-learn digits")
    model = digits.train(digits.CNN())
    x_train, _, x_test, y_test = digits.data()
    calib = [((x_train[i:i + 16],), {}) for i in range(0, 32 * 16, 16)]
    n_test = len(x_test)

    def batches(size: int) -> tuple[list[Any], int]:
        """The whole test set in batches of ``size``, the last padded with zeros."""
        out = []
        for i in range(0, n_test, size):
            x = x_test[i:i + size]
            if len(x) < size:
                x = torch.cat([x, torch.zeros(size - len(x), *x.shape[1:])])
            out.append(((x,), {}))
        return out, n_test

    def accuracy(module: Callable[..., Any], size: int) -> float:
        bs, n = batches(size)
        with torch.inference_mode():
            logits = torch.cat([module(*a) for a, _ in bs])[:n]
        return float((logits.argmax(-1) == y_test).float().mean())

    fp32_acc = accuracy(model, 256)
    progress(f"  fp32 test accuracy {fp32_acc:.4f} ({n_test} images)")
    static = Quantization.of({"_default": "int8-static-pc"})
    families = [
        ("fp32 inductor", Recipe(backend=Backend("inductor"))),
        ("fp32 fused, channels_last, inductor",
         Recipe(fusion=Fusion(True, True), layout=Layout("channels_last"), backend=Backend("inductor"))),
        ("int8 static (pt2e)", Recipe(quantization=static, backend=Backend("inductor"))),
        ("ONNX Runtime int8 per-channel", Recipe(quantization=static, backend=Backend("onnxruntime"))),
    ]
    if args.quick:
        families = [families[0], families[2], families[3]]
    result: dict[str, Any] = {"cnn_fp32_accuracy": fp32_acc}
    for batch in (1, 256):
        inputs = batches(batch)[0][:64] if batch == 1 else batches(batch)[0]
        for name, recipe in families:
            progress(f"CNN batch {batch}: {name}")
            variant = build(model, recipe, calibration=calib, example=inputs[0])
            warm(variant, inputs[:1], rounds=1)
            acc = accuracy(variant.module, 256) if batch == 256 else accuracy(variant.module, 1)
            tm = timed(model, variant.module, inputs, args.seconds)
            rows.append({"model": "cnn", "batch": batch, "family": name, "recipe": recipe.label(),
                         "speedup": tm["speedup"], "ci": tm["ci"], "ms": tm["ms"], "fp32_ms": tm["base_ms"],
                         "fidelity": acc, "metric": "accuracy",
                         "kernels": variant.report.kernel_paths.get("<compiled>", "")})
            progress(f"  {tm['speedup']:.2f}x ({tm['ms']:.3f} ms vs {tm['base_ms']:.3f} ms), accuracy {acc:.4f}")
            tag = {"int8 static (pt2e)": "int8", "ONNX Runtime int8 per-channel": "ort_int8"}.get(name)
            if tag:
                result[f"cnn_b{batch}_{tag}_speedup"] = tm["speedup"]
                result[f"cnn_b{batch}_{tag}_accuracy"] = acc
    return result


# --------------------------------------------------------------------------- table


def table(rows: list[dict[str, Any]]) -> str:
    head = "| model | batch | recipe family | speedup vs fp32 eager (95% CI) | latency ms (fp32) | fidelity |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        fid = f"cos {r['fidelity']:.4f}" if r["metric"] == "cosine" else f"acc {r['fidelity']:.4f}"
        lines.append(
            f"| {'MiniLM' if r['model'] == 'minilm' else 'digits CNN'} | {r['batch']} | {r['family']} | "
            f"{r['speedup']:.2f}x ({r['ci'][0]:.2f}-{r['ci'][1]:.2f}) | {r['ms']:.3f} ({r['fp32_ms']:.3f}) | {fid} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads (2)")
    parser.add_argument("--seconds", type=float, default=8.0, help="timing budget per ratio (8)")
    parser.add_argument("--quick", action="store_true", help="fewer families and inputs (smoke run)")
    parser.add_argument("--only", choices=("minilm", "cnn"), help="one model only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hw = probe()
    progress(f"{hw.summary()}; torch {torch.__version__}; {args.threads} threads")
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"hardware": hw.summary(), "threads": args.threads, "torch": torch.__version__}
    if args.only in (None, "minilm"):
        result.update(minilm(args, rows))
    if args.only in (None, "cnn"):
        result.update(cnn(args, rows))
    result["seconds"] = round(time.monotonic() - STARTED, 1)
    result["rows"] = rows
    print(table(rows))
    best = result.get("minilm_b1_best_speedup_cos099")
    if best is not None:
        ort = result.get("minilm_b1_ort_int8_speedup") or math.nan
        print(f"\nMiniLM batch 1: best recipe with cosine >= 0.99 is {best:.2f}x fp32 eager "
              f"({result['minilm_b1_best_recipe']}, cosine {result['minilm_b1_best_cosine']:.4f}); "
              f"ONNX Runtime int8 per-channel {ort:.2f}x in the same run.")
    if "cnn_b256_int8_speedup" in result:
        print(f"digits CNN batch 256: static int8 {result['cnn_b256_int8_speedup']:.2f}x, accuracy "
              f"{result['cnn_b256_int8_accuracy']:.4f} vs fp32 {result['cnn_fp32_accuracy']:.4f}.")
    print(f"({result['seconds']:.0f} s)")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

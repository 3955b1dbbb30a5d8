"""Latency and fidelity of each recipe family against fp32 eager, on all-MiniLM-L6-v2 (batch 1
and 8, 128 tokens) and on a small CNN trained here on scikit-learn's digits (batch 1 and 256),
with peers measured in the same run: ONNX Runtime int8 per-channel and OpenVINO (f32, its
default precision, and NNCF int8 with the rest in the default precision), each run on its own,
not chosen by pgc.

    python bench/variants.py [--json] [--threads N] [--quick]

Every ratio is measured interleaved with fp32 eager in this process (``pgc_daemon.optimizer.search.
measure.interleaved``: short blocks in random order, median of block ratios), so load from
other processes hits both arms. Every variant is built for the batch it is timed at (an
AOTInductor package serves the shapes it was compiled for). MiniLM fidelity is the mean cosine
of sentence embeddings against fp32 on held-out sentences (not the calibration ones); the CNN's
is test accuracy, and the mean cosine of its logits against fp32's. Static int8 calibrates on
32 live-like inputs (training images for the CNN). Which feed-forward output projections stay
out of static int8 comes from ``compiler.sensitivity`` run here.

Per model and batch the JSON has ``<m>_b<n>_best_speedup_cos099`` and ``..._cos09999`` (pgc's
fastest row at that cosine), ``..._openvino_best_speedup_cos099`` and ``..._best_over_peers``
(pgc's best at cosine >= 0.99 over the best peer row at cosine >= 0.99), and the machine's ISA.
Progress goes to stderr; ``--json`` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
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
    Fusion,
    Quantization,
    Recipe,
    build,
    fidelity,
    openvino_backends,
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


Family = tuple[str, Recipe, bool]
"""A row's name, its recipe, and whether it is a peer (run on its own, not chosen by pgc)."""


def peers(int8: Quantization) -> list[Family]:
    """ONNX Runtime int8 per-channel, and OpenVINO f32, default precision and NNCF int8 (the
    rest in the default precision) where OpenVINO is installed."""
    out: list[Family] = [("ONNX Runtime int8 per-channel", Recipe(quantization=int8, backend=Backend("onnxruntime")), True)]
    if openvino_backends():
        out += [
            ("OpenVINO fp32 (f32 hint)", Recipe(backend=Backend("openvino", "f32")), True),
            ("OpenVINO default precision", Recipe(backend=Backend("openvino")), True),
            ("OpenVINO NNCF int8", Recipe(quantization=Quantization.of({"_default": "int8-static-pc"}),
                                          backend=Backend("openvino")), True),
        ]
    return out


def summary(prefix: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best pgc row at cosine >= 0.99 and >= 0.9999, the best OpenVINO row and the best
    peer row at cosine >= 0.99, and pgc's best over the peers' best."""

    def best(candidates: list[dict[str, Any]], floor: float) -> dict[str, Any] | None:
        ok = [r for r in candidates if r["cosine"] >= floor]
        return max(ok, key=lambda r: r["speedup"]) if ok else None

    mine = [r for r in rows if not r["peer"]]
    others = [r for r in rows if r["peer"]]
    b99, b9999 = best(mine, 0.99), best(mine, 0.9999)
    ov = best([r for r in others if r["family"].startswith("OpenVINO")], 0.99)
    peer = best(others, 0.99)
    return {
        f"{prefix}_best_speedup_cos099": b99["speedup"] if b99 else None,
        f"{prefix}_best_recipe_cos099": b99["recipe"] if b99 else None,
        f"{prefix}_best_speedup_cos09999": b9999["speedup"] if b9999 else None,
        f"{prefix}_best_recipe_cos09999": b9999["recipe"] if b9999 else None,
        f"{prefix}_openvino_best_speedup_cos099": ov["speedup"] if ov else None,
        f"{prefix}_openvino_best_family_cos099": ov["family"] if ov else None,
        f"{prefix}_best_peer_cos099": peer["family"] if peer else None,
        f"{prefix}_best_over_peers": b99["speedup"] / peer["speedup"] if b99 and peer else None,
    }


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
    inductor = Backend("inductor")
    # as the search builds them: query, key and value as one linear (compiler._siblings)
    sib = Fusion(linear_siblings=True)
    families: list[Family] = [
        ("fp32 inductor", Recipe(backend=inductor, fusion=sib), False),
        ("bf16 inductor", Recipe(quantization=Quantization.of({"_default": "bf16"}), backend=inductor,
                                 fusion=sib), False),
        ("int8 dynamic", Recipe(quantization=Quantization.of({"_default": "int8-dynamic-pc"}),
                                backend=inductor, fusion=sib), False),
        ("int8 static (pt2e)", Recipe(quantization=Quantization.of(static), backend=inductor,
                                      fusion=sib), False),
        ("int8 static (pt2e), max-autotune",
         Recipe(quantization=Quantization.of(static), backend=Backend("inductor", "max-autotune"),
                fusion=sib), False),
        *([("int8 static (pt2e), bf16 between (autocast)",
            Recipe(quantization=Quantization.of(static),
                   backend=Backend("inductor", autocast="bf16"), fusion=sib), False),
           ("int8 static (pt2e), max-autotune, bf16 between (autocast)",
            Recipe(quantization=Quantization.of(static),
                   backend=Backend("inductor", "max-autotune", "bf16"), fusion=sib), False)]
          if probe().features.get("amx_bf16") else []),  # offered where AMX is (see the search)
        (f"int8 static, {len(keep)} most sensitive fp32",
         Recipe(quantization=Quantization.of({**static, **{n: "fp32" for n in keep}}), backend=inductor,
                fusion=sib), False),
        (f"int8 static, {len(keep)} most sensitive bf16",
         Recipe(quantization=Quantization.of({**static, **{n: "bf16" for n in keep}}),
                backend=inductor, fusion=sib), False),
        (f"int8 static, {len(keep)} most sensitive dynamic",
         Recipe(quantization=Quantization.of({**static, **{n: "int8-dynamic-pc" for n in keep}}),
                backend=inductor, fusion=sib), False),
        *peers(Quantization.of({"_default": "int8-dynamic-pc"})),
    ]
    if args.quick:
        families = [families[0], families[3], *[f for f in families if f[2]]]
    result: dict[str, Any] = {"minilm_sensitive_layers": keep}
    best_b1: str | None = None
    for batch, evals, refs in ((1, eval_b1, refs_b1), (8, eval_b8, refs_b8)):
        batch_rows: list[dict[str, Any]] = []
        for name, recipe, peer in families:
            progress(f"MiniLM batch {batch}: building {name} ({recipe.label()})")
            t0 = time.monotonic()
            variant = build(model, recipe, calibration=calib, example=evals[0])
            warm(variant, evals[:1], rounds=1)
            build_s = time.monotonic() - t0
            cos = fidelity("cosine", refs, outputs(variant.module, evals))
            progress(f"  built in {build_s:.0f}s, cosine {cos:.4f}; timing batch {batch}")
            tm = timed(model, variant.module, evals, args.seconds)
            row = {"model": "minilm", "batch": batch, "family": name, "recipe": recipe.label(), "peer": peer,
                   "speedup": tm["speedup"], "ci": tm["ci"], "ms": tm["ms"], "fp32_ms": tm["base_ms"],
                   "fidelity": cos, "cosine": cos, "metric": "cosine", "build_s": build_s,
                   "kernels": variant.report.kernel_paths.get("<compiled>", ""),
                   "paths": sorted({p.split("; ")[-1] for k, p in variant.report.kernel_paths.items()
                                    if not k.startswith("<")})}
            del variant  # before the next one is built (MiniLM variants are large)
            gc.collect()
            batch_rows.append(row)
            progress(f"  {tm['speedup']:.2f}x ({tm['ms']:.2f} ms vs {tm['base_ms']:.2f} ms)")
        rows.extend(batch_rows)
        result.update(summary(f"minilm_b{batch}", batch_rows))
        by_family = {r["family"]: r for r in batch_rows}
        ort = by_family.get("ONNX Runtime int8 per-channel")
        if batch == 1:
            best = max((r for r in batch_rows if r["cosine"] >= 0.99 and not r["peer"]),
                       key=lambda r: r["speedup"], default=None)
            result.update({
                "minilm_b1_best_cosine": best["fidelity"] if best else None,
                "minilm_b1_best_recipe": best["recipe"] if best else None,
                "minilm_b1_ort_int8_speedup": ort["speedup"] if ort else None,
                "minilm_b1_ort_int8_cosine": ort["fidelity"] if ort else None,
            })
            best_b1 = best["family"] if best else None
        else:  # the keys earlier runs wrote: batch 1's best family, fp32 compiled, the ONNX peer
            for key, name in (("best", best_b1), ("fp32_inductor", "fp32 inductor"),
                              ("ort_int8", "ONNX Runtime int8 per-channel")):
                if name in by_family:
                    result[f"minilm_b8_{key}_speedup"] = by_family[name]["speedup"]
                    result[f"minilm_b8_{key}_cosine"] = by_family[name]["fidelity"]
    return result


# --------------------------------------------------------------------------- digits CNN


def cnn(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from compiler.parts import Layout
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

    def logits(module: Callable[..., Any], size: int) -> torch.Tensor:
        bs, n = batches(size)
        with torch.inference_mode():
            return torch.cat([module(*a) for a, _ in bs])[:n]

    def accuracy(out: torch.Tensor) -> float:
        return float((out.argmax(-1) == y_test).float().mean())

    fp32_logits = {1: logits(model, 1), 256: logits(model, 256)}
    fp32_acc = accuracy(fp32_logits[256])
    progress(f"  fp32 test accuracy {fp32_acc:.4f} ({n_test} images)")
    static = Quantization.of({"_default": "int8-static-pc"})
    inductor = Backend("inductor")
    families: list[Family] = [
        ("fp32 inductor", Recipe(backend=inductor), False),
        ("fp32 fused, channels_last, inductor",
         Recipe(fusion=Fusion(True, True), layout=Layout("channels_last"), backend=inductor), False),
        ("bf16 inductor", Recipe(quantization=Quantization.of({"_default": "bf16"}), backend=inductor), False),
        ("int8 static (pt2e)", Recipe(quantization=static, backend=inductor), False),
        ("int8 static (pt2e), max-autotune",
         Recipe(quantization=static, backend=Backend("inductor", "max-autotune")), False),
        *([("int8 static (pt2e), max-autotune, bf16 between (autocast)",
            Recipe(quantization=static, backend=Backend("inductor", "max-autotune", "bf16")),
            False)]
          if probe().features.get("amx_bf16") else []),
        *peers(static),
    ]
    gemms = Fusion(conv_bn=True, conv_gemm=True)  # batch 1 only: at 256 (16 384 GEMM rows)
    b1_only: list[Family] = [  # the build keeps every convolution a convolution
        ("fp32, convs as GEMMs, max-autotune",
         Recipe(fusion=gemms, backend=Backend("inductor", "max-autotune")), False),
        ("int8 static (pt2e), convs as GEMMs, max-autotune",
         Recipe(fusion=gemms, quantization=static, backend=Backend("inductor", "max-autotune")),
         False),
        *([("fp32, convs as GEMMs, max-autotune, bf16 autocast",
            Recipe(fusion=gemms, backend=Backend("inductor", "max-autotune", "bf16")), False)]
          if probe().features.get("amx_bf16") else []),
    ]
    if args.quick:
        families = [families[0], families[3], *[f for f in families if f[2]]]
        b1_only = b1_only[1:2]
    result: dict[str, Any] = {"cnn_fp32_accuracy": fp32_acc}
    for batch in (1, 256):
        inputs = batches(batch)[0][:64] if batch == 1 else batches(batch)[0]
        batch_rows: list[dict[str, Any]] = []
        for name, recipe, peer in families + (b1_only if batch == 1 else []):
            progress(f"CNN batch {batch}: {name}")
            variant = build(model, recipe, calibration=calib, example=inputs[0])
            warm(variant, inputs[:1], rounds=1)
            out = logits(variant.module, batch)
            acc = accuracy(out)
            cos = fidelity("cosine", [fp32_logits[batch]], [out])
            tm = timed(model, variant.module, inputs, args.seconds)
            batch_rows.append({"model": "cnn", "batch": batch, "family": name, "recipe": recipe.label(), "peer": peer,
                               "speedup": tm["speedup"], "ci": tm["ci"], "ms": tm["ms"], "fp32_ms": tm["base_ms"],
                               "fidelity": acc, "cosine": cos, "metric": "accuracy",
                               "kernels": variant.report.kernel_paths.get("<compiled>", "")})
            del variant
            gc.collect()
            progress(f"  {tm['speedup']:.2f}x ({tm['ms']:.3f} ms vs {tm['base_ms']:.3f} ms), accuracy {acc:.4f}, "
                     f"cosine {cos:.5f}")
            tag = {"int8 static (pt2e)": "int8", "ONNX Runtime int8 per-channel": "ort_int8"}.get(name)
            if tag:
                result[f"cnn_b{batch}_{tag}_speedup"] = tm["speedup"]
                result[f"cnn_b{batch}_{tag}_accuracy"] = acc
        rows.extend(batch_rows)
        result.update(summary(f"cnn_b{batch}", batch_rows))
    return result


# --------------------------------------------------------------------------- table


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def table(rows: list[dict[str, Any]]) -> str:
    head = "| model | batch | recipe family | speedup vs fp32 eager (95% CI) | latency ms (fp32) | fidelity |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        fid = f"cos {r['cosine']:.4f}"
        if r["metric"] == "accuracy":
            fid = f"acc {r['fidelity']:.4f}, {fid}"
        family = f"{r['family']} (peer)" if r["peer"] else r["family"]
        lines.append(
            f"| {'MiniLM' if r['model'] == 'minilm' else 'digits CNN'} | {r['batch']} | {family} | "
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
    result: dict[str, Any] = {
        "hardware": hw.summary(), "threads": args.threads, "torch": torch.__version__,
        "isa": {**hw.features, "torch_cpu_capability": hw.torch_cpu_capability},
        "versions": {m: _version(m) for m in ("onnxruntime", "openvino", "nncf")},
    }
    if openvino_backends():
        from compiler._openvino import default_precision

        result["openvino_default_precision"] = default_precision()
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
    for prefix in ("minilm_b1", "minilm_b8", "cnn_b1", "cnn_b256"):
        over = result.get(f"{prefix}_best_over_peers")
        if over is not None:
            print(f"{prefix}: pgc's best at cosine >= 0.99 {result[f'{prefix}_best_speedup_cos099']:.2f}x "
                  f"({result[f'{prefix}_best_recipe_cos099']}), best peer {result[f'{prefix}_best_peer_cos099']}: "
                  f"pgc / peer = {over:.2f}")
    if "cnn_b256_int8_speedup" in result:
        print(f"digits CNN batch 256: static int8 {result['cnn_b256_int8_speedup']:.2f}x, accuracy "
              f"{result['cnn_b256_int8_accuracy']:.4f} vs fp32 {result['cnn_fp32_accuracy']:.4f}.")
    print(f"({result['seconds']:.0f} s)")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

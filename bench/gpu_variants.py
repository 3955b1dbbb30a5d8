"""On one GPU: how fast are pgc's GPU variants against ``torch.compile`` in fp16 with
max-autotune, at the same fidelity?

Cases: MiniLM (all-MiniLM-L6-v2, 128 tokens) at batch 1 and 64, and a ResNet-50-shaped
convnet (transformers' ``ResNetConfig()``: bottleneck blocks 3-4-6-3, random weights) at batch
32 on 224x224 images. Per case, in one run:

- ``fp32``: the model as it is (the fidelity reference);
- ``compiled fp16``, the peer: the model in fp16 through ``torch.compile(mode="max-autotune")``
  (Inductor's autotuned GEMMs and convolutions, CUDA graphs);
- pgc's candidates: the recipes pgc's search tries first for a model on this GPU
  (``Space.gpu_baselines``: fp32 compiled, then fp16, bf16, fp8 where the GPU has float8
  tensor cores, and int8 weight-only through pgc's Triton kernel, through max-autotune), each
  built by ``compiler.build`` as the search builds it (an AOTInductor package).

Every arm is called in rounds, the order shuffled each round, each call timed with CUDA events
around it (median ms per call). Fidelity against fp32 on the same inputs: mean cosine of the
outputs (MiniLM's embeddings), top-1 agreement (the convnet). pgc's best is its fastest
candidate at cosine >= 0.99 (top-1 agreement >= 99.7% for the convnet); ``over_compiled_fp16``
is the peer's ms over it (target 1.25). Builds that do not fit the time budget are left out
and named. Exits 2 without a CUDA device. ``--json`` prints one JSON object as the last line.

    python bench/gpu_variants.py [--json] [--cases minilm_b1,minilm_b64,resnet50_b32]
                                 [--budget-s 220] [--rounds 30]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ("minilm_b1", "minilm_b64", "resnet50_b32")
TARGET = 1.25
MIN_COSINE = 0.99
MIN_TOP1 = 0.997
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", file=sys.stderr, flush=True)


class Logits(nn.Module):
    """transformers' image classifier, answering its logits (a tensor, as servers use it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values).logits


def load(case: str, device: str = "cuda") -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The fp32 model on ``device`` and a few inputs of the case's batch."""
    if case.startswith("minilm"):
        from pgc_daemon.examples import minilm  # noqa: PLC0415

        stream = minilm.traffic(seed=5, batch=int(case.split("_b")[1]))
        return minilm.load_model().to(device).eval(), [
            tuple(t.to(device) for t in next(stream)) for _ in range(4)]
    from transformers import ResNetConfig, ResNetForImageClassification  # noqa: PLC0415

    torch.manual_seed(0)  # ResNetConfig() has ResNet-50's blocks; random weights, no download
    net = ResNetForImageClassification(ResNetConfig(num_labels=1000))
    model = Logits(net).to(device).eval()
    return model, [(torch.randn(32, 3, 224, 224, device=device),) for _ in range(4)]


def fidelity(case: str, ref: list[torch.Tensor], out: list[torch.Tensor]) -> dict[str, float]:
    if case.startswith("resnet"):
        agree = [float((r.argmax(-1) == o.argmax(-1)).float().mean()) for r, o in zip(ref, out)]
        return {"top1": statistics.fmean(agree)}
    cos = [float(nn.functional.cosine_similarity(r.float(), o.float(), dim=-1).mean())
           for r, o in zip(ref, out)]
    return {"cosine": statistics.fmean(cos)}


def faithful(case: str, fid: dict[str, float]) -> bool:
    return fid.get("top1", 1.0) >= MIN_TOP1 and fid.get("cosine", 1.0) >= MIN_COSINE


def peer(model: nn.Module) -> nn.Module:
    """The model in fp16 through ``torch.compile(mode="max-autotune")``, inputs cast to fp16."""
    half = copy.deepcopy(model).half()
    compiled = torch.compile(half, mode="max-autotune")

    class Half(nn.Module):
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            cast = [a.half() if a.is_floating_point() else a for a in args]
            return compiled(*cast).float()

    return Half()


def candidates(model: nn.Module) -> list[Any]:
    """The recipes pgc's search tries first for this model where it is (``Space.baselines``:
    on a GPU, its GPU baselines)."""
    from compiler import probe  # noqa: PLC0415
    from pgc_daemon.optimizer.search.space import build_space  # noqa: PLC0415

    space = build_space(model, [], probe())
    return [space.recipe(p) for p in space.baselines()]


def timed(fn: nn.Module, args: tuple[torch.Tensor, ...]) -> float:
    """One call's milliseconds: CUDA events around it on a GPU, the clock elsewhere (the
    script's plumbing is tested on CPU)."""
    if not args[0].is_cuda:
        t0 = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def run_case(case: str, deadline: float, rounds: int) -> dict[str, Any]:
    from compiler import build  # noqa: PLC0415

    model, inputs = load(case)
    arms: dict[str, nn.Module] = {"fp32": model}
    built_s: dict[str, float] = {}
    skipped: dict[str, str] = {}
    with torch.inference_mode():
        ref = [model(*x).float() for x in inputs]
        t = time.monotonic()
        arms["compiled fp16"] = peer(model)
        arms["compiled fp16"](*inputs[0])  # compiles (autotunes) here
        built_s["compiled fp16"] = time.monotonic() - t
        log(f"{case}: compiled fp16 (max-autotune) in {built_s['compiled fp16']:.0f} s")
        for recipe in candidates(model):
            label = recipe.label()
            if time.monotonic() > deadline:
                skipped[label] = "out of the time budget"
                continue
            t = time.monotonic()
            try:
                variant = build(model, recipe, calibration=[(x, {}) for x in inputs],
                                example=(inputs[0], {}))
                variant.module(*inputs[0])
            except Exception as exc:  # noqa: BLE001 - a build that fails is a result too
                skipped[label] = f"{type(exc).__name__}: {str(exc)[:200]}"
                log(f"{case}: {label} failed: {skipped[label]}")
                continue
            arms[label] = variant.module
            built_s[label] = time.monotonic() - t
            log(f"{case}: {label} built in {built_s[label]:.0f} s")
        fid = {name: fidelity(case, ref, [fn(*x).float() for x in inputs])
               for name, fn in arms.items()}
        ms: dict[str, list[float]] = {name: [] for name in arms}
        rng = random.Random(0)
        for r in range(rounds + 3):
            order = list(arms)
            rng.shuffle(order)
            for name in order:
                took = timed(arms[name], inputs[r % len(inputs)])
                if r >= 3:  # warm-up rounds
                    ms[name].append(took)
    med = {name: statistics.median(v) for name, v in ms.items()}
    ours = [n for n in arms if n not in ("fp32", "compiled fp16") and faithful(case, fid[n])]
    best = min(ours, key=med.__getitem__) if ours else None
    out = {
        "arms": {n: {"ms": round(med[n], 4), **{k: round(v, 5) for k, v in fid[n].items()},
                     "built_s": round(built_s.get(n, 0.0), 1)} for n in arms},
        "skipped": skipped,
        "pgc_best": best,
        "over_compiled_fp16": round(med["compiled fp16"] / med[best], 3) if best else None,
        "over_fp32": round(med["fp32"] / med[best], 3) if best else None,
        "peer_faithful": faithful(case, fid["compiled fp16"]),
    }
    log(f"{case}: pgc best {best} {out['over_compiled_fp16']}x over compiled fp16")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {CASES}")
    ap.add_argument("--budget-s", type=float, default=220.0,
                    help="seconds for all builds (default 220: the run stays under 4 minutes)")
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds per case (default 30)")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases) or args.rounds < 1 or args.budget_s <= 0:
        ap.error(f"--cases takes {', '.join(CASES)}; --rounds and --budget-s must be positive")
    if not torch.cuda.is_available():
        print("gpu_variants: no CUDA device here; run it on a machine with one GPU.")
        if args.json:
            print(json.dumps({"gpu": None, "ran": False}))
        return 2
    from threads import cpu_isa  # noqa: PLC0415

    name, cap = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
    log(f"{name} (sm {cap[0]}.{cap[1]}), torch {torch.__version__}")
    results: dict[str, Any] = {}
    for i, case in enumerate(cases):  # each case gets its share of what is left
        left = args.budget_s - (time.monotonic() - T0)
        deadline = time.monotonic() + left / (len(cases) - i)
        try:
            results[case] = run_case(case, deadline, args.rounds)
        except Exception as exc:  # noqa: BLE001 - one case failing leaves the others
            results[case] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log(f"{case}: failed: {results[case]['error']}")
        torch.cuda.empty_cache()
    ratios = [r["over_compiled_fp16"] for r in results.values() if r.get("over_compiled_fp16")]
    summary = {"gpu": name, "capability": f"{cap[0]}.{cap[1]}", "ran": True,
               "torch": torch.__version__, "cpu": cpu_isa(), "cases": results,
               "target": TARGET, "min_over_compiled_fp16": min(ratios) if ratios else None,
               "met": bool(ratios) and len(ratios) == len(cases) and min(ratios) >= TARGET,
               "seconds": round(time.monotonic() - T0, 1)}
    for case, r in results.items():
        print(f"{case}: " + ("; ".join(f"{n} {a['ms']:.3f} ms" for n, a in r["arms"].items())
                             if "arms" in r else r["error"]))
        if r.get("pgc_best"):
            print(f"  pgc best: {r['pgc_best']}, {r['over_compiled_fp16']}x compiled fp16 "
                  f"(max-autotune), {r['over_fp32']}x fp32")
    if args.json:
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check of pgc's Triton kernel: fused int8 weight-only linear (dequantize + matmul + bias
+ activation) against the paths it competes with, on one GPU, in well under 3 minutes.

    python bench/gpu_triton_check.py [--json] [--quick]

For each shape (tokens M x in K x out N, the linear layers of MiniLM and of a 7B LLM):
correctness against a float reference, and the median time (triton.testing.do_bench) of
- ``fp16``: ``F.linear`` on fp16 weights (cuBLAS), the speed to beat;
- ``dequant+fp16``: int8 weights dequantized by torch, then cuBLAS (the naive int8 path);
- ``inductor``: the same dequant+matmul compiled by Inductor (what pgc's torchao weight-only
  path compiles to);
- ``pgc-triton``: pgc's kernel (the operator ``torch.ops.pgc.int8_weight_only_linear``);
- in a CUDA graph (``graph_ms``): fp16 and pgc's kernel replayed, and both compiled by
  ``torch.compile(mode="reduce-overhead")`` (``compiled_ms``), where Inductor launches the
  kernel from its generated code inside torch's own CUDA graphs.
``--json`` prints one JSON object as the last line. Without a CUDA device it says so and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SHAPES = [  # (M, K, N)
    (1, 384, 1536), (1, 1536, 384), (128, 384, 1536),
    (1, 4096, 4096), (16, 4096, 11008), (1, 11008, 4096), (64, 4096, 4096),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--quick", action="store_true", help="three shapes, no Inductor column")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_triton_check: no CUDA device here; run it on a machine with one GPU.")
        if args.json:
            print(json.dumps({"gpu": None, "ran": False}))
        return 0
    import torch.nn.functional as F
    from triton.testing import do_bench, do_bench_cudagraph

    sys.path.insert(0, ".")
    from compiler._triton import (
        _int8_weight_only_linear,
        _shape,
        int8_weight_only_linear,
        quantize_weight,
    )

    started = time.time()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    rows = []
    shapes = SHAPES[:3] if args.quick else SHAPES
    for m, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        w = torch.randn(n, k, device=dev) / k**0.5
        b = torch.randn(n, device=dev, dtype=torch.float16)
        q, s = quantize_weight(w)
        w16 = w.half()
        deq = lambda: F.linear(x, (q.half() * s[:, None].half()), b)
        ref = F.gelu(x.float() @ (q.float() * s[:, None]).T + b.float())
        got = int8_weight_only_linear(x, q, s, b, "gelu")
        chosen = _shape(_int8_weight_only_linear.best_config)  # the autotuner's, this shape
        err = float((got.float() - ref).abs().max() / ref.abs().max())
        ms = {
            "fp16": do_bench(lambda: F.gelu(F.linear(x, w16, b)), warmup=10, rep=50),
            "dequant+fp16": do_bench(lambda: F.gelu(deq()), warmup=10, rep=50),
            "pgc-triton": do_bench(lambda: int8_weight_only_linear(x, q, s, b, "gelu"), warmup=10, rep=50),
        }
        # the same kernels replayed in a CUDA graph: their own time, without Python and
        # launch overhead (which dominate eager calls at these sizes)
        graph = {
            "fp16": do_bench_cudagraph(lambda: F.gelu(F.linear(x, w16, b)), rep=20),
            "pgc-triton": do_bench_cudagraph(lambda: int8_weight_only_linear(x, q, s, b, "gelu"), rep=20),
        }
        compiled = {}
        if time.time() - started < 90:  # the kernel called from Inductor's code, in torch's graphs
            for key, fn in (("fp16", lambda: F.gelu(F.linear(x, w16, b))),
                            ("pgc-triton", lambda: int8_weight_only_linear(x, q, s, b, "gelu"))):
                c = torch.compile(fn, mode="reduce-overhead")
                for _ in range(3):
                    c()
                compiled[key] = do_bench(c, warmup=10, rep=50)
        if not args.quick and time.time() - started < 120:
            compiled = torch.compile(lambda: F.gelu(F.linear(x, q.half() * s[:, None].half(), b)))
            compiled()
            ms["inductor"] = do_bench(compiled, warmup=10, rep=50)
        best_other = min(v for key, v in ms.items() if key != "pgc-triton")
        row = {"shape": [m, k, n], "rel_err": err, "ms": {k2: round(v, 4) for k2, v in ms.items()},
               "triton_vs_best_other": round(best_other / ms["pgc-triton"], 3),
               "graph_ms": {k2: round(v, 4) for k2, v in graph.items()},
               "graph_triton_vs_fp16": round(graph["fp16"] / graph["pgc-triton"], 3),
               "compiled_ms": {k2: round(v, 4) for k2, v in compiled.items()},
               "blocks": dict(zip(("m", "n", "k", "warps", "stages"), chosen, strict=True))}
        rows.append(row)
        cols = "  ".join(f"{k2} {v:7.4f}" for k2, v in ms.items())
        print(f"M={m:<4} K={k:<6} N={n:<6} err {err:.1e}  {cols}  -> triton {row['triton_vs_best_other']:.2f}x vs best other "
              f"(blocks {chosen}); in a CUDA graph fp16 {graph['fp16']:.4f} pgc-triton "
              f"{graph['pgc-triton']:.4f} -> {row['graph_triton_vs_fp16']:.2f}x", flush=True)
    ok = all(r["rel_err"] < 2e-2 for r in rows)
    wins = [r["shape"] for r in rows if r["triton_vs_best_other"] > 1.0]
    graph_wins = [r["shape"] for r in rows if r["graph_triton_vs_fp16"] > 1.0]
    print(f"correct: {ok}; Triton kernel fastest on {len(wins)}/{len(rows)} shapes: {wins}; "
          f"faster than fp16 in a CUDA graph on {len(graph_wins)}/{len(rows)}: {graph_wins}; "
          f"{time.time() - started:.0f} s")
    if args.json:
        print(json.dumps({"gpu": name, "ran": True, "correct": ok, "rows": rows, "triton_wins": wins,
                          "graph_triton_wins": graph_wins}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

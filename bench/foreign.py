"""``pgc optimize`` on models written the way users write them (``bench/_foreign_models.py``):
PyTorch's own transformer layers, dict and tuple outputs, keyword inputs, a GRU, depthwise
convolutions with a squeeze-excite gate, an ``EmbeddingBag`` over integer ids.

Each model is searched by the real command in its own process, at the search's defaults
(every installed backend, 12 trials, drop <= 0.01), as a user would run it. Per model: the
recipe chosen, its speedup over fp32 eager (ratios measured interleaved inside each trial),
the trials that failed to build or run and why, and the wall time. A model whose trials fail
where its recipe family builds on the shipped examples shows a fault pgc has to fix (found
this way: four on ``nn.TransformerEncoder``, see docs/DESIGN.md).

    python bench/foreign.py [--models encoder,gru] [--trials 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from bench._foreign_models import SPECS  # noqa: E402
from compiler import probe  # noqa: E402


def search(model: str, trials: int, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent))
    cmd = [sys.executable, "-m", "pgc_daemon.cli", "optimize", f"bench._foreign_models:{model}",
           "--trials", str(trials), "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                             cwd=ROOT.parent)
    except subprocess.TimeoutExpired:
        return {"model": model, "ok": False, "error": f"no answer in {timeout_s:.0f} s"}
    wall = round(time.monotonic() - started, 1)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": model, "ok": False, "error": f"exit {out.returncode}: {tail}",
                "wall_s": wall}
    data = json.loads(lines[-1])
    return {"model": model, "ok": True, "chosen": data["label"], "speedup": data["speedup"],
            "accuracy_drop": data["accuracy_drop"], "metric": data["metric"],
            "baseline_ms": data["baseline_ms"], "trials": data["trials"],
            "failed": data["failed"], "trial_s_median": data["trial_s_median"], "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SPECS),
                        help=f"comma-separated, of {', '.join(SPECS)}")
    parser.add_argument("--trials", type=int, default=12,
                        help="trials per search (12, the default)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per model (1200)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(SPECS))
    if unknown:
        print(f"foreign: unknown model(s) {', '.join(unknown)}; choose from {', '.join(SPECS)}",
              file=sys.stderr)
        return 2
    hw = probe()
    print(f"{hw.summary()}; {args.trials} trials a model", file=sys.stderr, flush=True)
    started = time.monotonic()
    rows = []
    for model in models:
        row = search(model, args.trials, args.timeout)
        rows.append(row)
        if row["ok"]:
            fails = "; ".join(f"{f['label']}: {f['message'][:120]}" for f in row["failed"])
            print(f"{model}: {row['chosen']} {row['speedup']:.2f}x "
                  f"(drop {row['accuracy_drop']:.4f}, {row['metric']}), "
                  f"{row['trials']} trials in {row['wall_s']} s, "
                  f"{len(row['failed'])} failed{': ' + fails if fails else ''}",
                  file=sys.stderr, flush=True)
        else:
            print(f"{model}: {row['error']}", file=sys.stderr, flush=True)
    result = {
        "hardware": hw.summary(),
        "isa": {**hw.features, "torch_cpu_capability": hw.torch_cpu_capability},
        "models": rows,
        "searches_ok": sum(r["ok"] for r in rows),
        "failed_trials": sum(len(r.get("failed", [])) for r in rows),
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

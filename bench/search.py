"""How fast does each search strategy find a good variant?

Trials and wall time until a strategy has found a feasible variant within 5% of the best
feasible latency, for pgc's profile-guided search (hot layers from the live profile, baselines
enqueued first, quick accuracy check before timing, TPE), Optuna's random search, and a grid
over the same space, on MiniLM (batch 1, 128 tokens), over several seeds.

Method (a tabular benchmark): every recipe of the space is built, compiled and measured once
for real, in this run (candidate and fp32 eager interleaved; accuracy on 64 real sentences),
with the seconds each step took. The strategies are then replayed over that table: a trial
costs what its steps really cost (a trial pruned on the quick accuracy check never pays for
compilation beyond the build or for timing). The table is cached under bench/.cache (keyed by
hardware, versions, model and space); ``--fresh`` measures again.

    python bench/search.py [--seeds 7] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from compiler import Recipe, probe  # noqa: E402
from compiler.fingerprint import fingerprint  # noqa: E402
from pgc_daemon.policy import Policy  # noqa: E402
from pgc_daemon.optimizer.search.evaluate import Evaluator, QuickStep, quick_verdict  # noqa: E402
from pgc_daemon.optimizer.search.prepare import (  # noqa: E402
    _most_sensitive,
    measure_sensitivity,
    offline_profile,
    timing_inputs_for,
)
from pgc_daemon.optimizer.search.space import Space, build_space  # noqa: E402
from pgc_daemon.optimizer.search.study import Search, TrialRecord  # noqa: E402

TARGET = 1.05  # within 5% of the best feasible latency
CHOICES = ("fp32", "int8-static-pc", "int8-dynamic-pc", "int8-dynamic-pt")


def load_model(name: str) -> tuple[torch.nn.Module, list[Any]]:
    if name == "minilm":
        from pgc_daemon.examples import minilm

        stream = minilm.traffic(seed=7)
        return minilm.load_model(), [(next(stream), {}) for _ in range(64)]
    from pgc_daemon.examples import digits

    spec = digits.mlp()
    return spec["model"], [(a, {}) for a in spec["example_inputs"]]


def build_table(space: Space, search: Search, progress: Any) -> dict[str, dict[str, Any]]:
    """Measure every recipe of the space once, completely (no pruning), with step times."""
    table: dict[str, dict[str, Any]] = {}
    grid = list(space.grid())
    task = progress.add_task("measuring the space", total=len(grid))
    keep = search.policy
    # measure everything fully: a policy that never prunes
    search.policy = Policy(max_accuracy_drop=1.0, max_trials=1)
    try:
        for params in grid:
            recipe = space.recipe(params)
            if recipe.hash in table:
                progress.advance(task)
                continue
            rec = search._evaluate(len(table), params, recipe)
            table[recipe.hash] = {
                "label": rec.label,
                "params": params,
                "state": rec.state,
                "ratio": rec.ratio,
                "drop": rec.drop,
                "fidelity": rec.fidelity,
                "quick_drop": rec.quick_drop,
                "quick_steps": rec.quick_steps,
                "phases": rec.phases,
                "message": rec.message,
            }
            progress.update(task, advance=1, description=f"measured {rec.label}: {rec.message}"[:70])
    finally:
        search.policy = keep
    return table


#: Bumped when a table records something new, so older cached tables are measured again.
TABLE_VERSION = 2


def replay_evaluate(table: dict[str, dict[str, Any]], policy: Policy, prune: bool):
    """A Search ``evaluate`` that looks recipes up in the table instead of measuring."""

    def evaluate(number: int, params: dict[str, Any], recipe: Recipe) -> TrialRecord:
        e = table[recipe.hash]
        rec = TrialRecord(
            number=number, state="failed", params=dict(params), recipe=recipe.to_dict(),
            recipe_hash=recipe.hash, label=recipe.label(), message=e["message"],
        )
        ph = e["phases"]
        if e["state"] != "complete":
            rec.duration_s = sum(ph.values())
            return rec
        steps = [QuickStep(*step) for step in e.get("quick_steps") or []]
        pruned, step = quick_verdict(steps, policy.max_accuracy_drop) if steps else (False, None)
        if prune and pruned:
            rec.state, rec.drop = "pruned", step.drop
            rec.duration_s = ph.get("build", 0) + ph.get("warm", 0) + ph.get("quick", 0)
            return rec
        rec.state = "complete"
        rec.ratio, rec.speedup = e["ratio"], 1 / e["ratio"]
        rec.drop, rec.fidelity = e["drop"], e["fidelity"]
        rec.feasible = e["drop"] <= policy.max_accuracy_drop
        rec.duration_s = sum(ph.values())
        return rec

    return evaluate


def trials_to_target(records: list[TrialRecord], best: float) -> tuple[int | None, float]:
    """(distinct trials, seconds) until a feasible trial within TARGET of ``best``."""
    spent = 0.0
    for i, r in enumerate(records, start=1):
        spent += r.duration_s
        if r.state == "complete" and r.feasible and r.ratio <= best * TARGET:
            return i, spent
    return None, spent


def run_strategy(
    name: str, space: Space, pgc_space: Space, sensitive: list[str], table: dict[str, Any],
    policy: Policy, base: Any, evaluator: Any, seed: int, cap: int, best: float,
) -> tuple[int | None, float]:
    records: list[TrialRecord] = []

    def on_trial(rec: TrialRecord, done: int, budget: int) -> None:
        records.append(rec)

    pgc = name == "pgc"
    search = Search(
        base=base, space=pgc_space if pgc else space, policy=policy, evaluator=evaluator,
        timing_inputs=[], calibration=[], storage=None, name=f"bench-{name}-{seed}", seed=seed,
        on_trial=on_trial,
        sampler=None if pgc else optuna.samplers.RandomSampler(seed=seed),
        evaluate=replay_evaluate(table, policy, prune=pgc),
    )
    if pgc:
        search.enqueue(pgc_space.baselines(sensitive))
    search.run(cap)
    return trials_to_target(records, best)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["minilm", "mlp"], default="minilm")
    ap.add_argument("--seeds", type=int, default=7)
    ap.add_argument("--max-hot", type=int, default=2, help="hot layers with their own choice")
    ap.add_argument("--max-drop", type=float, default=0.01)
    ap.add_argument("--fresh", action="store_true", help="measure the table again")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=True)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.monotonic()
    base, inputs = load_model(args.model)
    profile = offline_profile(base, inputs)
    hw = probe()
    # pgc's own view: hot layers and pruned choices from sensitivity, measured in this run
    t_sens = time.monotonic()
    report = measure_sensitivity(base, inputs, profile, metric="cosine" if args.model == "minilm" else None)
    sens_s = time.monotonic() - t_sens
    pgc_space = build_space(
        base, profile, hw, max_hot=args.max_hot, sensitivity=report, max_drop=args.max_drop,
        choices=CHOICES, backends=("inductor", "eager"),
    )
    sensitive = _most_sensitive(report, pgc_space.hot_layers, args.max_drop)
    # the same space without pgc's pruning: what random search and the grid explore
    space = Space(
        hot_layers=pgc_space.hot_layers,
        layer_choices=CHOICES,
        default_choices=CHOICES,
        backends=("inductor", "eager"),
    )
    choices = CHOICES
    policy = Policy(max_accuracy_drop=args.max_drop, max_trials=space.size)
    evaluator = Evaluator(base, inputs, metric="cosine" if args.model == "minilm" else None)
    key = hashlib.sha256(  # TABLE_VERSION: what a table records (2: the quick check's steps)
        json.dumps([TABLE_VERSION, hw.key(), torch.__version__, fingerprint(base),
                    space.to_dict()]).encode()
    ).hexdigest()[:16]
    cache = ROOT / ".cache" / f"search-table-{args.model}-{key}.json"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        if cache.exists() and not args.fresh:
            table = json.loads(cache.read_text())
            console.print(f"table of {len(table)} measured recipes from {cache}")
        else:
            measurer = Search(
                base=base, space=space, policy=policy, evaluator=evaluator,
                timing_inputs=timing_inputs_for(inputs, {}), calibration=inputs,
                storage=None, name="bench-table",
            )
            table = build_table(space, measurer, progress)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(table))
        feasible = [e for e in table.values() if e["state"] == "complete" and e["drop"] <= args.max_drop]
        best = min([1.0] + [e["ratio"] for e in feasible])  # fp32 eager itself is feasible
        best_label = next((e["label"] for e in feasible if e["ratio"] == best), "fp32 · eager")
        grid_trials = next(
            (i for i, p in enumerate(space.grid(), 1)
             if (e := table[space.recipe(p).hash])["state"] == "complete"
             and e["drop"] <= args.max_drop and e["ratio"] <= best * TARGET),
            None,
        )
        grid_wall = 0.0
        for i, p in enumerate(space.grid(), 1):
            grid_wall += sum(table[space.recipe(p).hash]["phases"].values())
            if i == grid_trials:
                break
        results: dict[str, list[tuple[int | None, float]]] = {"pgc": [], "random": []}
        task = progress.add_task("replaying strategies", total=2 * args.seeds)
        for seed in range(args.seeds):
            for name in ("pgc", "random"):
                trials, wall = run_strategy(
                    name, space, pgc_space, sensitive, table, policy, base, evaluator, seed,
                    3 * space.size, best,
                )
                results[name].append((trials, wall + (sens_s if name == "pgc" else 0.0)))
                progress.advance(task)

    def med(xs: list[tuple[int | None, float]], i: int) -> float:
        vals = [x[i] if x[i] is not None else math.inf for x in xs]
        return statistics.median(vals)

    out = {
        "model": args.model,
        "space_size": space.size,
        "hot_layers": list(space.hot_layers),
        "choices": list(choices),
        "best_feasible_label": best_label,
        "best_feasible_speedup": 1 / best,
        "feasible_recipes": len(feasible),
        "pgc_space_size": pgc_space.size,
        "pruned": [list(p) for p in pgc_space.pruned],
        "sensitivity_s": round(sens_s, 1),
        "seeds": args.seeds,
        "pgc_trials_median": med(results["pgc"], 0),
        "random_trials_median": med(results["random"], 0),
        "grid_trials": grid_trials,
        "pgc_wall_s_median": round(med(results["pgc"], 1), 1),
        "random_wall_s_median": round(med(results["random"], 1), 1),
        "grid_wall_s": round(grid_wall, 1),
        "pgc_trials": [r[0] for r in results["pgc"]],
        "random_trials": [r[0] for r in results["random"]],
        "table_measure_s": round(sum(sum(e["phases"].values()) for e in table.values()), 1),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    t = Table(title=f"search efficiency on {args.model}: trials to within 5% of the best feasible "
                    f"({out['best_feasible_label']}, {out['best_feasible_speedup']:.2f}x)")
    for col in ("strategy", "trials (median)", "wall s (median)", "per seed"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    t.add_row("pgc (profile-guided TPE)", f"{out['pgc_trials_median']}", f"{out['pgc_wall_s_median']}", str(out["pgc_trials"]))
    t.add_row("Optuna random", f"{out['random_trials_median']}", f"{out['random_wall_s_median']}", str(out["random_trials"]))
    t.add_row("grid", f"{grid_trials}", f"{out['grid_wall_s']}", "-")
    console.print(t)
    console.print(
        f"space: {space.size} recipes, {len(feasible)} feasible at drop <= {args.max_drop}; "
        f"pgc pruned it to {pgc_space.size} with {sens_s:.0f} s of sensitivity (counted in its wall time)"
    )
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast does each search strategy find a good variant, and what does its prior buy?

Trials and wall time until a strategy has a feasible variant within 5% of the best feasible,
for pgc's profile-guided search and three ablations that separate its prior from its sampler
(``bench/_search_replay.py``: pgc without the baselines, random sampling with pgc's help,
plain random search), over several seeds, in several *scenarios*: policies where the
baselines are the answer and where they are not (a stricter accuracy budget that rules out
all-int8, the most accurate recipe under a latency target).

Method (a tabular benchmark): every recipe of a table's space is built, compiled and measured
once for real, in this run (candidate and fp32 eager interleaved; accuracy on the table's
real inputs), with the seconds each step took; the three fastest feasible recipes are then
timed twice more and keep the median, so "best" is not one noisy pass. The strategies are
replayed over the table: a trial costs what its steps really cost. Tables are cached under
bench/.cache (keyed by hardware, versions, model and space); ``--fresh`` measures again.

    python bench/search.py [--scenarios minilm,minilm_strict,...] [--seeds 7] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from bench._search_replay import (  # noqa: E402
    STRATEGIES,
    Scenario,
    Table,
    replay,
    summarize,
)
from compiler import probe  # noqa: E402
from compiler.fingerprint import fingerprint  # noqa: E402
from pgc_daemon.optimizer.search.evaluate import Evaluator  # noqa: E402
from pgc_daemon.optimizer.search.prepare import (  # noqa: E402
    _most_sensitive,
    measure_sensitivity,
    offline_profile,
    timing_inputs_for,
)
from pgc_daemon.optimizer.search.space import Space, build_space  # noqa: E402
from pgc_daemon.optimizer.search.study import Search  # noqa: E402
from pgc_daemon.policy import Policy  # noqa: E402

CHOICES = ("fp32", "int8-static-pc", "int8-dynamic-pc", "int8-dynamic-pt")
#: The default search budget (``Policy.max_trials``): pgc should be close to the best in it.
BUDGET = 12


@dataclass(frozen=True)
class TableSpec:
    """A model, its inputs and metric, and the space measured for it."""

    load: Callable[[], tuple[torch.nn.Module, list[Any], dict[str, Any]]]
    max_hot: int = 2
    backends: tuple[str, ...] = ("inductor", "eager")


def _minilm() -> tuple[torch.nn.Module, list[Any], dict[str, Any]]:
    from pgc_daemon.examples import minilm

    stream = minilm.traffic(seed=7)
    return minilm.load_model(), [(next(stream), {}) for _ in range(64)], {"metric": "cosine"}


Loaded = tuple[torch.nn.Module, list[Any], dict[str, Any]]


def _digits(kind: str, batch: int) -> Callable[[], Loaded]:
    def load() -> Loaded:
        from pgc_daemon.examples import digits

        spec = digits._cached(kind, batch)
        inputs = [(a, {}) for a in spec["example_inputs"][:64]]
        return spec["model"], inputs, {"accuracy": spec["accuracy"],
                                       "labels": spec["labels"][:64]}

    return load


def _ort() -> tuple[str, ...]:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return ()
    return ("onnxruntime",)


TABLES: dict[str, TableSpec] = {
    "minilm": TableSpec(_minilm),
    "cnn_b1": TableSpec(_digits("cnn", 1), max_hot=1, backends=("inductor", "eager", *_ort())),
    "lstm": TableSpec(_digits("lstm", 16), max_hot=1, backends=("inductor", "eager", *_ort())),
}

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("minilm", "minilm", 0.01, note="MiniLM batch 1, 128 tokens; all-int8 is feasible"),
    Scenario("minilm_strict", "minilm", 0.005,
             note="all-int8 static is infeasible: the answer mixes precisions"),
    Scenario("minilm_most_accurate", "minilm", 0.01, objective="most_accurate",
             target_speedup=2.5, note="the most accurate recipe at least 2.5x fp32"),
    Scenario("cnn_b1", "cnn_b1", 0.01, note="digits CNN at batch 1 (ONNX Runtime in the space)"),
    Scenario("lstm", "lstm", 0.01, note="digits row-LSTM, batch 16"),
)}


def build_table(space: Space, search: Search, progress: Any) -> dict[str, dict[str, Any]]:
    """Measure every recipe of the space once, completely (no pruning), with step times;
    then time the three fastest complete recipes twice more and keep each one's median."""
    table: dict[str, dict[str, Any]] = {}
    grid = list(space.grid())
    task = progress.add_task("measuring the space", total=len(grid) + 6)
    keep = search.policy
    search.policy = Policy(max_accuracy_drop=1.0, max_trials=1)  # a policy that never prunes
    try:
        for params in grid:
            recipe = space.recipe(params)
            if recipe.hash in table:
                progress.advance(task)
                continue
            rec = search._evaluate(len(table), params, recipe)
            table[recipe.hash] = {
                "label": rec.label, "params": params, "state": rec.state, "ratio": rec.ratio,
                "ratios": [rec.ratio], "drop": rec.drop, "fidelity": rec.fidelity,
                "quick_drop": rec.quick_drop, "quick_steps": rec.quick_steps,
                "phases": rec.phases, "message": rec.message, "recipe": rec.recipe,
                "baseline_ms": rec.baseline_ms,
            }
            progress.update(task, advance=1,
                            description=f"measured {rec.label}: {rec.message}"[:70])
            if not progress.console.is_terminal:  # no live bar in a log: a line per recipe
                progress.console.print(f"[{len(table)}/{len(grid)}] {rec.label}: {rec.message}")
        top = sorted((e for e in table.values() if e["state"] == "complete"),
                     key=lambda e: e["ratio"])[:3]
        for e in top:
            from compiler import Recipe

            for _ in range(2):
                again = search._evaluate(len(table), e["params"], Recipe.from_dict(e["recipe"]))
                if again.state == "complete":
                    e["ratios"].append(again.ratio)
                progress.update(task, advance=1, description=f"re-timed {e['label']}"[:70])
            e["ratio"] = statistics.median(e["ratios"])
    finally:
        search.policy = keep
    return table


#: Bumped when a table records something new, so older cached tables are measured again
#: (3: fp32's latency and the top three re-timed).
TABLE_VERSION = 3


@dataclass
class Prepared:
    """A table and what pgc's strategies bring to it (the pruned spaces per budget are made
    per scenario from the same sensitivity report)."""

    spec: TableSpec
    model: torch.nn.Module
    inputs: list[Any]
    metric_kwargs: dict[str, Any]
    profile: list[dict[str, Any]]
    report: Any
    sensitivity_s: float
    full: Space
    table: Table
    measure_s: float


def prepare_table(name: str, fresh: bool, progress: Any, console: Any) -> Prepared:
    spec = TABLES[name]
    model, inputs, kwargs = spec.load()
    profile = offline_profile(model, inputs)
    hw = probe()
    started = time.monotonic()
    report = measure_sensitivity(model, inputs, profile, metric=kwargs.get("metric"))
    sens_s = time.monotonic() - started
    hot_space = build_space(model, profile, hw, max_hot=spec.max_hot, sensitivity=report,
                            max_drop=1.0, choices=CHOICES, backends=spec.backends)
    full = Space(hot_layers=hot_space.hot_layers, layer_choices=CHOICES,
                 default_choices=CHOICES, backends=spec.backends,
                 graph_choices=hot_space.graph_choices)
    key = hashlib.sha256(json.dumps([TABLE_VERSION, hw.key(), torch.__version__,
                                     fingerprint(model), full.to_dict()]).encode()).hexdigest()[:16]
    cache = ROOT / ".cache" / f"search-table-{name}-{key}.json"
    if cache.exists() and not fresh:
        data = json.loads(cache.read_text())
        console.print(f"table {name}: {len(data['entries'])} measured recipes from {cache}")
    else:
        measurer = Search(
            base=model, space=full, policy=Policy(max_trials=full.size),
            evaluator=Evaluator(model, inputs, **kwargs),
            timing_inputs=timing_inputs_for(inputs, {}), calibration=inputs,
            storage=None, name=f"bench-table-{name}",
        )
        t0 = time.monotonic()
        entries = build_table(full, measurer, progress)
        baseline = statistics.median(e["baseline_ms"] for e in entries.values()
                                     if e.get("baseline_ms"))
        data = {"entries": entries, "baseline_ms": baseline,
                "measure_s": round(time.monotonic() - t0, 1)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(data))
    return Prepared(spec, model, inputs, kwargs, profile, report, sens_s, full,
                    Table(data["entries"], data["baseline_ms"]), data["measure_s"])


def run_scenario(sc: Scenario, prep: Prepared, seeds: int, cap: int) -> dict[str, Any]:
    hw = probe()
    policy = sc.policy(prep.table.baseline_ms, cap)
    pruned = build_space(prep.model, prep.profile, hw, max_hot=prep.spec.max_hot,
                         sensitivity=prep.report, max_drop=sc.max_drop, choices=CHOICES,
                         backends=prep.spec.backends)
    sensitive = _most_sensitive(prep.report, pruned.hot_layers, sc.max_drop)
    best, best_label = prep.table.best(policy)
    spaces = {"pruned": pruned, "full": prep.full}
    runs = {
        st.name: [replay(st, prep.table, policy, spaces, pruned.baselines(sensitive), seed,
                         cap, prep.sensitivity_s, best) for seed in range(seeds)]
        for st in STRATEGIES
    }
    out = summarize(sc.name, runs, policy, best, BUDGET, cap)
    return out | {
        "note": sc.note, "max_drop": sc.max_drop, "objective": sc.objective,
        "latency_target_ms": policy.latency_target_ms, "best_label": best_label,
        "best_speedup": (1 / best) if sc.objective == "fastest" and best > 0 else None,
        "feasible_recipes": len(prep.table.feasible(policy)), "space_size": prep.full.size,
        "pgc_space_size": pruned.size, "sensitivity_s": round(prep.sensitivity_s, 1),
        "table_measure_s": prep.measure_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--seeds", type=int, default=7)
    ap.add_argument("--fresh", action="store_true", help="measure the tables again")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        print(f"error: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2

    import optuna
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table as RichTable

    console = Console(stderr=True)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.monotonic()
    hw = probe()
    results = []
    prepared: dict[str, Prepared] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        for name in names:
            sc = SCENARIOS[name]
            if sc.table not in prepared:
                prepared[sc.table] = prepare_table(sc.table, args.fresh, progress, console)
            prep = prepared[sc.table]
            results.append(run_scenario(sc, prep, args.seeds, 3 * BUDGET))
    ratios = [r["ratio_vs_random_baselines"] for r in results]
    finite = [r for r in ratios if r is not None and math.isfinite(r)]
    out = {
        "cpu": hw.cpu, "features": sorted(k for k, v in hw.features.items() if v),
        "seeds": args.seeds, "budget": BUDGET,
        "worst_ratio": max(finite) if len(finite) == len(ratios) else None,
        "pgc_within_target_at_budget_min": min(r["pgc_within_target_at_budget"] for r in results),
        "scenarios": {r["scenario"]: r for r in results},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    t = RichTable(title="trials (median over seeds) to a feasible recipe within 5% of the best")
    for col in ("scenario", "best", "pgc", "pgc no baselines", "random + baselines", "random",
                "pgc/random+b", f"pgc at {BUDGET}"):
        t.add_column(col, justify="left" if col in ("scenario", "best") else "right")
    for r in results:
        t.add_row(r["scenario"], r["best_label"][:40],
                  *(f"{r[f'{st.name}_trials_median']}" for st in STRATEGIES),
                  f"{r['ratio_vs_random_baselines']:.2f}" if r["ratio_vs_random_baselines"]
                  is not None else "-",
                  f"{r['pgc_within_target_at_budget']:.0%}")
    console.print(t)
    console.print(f"worst pgc/random-with-baselines: {out['worst_ratio']}; machine: {hw.cpu} "
                  f"({', '.join(out['features'])})")
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

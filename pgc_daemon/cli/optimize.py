"""``pgc optimize MODEL_SPEC``: a one-shot search for any model, printing the front and the
chosen recipe (loadable by ``compiler.Recipe.from_json``)."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from pgc_daemon.cli._base import UsageError, add_backends_option, backends_from

ORDER = 40
EXIT_INFEASIBLE = 3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "optimize",
        help="search variants of a model offline (MODEL_SPEC = package.module:function)",
        description="Search the variant space of any model given by a MODEL_SPEC and print the "
        "latency-accuracy front and the chosen recipe. Exit code 3 when nothing is feasible.",
    )
    p.add_argument("spec", metavar="MODEL_SPEC", help="package.module:function")
    p.add_argument("--max-drop", type=float, default=0.01, help="accuracy budget (default 0.01)")
    p.add_argument("--latency-ms", type=float, help="latency target at --percentile")
    p.add_argument("--percentile", choices=["p50", "p95", "p99"], default="p50")
    p.add_argument("--objective", choices=["fastest", "most_accurate"], default="fastest")
    p.add_argument("--trials", type=int, default=12, help="distinct variants to try (default 12)")
    p.add_argument("--time-budget", type=float, default=1800.0, help="seconds (default 1800)")
    p.add_argument("--storage", help="Optuna storage URL to keep (and resume) the study")
    p.add_argument("--seed", type=int, default=0)
    add_backends_option(p)
    p.add_argument(
        "--no-sensitivity", action="store_true", help="skip per-layer sensitivity (faster, blinder)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from pgc_daemon.cli._supervise import optimize_supervised
    from pgc_daemon.errors import PolicyError
    from pgc_daemon.policy import Policy

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    # SIGTERM stops the search's process in order (its trial in flight is withdrawn, not
    # blamed), then this one
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        policy = Policy.parse(
            {
                "max_accuracy_drop": args.max_drop,
                "latency_target_ms": args.latency_ms,
                "latency_percentile": args.percentile,
                "objective": args.objective,
                "max_trials": args.trials,
                "time_budget_s": args.time_budget,
                "backends": backends_from(args),
            }
        )
    except PolicyError as exc:
        raise UsageError(str(exc).removeprefix("invalid policy: ")) from None
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        task = progress.add_task("loading and profiling", total=args.trials)

        def on_trial(rec, done: int, budget: int) -> None:  # type: ignore[no-untyped-def]
            progress.update(task, completed=done, description=f"{rec.label}: {rec.message}"[:80])
            if not console.is_terminal:
                console.print(f"trial {done}/{budget}{rec.origin_note}: {rec.label}: {rec.message}")

        out, crashes = optimize_supervised(
            args.spec, policy, storage=args.storage, seed=args.seed, on_trial=on_trial,
            with_sensitivity=not args.no_sensitivity, on_crash=console.print,
        )
    data = {**out.to_dict(), "crashes": crashes}
    table = Table(title=f"{args.spec}: latency-accuracy front ({data['metric']})")
    for col in ("variant", "speedup", "latency ms", "drop", "feasible"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for t in sorted(out.result.records, key=lambda r: -(r.speedup or 0)):
        if t.state != "complete":
            table.add_row(t.label, "-", "-", f"{t.drop:.4f}" if t.drop is not None else "-", t.state)
            continue
        mark = " *" if t in out.result.front else ""
        table.add_row(
            t.label + mark, f"{t.speedup:.2f}x", f"{t.latency_ms:.3f}", f"{t.drop:.4f}",
            "yes" if t.feasible else "no",
        )
    console.print(table)
    console.print(f"metric: {data['metric_reason']}; * = on the Pareto front")
    for layer, choice, why in data["pruned"][:8]:
        console.print(f"pruned {choice} for {layer}: {why}")
    console.print(f"baseline fp32 eager {data['baseline_ms'] or 0:.3f} ms · {data['message']}")
    if data["trial_s_median"] is not None:
        console.print(f"{len(data['trial_s'])} trials evaluated in {data['elapsed_s']:.0f} s, "
                      f"median {data['trial_s_median']:.1f} s a trial")
    if data["recipe"] is not None:
        console.print("recipe: " + json.dumps(data["recipe"]))
    if args.json:
        print(json.dumps(data), flush=True)
    sys.stderr.flush()
    return 0 if data["feasible"] else EXIT_INFEASIBLE

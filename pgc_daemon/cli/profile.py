"""``pgc profile MODEL_SPEC``: an offline per-layer report, with suggestions.

Every call on the spec's example inputs is profiled per layer through the live profiler's own
code (hooks, perf counters, CUDA events and CUPTI on a GPU), then one torch.profiler pass
measures time lost to layout conversions. Suggestions come from
:mod:`pgc_daemon.services.suggest` (the engine behind the API's profile too): layers (and
repeated roles, such as every block's feed-forward) at 15% of the time or more are
quantization or fusion candidates; op types with a fast int8 (or bf16) path on this hardware,
from ``compiler.probe()``; layout conversions worth removing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pgc_daemon.cli._base import UsageError, clip

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="per-layer profile of a MODEL_SPEC, with suggestions",
        description="Profile every layer of the model a MODEL_SPEC builds, on its example "
        "inputs: latency share (latency_ratio), mean and p95, perf counters, and suggestions.",
    )
    p.add_argument("spec", metavar="MODEL_SPEC", help="package.module:function (see the README)")
    p.add_argument("--rounds", type=int, default=3, help="passes over the inputs (default 3)")
    p.add_argument("--inputs", type=int, default=16, help="example inputs used at most (default 16)")
    p.add_argument("--top", type=int, default=15, help="layers in the table (default 15)")
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads (default: torch's choice; 1 on a busy machine)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    p.add_argument("--no-counters", action="store_true", help="skip perf counters")
    p.add_argument(
        "--sensitivity",
        action="store_true",
        help="also measure each hot layer's sensitivity to int8 (output error with only that "
        "layer changed)",
    )
    p.add_argument(
        "--store",
        dest="store_url",
        help="with --sensitivity: save it for the served models this spec builds (same "
        "fingerprint), where the search reuses it",
    )
    p.add_argument(
        "--recipe",
        metavar="JSON",
        help="profile this variant instead of the fp32 model (a recipe as the API and `pgc "
        "deploy` show it); a compiled (AOTInductor) variant is profiled through its kernels, "
        "an OpenVINO one through OpenVINO's per-node counters, split over the layers each "
        "kernel or node was made from",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.rounds < 1 or args.inputs < 1 or args.top < 1:
        raise UsageError("--rounds, --inputs and --top must be positive")
    if args.store_url and not args.sensitivity:
        raise UsageError("--store goes with --sensitivity")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be positive")
    if args.recipe is not None and args.sensitivity:
        raise UsageError("--sensitivity measures the fp32 model's layers: not with --recipe")


def _variant(args: argparse.Namespace, model: Any, examples: list[Any]) -> tuple[Any, Any, str]:
    """The module to profile, its kernel map (compiled variants) and what it is."""
    if args.recipe is None:
        return model, None, "fp32"
    from compiler import BuildError, Recipe, build  # noqa: PLC0415

    try:
        recipe = Recipe.from_json(args.recipe)
    except Exception as exc:  # noqa: BLE001 - the user's text
        raise UsageError(f"--recipe: not a recipe: {type(exc).__name__}: {exc}") from None
    if recipe.backend.kind == "openvino":
        return _openvino_variant(recipe, model, examples)
    if recipe.backend.kind not in ("eager", "inductor"):
        raise UsageError(f"--recipe: {recipe.label()} has no per-layer view (its backend runs "
                         "outside torch; eager, AOTInductor and OpenVINO variants have one)")
    from compiler._kernel_map import kernel_events  # noqa: PLC0415

    print(f"pgc profile: building {recipe.label()}", file=sys.stderr, flush=True)
    try:
        with kernel_events():  # a package built with kernel events, to attribute them
            built = build(model, recipe, calibration=examples[:8], example=examples[0])
    except BuildError as exc:
        raise UsageError(f"--recipe: {exc}") from None
    if not built.hookable and built.kernel_layers is None:
        raise UsageError(f"--recipe: {recipe.label()} was compiled without a kernel map (not as "
                         "an AOTInductor package): no per-layer view")
    return built.module, built.kernel_layers, recipe.label()


def _openvino_variant(recipe: Any, model: Any, examples: list[Any]) -> tuple[Any, Any, str]:
    """An OpenVINO variant, compiled again with OpenVINO's per-node counters, and which layers
    each of its nodes computes (``compiler._openvino_layers``)."""
    from compiler import BuildError, build  # noqa: PLC0415
    from compiler._openvino import OvModule  # noqa: PLC0415
    from compiler._openvino_layers import node_layers  # noqa: PLC0415
    from profiler import NodeKernels  # noqa: PLC0415

    print(f"pgc profile: building {recipe.label()}", file=sys.stderr, flush=True)
    try:
        built = build(model, recipe, calibration=examples[:8], example=examples[0])
    except BuildError as exc:
        raise UsageError(f"--recipe: {exc}") from None
    if not isinstance(built.module, OvModule):
        raise UsageError(f"--recipe: {recipe.label()} serves through a wrapper around "
                         "OpenVINO (shape buckets): no per-layer view")
    counted = built.module.with_counters()
    layers = node_layers(counted.compiled, model, examples[0], counted.model)
    args, kwargs = examples[0]
    counted(*args, **kwargs)  # the first call allocates: left out of the nodes' times
    counted.count_from_here()
    nodes = NodeKernels(layers, counted.node_times)
    return counted, nodes, recipe.label()


def _to(value: Any, device: str) -> Any:
    import torch  # noqa: PLC0415

    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def suggestions(report: dict[str, Any], hardware: Any) -> list[dict[str, Any]]:
    """What the profile suggests, most valuable first (``pgc_daemon.services.suggest``, the
    engine the API's live profile uses too)."""
    from pgc_daemon.services.suggest import suggest  # noqa: PLC0415

    found = suggest(
        report["layers"],
        groups=report["groups"],
        device=report["device"],
        hardware=hardware,
        layout=report.get("layout") or None,
    )
    return [s.to_dict() for s in found]


def _busy() -> str | None:
    """A description of the load when runnable work exceeds the cores this process may use."""
    import os  # noqa: PLC0415

    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    except OSError:
        return None
    return f"load {load:.1f} on {cores} cores" if load > cores else None


def _progress(enabled: bool) -> Any:
    tty = sys.stderr.isatty()
    state = {"shown": -1}

    def show(done: int, total: int) -> None:
        if not enabled:
            return
        pct = 100 * done // total
        if tty:
            print(f"\rpgc profile: {done}/{total} calls", end="", file=sys.stderr, flush=True)
            if done == total:
                print(file=sys.stderr)
        elif pct // 25 != state["shown"]:
            state["shown"] = pct // 25
            print(f"pgc profile: {done}/{total} calls", file=sys.stderr, flush=True)

    return show


def _counter_text(r: dict[str, Any]) -> str:
    c = r.get("counters") or {}
    d = r.get("derived") or {}
    parts = []
    if "ipc" in d:
        parts.append(f"IPC {d['ipc']:.2f}")
    if "cache_miss_rate" in d:
        parts.append(f"miss {d['cache_miss_rate']:.1%}")
    if "task_clock_ns" in c:
        parts.append(f"cpu {c['task_clock_ns'] / 1e6:.2f}ms")
    if "context_switches" in c:
        parts.append(f"cs {c['context_switches']:.2f}")
    if "page_faults" in c:
        parts.append(f"pf {c['page_faults']:.1f}")
    if "cpu_ms" in c:
        parts.append(f"host {c['cpu_ms']:.2f}ms")
    return " ".join(parts)


def render(report: dict[str, Any], top: int) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(file=sys.stdout, highlight=False, soft_wrap=False,
                      width=None if sys.stdout.isatty() else 160)
    call = report["call"]
    threads = report.get("threads_note") or f"{report['threads']} threads"
    console.print(
        f"[bold]{report['spec']}[/bold] ({report.get('variant', 'fp32')}) on {report['device']} "
        f"({report['hardware']}; {threads}), "
        f"{report['calls']} calls: p50 {call['p50_ms']:.2f} ms, p95 {call['p95_ms']:.2f} ms; "
        f"counters: {report['counters']}"
    )
    table = Table(title=f"hottest layers (of {len(report['layers'])})", title_justify="left")
    for col, just in (("#", "right"), ("layer", "left"), ("op", "left"), ("latency_ratio", "right"),
                      ("mean ms", "right"), ("p95 ms", "right"), ("counters / call", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for i, r in enumerate(report["layers"][:top], 1):
        table.add_row(str(i), clip(r["layer"], 48, tail=True), clip(r["op_type"], 36),
                      f"{r['latency_ratio']:.1%}",
                      f"{r['mean_ms']:.3f}", f"{r['p95_ms']:.3f}", _counter_text(r))
    console.print(table)
    groups = [g for g in report["groups"] if g["layers"] > 1][:5]
    if groups:
        gt = Table(title="repeated roles", title_justify="left")
        for col in ("group", "layers", "latency_ratio"):
            gt.add_column(col)
        for g in groups:
            gt.add_row(g["group"], str(g["layers"]), f"{g['latency_ratio']:.1%}")
        console.print(gt)
    console.print("[bold]suggestions[/bold]")
    for s in report["suggestions"]:
        console.print(f"  • {s['message']}")


def _sensitivity(args: argparse.Namespace, spec: Any, model: Any, examples: list[Any], report: dict[str, Any]) -> dict[str, Any]:
    """Measure, show and (with --store) save per-layer sensitivity of the hottest layers."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    from compiler import fingerprint  # noqa: PLC0415
    from pgc_daemon.optimizer.search.prepare import measure_sensitivity  # noqa: PLC0415

    profile = [{"layer": r["layer"], "share": r["latency_ratio"]} for r in report["layers"]]
    sens = measure_sensitivity(model, examples, profile, metric=spec.metric)
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 160)
    table = Table(
        title=f"sensitivity: {sens.metric} fidelity with only one layer changed "
        f"({sens.inputs} inputs, {sens.seconds:.0f} s), most sensitive first",
        title_justify="left",
    )
    for col in ("layer", "choice", "fidelity", "SQNR dB", "layer SQNR dB", "RMS"):
        table.add_column(col, justify="left" if col in ("layer", "choice") else "right")
    for r in sens.ranked()[: max(args.top, 10)]:
        table.add_row(
            r.layer, r.choice, f"{r.fidelity:.5f}",
            f"{r.sqnr_db:.1f}" if r.sqnr_db is not None else "-",
            f"{r.layer_sqnr_db:.1f}" if r.layer_sqnr_db is not None else "-",
            f"{r.rms:.2e}" if r.rms is not None else "-",
        )
    console.print(table)
    out = sens.to_dict()
    if args.store_url:
        import store as st  # noqa: PLC0415

        digest = fingerprint(spec.model)
        store = st.open_store(args.store_url)
        with store.session() as s:
            models = [m for m in st.repo.list_models(s) if m.graph_hash == digest]
            for m in models:
                st.repo.save_sensitivity(s, m.id, digest, sens.to_rows())
        out["saved_for"] = [m.name for m in models]
        console.print(
            f"saved for {', '.join(out['saved_for'])}" if models
            else "no served model in the store has this fingerprint; nothing saved"
        )
    return out


def run(args: argparse.Namespace) -> int:
    _check(args)
    import torch  # noqa: PLC0415

    from compiler import probe  # noqa: PLC0415
    from pgc_daemon.modelspec import load_spec  # noqa: PLC0415
    from profiler import cuda_status, layout_conversions, profile_model  # noqa: PLC0415

    threads_note = None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif torch.get_num_threads() > 1 and _busy():
        # On a machine already busy, a multi-threaded forward pass mostly waits for its own
        # worker threads to be scheduled; every op then looks alike and the ranking is noise.
        threads_note = (f"1 thread: the machine is busy ({_busy()}); pass --threads to choose")
        torch.set_num_threads(1)
    if args.device == "cuda":
        ok, why = cuda_status()
        if not ok:
            raise UsageError(f"--device cuda: {why}")
    spec = load_spec(args.spec)
    model = spec.model.to(args.device) if args.device != "cpu" else spec.model
    examples = [_to(ex, args.device) for ex in spec.examples[: args.inputs]]
    module, kernels, variant = _variant(args, model, examples)
    show = _progress(True)
    try:
        profile = profile_model(module, examples, rounds=args.rounds,
                                counters=not args.no_counters, progress=show, kernels=kernels)
    except Exception as exc:  # noqa: BLE001 - the spec's model or inputs are the input here
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UsageError(
            f"{args.spec}: the model failed on its example inputs: {type(exc).__name__}: {text}"
        ) from None
    report = profile.to_dict()
    report["variant"] = variant
    try:
        report["layout"] = layout_conversions(module, examples) if kernels is None else {}
    except Exception as exc:  # noqa: BLE001 - the layout pass is an extra, not the report
        report["layout"] = {"error": f"{type(exc).__name__}: {exc}"}
    hardware = probe()
    report.update(
        spec=args.spec,
        threads=torch.get_num_threads(),
        threads_note=threads_note,
        hardware=hardware.summary(),
        int8_fast=hardware.int8_fast,
        bf16_fast=hardware.bf16_fast,
    )
    report["suggestions"] = suggestions(report, hardware)
    render(report, args.top)
    if args.sensitivity:
        report["sensitivity"] = _sensitivity(args, spec, model, examples, report)
    if args.json:
        print(json.dumps(report, default=str), flush=True)
    return 0

"""``pgc status``: what pgc knows about the served models, from the store."""

from __future__ import annotations

import argparse
import json

from pgc_daemon.cli._base import add_store_option, existing_store

ORDER = 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="the served models: active variant, live latency, search")
    add_store_option(p)
    p.add_argument("model", nargs="?", help="one model (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=run)


def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import store as st
    from pgc_daemon.services.queries import model_summary

    store = existing_store(args)
    with store.session() as s:
        models = [st.repo.get_model(s, args.model)] if args.model else list(st.repo.list_models(s))
        summaries = [model_summary(s, m) for m in models]
    if args.json:
        print(json.dumps({"models": summaries}))
        return 0
    table = Table(title=f"pgc · {store.safe_url}")
    for col in ("model", "serving", "p50 ms", "speedup", "search"):
        table.add_column(col)
    for m in summaries:
        lat = m["latency"]
        cur = (lat["current"] or {}).get("p50_ms")
        search = m["search"]
        table.add_row(
            m["name"],
            (m["active"] or {}).get("label", "-"),
            _f(cur),
            _f(lat["speedup"]) + ("x" if lat["speedup"] else ""),
            f"{search['state']} {search['trials_done']}/{search['trials_budget']}" if search else "-",
        )
    Console().print(table)
    return 0

"""``pgc demo``: the whole loop on all-MiniLM-L6-v2 with live traffic."""

from __future__ import annotations

import argparse

from pgc_daemon.cli._base import (
    EXIT_FAILED,
    UsageError,
    add_backends_option,
    add_store_option,
    backends_from,
    settings_from,
)

ORDER = 10


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="run the whole loop on all-MiniLM-L6-v2 with live traffic")
    add_store_option(demo)
    demo.add_argument("--duration", type=float, help="stop after this many seconds")
    demo.add_argument("--no-serve", action="store_true", help="do not keep the API up at the end")
    demo.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    demo.add_argument("--host", help="API bind address (default 127.0.0.1)")
    demo.add_argument("--port", type=int, help="API port (default 8765)")
    demo.add_argument(
        "--rate", type=float,
        help="requests per second (default: what keeps fp32 serving half busy here, at most 20)",
    )
    demo.add_argument("--clients", type=int, default=1, help="client threads (default 1)")
    demo.add_argument("--trials", type=int, default=6, help="search trials (default 6)")
    demo.add_argument("--max-drop", type=float, default=0.01, help="accuracy budget (default 0.01)")
    add_backends_option(demo)
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pgc_daemon.errors import PolicyError
    from pgc_daemon.policy import Policy

    # every check before the demo's imports (torch and the model: seconds), so a typo is
    # refused at once
    settings = settings_from(args).model_copy(
        update={"window_s": 5.0, "sample_every": 20, "min_profile_calls": 200, "poll_s": 1.0}
    )
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be positive")
    if (args.rate is not None and args.rate <= 0) or args.clients < 1 or args.trials < 1:
        raise UsageError("--rate, --clients and --trials must be positive")
    if not 0 <= args.max_drop <= 1:
        raise UsageError("--max-drop must be between 0 and 1")
    terms = {"max_accuracy_drop": args.max_drop, "max_trials": args.trials,
             "backends": backends_from(args)}
    try:
        Policy.parse(terms)
    except PolicyError as exc:
        raise UsageError(str(exc).removeprefix("invalid policy: ")) from None
    from pgc_daemon.cli._demo import CANARY_S, DemoOptions, run_demo

    policy = Policy.parse({**terms, "canary_s": CANARY_S})
    report = run_demo(
        settings,
        DemoOptions(
            duration=args.duration,
            serve=not args.no_serve,
            json=args.json,
            rate=args.rate,
            clients=args.clients,
            policy=policy,
        ),
    )
    return 0 if report.get("outcome") in ("deployed", "kept") else EXIT_FAILED

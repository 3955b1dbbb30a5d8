"""The ``pgc`` command: a thin layer over the library, one module per command in this package
(each public module has ``register(subparsers)``, which sets ``func``, and an ``ORDER`` for
``pgc --help``). Errors become one readable line on
stderr and an exit code (1: the work failed, 2: bad usage or input, 130: interrupted)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from pgc_daemon.cli._base import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from pgc_daemon.errors import KNOWN_ERRORS, describe


def discover() -> list[ModuleType]:
    modules = [
        importlib.import_module(f"{__name__}.{info.name}")
        for info in pkgutil.iter_modules(__path__)
        if not info.name.startswith("_")
    ]
    return sorted(modules, key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgc", description="Profile-guided compilation daemon for PyTorch inference."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what pgc does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in discover():
        command.register(sub)
    return parser


def run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UsageError as exc:
        print(f"pgc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KNOWN_ERRORS as exc:
        print(f"pgc {args.command}: error: {describe(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ValueError, LookupError)) else EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"pgc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()

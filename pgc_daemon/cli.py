"""The ``pgc`` command: a thin layer over the library. Errors become one readable line on
stderr and an exit code (1: the work failed, 2: bad usage or input, 130: interrupted)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from pgc_daemon.commands import discover
from pgc_daemon.commands._base import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from pgc_daemon.errors import KNOWN_ERRORS, describe


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

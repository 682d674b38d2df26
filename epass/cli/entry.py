"""The ``epass`` parser, assembled from the command modules, and :func:`main`: the
command run with its signals and warnings handled, every failure turned into an exit
code and one ``epass: error:`` line."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from epass._terminal import Out
from epass._text import printable
from epass.cli import cache, demo, inspect, passes, reduce, run
from epass.cli._shared import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    CommandTerminated,
    sigterm_raises,
)
from epass.errors import CliError, LoadError, SaveError

__all__ = ["build_parser", "main"]

# In the order `epass --help` lists them.
COMMANDS = (run, passes, inspect, demo, reduce, cache)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    """The ``epass`` argument parser."""
    parser = _Parser(
        prog="epass",
        description="Run pipelines on .pt2 files, list passes, inspect programs.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and warnings")
    parser.add_argument("--plain", action="store_true", help="plain text: no rich tables")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        p = command.add_parser(sub)
        for flag, text in (("--debug", "show tracebacks"), ("--plain", "no rich tables")):
            p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
    return parser


def _error(reason: str, code: int, context: str = "") -> int:
    print(f"epass: error: {printable(reason)}", file=sys.stderr)
    if context:
        print("\n".join(printable(line) for line in context.split("\n")), file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (0, 1, 2, 130 or 143)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        with sigterm_raises(CommandTerminated), warnings.catch_warnings():
            if not debug:
                # torch's own deprecations and fallbacks: noise for a command-line
                # user, who cannot act on them (--debug shows them).
                warnings.simplefilter("ignore")
            args = build_parser().parse_args(argv)
            code: int = args.func(args, Out(plain=args.plain))
            return code
    except CliError as exc:
        if debug:
            raise
        return _error(exc.reason, exc.code, exc.context)
    except (LoadError, SaveError) as exc:  # bad files: usage errors
        if debug:
            raise
        return _error(str(exc).splitlines()[0], EXIT_USAGE)
    except KeyboardInterrupt:
        print("epass: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CommandTerminated:
        print("epass: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except SystemExit as exc:  # argparse's --help; or a plugin calling sys.exit on import
        if exc.code in (0, None):
            return 0
        if debug:
            raise
        return _error(f"SystemExit({exc.code!r}) outside a pass", EXIT_FAILED)
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        kind = type(exc).__name__
        return _error(f"{kind}: {first}" if first else kind, EXIT_FAILED)

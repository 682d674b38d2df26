"""What several commands share: exit codes, SIGTERM, the load arguments, tolerances,
pipeline text to a manager, and the spinner.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from epass.errors import CliError, PipelineError

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "REPORT_SUFFIXES",
    "CommandTerminated",
    "add_load_arguments",
    "build_manager",
    "pipeline_error",
    "sigterm_raises",
    "spinner",
    "tolerance",
]

EXIT_FAILED = 1  # a pass failed, or numerics differ
EXIT_USAGE = 2  # bad arguments, files or pipeline text
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM

REPORT_SUFFIXES = (".json", ".html", ".htm")


class CommandTerminated(BaseException):
    """SIGTERM, raised where the command is, so that it cleans up as on Ctrl-C."""


@contextlib.contextmanager
def sigterm_raises(terminated: type[BaseException]) -> Iterator[None]:
    """SIGTERM raises ``terminated`` inside the block, so that the command ends as on
    Ctrl-C: the reduction still writes the smallest program found, ``epass`` cleans
    up (main thread only; :func:`epass.cli.main` uses it too)."""

    def handler(signum: int, frame: Any) -> None:
        raise terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: signals are not ours to take
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trust`` and ``--import``, for a command that loads a .pt2 file."""
    parser.add_argument(
        "--trust",
        action="store_true",
        help="load without screening (the file may run code: only for files you trust)",
    )
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (a library registering custom ops); repeatable",
    )


def tolerance(text: str) -> float:
    """argparse type for --atol / --rtol: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def pipeline_error(exc: PipelineError) -> CliError:
    return CliError(f"bad pipeline: {exc.reason}", context=exc.context)


def build_manager(text: str, **kwargs: Any) -> PassManager:
    """``PassManager.from_text(text, **kwargs)``; what it raises as a usage error."""
    from epass.manager import PassManager

    try:
        return PassManager.from_text(text, **kwargs)
    except PipelineError as exc:
        raise pipeline_error(exc) from exc
    except Exception as exc:  # ordering errors, factory errors
        raise CliError(f"bad pipeline: {type(exc).__name__}: {exc}") from exc


def spinner(args: argparse.Namespace) -> Any:
    """A spinner for loading, screening and saving (a ``progress`` callable); None
    with ``--plain`` or when stderr is not a terminal."""
    if args.plain or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from epass.instruments import Spinner

    return Spinner()

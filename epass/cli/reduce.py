"""``epass reduce``: shrink a program on which a pipeline fails or drifts, and write
the smallest one found with its reproducer; the reduction is :func:`epass.reduce`."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from epass._terminal import Out
from epass.cli._shared import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    add_load_arguments,
    build_manager,
    sigterm_raises,
    tolerance,
)
from epass.errors import ArgumentValueError, CliError, SaveError

__all__ = ["add_parser", "run"]


def _seconds(text: str) -> float:
    """argparse type for --time-limit: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def _count(text: str) -> int:
    """argparse type for --max-steps: a whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text!r}")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``reduce`` to the subcommands ``sub``; returns its parser."""
    reduce: argparse.ArgumentParser = sub.add_parser(
        "reduce", help="shrink a program on which a pipeline fails or drifts"
    )
    reduce.add_argument("input", help="an ExportedProgram saved with torch.export.save")
    reduce.add_argument("-p", "--pipeline", required=True, help='pipeline text, e.g. "lower"')
    reduce.add_argument(
        "-o",
        "--output",
        default="reduced",
        metavar="DIR",
        help="write program.pt2 and repro.py into this new folder, or one an earlier "
        "reduction wrote (default: reduced)",
    )
    reduce.add_argument(
        "--failure",
        choices=("auto", "error", "drift"),
        default="auto",
        help="what must keep happening: a pass raises, or a pass's outputs "
        "drift (auto: what the program shows)",
    )
    reduce.add_argument("--match", metavar="REGEX", help="the error must match REGEX")
    reduce.add_argument("--in-pass", metavar="NAME", help="the pass that must fail or drift")
    reduce.add_argument("--atol", type=tolerance, default=1e-5, help="drift: absolute tolerance")
    reduce.add_argument("--rtol", type=tolerance, default=1e-4, help="drift: relative tolerance")
    reduce.add_argument(
        "--time-limit",
        type=_seconds,
        metavar="SECONDS",
        help="stop after this long, even inside a pass that hangs, keeping the "
        "smallest program found",
    )
    reduce.add_argument(
        "--max-steps", type=_count, metavar="N", help="stop after N candidate programs"
    )
    add_load_arguments(reduce)
    reduce.set_defaults(func=run)
    return reduce


class _StatusLine:
    """The progress of a reduction on one terminal line (stderr), redrawn in place."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, progress: Any) -> None:
        text = (
            f"reduce: {progress.nodes_before} -> {progress.nodes} nodes, "
            f"{progress.step} steps, {progress.seconds:.1f} s ({progress.phase})"
        )
        sys.stderr.write(f"\r{text}\x1b[K")
        sys.stderr.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def run(args: argparse.Namespace, out: Out) -> int:
    """Check -o, load, reduce, write; the summary line on stdout."""
    from epass import io
    from epass.reduce import Terminated, check_output, reduce

    try:  # refused before any work: the output never replaces the input
        check_output(args.output, inputs=[args.input])
    except SaveError as exc:
        raise CliError(f"-o {exc}") from exc
    io.import_modules(args.imports)
    pipeline = build_manager(args.pipeline)
    io.import_modules(io.declared_imports(pipeline.passes))
    ep = io.load(args.input, trust=args.trust)
    status = _StatusLine() if sys.stderr.isatty() and not args.plain else None
    try:
        with sigterm_raises(Terminated):
            result = reduce(
                ep,
                pipeline,
                failure=args.failure,
                match=args.match,
                in_pass=args.in_pass,
                rtol=args.rtol,
                atol=args.atol,
                time_limit=args.time_limit,
                max_steps=args.max_steps,
                progress=status,
            )
    except ArgumentValueError as exc:
        raise CliError(str(exc), code=EXIT_FAILED) from exc
    except Terminated:
        raise CliError("terminated before the failure was known", code=EXIT_TERMINATED) from None
    finally:
        if status is not None:
            status.close()
    out.line(result.summary())
    where = result.write(args.output, imports=args.imports)
    out.line(f"wrote {where / 'program.pt2'} and {where / 'repro.py'}")
    return {"interrupted": EXIT_INTERRUPTED, "terminated": EXIT_TERMINATED}.get(result.stopped, 0)

"""``epass run``: check (before torch) -> build -> load -> run -> show -> write.

Its instruments (numerics check, reproducer, progress, the report's log) are library
pieces; this module adds them as the arguments ask, and writes the program and the
report, also for a run that failed or was interrupted. What it concludes about a run
(the numerics verdict, a failure's) is :mod:`epass.cli._verdicts`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from epass import _paths, pipeline, registry
from epass._terminal import Out, notices, pass_table
from epass._text import printable
from epass.cli._shared import (
    EXIT_FAILED,
    REPORT_SUFFIXES,
    CommandTerminated,
    add_load_arguments,
    build_manager,
    pipeline_error,
    spinner,
    tolerance,
)
from epass.cli._verdicts import (
    drift_verdict,
    failure_verdict,
    numerics_entry,
    reproducer_note,
    show_numerics,
)
from epass.errors import CliError, PassError, PipelineError

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from epass.instruments import NumericsCheck, Reproducer
    from epass.manager import PassManager
    from epass.records import PipelineResult
    from epass.report import RunLog

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``run`` to the subcommands ``sub``; returns its parser."""
    parser: argparse.ArgumentParser = sub.add_parser("run", help="run a pipeline on a .pt2 file")
    parser.add_argument("input", help="an ExportedProgram saved with torch.export.save")
    parser.add_argument("-p", "--pipeline", required=True, help='pipeline text, e.g. "lower"')
    parser.add_argument("-o", "--output", help="write the result here (.pt2)")
    parser.add_argument("--report", help="write a report (.html or .json)")
    parser.add_argument(
        "--check-numerics", action="store_true", help="compare outputs before/after"
    )
    parser.add_argument("--atol", type=tolerance, help="numerics: absolute tolerance (1e-5)")
    parser.add_argument("--rtol", type=tolerance, help="numerics: relative tolerance (1e-4)")
    parser.add_argument("--repro-dir", help="on a pass failure, write a reproducer here")
    parser.add_argument("--steps", type=int, default=1, help="repeat the pipeline up to N times")
    add_load_arguments(parser)
    parser.set_defaults(func=run)
    return parser


@attrs.define
class _RunTools:
    """The instruments ``epass run`` adds to the pipeline, and where its files go."""

    output: Path | None
    report: Path | None
    check: NumericsCheck | None = None
    reproducer: Reproducer | None = None
    log: RunLog | None = None


def run(args: argparse.Namespace, out: Out) -> int:
    """check (before torch) -> build -> load -> run -> write."""
    tools = _check_run(args)
    from epass import io  # torch: after everything that can be checked without it

    io.import_modules(args.imports)  # they may register passes as well as ops
    pm = build_manager(args.pipeline, steps=args.steps)
    io.import_modules(io.declared_imports(pm.passes))
    with spinner(args) as progress:
        ep = io.load(args.input, trust=args.trust, progress=progress)
    _attach(args, pm, ep, tools)
    result, seconds = _run_pipeline(args, pm, ep, tools)
    _show_run(out, ep, result, seconds, tools)
    return _write_outputs(args, out, pm, result, tools)


def _check_run(args: argparse.Namespace) -> _RunTools:
    """Everything ``epass run`` can check before torch is imported: its numbers, its
    files and its pipeline text (names and a built-in's options too, unless
    ``--import`` modules, which may register passes, have to be imported first)."""
    if args.steps < 1:
        raise CliError(f"--steps must be a positive integer, got {args.steps}")
    output = _paths.check_output_path(args.output, (".pt2",)) if args.output else None
    report = _paths.check_output_path(args.report, REPORT_SUFFIXES) if args.report else None
    if output is not None and report is not None and output.resolve() == report.resolve():
        raise CliError(f"{args.output}: -o and --report name the same file")
    _paths.check_input_path(args.input)
    try:
        if args.imports:
            pipeline.parse(args.pipeline, resolve=False)
        else:
            registry.check_text(args.pipeline)
    except PipelineError as exc:
        raise pipeline_error(exc) from exc
    return _RunTools(output, report)


def _attach(
    args: argparse.Namespace, pm: PassManager, ep: ExportedProgram, tools: _RunTools
) -> None:
    """Add the instruments the arguments ask for to ``pm``."""
    from epass.instruments import Progress, Reproducer
    from epass.report import RunLog

    tools.check = _numerics_check(args, ep) if args.check_numerics else None
    if args.repro_dir:
        tools.reproducer = Reproducer(args.repro_dir, imports=args.imports)
    tools.log = RunLog() if tools.report is not None else None
    progress = Progress() if sys.stderr.isatty() and not args.plain else None
    for instrument in (tools.check, tools.reproducer, progress, tools.log):
        if instrument is not None:
            pm.instruments.append(instrument)


def _run_pipeline(
    args: argparse.Namespace, pm: PassManager, ep: ExportedProgram, tools: _RunTools
) -> tuple[PipelineResult, float]:
    """Run ``pm``; a failed or interrupted run is reported before its error goes on."""
    from epass.records import count_text
    from epass.report import verdict

    start = time.perf_counter()
    try:
        result = pm(ep)
        return result, time.perf_counter() - start
    except PassError as exc:
        note = reproducer_note(tools.reproducer) if tools.reproducer is not None else ""
        if note:
            print(printable(note), file=sys.stderr)
        _report_unfinished(args, pm, tools, failure_verdict(args, exc, tools.log, tools.reproducer))
        raise CliError(str(exc).splitlines()[0], code=EXIT_FAILED) from exc
    except (KeyboardInterrupt, CommandTerminated) as exc:
        done = count_text(tools.log.records) if tools.log is not None else "no pass"
        what = "terminated" if isinstance(exc, CommandTerminated) else "interrupted"
        _report_unfinished(
            args, pm, tools, verdict("interrupted", summary=f"{what} after {done} finished")
        )
        raise


def _show_run(
    out: Out, ep: ExportedProgram, result: PipelineResult, seconds: float, tools: _RunTools
) -> None:
    from epass.records import total_text

    pass_table(out, result)
    prog = result.program
    out.line()
    out.line(
        f"{total_text(result.records, seconds)}; nodes "
        f"{len(ep.graph.nodes)} -> {len(prog.graph.nodes)}; "
        f"state_dict shared: {'yes' if prog.state_dict is ep.state_dict else 'no'}, "
        f"constants shared: {'yes' if prog.constants is ep.constants else 'no'}"
    )
    notices(out, result.records)
    if tools.check is not None:
        show_numerics(out, tools.check)


def _write_outputs(
    args: argparse.Namespace, out: Out, pm: PassManager, result: PipelineResult, tools: _RunTools
) -> int:
    """Save the program (unless its numerics drifted), write the report, and exit 1
    on a drift."""
    from epass import io

    check = tools.check
    drift = check.first_drift if check is not None else None
    output = tools.output if drift is None else None
    if output is not None:
        with spinner(args) as progress:
            pruned = io.save(result.program, output, progress=progress)
        note = f" (pruned {len(pruned)} unreferenced state entries)" if pruned else ""
        out.line(f"wrote {args.output}{note}")
    if tools.report is not None:
        outcome = drift_verdict(args, check) if check is not None else None
        _write_report(args, pm, tools, result, outcome, output)
        out.line(f"wrote {args.report}")
    if drift is not None and check is not None:
        why = drift.detail or (
            f"max abs diff {drift.max_abs:.3g} exceeds atol {check.atol:g} / rtol {check.rtol:g}"
        )
        unwritten = f"; {args.output} was not written" if tools.output is not None else ""
        raise CliError(
            f"numerics differ after pass {drift.path!r}: {why}{unwritten}", code=EXIT_FAILED
        )
    return 0


def _numerics_check(args: argparse.Namespace, ep: ExportedProgram) -> NumericsCheck:
    from epass.instruments import NumericsCheck
    from epass.instruments.numerics import random_inputs

    tolerances = {k: v for k, v in (("atol", args.atol), ("rtol", args.rtol)) if v is not None}
    inputs = None if ep.example_inputs is not None else random_inputs(ep)
    return NumericsCheck(inputs, reference="input", **tolerances)


def _write_report(
    args: argparse.Namespace,
    pm: PassManager,
    tools: _RunTools,
    result: PipelineResult,
    outcome: dict[str, Any] | None,
    output: Path | None = None,
) -> None:
    from epass.report import PipelineRun, write_report

    assert tools.report is not None
    record = PipelineRun(
        result,
        manager=pm,
        pipeline=_canonical(pm, args.pipeline),
        input_path=str(args.input),
        output_path=str(args.output) if output is not None else None,
        numerics=numerics_entry(tools.check) if tools.check is not None else None,
        outcome=outcome,
        diffs=tools.log.diffs if tools.log is not None else None,
    )
    write_report(tools.report, record)


def _report_unfinished(
    args: argparse.Namespace, pm: PassManager, tools: _RunTools, outcome: dict[str, Any]
) -> None:
    """A run that got past loading is reported whatever happened to it."""
    if tools.log is None or tools.report is None or tools.log.program is None:
        return
    _write_report(args, pm, tools, tools.log.result(), outcome)
    print(f"epass: wrote {printable(args.report)}", file=sys.stderr)


def _canonical(pm: Any, text: str) -> str:
    try:
        return str(pm.to_text())
    except ValueError:
        return text

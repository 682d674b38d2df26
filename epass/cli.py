"""The ``epass`` command: run pipelines on .pt2 files, list passes, inspect programs.

Argument parsing and rendering only: loading, saving, numerics and reproducers are
library pieces (:mod:`epass.io`, :mod:`epass.instruments`). Every failure exits
non-zero with one line ``epass: error: <reason>`` on stderr (plus a caret line for
pipeline syntax errors); ``--debug`` shows the traceback. Exit codes: 0, 1 (a pass
or a check failed), 2 (bad arguments, files or pipeline text), 130 (interrupted,
SIGINT), 143 (terminated, SIGTERM); both signals clean up as any failure does.

Each command imports torch and the library inside the function that runs it, after
everything that can be checked without them, so ``epass --help``, ``epass passes``
and argument errors (bad files and pipeline text included) answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import re
import shlex
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from epass import _cli_reduce, _paths, pipeline, registry
from epass._terminal import Out as _Out
from epass._terminal import inputs_table, notices, printable
from epass._terminal import pass_table as _summary
from epass._text import json_text
from epass.errors import CliError, LoadError, PassError, PipelineError, RegistryError, SaveError
from epass.registry import pass_table

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from epass.instruments import NumericsCheck, Reproducer
    from epass.manager import PassManager
    from epass.records import PipelineResult
    from epass.report import RunLog

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "build_parser",
    "main",
    "printable",
]

EXIT_FAILED = 1  # a pass failed, or numerics differ
EXIT_USAGE = 2  # bad arguments, files or pipeline text
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM

REPORT_SUFFIXES = (".json", ".html", ".htm")
DEMO_FILE = "demo.pt2"  # where `epass demo --save` writes when given no name


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _spinner(args: argparse.Namespace) -> Any:
    """A spinner for loading, screening and saving (a ``progress`` callable); None
    with ``--plain`` or when stderr is not a terminal."""
    if args.plain or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from epass.instruments import Spinner

    return Spinner()


def _cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    _paths.check_input_path(args.input)  # before torch
    from epass import io

    with _spinner(args) as spinner:
        ep = io.load(args.input, trust=args.trust, imports=args.imports, progress=spinner)
    info = io.inspect(ep)
    if args.json:
        print(json_text(info))
        return 0
    out.line(f"{args.input}: dialect {info['dialect']}, {info['nodes']} nodes")
    ops = list(info["ops"].items())
    shown = ops if args.all_ops else ops[:20]
    rows = [[op, str(n)] for op, n in shown]
    if len(ops) > len(shown):
        rows.append([f"... {len(ops) - len(shown)} more (--all-ops)", ""])
    out.line()
    out.table("op histogram", ["op", "count"], rows)
    state = info["state"]
    out.line()
    out.table(
        "state",
        ["kind", "entries", "bytes"],
        [
            [kind, str(state[kind]["count"]), _human(state[kind]["bytes"])]
            for kind in ("parameters", "buffers", "constants")
        ]
        + [
            [f"dtype {k}", str(v["entries"]), _human(v["bytes"])]
            for k, v in state["by_dtype"].items()
        ],
    )
    sig = info["signature"]
    out.line()
    out.line(f"inputs:  {', '.join(sig['user_inputs']) or '-'}")
    out.line(f"outputs: {', '.join(sig['user_outputs']) or '-'}")
    kinds = ", ".join(f"{k} {v}" for k, v in sig["input_kinds"].items())
    out.line(f"input specs:  {kinds}")
    kinds = ", ".join(f"{k} {v}" for k, v in sig["output_kinds"].items())
    out.line(f"output specs: {kinds}")
    if sig["buffers_mutated"]:
        out.line(f"mutated buffers: {', '.join(sorted(set(sig['buffers_mutated'].values())))}")
    inputs_table(out, sig, args.all_ops)
    return 0


def _demo_program() -> ExportedProgram:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return torch.export.export(model, (torch.randn(2, 5, 32),))


def _demo_pipeline() -> tuple[Any, str]:
    """The ``lower`` preset when it is installed, else ``decompose``."""
    from epass.manager import PassManager, create_pass

    try:
        create_pass("lower")
        return PassManager.from_text("lower"), "lower"
    except RegistryError:
        return PassManager.from_text("decompose"), "decompose"


def _cmd_demo(args: argparse.Namespace, out: _Out) -> int:
    if args.report:  # before torch
        _paths.check_output_path(args.report, REPORT_SUFFIXES)
    if args.save:
        _paths.check_output_path(args.save, (".pt2",))
    import torch

    from epass import io
    from epass.report import PipelineRun, write_report

    start = time.perf_counter()
    ep = _demo_program()
    out.line(f"exported a 2-layer TransformerEncoder in {time.perf_counter() - start:.2f}s")
    if args.save:
        with _spinner(args) as spinner:
            io.save(ep, args.save, progress=spinner)
        out.line(f"wrote {args.save} (the exported program, before any pass)")
    pm, text = _demo_pipeline()
    if text != "lower":
        out.line("the 'lower' preset is not available here; running 'decompose'")
    out.line(f"pipeline: {text}")
    with _collect_new_objects_only():
        result = pm(ep)
    _summary(out, result)
    notices(out, result.records)
    prog = result.program
    out.line()
    out.line(f"state_dict shared: {prog.state_dict is ep.state_dict}")
    out.line(f"constants shared:  {prog.constants is ep.constants}")
    same = all(prog.state_dict[k] is v for k, v in ep.state_dict.items() if k in prog.state_dict)
    out.line(f"every tensor is the user's object: {same}")
    x = torch.randn(2, 5, 32)
    diff = (prog.module()(x) - ep.module()(x)).abs().max().item()
    out.line(f"max abs difference against the exported program: {diff:.2e}")
    if args.report:
        write_report(args.report, PipelineRun(result, manager=pm, pipeline=text))
        out.line(f"wrote {args.report}")
    out.line()
    if args.save:
        out.line(f"next: epass run {args.save} -p lower -o lowered.pt2 --report report.html")
    else:
        then = f"epass run {DEMO_FILE} -p lower --report report.html"
        out.line(f"next: epass demo --save (writes {DEMO_FILE}), then {then}")
    return 0


def _pipeline_error(exc: PipelineError) -> CliError:
    return CliError(f"bad pipeline: {exc.reason}", context=exc.context)


def _build_manager(text: str, steps: int) -> PassManager:
    from epass.manager import PassManager

    try:
        return PassManager.from_text(text, steps=steps)
    except PipelineError as exc:
        raise _pipeline_error(exc) from exc
    except Exception as exc:  # ordering errors, factory errors
        raise CliError(f"bad pipeline: {type(exc).__name__}: {exc}") from exc


def _tolerance(text: str) -> float:
    """argparse type for --atol / --rtol: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _numerics_check(args: argparse.Namespace, ep: ExportedProgram) -> NumericsCheck:
    from epass.instruments import NumericsCheck
    from epass.instruments.numerics import random_inputs

    tolerances = {k: v for k, v in (("atol", args.atol), ("rtol", args.rtol)) if v is not None}
    inputs = None if ep.example_inputs is not None else random_inputs(ep)
    return NumericsCheck(inputs, reference="input", **tolerances)


def _numerics_summary(check: NumericsCheck) -> dict[str, Any]:
    """The report's ``numerics`` entry: the output against the input, and the verdict."""
    final = check.checks[-1] if check.checks else None
    first = check.first_drift
    return {
        "max_abs_diff": final.max_abs if final is not None else 0.0,
        "ok": first is None,
        "atol": check.atol,
        "rtol": check.rtol,
        "first_drift": None if first is None else str(first),
        "first_node": None if first is None or first.node is None else first.node.as_dict(),
        "passes": [
            {"pass": d.path, "max_abs": d.max_abs, "max_rel": d.max_rel, "ok": d.ok}
            for d in check.checks
        ],
    }


def _reproducer_note(reproducer: Reproducer) -> str:
    if reproducer.written:
        return f"epass: reproducer written to {reproducer.written[-1]}"
    if reproducer.write_errors:
        reason = reproducer.write_errors[-1]
        return f"epass: cannot write a reproducer to {reproducer.directory}: {reason}"
    return ""


@attrs.define
class _RunTools:
    """The instruments ``epass run`` adds to the pipeline, and where its files go."""

    output: Path | None
    report: Path | None
    check: NumericsCheck | None = None
    reproducer: Reproducer | None = None
    log: RunLog | None = None


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
        raise _pipeline_error(exc) from exc
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
    run = PipelineRun(
        result,
        manager=pm,
        pipeline=_canonical(pm, args.pipeline),
        input_path=str(args.input),
        output_path=str(args.output) if output is not None else None,
        numerics=_numerics_summary(tools.check) if tools.check is not None else None,
        outcome=outcome,
        diffs=tools.log.diffs if tools.log is not None else None,
    )
    write_report(tools.report, run)


def _report_unfinished(
    args: argparse.Namespace, pm: PassManager, tools: _RunTools, outcome: dict[str, Any]
) -> None:
    """A run that got past loading is reported whatever happened to it."""
    if tools.log is None or tools.report is None or tools.log.program is None:
        return
    _write_report(args, pm, tools, tools.log.result(), outcome)
    print(f"epass: wrote {printable(args.report)}", file=sys.stderr)


def _failure_verdict(args: argparse.Namespace, tools: _RunTools, exc: PassError) -> dict[str, Any]:
    from epass.report import verdict

    failure = (tools.log.failure if tools.log is not None else None) or {}
    written = tools.reproducer.written if tools.reproducer is not None else []
    repro = str(written[-1] / "repro.py") if written else None
    again = f"epass run {args.input} -p {shlex.quote(args.pipeline)} --repro-dir repros"
    return verdict(
        "pass failed",
        summary=f"pass {failure.get('pass', exc.pass_name)!r} failed",
        pass_path=failure.get("pass", exc.pass_name),
        error=failure.get("error", str(exc).splitlines()[0]),
        traceback_lines=failure.get("traceback", ()),
        reproducer=repro,
        next_step=f"python {repro}" if repro else again,
    )


def _run_pipeline(
    args: argparse.Namespace, pm: PassManager, ep: ExportedProgram, tools: _RunTools
) -> tuple[PipelineResult, float]:
    """Run ``pm``; a failed or interrupted run is reported before its error goes on."""
    from epass.records import count_text
    from epass.report import verdict

    start = time.perf_counter()
    try:
        with _collect_new_objects_only():
            result = pm(ep)
        return result, time.perf_counter() - start
    except PassError as exc:
        note = _reproducer_note(tools.reproducer) if tools.reproducer is not None else ""
        if note:
            print(printable(note), file=sys.stderr)
        _report_unfinished(args, pm, tools, _failure_verdict(args, tools, exc))
        raise CliError(str(exc).splitlines()[0], code=EXIT_FAILED) from exc
    except (KeyboardInterrupt, _Terminated) as exc:
        done = count_text(tools.log.records) if tools.log is not None else "no pass"
        what = "terminated" if isinstance(exc, _Terminated) else "interrupted"
        _report_unfinished(
            args, pm, tools, verdict("interrupted", summary=f"{what} after {done} finished")
        )
        raise


def _show_run(
    out: _Out, ep: ExportedProgram, result: PipelineResult, seconds: float, tools: _RunTools
) -> None:
    from epass.records import count_text

    _summary(out, result)
    prog = result.program
    out.line()
    out.line(
        f"{count_text(result.records)} in {seconds:.2f} s; nodes "
        f"{len(ep.graph.nodes)} -> {len(prog.graph.nodes)}; "
        f"state_dict shared: {'yes' if prog.state_dict is ep.state_dict else 'no'}, "
        f"constants shared: {'yes' if prog.constants is ep.constants else 'no'}"
    )
    notices(out, result.records)
    check = tools.check
    if check is None:
        return
    numerics = _numerics_summary(check)
    word = "ok" if numerics["ok"] else "FAILED"
    out.line(
        f"numerics: max abs diff {numerics['max_abs_diff']:.3g} "
        f"(atol {check.atol:g}, rtol {check.rtol:g}) {word}"
    )
    if check.first_drift is not None:
        out.line(f"numerics: first drifting pass: {check.first_drift}")
        if check.first_drift.node is not None:
            out.line(f"numerics: first diverging node: {check.first_drift.node}")


def _drift_verdict(args: argparse.Namespace, check: NumericsCheck) -> dict[str, Any] | None:
    from epass.report import verdict

    drift = check.first_drift
    if drift is None:
        return None
    return verdict(
        "numerics drift",
        summary=f"outputs drift after pass {drift.path!r}: max_abs {drift.max_abs:.3g}, "
        f"max_rel {drift.max_rel:.3g} (atol {check.atol:g}, rtol {check.rtol:g})",
        pass_path=drift.path,
        node=None if drift.node is None else str(drift.node),
        next_step=f"epass run {args.input} -p {shlex.quote(args.pipeline)} "
        f"--check-numerics --report report.html: its section for {drift.path!r} lists "
        "the nodes that pass added and removed",
    )


def _write_outputs(
    args: argparse.Namespace, out: _Out, pm: PassManager, result: PipelineResult, tools: _RunTools
) -> int:
    """Save the program (unless its numerics drifted), write the report, and exit 1
    on a drift."""
    from epass import io

    check = tools.check
    drift = check.first_drift if check is not None else None
    output = tools.output if drift is None else None
    if output is not None:
        with _spinner(args) as spinner:
            pruned = io.save(result.program, output, progress=spinner)
        note = f" (pruned {len(pruned)} unreferenced state entries)" if pruned else ""
        out.line(f"wrote {args.output}{note}")
    if tools.report is not None:
        outcome = _drift_verdict(args, check) if check is not None else None
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


def _cmd_run(args: argparse.Namespace, out: _Out) -> int:
    """check (before torch) -> build -> load -> run -> write."""
    tools = _check_run(args)
    from epass import io  # torch: after everything that can be checked without it

    io.import_modules(args.imports)  # they may register passes as well as ops
    pm = _build_manager(args.pipeline, args.steps)
    io.import_modules(io.declared_imports(pm.passes))
    with _spinner(args) as spinner:
        ep = io.load(args.input, trust=args.trust, progress=spinner)
    _attach(args, pm, ep, tools)
    result, seconds = _run_pipeline(args, pm, ep, tools)
    _show_run(out, ep, result, seconds, tools)
    return _write_outputs(args, out, pm, result, tools)


def _canonical(pm: Any, text: str) -> str:
    try:
        return str(pm.to_text())
    except ValueError:
        return text


_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def plain_text(text: str) -> str:
    """A docstring line without reST markup: roles and double backquotes removed."""
    text = _ROLE.sub(
        lambda m: m.group(1).rsplit(".", 1)[-1] if "." in m.group(1) else m.group(1), text
    )
    return text.replace("``", "")


def _cmd_passes(args: argparse.Namespace, out: _Out) -> int:
    entries = pass_table()
    if args.json:
        print(json_text(entries))
        return 0
    rows = []
    for e in entries:
        description = f"ERROR: {e['error']}" if e["error"] else plain_text(e["description"])
        options = ", ".join(
            o["name"] if o["required"] else f"{o['name']}={o['default']}" for o in e["options"]
        )
        rows.append([e["name"], e["source"], description, options])
    out.table(None, ["pass", "source", "description", "options"], rows)
    return 0


def _cmd_cache(args: argparse.Namespace, out: _Out) -> int:
    # The store is stdlib-only at import: this command starts without torch.
    from epass._decomp import store

    if args.action == "clear":
        removed, left = store.clear()
        where = store.directory()
        out.line(f"removed {removed} entries from {where}" if where else "the cache is off")
        if left:
            out.line(f"left {len(left)} that this cache did not write: {', '.join(left[:10])}")
        return 0
    info = store.info()
    if args.json:
        print(json_text(info))
        return 0
    if not info["enabled"]:
        out.line(f"the template cache is off ({store.DIR_ENV} is empty)")
        return 0
    mib = 1024 * 1024
    out.line(f"directory: {info['directory']}")
    out.line(f"entries: {info['entries']} ({info['bytes'] / mib:.1f} MiB)")
    out.line(f"limit: {info['max_bytes'] / mib:.1f} MiB ({store.SIZE_ENV})")
    return 0


# --- argument parsing ---------------------------------------------------------------


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
    trust = "load without screening (the file may run code: only for files you trust)"
    imports = "import MODULE first (a library registering custom ops); repeatable"

    run = sub.add_parser("run", help="run a pipeline on a .pt2 file")
    run.add_argument("input", help="an ExportedProgram saved with torch.export.save")
    run.add_argument("-p", "--pipeline", required=True, help='pipeline text, e.g. "lower"')
    run.add_argument("-o", "--output", help="write the result here (.pt2)")
    run.add_argument("--report", help="write a report (.html or .json)")
    run.add_argument("--check-numerics", action="store_true", help="compare outputs before/after")
    run.add_argument("--atol", type=_tolerance, help="numerics: absolute tolerance (1e-5)")
    run.add_argument("--rtol", type=_tolerance, help="numerics: relative tolerance (1e-4)")
    run.add_argument("--repro-dir", help="on a pass failure, write a reproducer here")
    run.add_argument("--steps", type=int, default=1, help="repeat the pipeline up to N times")
    run.add_argument("--trust", action="store_true", help=trust)
    run.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                     help=imports)  # fmt: skip
    run.set_defaults(func=_cmd_run)

    passes = sub.add_parser("passes", help="list registered passes")
    passes.add_argument("--json", action="store_true", help="print JSON")
    passes.set_defaults(func=_cmd_passes)

    inspect = sub.add_parser("inspect", help="describe a .pt2 file")
    inspect.add_argument("input")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument("--all-ops", action="store_true", help="show every op and input")
    inspect.add_argument("--trust", action="store_true", help=trust)
    inspect.add_argument("--import", dest="imports", action="append", default=[],
                         metavar="MODULE", help=imports)  # fmt: skip
    inspect.set_defaults(func=_cmd_inspect)

    demo = sub.add_parser("demo", help="export a small transformer, lower it, show what happened")
    demo.add_argument("--report", help="write a report (.html or .json)")
    demo.add_argument("--save", metavar="PATH", nargs="?", const=DEMO_FILE,
                      help=f"write the exported program (.pt2) to PATH ({DEMO_FILE})")  # fmt: skip
    demo.set_defaults(func=_cmd_demo)

    reduce = _cli_reduce.add_parser(sub, _tolerance, trust, imports)

    cache = sub.add_parser("cache", help="the decomposition-template cache on disk")
    cache.add_argument("action", choices=("info", "clear"), help="show it, or empty it")
    cache.add_argument("--json", action="store_true", help="print JSON (info)")
    cache.set_defaults(func=_cmd_cache)
    for p in (run, passes, inspect, demo, reduce, cache):
        for flag, text in (("--debug", "show tracebacks"), ("--plain", "no rich tables")):
            p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
    return parser


def _error(reason: str, code: int, context: str = "") -> int:
    print(f"epass: error: {printable(reason)}", file=sys.stderr)
    if context:
        print("\n".join(printable(line) for line in context.split("\n")), file=sys.stderr)
    return code


class _Terminated(BaseException):
    """SIGTERM, raised where the command is, so that it cleans up as on Ctrl-C."""


@contextlib.contextmanager
def _collect_new_objects_only() -> Iterator[None]:
    """The pipeline runs with every object alive before it (torch's modules, the
    program: hundreds of thousands) left out of Python's cycle collection.

    A full collection walks every tracked object in C, and no signal handler runs
    until it ends: with torch loaded that held Ctrl-C back for a second or more in
    the middle of ``Decompose``. Those objects outlive the run anyway; the run's own
    garbage is collected as before.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (0, 1, 2, 130 or 143)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        with _cli_reduce.sigterm_raises(_Terminated), warnings.catch_warnings():
            if not debug:
                # torch's own deprecations and fallbacks: noise for a command-line
                # user, who cannot act on them (--debug shows them).
                warnings.simplefilter("ignore")
            args = build_parser().parse_args(argv)
            code: int = args.func(args, _Out(plain=args.plain))
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
    except _Terminated:
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


if __name__ == "__main__":
    sys.exit(main())

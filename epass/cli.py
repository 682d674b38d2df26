"""The ``epass`` command: run pipelines on .pt2 files, list passes, inspect programs.

Every failure exits non-zero with one line ``epass: error: <reason>`` on stderr
(plus a caret line for pipeline syntax errors); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import logging
import os
import shlex
import sys
import time
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
from torch.export import ExportedProgram

from epass.errors import CliError

__all__ = ["CliError", "load_program", "main", "prune_state", "save_program"]

EXIT_FAILED = 1  # a pass failed, or numerics differ
EXIT_USAGE = 2  # bad arguments, files or pipeline text


# --- loading and saving -----------------------------------------------------------


@contextlib.contextmanager
def _weights_only_unpickling() -> Iterator[None]:
    """Force ``weights_only=True`` on every ``torch.load`` inside the block.

    torch 2.13's ``torch.export.load`` unpickles tensor-subclass weights and
    constants with ``weights_only=False``, and retries sample inputs with
    ``weights_only=False`` when the safe unpickler refuses them. Either runs
    arbitrary code from the file; under this block both use the restricted
    unpickler and fail instead.
    """
    real = torch.load

    def guarded(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return real(*args, **kwargs)

    torch.load = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = real


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    # torch.export.load logs a full traceback (at WARNING) before falling back to
    # its legacy reader; the CLI reports one line instead.
    loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _archive_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CliError(f"{path}: not a .pt2 archive ({exc})") from exc


def load_program(path: str | os.PathLike[str], *, trust: bool = False) -> ExportedProgram:
    """Load a .pt2 file with the safest path torch offers.

    Unless ``trust`` is set, archives holding pickled opaque objects are refused
    before anything is read, and every ``torch.load`` inside runs with
    ``weights_only=True`` (see docs/cli.md, "Untrusted files").

    Raises:
        CliError: the file is missing, not a .pt2 archive, unsafe, or corrupt.
    """
    p = Path(path)
    if not p.exists():
        raise CliError(f"{p}: no such file")
    if p.is_dir():
        raise CliError(f"{p}: is a directory, not a .pt2 file")
    if not zipfile.is_zipfile(p):
        raise CliError(f"{p}: not a .pt2 archive (torch.export.save writes a zip file)")
    names = _archive_names(p)
    if not any("/models/" in f"/{n}" and n.endswith(".json") for n in names):
        raise CliError(f"{p}: a zip file, but not an exported program (no models/*.json inside)")
    if not trust:
        risky = [n for n in names if "/opaque_obj_" in f"/{n}"]
        if risky:
            raise CliError(
                f"{p}: holds pickled objects ({risky[0]}) that loading would execute; "
                "rerun with --trust only if you trust where the file came from"
            )
    guard = contextlib.nullcontext() if trust else _weights_only_unpickling()
    try:
        with guard, _quiet_torch_logs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.load(p)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc) or "Unpickl" in type(exc).__name__:
            raise CliError(
                f"{p}: holds a pickled object that is not plain tensor data, and "
                "torch.load(weights_only=True) refused it; rerun with --trust only if you "
                "trust where the file came from"
            ) from exc
        raise CliError(f"{p}: cannot load ({type(exc).__name__}: {first})") from exc
    if not isinstance(ep, ExportedProgram):
        raise CliError(f"{p}: did not hold an ExportedProgram")
    return ep


def prune_state(ep: ExportedProgram) -> tuple[ExportedProgram, list[str]]:
    """:func:`epass.prune` (compacting views of dropped entries) plus the dropped keys.

    Returns the program and the pruned keys (``"state_dict:<key>"`` / ``"constants:<key>"``).
    """
    from epass.linker import prune

    targets = {s.target for s in ep.graph_signature.input_specs if s.target is not None}
    pruned = [f"state_dict:{k}" for k in ep.state_dict if k not in targets]
    pruned += [f"constants:{k}" for k in ep.constants if k not in targets]
    if not pruned:
        return ep, []
    return prune(ep, compact=True), pruned


def save_program(ep: ExportedProgram, path: str | os.PathLike[str]) -> list[str]:
    """Prune unreferenced state and save with ``torch.export.save``; returns the pruned keys."""
    p = Path(path)
    if p.suffix != ".pt2":
        raise CliError(f"{p}: the output file must end in .pt2")
    if not p.parent.is_dir():
        raise CliError(f"{p}: directory {p.parent} does not exist")
    pruned_ep, pruned = prune_state(ep)
    if p.is_dir():
        raise CliError(f"{p}: is a directory")
    try:
        torch.export.save(pruned_ep, p)
    except OSError as exc:
        raise CliError(f"{p}: cannot write ({exc.strerror or exc})") from exc
    except RuntimeError as exc:  # torch's archive writer reports open failures this way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "RuntimeError"
        raise CliError(f"{p}: cannot write ({first})") from exc
    return pruned


# --- output: rich when available, plain otherwise ------------------------------


class _Out:
    """Tables and progress with rich, or plain text when rich is missing or --plain."""

    def __init__(self, plain: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.rich: Any = None
        if not plain and not os.environ.get("EPASS_PLAIN"):
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                terminal = self.stream.isatty()
                self.rich = Console(
                    file=self.stream,
                    width=None if terminal else 120,
                    highlight=False,
                    soft_wrap=False,
                )

    def line(self, text: str = "") -> None:
        if self.rich is not None:
            self.rich.print(text, markup=False)
        else:
            print(text, file=self.stream)

    def table(
        self, title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]]
    ) -> None:
        right = {"step", "seconds", "nodes", "count", "bytes", "entries", "ops"}
        if self.rich is not None:
            from rich.table import Table

            table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
            for c in columns:
                table.add_column(c, justify="right" if c in right else "left", overflow="fold")
            for row in rows:
                table.add_row(*row)
            self.rich.print(table)
            return
        if title:
            print(title, file=self.stream)
        widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

        def fmt(cells: Sequence[str]) -> str:
            return "  ".join(
                cell.rjust(w) if col in right else cell.ljust(w)
                for cell, w, col in zip(cells, widths, columns, strict=True)
            ).rstrip()

        print(fmt(columns), file=self.stream)
        print("  ".join("-" * w for w in widths), file=self.stream)
        for row in rows:
            print(fmt(row), file=self.stream)


class _Progress:
    """An instrument showing the running pass on a terminal (stderr)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.status: Any = None
        self.stream = sys.stderr
        try:
            from rich.console import Console

            self.status = Console(file=sys.stderr).status("starting")
        except ImportError:
            self.status = None

    def __enter__(self) -> _Progress:
        if self.status is not None:
            self.status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.stop()
        else:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def before_pass(self, info: Any, program: Any) -> None:
        indent = "  " * info.depth
        text = f"[{self.done + 1}/{self.total}] {indent}{info.name} (step {info.step})"
        if self.status is not None:
            self.status.update(text)
        else:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()

    def after_pass(self, info: Any, program: Any, record: Any) -> None:
        if info.depth == 0:
            self.done += 1


class _Repro:
    """An instrument remembering the pass that failed and the program it was given."""

    def __init__(self) -> None:
        self.failed: tuple[Any, ExportedProgram, BaseException] | None = None

    def pass_failed(self, info: Any, program: ExportedProgram, error: BaseException) -> None:
        if self.failed is None:
            self.failed = (info, program, error)


def _write_repro(
    directory: Path, repro: _Repro, args: argparse.Namespace, error: BaseException
) -> Path:
    from epass.pipeline import to_text

    directory.mkdir(parents=True, exist_ok=True)
    pipeline, source = args.pipeline, Path(args.input).resolve()
    if repro.failed is not None:
        info, program, _ = repro.failed
        try:
            pipeline = to_text([info.pass_])
            save_program(program, directory / "input.pt2")
            source = directory / "input.pt2"
        except Exception:  # fall back to the whole pipeline on the original file
            pipeline, source = args.pipeline, Path(args.input).resolve()
    (directory / "pipeline.txt").write_text(pipeline + "\n")
    (directory / "error.txt").write_text(f"{type(error).__name__}: {error}\n")
    script = directory / "repro.sh"
    target = source.name if source.parent == directory else str(source)
    script.write_text(
        "#!/bin/sh\n# Reproduce an epass pass failure.\n"
        f'cd "$(dirname "$0")" && epass run {shlex.quote(target)} '
        f"-p {shlex.quote(pipeline)} --debug\n"
    )
    script.chmod(0o755)
    return directory


# --- numerics ------------------------------------------------------------------


def _example_inputs(ep: ExportedProgram) -> tuple[tuple[Any, ...], dict[str, Any]]:
    example = getattr(ep, "example_inputs", None)
    if example is not None:
        return tuple(example[0]), dict(example[1])
    torch.manual_seed(0)
    user = set(ep.graph_signature.user_inputs)
    args: list[Any] = []
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise CliError(f"cannot make an example for input {node.name!r}; no tensor metadata")
        shape = []
        for d in val.shape:
            try:
                shape.append(int(d))
            except Exception:
                shape.append(2)
        if val.dtype.is_floating_point:
            args.append(torch.randn(shape, dtype=val.dtype))
        elif val.dtype == torch.bool:
            args.append(torch.zeros(shape, dtype=torch.bool))
        else:
            args.append(torch.randint(0, 2, shape, dtype=val.dtype))
    return tuple(args), {}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _outputs(ep: ExportedProgram, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> list[Any]:
    # A private copy: running the module would otherwise mutate shared buffers.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
        module = copy.deepcopy(ep.module())
    args, kwargs = copy.deepcopy(inputs)
    with torch.no_grad():
        return _tensors(module(*args, **kwargs))


def _compare(before: list[Any], after: list[Any], atol: float, rtol: float) -> dict[str, Any]:
    if len(before) != len(after):
        return {"max_abs_diff": float("inf"), "ok": False, "atol": atol, "rtol": rtol}
    worst, ok = 0.0, True
    for a, b in zip(before, after, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"max_abs_diff": float("inf"), "ok": False, "atol": atol, "rtol": rtol}
        if a.numel():
            diff = (a.double() - b.double()).abs()
            worst = max(worst, float(diff.max()))
            ok &= bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=True))
    return {"max_abs_diff": worst, "ok": ok, "atol": atol, "rtol": rtol}


# --- commands --------------------------------------------------------------------


def _state_text(record: Any) -> str:
    if record.skipped:
        return f"skipped: {record.skip_reason}"
    if record.link is None:
        return "unchanged"
    return str(record.link.summary())


def _summary(out: _Out, result: Any) -> None:
    from epass.records import flatten as _flatten

    rows = []
    for r in _flatten(result.records):
        ops = sum(abs(v) for v in r.op_delta.values())
        rows.append(
            [
                "  " * r.depth + r.name,
                str(r.step),
                f"{r.seconds:.4f}",
                f"{r.nodes_before} -> {r.nodes_after}",
                str(ops) if ops else "",
                _state_text(r),
            ]
        )
    out.table(None, ["pass", "step", "seconds", "nodes", "ops", "state"], rows)


def _build_manager(text: str, steps: int, instruments: Sequence[Any]) -> Any:
    from epass.errors import PipelineError
    from epass.manager import PassManager

    try:
        return PassManager.from_text(text, steps=steps, instruments=instruments)
    except PipelineError as exc:
        raise CliError(f"bad pipeline: {exc.reason}", context=exc.context) from exc
    except Exception as exc:  # ordering errors, factory errors
        raise CliError(f"bad pipeline: {type(exc).__name__}: {exc}") from exc


def _cmd_run(args: argparse.Namespace, out: _Out) -> int:
    from epass.errors import EpassError
    from epass.report import build_report, write_report

    if args.report and Path(args.report).suffix.lower() not in (".json", ".html", ".htm"):
        raise CliError(f"{args.report}: the report file must end in .json or .html")
    if args.report and not Path(args.report).resolve().parent.is_dir():
        raise CliError(f"{args.report}: directory {Path(args.report).parent} does not exist")
    if args.output and Path(args.output).suffix != ".pt2":
        raise CliError(f"{args.output}: the output file must end in .pt2")
    for path in (args.output, args.report):
        if path and Path(path).is_dir():  # found out before the pipeline runs
            raise CliError(f"{path}: is a directory")
    if args.steps < 1:
        raise CliError(f"--steps must be a positive integer, got {args.steps}")
    repro = _Repro()
    instruments: list[Any] = [repro]
    show_progress = sys.stderr.isatty() and not args.plain
    # Parse the pipeline before the (slow) load, so a typo fails at once.
    pm = _build_manager(args.pipeline, args.steps, instruments)
    ep = load_program(args.input, trust=args.trust)
    inputs = reference = None
    if args.check_numerics:
        inputs = _example_inputs(ep)
        reference = _outputs(ep, inputs)
    progress = _Progress(len(pm.passes)) if show_progress else None
    if progress is not None:
        pm.instruments.append(progress)
    start = time.perf_counter()
    try:
        with progress if progress is not None else contextlib.nullcontext():
            result = pm(ep)
    except EpassError as exc:
        if args.repro_dir:
            try:
                where = _write_repro(Path(args.repro_dir), repro, args, exc)
            except OSError as write_error:  # the pass's error is the one to report
                print(
                    f"epass: cannot write a reproducer to {args.repro_dir}: {write_error}",
                    file=sys.stderr,
                )
            else:
                print(f"epass: reproducer written to {where}", file=sys.stderr)
        first = str(exc).splitlines()[0]
        raise CliError(first, code=EXIT_FAILED) from exc
    elapsed = time.perf_counter() - start
    _summary(out, result)
    numerics = None
    if inputs is not None and reference is not None:
        try:
            outputs = _outputs(result.program, inputs)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CliError(
                "numerics: the output program fails on the input's example inputs "
                f"({type(exc).__name__}: {first})",
                code=EXIT_FAILED,
            ) from exc
        numerics = _compare(reference, outputs, args.atol, args.rtol)
    prog = result.program
    out.line()
    out.line(
        f"{len(result.records)} pass{'' if len(result.records) == 1 else 'es'} in "
        f"{elapsed:.2f}s; nodes "
        f"{len(ep.graph.nodes)} -> {len(prog.graph.nodes)}; "
        f"state_dict shared: {'yes' if prog.state_dict is ep.state_dict else 'no'}, "
        f"constants shared: {'yes' if prog.constants is ep.constants else 'no'}"
    )
    if numerics is not None:
        verdict = "ok" if numerics["ok"] else "FAILED"
        out.line(
            f"numerics: max abs diff {numerics['max_abs_diff']:.3g} "
            f"(atol {args.atol:g}, rtol {args.rtol:g}) {verdict}"
        )
    if args.output:
        pruned = save_program(prog, args.output)
        note = f" (pruned {len(pruned)} unreferenced state entries)" if pruned else ""
        out.line(f"wrote {args.output}{note}")
    if args.report:
        report = build_report(
            result,
            manager=pm,
            pipeline=_canonical(pm, args.pipeline),
            input_path=str(args.input),
            output_path=str(args.output) if args.output else None,
            numerics=numerics,
        )
        write_report(args.report, report)
        out.line(f"wrote {args.report}")
    if numerics is not None and not numerics["ok"]:
        raise CliError(
            f"numerics differ: max abs diff {numerics['max_abs_diff']:.3g} exceeds "
            f"atol {args.atol:g} / rtol {args.rtol:g}",
            code=EXIT_FAILED,
        )
    return 0


def _canonical(pm: Any, text: str) -> str:
    try:
        return str(pm.to_text())
    except ValueError:
        return text


def _cmd_passes(args: argparse.Namespace, out: _Out) -> int:
    from epass.registry import list_passes

    entries = list_passes()
    if args.json:
        print(json.dumps([e.as_dict() for e in entries], indent=2))
        return 0
    rows = []
    for e in entries:
        description = f"ERROR: {e.error}" if e.error else e.description
        options = ", ".join(
            o.name if o.required else f"{o.name}={o.as_dict()['default']}" for o in e.options
        )
        rows.append([e.name, e.source, description, options])
    out.table(None, ["pass", "source", "description", "options"], rows)
    return 0


def _bytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return int(t.numel() * t.element_size())
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def inspect_program(ep: ExportedProgram) -> dict[str, Any]:
    """What ``epass inspect`` shows, as JSON-ready data."""
    from epass.records import op_histogram

    sig = ep.graph_signature
    by_dtype: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for d in (ep.state_dict, ep.constants):
        for value in d.values():
            if isinstance(value, torch.Tensor):
                entry = by_dtype[str(value.dtype).removeprefix("torch.")]
                entry[0] += 1
                entry[1] += _bytes(value)
    params = [ep.state_dict[k] for k in sig.parameters if k in ep.state_dict]
    buffers = [ep.state_dict.get(k, ep.constants.get(k)) for k in sig.buffers]
    constants = [ep.constants[k] for k in sig.lifted_tensor_constants if k in ep.constants]
    input_kinds = collections.Counter(s.kind.name.lower() for s in sig.input_specs)
    output_kinds = collections.Counter(s.kind.name.lower() for s in sig.output_specs)
    return {
        "dialect": ep.dialect,
        "nodes": len(ep.graph.nodes),
        "ops": dict(op_histogram(ep).most_common()),
        "state": {
            "state_dict_entries": len(ep.state_dict),
            "constants_entries": len(ep.constants),
            "by_dtype": {k: {"entries": v[0], "bytes": v[1]} for k, v in sorted(by_dtype.items())},
            "parameters": {"count": len(params), "bytes": sum(map(_bytes, params))},
            "buffers": {"count": len(buffers), "bytes": sum(map(_bytes, buffers))},
            "constants": {
                "count": len(sig.lifted_tensor_constants) + len(sig.lifted_custom_objs),
                "bytes": sum(map(_bytes, constants)),
            },
        },
        "signature": {
            "user_inputs": list(sig.user_inputs),
            "user_outputs": [str(o) for o in sig.user_outputs],
            "input_kinds": dict(input_kinds),
            "output_kinds": dict(output_kinds),
            "buffers_mutated": dict(sig.buffers_to_mutate),
        },
    }


def _cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    ep = load_program(args.input, trust=args.trust)
    info = inspect_program(ep)
    if args.json:
        print(json.dumps(info, indent=2))
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
    return 0


def _demo_program() -> ExportedProgram:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return torch.export.export(model, (torch.randn(2, 5, 32),))


def _demo_pipeline() -> tuple[Any, str]:
    """The ``lower`` preset when it is installed, else ``decompose``."""
    from epass.errors import RegistryError
    from epass.manager import PassManager
    from epass.pipeline import create_pass

    try:
        create_pass("lower")
        return PassManager.from_text("lower"), "lower"
    except RegistryError:
        return PassManager.from_text("decompose"), "decompose"


def _cmd_demo(args: argparse.Namespace, out: _Out) -> int:
    from epass.report import build_report, write_report

    start = time.perf_counter()
    ep = _demo_program()
    out.line(f"exported a 2-layer TransformerEncoder in {time.perf_counter() - start:.2f}s")
    pm, text = _demo_pipeline()
    if text != "lower":
        out.line("the 'lower' preset is not available here; running 'decompose'")
    out.line(f"pipeline: {text}")
    result = pm(ep)
    _summary(out, result)
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
        write_report(args.report, build_report(result, manager=pm, pipeline=text))
        out.line(f"wrote {args.report}")
    return 0


# --- argument parsing ---------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="epass", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--plain", action="store_true", help="plain text: no rich tables")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a pipeline on a .pt2 file")
    run.add_argument("input", help="an ExportedProgram saved with torch.export.save")
    run.add_argument("-p", "--pipeline", required=True, help='pipeline text, e.g. "lower"')
    run.add_argument("-o", "--output", help="write the result here (.pt2)")
    run.add_argument("--report", help="write a report (.html or .json)")
    run.add_argument("--check-numerics", action="store_true", help="compare outputs before/after")
    run.add_argument("--atol", type=float, default=1e-4, help="numerics: absolute tolerance")
    run.add_argument("--rtol", type=float, default=1e-4, help="numerics: relative tolerance")
    run.add_argument("--repro-dir", help="on a pass failure, write a reproducer here")
    run.add_argument("--steps", type=int, default=1, help="repeat the pipeline up to N times")
    run.add_argument("--trust", action="store_true", help="allow unpickling arbitrary objects")
    run.set_defaults(func=_cmd_run)

    passes = sub.add_parser("passes", help="list registered passes")
    passes.add_argument("--json", action="store_true", help="print JSON")
    passes.set_defaults(func=_cmd_passes)

    inspect = sub.add_parser("inspect", help="describe a .pt2 file")
    inspect.add_argument("input")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument("--all-ops", action="store_true", help="show every op")
    inspect.add_argument("--trust", action="store_true", help="allow unpickling arbitrary objects")
    inspect.set_defaults(func=_cmd_inspect)

    demo = sub.add_parser("demo", help="export a small transformer, lower it, show what happened")
    demo.add_argument("--report", help="write a report (.html or .json)")
    demo.set_defaults(func=_cmd_demo)
    for p in (parser, run, passes, inspect, demo):
        for flag, text in (("--debug", "show tracebacks"), ("--plain", "no rich tables")):
            if p is not parser:
                p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if not debug:
        # torch's own deprecation inside run_decompositions on loaded programs: noise
        # for a command-line user, who cannot act on it.
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning
        )
    try:
        args = build_parser().parse_args(argv)
        out = _Out(plain=args.plain)
        code: int = args.func(args, out)
        return code
    except CliError as exc:
        if debug:
            raise
        print(f"epass: error: {exc.reason}", file=sys.stderr)
        if exc.context:
            print(exc.context, file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("epass: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"epass: error: {type(exc).__name__}: {first}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

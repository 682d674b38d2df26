"""Pipeline reports: a JSON document with stable keys and a self-contained HTML page.

The JSON document (``schema: "epass.report/2"``) holds:

``schema``, ``epass_version``, ``torch_version``, ``created`` (UTC, ISO 8601),
``pipeline`` (text, or null when the pipeline has no textual form), ``input`` /
``output`` (file paths or null), ``modified``, ``shared`` (every pass's output dicts
were its input's), ``owners`` (``{"state_dict": "user" | "own", "constants": ...}``:
whether each of the output's dicts is the user's dict object or the output's own),
``seconds`` (sum over top-level passes), ``nodes_before``, ``nodes_after``,
``numerics`` (null, or ``{"max_abs_diff", "ok", "atol", "rtol", "first_drift",
"first_node"}``, where ``first_node`` is null or the first diverging node of the first
drifting pass: ``{"node", "op", "source", "max_abs", "max_rel", "compared", "became"}``),
``fallbacks`` (how many passes fell back), ``notice_count`` (the notices counted:
``"1 of 3 passes fell back"``, or ``""``), ``notices`` (every notice a pass gave,
in run order: ``{"pass", "kind", "text"}``, ``pass`` its path), and
``passes``: one object per pass run, in order, with every key of
:meth:`epass.PassRecord.as_dict` (``children`` nest the same way) plus ``path``
(``"lower/dce"`` for nested passes), ``spec`` (the pass as pipeline text, or null),
``options`` (JSON values; dtypes and operators as their text) and ``state_bytes``
(null unless a :class:`~epass.instruments.MemoryAccounting` measured the run, else
``{"bytes", "new_bytes", "released_bytes", "duplicate_bytes"}`` of the pass's
output state), and ``verdict``: ``{"status", "summary", "pass", "node", "error",
"traceback", "reproducer", "next"}`` (``node``: the first diverging node of a
drift, as text, or null), where ``status`` is ``"ok"``,
``"pass failed"``, ``"numerics drift"`` or ``"interrupted"``. A run that failed or
was interrupted is reported too (from a :class:`RunLog`): ``passes`` then holds the
passes that finished, and ``verdict`` names the one that did not.

Example::

    report = build_report(PipelineRun(result, manager=pm, pipeline="decompose"))
    write_report("report.html", report)
"""

from __future__ import annotations

import datetime
import re
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from epass._report_html import json_value, render_html
from epass._text import json_text, shown_path
from epass._version import __version__
from epass.errors import ArgumentValueError
from epass.instrumentation import Instrument
from epass.instruments import MemoryAccounting, MemoryEntry
from epass.io import atomic_write
from epass.manager import PassManager
from epass.pipeline import format_item
from epass.protocol import PassModel
from epass.records import (
    PassInfo,
    PassRecord,
    PipelineResult,
    count_text,
    fallback_count,
    notice_text,
    noticed,
    op_name,
)
from epass.registry import spec_of

__all__ = [
    "SCHEMA",
    "VERDICTS",
    "PipelineRun",
    "RunLog",
    "build_report",
    "render_html",
    "verdict",
    "write_report",
]

SCHEMA = "epass.report/2"


def _pass_spec(model: PassModel) -> tuple[str | None, dict[str, Any]]:
    spec = spec_of(model.pass_, model.name, model.origin)
    if spec is None:
        return None, {}
    try:
        text: str | None = format_item(spec)
    except ValueError:
        text = None
    return text, {k: json_value(v) for k, v in spec.options}


class _Memory:
    """MemoryAccounting's entries, taken in run order by (path, step)."""

    def __init__(self, instrument: MemoryAccounting | None) -> None:
        self.pending: dict[tuple[str, int], list[MemoryEntry]] = {}
        for e in instrument.entries if instrument is not None else ():
            self.pending.setdefault((e.path, e.step), []).append(e)

    def take(self, path: str, record: PassRecord) -> dict[str, int] | None:
        queue = self.pending.get((path, record.step))
        if record.skipped or not queue:
            return None
        e = queue.pop(0)
        return {
            "bytes": e.bytes,
            "new_bytes": e.new_bytes,
            "released_bytes": e.released_bytes,
            "duplicate_bytes": e.duplicate_bytes,
        }


def _model_at(models: Sequence[PassModel], index: int) -> PassModel | None:
    return models[index] if index < len(models) else None


def _record_dict(
    record: PassRecord,
    model: PassModel | None,
    prefix: str,
    memory: _Memory,
    diffs: Mapping[str, Any],
) -> dict[str, Any]:
    out: dict[str, Any] = json_value(record.as_dict())  # tuples become lists, as in JSON
    path = f"{prefix}{record.name}"
    spec, options = _pass_spec(model) if model is not None else (None, {})
    inner = model.children if model is not None else ()
    # MemoryAccounting records a nested pipeline's passes before the pipeline itself.
    out["children"] = [
        _record_dict(c, _model_at(inner, c.index), f"{path}/", memory, diffs)
        for c in record.children
    ]
    out["path"] = path
    out["spec"] = spec
    out["options"] = options
    out["state_bytes"] = memory.take(path, record)
    out["diff"] = diffs.get(f"{path}@{record.step}")
    return out


def _or_empty(diffs: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return {} if diffs is None else diffs


@attrs.frozen
class PipelineRun:
    """One pipeline run as a report sees it: what :func:`build_report` is made from.

    Attributes:
        result: the run's result (:meth:`RunLog.result` for a run that raised).
        manager: the pipeline that ran: its passes give each record its ``spec``
            and ``options``, and its text the report's ``pipeline``.
        pipeline: the pipeline text, when it is not the manager's own.
        input_path / output_path: the files read and written, if any.
        numerics: the ``numerics`` entry (see the module docstring), if measured.
        memory: the run's :class:`~epass.instruments.MemoryAccounting`, to fill each
            pass's ``state_bytes``.
        outcome: a :func:`verdict` for a run that did not succeed (default ``"ok"``).
        diffs: each pass's node diff, keyed ``"path@step"`` (:attr:`RunLog.diffs`).
    """

    result: PipelineResult
    manager: PassManager | None = None
    pipeline: str | None = None
    input_path: str | None = None
    output_path: str | None = None
    numerics: Mapping[str, Any] | None = None
    memory: MemoryAccounting | None = None
    outcome: Mapping[str, Any] | None = None
    diffs: Mapping[str, Any] = attrs.field(factory=dict, converter=_or_empty)

    def pipeline_text(self) -> str | None:
        """The pipeline as text: the one given, else the manager's, else None."""
        if self.pipeline is not None or self.manager is None:
            return self.pipeline
        try:
            return self.manager.to_text()
        except ValueError:
            return None


def build_report(run: PipelineRun | PipelineResult) -> dict[str, Any]:
    """The JSON-ready report of one pipeline run (see the module docstring for keys);
    a bare :class:`~epass.PipelineResult` is reported as ``PipelineRun(result)``."""
    if isinstance(run, PipelineResult):
        run = PipelineRun(run)
    result, records = run.result, run.result.records
    counted = notice_text(records)
    ran = f"{count_text(records)} ran" + (f"; {counted}" if counted else "")
    outcome = run.outcome or verdict("ok", summary=ran)
    measured = _Memory(run.memory)
    models = run.manager.models if run.manager is not None else ()
    return {
        "schema": SCHEMA,
        "epass_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "pipeline": run.pipeline_text(),
        "input": run.input_path,
        "output": run.output_path,
        "modified": result.modified,
        "shared": result.shared,
        "owners": result.owners,
        "seconds": sum(r.seconds for r in records),
        "count": count_text(records),
        "nodes_before": records[0].nodes_before if records else len(result.program.graph.nodes),
        "nodes_after": len(result.program.graph.nodes),
        "numerics": dict(run.numerics) if run.numerics is not None else None,
        "verdict": dict(outcome),
        "fallbacks": fallback_count(records),
        "notice_count": counted,
        "notices": [{"pass": path, **n.as_dict()} for path, n in noticed(records)],
        "passes": [
            _record_dict(r, _model_at(models, r.index), "", measured, run.diffs) for r in records
        ],
    }


class RunLog(Instrument):
    """Keeps a run's top-level records as they finish, and the first failure.

    A run that fails or is interrupted returns no :class:`PipelineResult`; with a
    ``RunLog`` among the instruments, :meth:`result` still gives the passes that
    finished, so the run can be reported.
    """

    def __init__(self, *, diffs: bool = True) -> None:
        self.records: list[PassRecord] = []
        self.input: ExportedProgram | None = None
        self.program: ExportedProgram | None = None
        self.failure: dict[str, Any] | None = None
        self.keep_diffs = diffs
        # "path@step" -> the pass's node diff (see graph_diff).
        self.diffs: dict[str, dict[str, Any]] = {}
        self._before: dict[str, list[tuple[str, str, str]]] = {}

    def before_pipeline(
        self, manager: Any, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self.records, self.input, self.program, self.failure = [], program, program, None
            self.diffs, self._before = {}, {}

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        if self.keep_diffs:
            self._before[f"{info.path}@{info.step}"] = _calls(program)

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        key = f"{info.path}@{info.step}"
        before = self._before.pop(key, None)
        if before is not None and record.modified:
            self.diffs[key] = graph_diff(before, _calls(program))
        if info.depth == 0:
            self.records.append(record)
            self.program = program

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        if self.failure is None:  # the innermost pass comes first
            cause = error.__cause__ or error
            frames = traceback.extract_tb(cause.__traceback__)[-3:]
            self.failure = {
                "pass": info.path,
                "error": str(error).splitlines()[0] if str(error) else type(error).__name__,
                "traceback": [f"{shown_path(f.filename)}:{f.lineno} in {f.name}" for f in frames]
                + [f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"],
            }

    def result(self) -> PipelineResult:
        """What the run produced up to now, as a result of the passes that finished."""
        if self.program is None:
            raise ArgumentValueError("RunLog.result(): the log has seen no run")
        modified = any(r.modified for r in self.records)
        return PipelineResult(self.program, modified, tuple(self.records))


# A pass's node diff lists at most this many nodes on each side.
DIFF_CAP = 60
_FILE = re.compile(r'"([^"]+)"')


def _calls(program: ExportedProgram) -> list[tuple[str, str, str]]:
    """(node name, op, source line) of each call in the program's graph."""
    out = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        trace = node.meta.get("stack_trace") or ""
        lines = [line.strip() for line in str(trace).strip().splitlines() if line.strip()]
        source = ""
        if len(lines) >= 2 and lines[-2].startswith("File "):
            where = _FILE.sub(lambda m: f'"{shown_path(m.group(1))}"', lines[-2])
            source = f"{where.removeprefix('File ')}: {lines[-1]}"
        elif lines:
            source = lines[-1]
        out.append((node.name, op_name(node.target), source))
    return out


def graph_diff(
    before: Sequence[tuple[str, str, str]], after: Sequence[tuple[str, str, str]]
) -> dict[str, Any]:
    """The calls a pass added and removed, grouped by op: a node that keeps its name
    but calls another op counts as removed and added. At most :data:`DIFF_CAP`
    nodes are listed on each side; ``capped`` says how many more there were."""
    old = {(n, op): src for n, op, src in before}
    new = {(n, op): src for n, op, src in after}
    out: dict[str, Any] = {"capped": 0}
    for side, mine, theirs in (("added", new, old), ("removed", old, new)):
        keys = [k for k in mine if k not in theirs]
        groups: dict[str, list[dict[str, str]]] = {}
        for name, op in keys[:DIFF_CAP]:
            groups.setdefault(op, []).append({"node": name, "source": mine[(name, op)]})
        out[side] = groups
        out["capped"] += max(0, len(keys) - DIFF_CAP)
    return out


VERDICTS = ("ok", "pass failed", "numerics drift", "interrupted")


def verdict(
    status: str,
    *,
    summary: str,
    pass_path: str | None = None,
    error: str | None = None,
    traceback_lines: Sequence[str] = (),
    reproducer: str | None = None,
    next_step: str | None = None,
    node: str | None = None,
) -> dict[str, Any]:
    """The report's ``verdict`` entry: what happened, where (the pass, and for a
    drift the first diverging node), and what to run next."""
    if status not in VERDICTS:
        raise ArgumentValueError(f"verdict status must be one of {VERDICTS}, got {status!r}")
    return {
        "status": status,
        "summary": summary,
        "pass": pass_path,
        "node": node,
        "error": error,
        "traceback": list(traceback_lines),
        "reproducer": reproducer,
        "next": next_step,
    }


def write_report(
    path: str | Path, report: Mapping[str, Any] | PipelineRun | PipelineResult
) -> Path:
    """Write ``report`` as JSON (``.json``) or HTML (``.html`` / ``.htm``); a run or a
    result is reported first (:func:`build_report`)."""
    if isinstance(report, (PipelineRun, PipelineResult)):
        report = build_report(report)
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        text = json_text(report) + "\n"
    elif suffix in (".html", ".htm"):
        text = render_html(report)
    else:
        raise ArgumentValueError(f"report file must end in .json or .html, got {path.name!r}")
    with atomic_write(path) as tmp:  # a reader never sees half a report
        tmp.write_text(text)
    return path

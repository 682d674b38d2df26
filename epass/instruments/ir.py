"""``PrintIR`` (graphs and graph diffs around passes) and ``OpCounts`` (op histograms)."""

from __future__ import annotations

import collections
import difflib
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs
from torch.export import ExportedProgram

from epass.errors import ArgumentValueError
from epass.instrumentation import Instrument
from epass.records import PassInfo, PassRecord, PipelineResult, op_delta, op_histogram

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = ["IRDump", "OpCountEntry", "OpCounts", "PrintIR", "format_delta", "short_op"]

PassFilter = Callable[[str], bool]


def _pass_filter(passes: str | Iterable[str] | PassFilter | None) -> PassFilter:
    if passes is None:
        return lambda name: True
    if isinstance(passes, str):
        pattern = re.compile(passes)
        return lambda name: pattern.fullmatch(name) is not None
    if callable(passes):
        return passes
    names = frozenset(passes)
    return lambda name: name in names


def _graph_text(program: ExportedProgram, form: str) -> str:
    if form == "code":
        # Generated from the graph, not read from the module: a pass that edits the
        # graph without ``recompile()`` leaves the module's code stale, and
        # recompiling here would edit the program the instrument was shown.
        code: str = program.graph_module.graph.python_code(root_module="self").src
        return code.strip("\n") + "\n"
    return str(program.graph).rstrip("\n") + "\n"


@attrs.frozen
class IRDump:
    """One piece of IR that :class:`PrintIR` emitted.

    Attributes:
        path: the pass (prefixed by enclosing pipelines).
        step: the fixed-point round.
        kind: ``"before"``, ``"after"``, ``"diff"`` or ``"failed"`` (the input of a
            pass that raised).
        text: the graph, or the unified diff.
    """

    path: str
    step: int
    kind: str
    text: str


class PrintIR(Instrument):
    """Print the graph before and/or after passes, or a unified diff of the two.

    Args:
        before: emit each selected pass's input graph.
        after: emit each selected pass's output graph.
        diff: emit a unified diff of the graph code from input to output; the
            default (None) is a diff when neither ``before`` nor ``after`` is set.
        only_changed: emit nothing for passes that left the program unmodified.
        passes: which passes to show: a name, a regular expression matched
            against the whole name, a collection of names, or a predicate.
        form: ``"code"`` (the Python code of the graph as it is, whether or not the
            pass recompiled its module) or ``"graph"`` (the fx
            graph listing).
        stream: where to write; default ``sys.stdout`` at the time of writing.
        directory: write each dump to a numbered file there instead of a stream.

    Every dump is also kept in ``dumps`` as :class:`IRDump`. When a selected pass
    raises, its input graph is emitted with kind ``"failed"``.

    Example::

        PassManager([Decompose()], instruments=[PrintIR(passes="decompose")]).run(ep)
    """

    def __init__(
        self,
        *,
        before: bool = False,
        after: bool = False,
        diff: bool | None = None,
        only_changed: bool = True,
        passes: str | Iterable[str] | PassFilter | None = None,
        form: str = "code",
        stream: IO[str] | None = None,
        directory: str | Path | None = None,
    ) -> None:
        if form not in ("code", "graph"):
            raise ArgumentValueError(f"form must be 'code' or 'graph', got {form!r}")
        self.before = before
        self.after = after
        self.diff = (not before and not after) if diff is None else diff
        self.only_changed = only_changed
        self.selected = _pass_filter(passes)
        self.form = form
        self.stream = stream
        self.directory = Path(directory) if directory is not None else None
        self.dumps: list[IRDump] = []
        self._inputs: dict[int, str] = {}

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        if not self.selected(info.name):
            return
        text = _graph_text(program, self.form)
        self._inputs[info.depth] = text
        if self.before and not self.only_changed:
            self._emit(info, "before", text)

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        before = self._inputs.pop(info.depth, None)
        if before is None or (self.only_changed and not record.modified):
            return
        if self.before and self.only_changed:
            self._emit(info, "before", before)
        after = _graph_text(program, self.form) if record.modified else before
        if self.after:
            self._emit(info, "after", after)
        if self.diff:
            path = info.path
            lines = difflib.unified_diff(
                before.splitlines(keepends=True),
                after.splitlines(keepends=True),
                fromfile=f"{path} (before)",
                tofile=f"{path} (after)",
            )
            self._emit(info, "diff", "".join(lines) or "(no change)\n")

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        before = self._inputs.pop(info.depth, None)
        if before is not None:
            self._emit(info, "failed", before)

    def _emit(self, info: PassInfo, kind: str, text: str) -> None:
        path = info.path
        dump = IRDump(path, info.step, kind, text)
        self.dumps.append(dump)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", path)
            suffix = "diff" if kind == "diff" else "py" if self.form == "code" else "txt"
            name = f"{len(self.dumps):03d}-{safe}-step{info.step}.{kind}.{suffix}"
            (self.directory / name).write_text(text)
            return
        stream = self.stream if self.stream is not None else sys.stdout
        stream.write(f"// ----- {kind} {path} (step {info.step}) -----\n{text}")


def short_op(target: str) -> str:
    """``aten.linear.default`` -> ``aten.linear``; other overloads are kept."""
    return target[: -len(".default")] if target.endswith(".default") else target


def format_delta(delta: dict[str, int]) -> str:
    """``aten.linear -1 → aten.addmm +1, aten.permute +1`` (removed ops first)."""
    gone = [f"{short_op(k)} {v:+d}" for k, v in sorted(delta.items()) if v < 0]
    new = [f"{short_op(k)} {v:+d}" for k, v in sorted(delta.items()) if v > 0]
    if not gone and not new:
        return "(no change)"
    return " → ".join(part for part in (", ".join(gone), ", ".join(new)) if part)


def _wrap(text: str, head: str, indent: str, width: int) -> list[str]:
    """Wrap a ``"op +n, op -m"`` list between items, never inside one."""
    glued = text.replace(" +", "\u00a0+").replace(" -", "\u00a0-")
    lines = textwrap.wrap(
        glued,
        width=max(width, len(head) + 30),
        initial_indent=head,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
    return [line.replace("\u00a0", " ") for line in lines]


@attrs.frozen
class OpCountEntry:
    """The call_function histogram around one pass run."""

    path: str
    step: int
    depth: int
    modified: bool
    before: collections.Counter[str]
    after: collections.Counter[str]

    @property
    def delta(self) -> dict[str, int]:
        """Nonzero count changes, by op."""
        return op_delta(self.before, self.after)

    def format_delta(self) -> str:
        return format_delta(self.delta)


class OpCounts(Instrument):
    """Histogram of call_function targets before and after every pass.

    ``entries`` holds one :class:`OpCountEntry` per pass run; ``table()`` lists
    the change each pass made, ``histogram()`` the final program's counts.

    Example::

        counts = OpCounts()
        PassManager([Decompose()], instruments=[counts]).run(ep)
        print(counts.table())   # decompose  aten.linear -1 → aten.addmm +1, ...
    """

    def __init__(self) -> None:
        self.entries: list[OpCountEntry] = []
        self.final: collections.Counter[str] = collections.Counter()
        self._before: dict[int, collections.Counter[str]] = {}

    def before_pipeline(
        self, manager: PassManager, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self.entries.clear()
            self.final = op_histogram(program)

    def after_pipeline(
        self, manager: PassManager, result: PipelineResult, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self.final = op_histogram(result.program)

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        self._before[info.depth] = op_histogram(program)

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        before = self._before.pop(info.depth, collections.Counter())
        after = op_histogram(program) if record.modified else before
        entry = OpCountEntry(info.path, info.step, info.depth, record.modified, before, after)
        self.entries.append(entry)

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        self._before.pop(info.depth, None)

    def histogram(self) -> collections.Counter[str]:
        """The op counts of the last top-level pipeline's output."""
        return collections.Counter(self.final)

    def table(self, *, top: int = 10, width: int = 100) -> str:
        """Per pass: op totals and the op delta (wrapped at ``width``); then the
        ``top`` most common ops of the final program."""
        lines = [f"{'pass':<28} {'step':>4} {'ops':>11}  delta"]
        indent = " " * 47
        for e in self.entries:
            name = "  " * e.depth + e.path.rsplit("/", 1)[-1]
            counts = f"{sum(e.before.values())}->{sum(e.after.values())}"
            head = f"{name:<28} {e.step:>4} {counts:>11}  "
            lines += _wrap(e.format_delta(), head, indent, width)
        if self.final:
            common = ", ".join(f"{short_op(k)} {v}" for k, v in self.final.most_common(top))
            head = f"final ({sum(self.final.values())} ops): "
            lines += _wrap(common, head, " " * len(head), width)
        return "\n".join(lines)

    def as_dicts(self) -> list[dict[str, Any]]:
        """JSON-ready entries."""
        return [
            {"path": e.path, "step": e.step, "depth": e.depth, "delta": e.delta}
            for e in self.entries
        ]

"""What a pipeline run leaves behind: pass infos and records, results, op counts.
Values only: they write no files (reports are :mod:`epass.report`'s)."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from torch.export import ExportedProgram

from epass._text import printable
from epass.linker import LinkReport, Owner
from epass.protocol import Notice, PassResult

__all__ = [
    "OpDelta",
    "PassInfo",
    "PassRecord",
    "PipelineResult",
    "flatten",
    "count_text",
    "fallback_count",
    "notice_lines",
    "notice_text",
    "noticed",
    "op_delta",
    "op_histogram",
    "op_name",
    "op_targets",
    "state_text",
    "total_text",
]


def op_name(target: Any) -> str:
    """The one name an op goes by in histograms, deltas, records and reports:
    ``aten.addmm.default`` for ATen overloads, ``getitem`` for Python functions."""
    name = str(target)
    if name.startswith("<"):  # "<built-in function getitem>"
        name = getattr(target, "__qualname__", name)
    return name


def state_text(skipped: bool, skip_reason: str | None, link: str | None) -> str:
    """A pass's state column, the one rendering every view uses: ``skipped: <why>``,
    ``unchanged`` (no link: the output is its input), or ``link``, the text of its
    link report (``user's dicts``, ``user's state_dict, own constants; 2 entries added; ...``)."""
    if skipped:
        return f"skipped: {skip_reason}" if skip_reason else "skipped"
    return "unchanged" if link is None else link


def op_histogram(ep: ExportedProgram) -> collections.Counter[str]:
    """How many times each call_function target occurs in the top-level graph."""
    return collections.Counter(op_name(n.target) for n in ep.graph.nodes if n.op == "call_function")


def op_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """The nonzero change of each op's count, sorted by op name."""
    keys = sorted(before.keys() | after.keys())
    return {
        k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)
    }


def op_targets(ep: ExportedProgram) -> collections.Counter[Any]:
    """How many times each call_function target object occurs in the top-level graph:
    what an op histogram is made from, counted without naming any op."""
    return collections.Counter([n.target for n in ep.graph.nodes if n.op == "call_function"])


class OpDelta(Mapping[str, int]):
    """A record's ``op_delta``, worked out from two target counts (:func:`op_targets`)
    the first time it is read: naming every op costs more than the count itself,
    and most runs never look."""

    __slots__ = ("_after", "_before", "_delta")

    def __init__(self, before: Mapping[Any, int], after: Mapping[Any, int]) -> None:
        self._before = before
        self._after = after
        self._delta: dict[str, int] | None = None

    def _value(self) -> dict[str, int]:
        if self._delta is None:
            self._delta = op_delta(_named(self._before), _named(self._after))
        return self._delta

    def __getitem__(self, key: str) -> int:
        return self._value()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._value())

    def __len__(self) -> int:
        return len(self._value())

    def __repr__(self) -> str:
        return repr(self._value())


def _named(targets: Mapping[Any, int]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for target, count in targets.items():
        out[op_name(target)] += count
    return out


@attrs.frozen
class PassInfo:
    """Which pass is about to run, or ran, and where: the manager hands one to every hook.

    Attributes:
        pass_: the pass object.
        name: its name.
        index: its position in its pipeline.
        step: the fixed-point round of that pipeline.
        depth: nesting depth (0 for the top-level pipeline).
        parent: the info of the nested pipeline (a pass of the enclosing one) that
            runs this pass; None at the top level.
        manager: the pipeline whose pass list holds this pass.
        previous: the names of the passes of this step that ran before it, in order.
    """

    pass_: Any
    name: str
    index: int
    step: int
    depth: int = 0
    parent: PassInfo | None = attrs.field(default=None, repr=False)
    manager: Any = attrs.field(default=None, repr=False, eq=False)
    previous: tuple[str, ...] = attrs.field(default=(), repr=False)

    def location(self) -> dict[str, Any]:
        """The keyword arguments that name this pass in a :class:`~epass.PassError`."""
        return {
            "pass_name": self.name,
            "index": self.index,
            "step": self.step,
            "previous": self.previous,
        }

    @property
    def path(self) -> str:
        """The pass's name prefixed by the names of the pipelines around it (``lower/cse``)."""
        names = [self.name]
        outer = self.parent
        while outer is not None:
            names.append(outer.name)
            outer = outer.parent
        return "/".join(reversed(names))


@attrs.frozen
class PassRecord:
    """What happened when one pass ran once.

    Attributes:
        name: the pass's name.
        index: its position in its pipeline.
        step: the fixed-point round.
        seconds: wall time of the pass call itself.
        modified: whether the pass changed the program.
        nodes_before / nodes_after: graph node counts around the pass.
        op_delta: change in the count of each call_function target (nonzero only),
            keyed by :func:`op_name`; an :class:`OpDelta`, which names the ops
            when first read.
        link: how the output's state was linked (None when unmodified or skipped).
        skipped: whether the pass was skipped as a no-op; ``skip_reason`` says why.
        depth: nesting depth (0 for the top-level pipeline).
        children: records of a nested pipeline's passes.
        notes: JSON-ready facts the pass reported about its run (its result's
            ``notes``), such as which method it used.
        notices: what the pass's result said its user should see (its
            ``notices``): a fallback and why, a cache that stepped aside.
    """

    name: str
    index: int
    step: int
    seconds: float
    modified: bool
    nodes_before: int
    nodes_after: int
    op_delta: Mapping[str, int] = attrs.field(factory=dict)
    link: LinkReport | None = None
    skipped: bool = False
    skip_reason: str | None = None
    depth: int = 0
    children: tuple[PassRecord, ...] = ()
    notes: Mapping[str, Any] = attrs.field(factory=dict)
    notices: tuple[Notice, ...] = ()

    @property
    def fell_back(self) -> bool:
        """Whether the pass said it fell back (a ``"fallback"`` notice)."""
        return any(n.fallback for n in self.notices)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form with stable keys."""
        return {
            "name": self.name,
            "index": self.index,
            "step": self.step,
            "seconds": self.seconds,
            "modified": self.modified,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "op_delta": dict(self.op_delta),
            "link": self.link.as_dict() if self.link is not None else None,
            "skipped": self.skipped,
            "skip_reason": self.skip_reason,
            "depth": self.depth,
            "children": [c.as_dict() for c in self.children],
            "notes": dict(self.notes),
            "notices": [n.as_dict() for n in self.notices],
        }


def flatten(records: Iterable[PassRecord]) -> Iterable[PassRecord]:
    """Every record, nested pipelines' records right after their own, depth first."""
    for r in records:
        yield r
        yield from flatten(r.children)


def count_text(records: Sequence[PassRecord]) -> str:
    """How many passes a run ran, the one way every view counts them: each row of
    the records (nested pipelines and skipped passes included), and how many of
    those rows are pipelines: ``6 passes (1 pipeline)``."""
    rows = list(flatten(records))
    pipelines = sum(1 for r in rows if r.children)
    text = f"{len(rows)} pass{'' if len(rows) == 1 else 'es'}"
    if pipelines:
        text += f" ({pipelines} pipeline{'' if pipelines == 1 else 's'})"
    return text


def total_text(records: Sequence[PassRecord], seconds: float) -> str:
    """A run's total, the one way every view writes it: ``6 passes (1 pipeline) in 0.42 s``."""
    return f"{count_text(records)} in {seconds:.2f} s"


def noticed(records: Iterable[PassRecord], prefix: str = "") -> Iterator[tuple[str, Notice]]:
    """Every notice of a run with the path of the pass that gave it (``lower/decompose``),
    in run order, nested pipelines' after their own."""
    for r in records:
        path = f"{prefix}{r.name}"
        for notice in r.notices:
            yield path, notice
        yield from noticed(r.children, f"{path}/")


def fallback_count(records: Sequence[PassRecord]) -> int:
    """How many rows of the records (as :func:`count_text` counts them) fell back."""
    return sum(1 for r in flatten(records) if r.fell_back)


def notice_text(records: Sequence[PassRecord]) -> str:
    """The notices of a run, counted the one way every view counts them: ``1 of 6
    passes fell back``, ``2 notices``, both (``1 of 6 passes fell back, 1 notice``), or
    "" when no pass gave any."""
    rows = len(list(flatten(records)))
    fell_back = fallback_count(records)
    others = sum(1 for _, n in noticed(records) if not n.fallback)
    parts = []
    if fell_back:
        parts.append(f"{fell_back} of {rows} pass{'' if rows == 1 else 'es'} fell back")
    if others:
        parts.append(f"{others} notice{'' if others == 1 else 's'}")
    return ", ".join(parts)


def notice_lines(records: Sequence[PassRecord]) -> list[str]:
    """What every text view prints for a run's notices: the count (:func:`notice_text`)
    and one line ``<pass>: <text>`` for each notice, escaped (:mod:`epass._text`);
    nothing when no pass gave any."""
    counted = notice_text(records)
    if not counted:
        return []
    return [f"{counted}:", *(printable(f"  {path}: {n.text}") for path, n in noticed(records))]


@attrs.frozen
class PipelineResult(PassResult):
    """A pipeline's output program, whether anything changed, and one record per pass run."""

    records: tuple[PassRecord, ...] = ()

    @property
    def shared(self) -> bool:
        """True when every pass's output dicts were its input's dict objects, so
        the output's dicts are the user's."""
        return all(r.link is None or r.link.shared for r in self.records)

    @property
    def owners(self) -> dict[str, Owner]:
        """Whose dict each of the output's dicts is: ``"user"`` (the very dict
        of the program the pipeline was given) or ``"own"`` (made by this run)."""
        for record in reversed(self.records):
            if record.link is not None:
                return record.link.owners
        return {"state_dict": "user", "constants": "user"}

    def summary(self) -> str:
        """A plain-text table of the records, a total line, and the notices
        (:func:`notice_lines`); every line escaped (:mod:`epass._text`)."""
        lines = [f"{'pass':<24} {'step':>4} {'seconds':>9} {'nodes':>13}  state"]
        for r in flatten(self.records):
            state = state_text(
                r.skipped, r.skip_reason, None if r.link is None else r.link.summary()
            )
            nodes = f"{r.nodes_before}->{r.nodes_after}"
            name = "  " * r.depth + r.name
            lines.append(f"{name:<24} {r.step:>4} {r.seconds:>9.4f} {nodes:>13}  {state}")
        lines.append(total_text(self.records, sum(r.seconds for r in self.records)))
        lines += notice_lines(self.records)
        return "\n".join(printable(line) for line in lines)

"""PassManager: runs passes on an ExportedProgram, verifies and links each result."""

from __future__ import annotations

import collections
import graphlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import torch
from torch.export import ExportedProgram

from epass import _program
from epass.errors import (
    OrderingError,
    PassError,
    StateConflictError,
    StateMutationError,
    VerificationError,
)
from epass.instruments import Dispatch, PassInfo
from epass.linker import Journal, LinkReport, StateLinker
from epass.protocol import PassResult, adapt, ordering_names, pass_name
from epass.verify import verify_program

__all__ = ["PassManager", "PassRecord", "PipelineResult", "coalesce", "op_histogram"]

logger = logging.getLogger("epass")


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
        op_delta: change in the count of each call_function target (nonzero only).
        link: how the output's state was linked (None when unmodified or skipped).
        skipped: whether the pass was skipped as a no-op; ``skip_reason`` says why.
        depth: nesting depth (0 for the top-level pipeline).
        children: records of a nested pipeline's passes.
        notes: what the pass said about its run (its result's ``notes``), JSON-ready.
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
        }


@attrs.frozen
class PipelineResult(PassResult):
    """A pipeline's output program, whether anything changed, and one record per pass run."""

    records: tuple[PassRecord, ...] = ()

    @property
    def shared(self) -> bool:
        """True when the output's dicts are the input's dict objects."""
        return all(r.link is None or r.link.shared for r in self.records)

    def summary(self) -> str:
        """A plain-text table of the records."""
        lines = [f"{'pass':<24} {'step':>4} {'seconds':>9} {'nodes':>13}  state"]
        for r in _flatten(self.records):
            if r.skipped:
                state = f"skipped: {r.skip_reason}"
            elif r.link is None:
                state = "unchanged"
            else:
                state = r.link.summary()
            nodes = f"{r.nodes_before}->{r.nodes_after}"
            name = "  " * r.depth + r.name
            lines.append(f"{name:<24} {r.step:>4} {r.seconds:>9.4f} {nodes:>13}  {state}")
        return "\n".join(lines)


def _flatten(records: Iterable[PassRecord]) -> Iterable[PassRecord]:
    for r in records:
        yield r
        yield from _flatten(r.children)


def op_histogram(ep: ExportedProgram) -> collections.Counter[str]:
    """How many times each call_function target occurs in the top-level graph."""
    return collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


def _op_delta(a: collections.Counter[str], b: collections.Counter[str]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in sorted(a.keys() | b.keys()) if b[k] != a[k]}


def _matches(p: Any, target: Any) -> bool:
    if isinstance(target, type):
        return isinstance(p, target)
    return bool(pass_name(p) == target)


def check_ordering(passes: Sequence[Any]) -> None:
    """Raise OrderingError when the pass order breaks a declared constraint."""
    edges: dict[int, set[int]] = {i: set() for i in range(len(passes))}  # node -> predecessors
    for i, p in enumerate(passes):
        for target in ordering_names(p, "run_before"):
            for j, q in enumerate(passes):
                if j != i and _matches(q, target):
                    edges[j].add(i)
        for target in ordering_names(p, "run_after"):
            for j, q in enumerate(passes):
                if j != i and _matches(q, target):
                    edges[i].add(j)
    try:
        tuple(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as exc:
        cycle = " -> ".join(f"{pass_name(passes[k])}@{k}" for k in exc.args[1])
        raise OrderingError(f"ordering constraints form a cycle: {cycle}") from None
    for node, preds in edges.items():
        for pred in sorted(preds):
            if pred > node:
                raise OrderingError(
                    f"pass {pass_name(passes[pred])!r} at position {pred} must run before "
                    f"pass {pass_name(passes[node])!r} at position {node}; reorder the pipeline"
                )


def coalesce(passes: Sequence[Any]) -> list[Any]:
    """Merge adjacent passes that offer it, left to right.

    A pass with a ``merge(next_pass)`` method returns one pass doing the work of both,
    or None to keep them apart; each pass decides (and documents) when that is exact.
    """
    out: list[Any] = []
    for p in passes:
        merge = getattr(out[-1], "merge", None) if out else None
        merged = merge(p) if callable(merge) else None
        if merged is None:
            out.append(p)
        else:
            logger.debug("coalesced %s into %s", pass_name(p), pass_name(out[-1]))
            out[-1] = merged
    return out


def _store_versions(ep: ExportedProgram) -> dict[tuple[str, str], int | None]:
    return {
        (label, key): _program.tensor_version(value)
        for label, d in (("state_dict", ep.state_dict), ("constants", ep.constants))
        for key, value in d.items()
    }


def _fingerprint(ep: ExportedProgram) -> dict[tuple[str, str], int]:
    import hashlib

    out: dict[tuple[str, str], int] = {}
    for label, d in (("state_dict", ep.state_dict), ("constants", ep.constants)):
        for key, value in d.items():
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                data = _program.tensor_bytes(value)
                digest = hashlib.blake2b(data, digest_size=8).digest()
                out[(label, key)] = int.from_bytes(digest, "little")
    return out


@attrs.define
class _Prepared:
    """What the manager holds while a pass runs: its view and the before-snapshots."""

    view: ExportedProgram
    versions: dict[tuple[str, str], int | None]
    prints: dict[tuple[str, str], int] | None
    nodes_before: int
    ops_before: collections.Counter[str]


class PassManager:
    """Runs a sequence of passes, verifying and linking the state after each one.

    Args:
        passes: pass objects, functions, torch.fx ``PassBase`` instances, or names
            from the registry.
        steps: repeat the whole sequence up to this many times, stopping after a
            round in which no pass modified the program.
        linker: the :class:`StateLinker` that reconciles each result's state.
        verify: run torch's verifier and the state checks after every pass.
        instruments: objects with ``before_pass`` / ``after_pass`` / ... hooks.
        fingerprint: also hash the store's tensor bytes around each pass, to catch
            writes that bypass ``_version`` (such as ``.data`` assignments).
        name: the manager's name when nested in another pipeline.

    Calling the manager returns a :class:`PipelineResult`; :meth:`run` returns the
    program alone. A manager is itself a pass, so managers nest.

    Example::

        out = PassManager([Decompose()]).run(ep)
        assert out.state_dict is ep.state_dict
    """

    changes_input = False

    def __init__(
        self,
        passes: Iterable[Any],
        *,
        steps: int = 1,
        linker: StateLinker | None = None,
        verify: bool = True,
        instruments: Sequence[Any] = (),
        fingerprint: bool = False,
        name: str = "pipeline",
    ) -> None:
        if isinstance(passes, (str, bytes)) or not isinstance(passes, Iterable):
            raise TypeError(
                f"PassManager takes a list of passes, got {type(passes).__name__}; "
                "use PassManager.from_text for a textual pipeline"
            )
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if linker is not None and not isinstance(linker, StateLinker):
            raise TypeError(f"linker must be a StateLinker, got {type(linker).__name__}")
        self.passes = coalesce([adapt(p, position=i) for i, p in enumerate(passes)])
        check_ordering(self.passes)
        self.steps = steps
        self.linker = linker if linker is not None else StateLinker()
        self.verify = verify
        self.instruments = list(instruments)
        self.fingerprint = fingerprint
        self.name = name

    def __repr__(self) -> str:
        names = ", ".join(pass_name(p) for p in self.passes)
        return f"PassManager([{names}], steps={self.steps})"

    @classmethod
    def from_text(cls, text: str, **kwargs: Any) -> PassManager:
        """Build a manager from pipeline text, such as ``"decompose, repeat(2, [dce])"``.

        Keyword arguments go to the constructor. See ``docs/pipelines.md`` for the
        grammar; errors are :class:`epass.pipeline.PipelineError` with a caret line.
        """
        from epass.pipeline import parse_pipeline

        return cls(parse_pipeline(text), **kwargs)

    def to_text(self) -> str:
        """The pipeline text that :meth:`from_text` reads back into this pipeline.

        Raises ValueError when a pass is not registered or has an option with no
        textual form. ``steps > 1`` prints as ``repeat(steps, [...])``.
        """
        from epass.pipeline import to_text

        text = to_text(self.passes)
        return f"repeat({self.steps}, [{text}])" if self.steps > 1 else text

    def run(self, ep: ExportedProgram) -> ExportedProgram:
        """Run the pipeline and return the resulting program."""
        return self._execute(ep, inherited=(), depth=0).program

    def __call__(self, ep: ExportedProgram) -> PipelineResult:
        """Run the pipeline and return the program, ``modified`` and the records."""
        return self._execute(ep, inherited=(), depth=0)

    # The pass is called straight from this loop, not from a helper: torch's tracer
    # symbolizes the whole Python stack for each node it creates without a stack
    # trace, so every frame between the caller and a retracing pass costs time
    # per node (benchmarks/bench_core.py measures a bare run_decompositions()
    # called from 20 more frames).
    def _execute(
        self, ep: ExportedProgram, *, inherited: Sequence[Any], depth: int
    ) -> PipelineResult:
        if not isinstance(ep, ExportedProgram):
            raise TypeError(
                f"{self.name} expects an ExportedProgram, got {type(ep).__name__}; "
                "call torch.export.export(module, args) first"
            )
        dispatch = Dispatch([*inherited, *self.instruments])
        if dispatch:
            dispatch.call("before_pipeline", self, ep)
        journal = Journal()
        records: list[PassRecord] = []
        current = ep
        modified = False
        try:
            for step in range(self.steps):
                round_modified = False
                ran: list[str] = []
                for index, p in enumerate(self.passes):
                    info = PassInfo(p, pass_name(p), index, step, depth)
                    where: dict[str, Any] = {
                        "pass_name": info.name,
                        "index": index,
                        "step": step,
                        "previous": tuple(ran),
                    }
                    try:
                        prepared = self._prepare(p, info, current, ep, dispatch, where)
                        if isinstance(prepared, PassRecord):  # skipped
                            record = prepared
                        else:
                            start = time.perf_counter()
                            try:
                                if isinstance(p, PassManager):
                                    out: Any = p._execute(
                                        prepared.view,
                                        inherited=dispatch.instruments,
                                        depth=depth + 1,
                                    )
                                else:
                                    out = p(prepared.view)
                            except Exception as exc:
                                self._raise_failure(p, exc, current, prepared, where)
                            seconds = time.perf_counter() - start
                            current, record = self._finish(
                                p, info, out, seconds, current, prepared, journal, dispatch, where
                            )
                    except PassError as exc:
                        self._report_failure(dispatch, info, current, exc)
                        raise
                    except Exception as exc:
                        error = PassError(f"{type(exc).__name__}: {exc}", **where)
                        self._report_failure(dispatch, info, current, error)
                        raise error from exc
                    ran.append(info.name)
                    records.append(record)
                    round_modified |= record.modified
                modified |= round_modified
                if not round_modified:
                    break
        except BaseException:
            journal.rollback()
            raise
        result = PipelineResult(current, modified, tuple(records))
        if dispatch:
            try:
                dispatch.call("after_pipeline", self, result)
            except BaseException:
                journal.rollback()
                raise
        return result

    def _prepare(
        self,
        p: Any,
        info: PassInfo,
        current: ExportedProgram,
        user: ExportedProgram,
        dispatch: Dispatch,
        where: dict[str, Any],
    ) -> _Prepared | PassRecord:
        """Check preconditions, skip a no-op, or build the pass's private view."""
        nodes_before = len(current.graph.nodes)
        requires = getattr(p, "requires", None)
        if requires is not None and requires(current) is False:
            raise PassError("its precondition (requires) does not hold", **where)
        skip_reason = getattr(p, "skip_reason", None)
        reason = skip_reason(current) if skip_reason is not None else None
        if reason:
            record = PassRecord(
                info.name, info.index, info.step, 0.0, False, nodes_before,
                nodes_before, skipped=True, skip_reason=str(reason), depth=info.depth,
            )  # fmt: skip
            logger.debug("skip %s: %s", info.name, reason)
            if dispatch:
                dispatch.call("pass_skipped", info, current, record, info=info)
            return record
        if dispatch:
            dispatch.call("before_pass", info, current, info=info)
        copy_graph = getattr(p, "changes_input", True) and _program.shares_graph(
            current.graph_module, user.graph_module
        )
        prepared = _Prepared(
            view=_program.private_view(current, copy_graph=copy_graph),
            versions=_store_versions(current),
            prints=_fingerprint(current) if self.fingerprint else None,
            nodes_before=nodes_before,
            ops_before=op_histogram(current),
        )
        logger.debug("start %s (position %d, step %d)", info.name, info.index, info.step)
        return prepared

    @staticmethod
    def _report_failure(
        dispatch: Dispatch, info: PassInfo, program: ExportedProgram, error: PassError
    ) -> None:
        # A nested pipeline reports its own failures; the outer levels do not repeat them.
        if dispatch and not getattr(error, "_reported", False):
            error._reported = True  # type: ignore[attr-defined]
            dispatch.call("pass_failed", info, program, error, info=info)

    def _raise_failure(
        self,
        p: Any,
        exc: Exception,
        current: ExportedProgram,
        prepared: _Prepared,
        where: dict[str, Any],
    ) -> NoReturn:
        """Raise the PassError for an exception the pass raised."""
        # A write into the store cannot be undone; say so rather than hide it.
        if not isinstance(exc, StateMutationError):  # a nested one already named it
            try:
                self._check_store(current, prepared.versions, prepared.prints, where)
            except StateMutationError as mutation:
                raise mutation from exc
        if not isinstance(exc, PassError):
            raise PassError(f"{type(exc).__name__}: {exc}", **where) from exc
        if isinstance(p, PassManager):
            # Same class and attributes (keys, instrument...), named at this level.
            wrapped = type(exc).__new__(type(exc))
            wrapped.__dict__.update(exc.__dict__)
            PassError.__init__(wrapped, f"in nested pipeline: {exc}", **where)
            wrapped._reported = getattr(exc, "_reported", False)  # type: ignore[attr-defined]
            raise wrapped from exc
        raise exc

    def _finish(
        self,
        p: Any,
        info: PassInfo,
        out: Any,
        seconds: float,
        current: ExportedProgram,
        prepared: _Prepared,
        journal: Journal,
        dispatch: Dispatch,
        where: dict[str, Any],
    ) -> tuple[ExportedProgram, PassRecord]:
        """Check the store, verify and link the pass's output, and record the run."""
        logger.debug("end %s in %.4fs", info.name, seconds)
        self._check_store(current, prepared.versions, prepared.prints, where)
        program, modified = _normalize(out, prepared.view, where)
        if not modified:
            # modified=False means the output is the input program, by contract.
            program = current
        elif self.verify:
            try:
                verify_program(program)
            except Exception as exc:
                raise VerificationError(
                    f"its output does not verify: {type(exc).__name__}: {exc}", **where
                ) from exc
        ensures = getattr(p, "ensures", None)
        if ensures is not None and ensures(program) is False:
            raise PassError("its postcondition (ensures) does not hold on its result", **where)
        link = None
        if modified:
            try:
                linked = self.linker.link(current, program, pass_name=info.name, journal=journal)
            except StateConflictError as exc:  # the linker knows the pass by name only
                raise StateConflictError(exc.reason, keys=exc.keys, **where) from None
            link = linked.report
        record = PassRecord(
            name=info.name,
            index=info.index,
            step=info.step,
            seconds=seconds,
            modified=modified,
            nodes_before=prepared.nodes_before,
            nodes_after=len(program.graph.nodes),
            op_delta=_op_delta(prepared.ops_before, op_histogram(program)) if modified else {},
            link=link,
            depth=info.depth,
            children=out.records if isinstance(p, PassManager) else (),
            notes=dict(getattr(out, "notes", None) or {}),
        )
        if dispatch:
            dispatch.call("after_pass", info, program, record, info=info)
        return program, record

    @staticmethod
    def _check_store(
        ep: ExportedProgram,
        versions: dict[tuple[str, str], int | None],
        prints: dict[tuple[str, str], int] | None,
        where: dict[str, Any],
    ) -> None:
        touched = [
            f"{label}:{key}"
            for (label, key), v in _store_versions(ep).items()
            if versions.get((label, key)) != v
        ]
        if prints is not None:
            after = _fingerprint(ep)
            touched += [
                f"{label}:{key}"
                for (label, key), h in prints.items()
                if after.get((label, key)) != h and f"{label}:{key}" not in touched
            ]
        if touched:
            raise StateMutationError(
                f"it wrote in place into shared state tensors {touched}; a pass must "
                "create new tensors instead of mutating the ones it is given",
                keys=touched,
                **where,
            )


def _normalize(
    out: Any, view: ExportedProgram, where: dict[str, Any]
) -> tuple[ExportedProgram, bool]:
    if isinstance(out, ExportedProgram):
        return out, out is not view
    if isinstance(out, PassResult):
        return out.program, out.modified
    program = getattr(out, "program", None)
    flag = getattr(out, "modified", None)
    if isinstance(program, ExportedProgram) and isinstance(flag, bool):
        return program, flag
    raise PassError(
        f"it returned {out!r} ({type(out).__name__}); a pass must return an "
        "ExportedProgram or a PassResult(program, modified)",
        **where,
    )

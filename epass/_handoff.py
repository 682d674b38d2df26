"""The one shape of every hand-off to a consumer: run the pipeline, give the consumer
a private program, serve its own ``run_decompositions`` calls through epass (the
switch), check that it wrote nothing into the shared tensors, relink what it hands
back. A consumer whose decomposition is known to come first (the ONNX exporter) may
have the pipeline run there instead, lowering to the consumer's own table."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from torch.export import ExportedProgram

from epass import _program, _served, _switch
from epass.errors import EpassError, StateMutationError
from epass.io import prune
from epass.linker import LinkReport, StateLinker
from epass.manager import PassManager, PipelineResult, as_pipeline
from epass.passes.constant_fold import ConstantFold
from epass.passes.cse import CSE
from epass.passes.dce import DeadCodeElimination
from epass.passes.decompose import Decompose
from epass.passes.remove_assertions import RemoveAssertions
from epass.records import PassRecord
from epass.watch import StoreWatch

__all__ = ["HandOff", "private_program", "start"]

logger = logging.getLogger("epass")

T = TypeVar("T")

_FIELDS = ("state_dict", "constants")

# One consumer call at a time in the process: ExecuTorch's to_edge and the ONNX
# exporter fail when two threads run them at once (they share the fake tensor mode
# of the program's values and register kernels on first use), plain as under epass.
_CONSUMER = threading.RLock()


def private_program(program: ExportedProgram) -> ExportedProgram:
    """A program a consumer may edit and keep: its own graph, signature and dicts,
    holding ``program``'s tensor objects, and only the entries its signature
    references (consumers read whole dicts: TVM binds every ``constants`` value in
    order, ExecuTorch rejects a constant without an input spec)."""
    return prune(_program.private_view(program, copy_graph=True))


@attrs.frozen
class HandOff:
    """One hand-off in progress.

    Attributes:
        consumer: the consumer's name, used in errors and link reports.
        programs: per method, the pipeline's output (sharing the user's state), or
            the user's program without a pipeline or while its pipeline is deferred.
        pipelines: per method, the pipeline's result (empty without a pipeline).
        private: per method, the program the consumer is given
            (:func:`private_program` of ``programs``).
        sources: per method, the user's program; link reports call its dicts the
            user's.
        served: the consumer's ``run_decompositions`` calls, served by epass while
            :meth:`call` runs (None: the caller opted out, and torch's own method
            runs).
        deferred: the pipelines that run at the consumer's first decomposition of
            each private program instead of before the hand-off (see :func:`start`);
            ``pipelines`` and ``programs`` get their results there.
    """

    consumer: str
    programs: dict[str, ExportedProgram]
    pipelines: dict[str, PipelineResult]
    private: Mapping[str, ExportedProgram]
    sources: Mapping[str, ExportedProgram]
    served: _served.DecompositionLog | None = None
    deferred: _Deferred | None = None

    def call(self, convert: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``convert(*args, **kwargs)``, checked on every exit: a consumer that writes
        into a tensor of the private programs (the user's tensors) is named in a
        :class:`~epass.StateMutationError` chained to whatever it raised, whether it
        returned, raised, called ``sys.exit()`` or was interrupted. A consumer that
        wrote nothing has its ``SystemExit`` or ``KeyboardInterrupt`` re-raised as it
        was. While it runs, its ``run_decompositions`` calls are served by epass
        (unless :attr:`served` is None); a served result of a private program holds
        that program's dicts. Hand-offs in other threads wait for it to return."""
        watch = StoreWatch.of(self.private.values(), fingerprint=True)
        try:
            with _CONSUMER, self._serving():
                out = convert(*args, **kwargs)
        except BaseException as exc:
            self._raise_failure(watch, exc)
            raise
        # a pipeline's failure the consumer went on without
        self._raise_failure(watch, None)
        if self.deferred is not None and self.deferred.pending:
            raise EpassError(
                f"{self.consumer} returned without decomposing "
                f"{', '.join(sorted(self.deferred.pending))}, so the pipeline given "
                "for it never ran; pass serve_decompositions=False to run the "
                "pipeline before the hand-off"
            )
        return out

    def _raise_failure(self, watch: StoreWatch, exc: BaseException | None) -> None:
        """Raise the deferred pipeline's own error where it failed (not the consumer's
        wrapping of it), or a write into the shared tensors it does not explain."""
        failure = None if self.deferred is None else self.deferred.failure
        both = f"{self.consumer}, or the pipeline run in it,"
        if failure is None:
            # a pipeline that ran in the consumer's call wrote in the same span
            ran = self.deferred is not None and bool(self.deferred.handed)
            self._check(watch, exc, both if ran else None)
        elif not isinstance(failure, StateMutationError):  # that one names the pass
            self._check(watch, failure, both)
        if failure is not None:
            failure.__suppress_context__ = True
            raise failure from failure.__cause__

    def _serving(self) -> contextlib.AbstractContextManager[Any]:
        if self.served is None:  # the caller's choice, over any switch around it
            return _switch.torchs_method()
        lowering = None if self.deferred is None else self._lower
        return _switch.switched(private=self.private.values(), log=self.served, lowering=lowering)

    def _lower(self, ep: ExportedProgram, table: Any, check: bool | None) -> _switch.Lowered | None:
        """The deferred pipeline of the private program ``ep``, run at the consumer's
        first decomposition of it with every table-less ``Decompose`` taking the
        consumer's ``table``; where epass cannot take that table, the pipeline as
        given, and the call is served on its output as any other.

        The pipeline runs as it would before the hand-off: on ``ep``'s graph and on
        copies of the user's whole dicts (a pass naming a new entry sees every key),
        and its output is kept as it made it. The consumer gets a copy holding only
        what the output's signature references (:func:`private_program`; the graph
        too unless only epass's code saw the output and the caller shows it to
        nobody), since it may write into the program its decomposition returns and
        edit its graph."""
        deferred = self.deferred
        assert deferred is not None
        name = next((n for n, p in self.private.items() if p is ep), None)
        manager = None if name is None else deferred.take(name)
        if name is None or manager is None:
            return None
        retabled = None if table is _switch.NOT_TAKEN else _taken(manager, table, check)
        source = self.sources[name]
        given = _program.private_view(ep, copy_graph=False, copy_state=False)
        _program.set_state(given, dict(source.state_dict), dict(source.constants))
        try:
            result = (manager if retabled is None else retabled)(given)
        except BaseException as exc:
            deferred.failure = exc
            raise
        self._keep(name, result)
        # (the switch serves a program it is handed on a graph of its own)
        copy_graph = retabled is not None and (deferred.shown or not _closed(manager))
        program = prune(
            _program.private_view(result.program, copy_graph=copy_graph, copy_state=False)
        )
        deferred.handed[name] = {f: frozenset(getattr(program, f)) for f in _FIELDS}
        if retabled is None:  # served on that program as on any other
            return _switch.Lowered(program)
        return _switch.Lowered(program, *_how(result.records), pipeline=manager.name)

    def _keep(self, name: str, result: PipelineResult) -> None:
        """Record the deferred pipeline's result for ``name``, its program linked to
        the user's dicts as a pipeline run before the hand-off would have left it
        (the user's dict objects where it holds the same entries or fewer)."""
        # the linker gives the view dicts of its own (the user's, or new ones)
        program = _program.private_view(result.program, copy_graph=False, copy_state=False)
        source = self.sources[name]
        StateLinker().link(source, program, pass_name=self.consumer, user=source)
        self.pipelines[name] = attrs.evolve(result, program=program)
        self.programs[name] = program

    def handed(self, name: str) -> dict[str, frozenset[str]] | None:
        """The keys of the dicts (``state_dict``, ``constants``) of the program the
        deferred pipeline of ``name`` made for the consumer, as handed over, or None
        where no pipeline ran at the consumer's decomposition."""
        return None if self.deferred is None else self.deferred.handed.get(name)

    def _check(
        self, watch: StoreWatch, cause: BaseException | None, who: str | None = None
    ) -> None:
        touched = watch.touched()
        if touched:
            raise StateMutationError(
                f"{who or self.consumer} wrote in place into shared state tensors "
                f"{touched}; the user's model holds these tensors",
                keys=touched,
            ) from cause

    def relink(self, name: str, exported: ExportedProgram) -> LinkReport:
        """Point ``exported`` (a program the consumer built or kept) at the dicts and
        tensor objects of ``programs[name]`` wherever it holds the same entries, and
        return the link report (the StateLinker's ``share`` policy: the user's dicts
        never gain an entry)."""
        report = (
            StateLinker()
            .link(self.programs[name], exported, pass_name=self.consumer, user=self.sources[name])
            .report
        )
        logger.debug("%s: %s: %s", self.consumer, name, report.summary())
        return report


@attrs.define(eq=False)
class _Deferred:
    """The pipelines still to run at a consumer's decomposition, and the error one of
    them raised there (which the consumer may have wrapped in its own)."""

    pending: dict[str, PassManager]
    # The caller shows the pipelines' programs to the user (ExecuTorch's result):
    # the consumer always gets a copy of their graphs.
    shown: bool = False
    failure: BaseException | None = None
    handed: dict[str, dict[str, frozenset[str]]] = attrs.field(factory=dict)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def take(self, name: str) -> PassManager | None:
        with self.lock:
            return self.pending.pop(name, None)


def start(
    sources: Mapping[str, ExportedProgram],
    pipeline: Any,
    consumer: str,
    *,
    serve: bool = True,
    at_decomposition: bool = False,
    shown: bool = False,
) -> HandOff:
    """Run ``pipeline`` (see :func:`~epass.manager.as_pipeline`) on every program of
    ``sources`` and build the private programs the consumer gets; ``serve``: serve
    the consumer's ``run_decompositions`` calls through epass.

    ``at_decomposition``: for a consumer that decomposes each program it is given
    before it reads anything else of it, with a table of its own (the ONNX
    exporter, ExecuTorch's ``to_edge``). Where the pipeline holds a ``Decompose``
    without a table (torch's default) followed by table-blind passes alone
    (:func:`_deferrable`) and calls are served, the pipeline runs instead at the
    consumer's first ``run_decompositions`` call on each private program, that
    ``Decompose`` taking the consumer's table: the consumer gets the program its own
    decomposition makes, cleaned up by the rest of the pipeline, rather than a
    core-ATen program decomposed again. ``shown``: the caller gives the pipelines'
    programs to the user, so the consumer never gets their graphs."""
    manager = as_pipeline(pipeline)
    deferred = serve and at_decomposition and manager is not None and _deferrable(manager)
    pipelines: dict[str, PipelineResult] = {}
    programs: dict[str, ExportedProgram] = {}
    for name, ep in sources.items():
        if manager is not None and not deferred:
            pipelines[name] = manager(ep)
            programs[name] = pipelines[name].program
        else:
            programs[name] = ep
    private = {name: private_program(p) for name, p in programs.items()}
    served = _served.DecompositionLog() if serve else None
    later = None
    if deferred and manager is not None:
        later = _Deferred({name: manager for name in sources}, shown=shown)
    return HandOff(consumer, programs, pipelines, private, dict(sources), served, later)


# Passes that neither match operators nor make new ones: after the consumer's
# decomposition they do what they would do after torch's core-ATen one.
_TABLE_BLIND = (RemoveAssertions, ConstantFold, CSE, DeadCodeElimination)


def _deferrable(manager: PassManager) -> bool:
    """Whether ``manager`` may run at the consumer's decomposition: it holds a
    table-less ``Decompose``, and after the first one (or anywhere in a repeated
    manager, whose later rounds run it after) only such ``Decompose`` steps and
    epass's table-blind passes. A pass that matches core ATen (``ReplaceOps`` on
    ``addmm``) or makes operators the consumer would decompose runs as written, as
    does a manager whose linker writes into the user's dicts or refuses changed
    values (the deferred pipeline links to private dicts)."""
    seen = False

    def allowed(group: PassManager, repeated: bool) -> bool:
        nonlocal seen
        if type(group) is not PassManager or group.linker.policy != "share":
            return False
        for step in group.passes:
            if isinstance(step, PassManager):
                if not allowed(step, repeated or step.steps > 1):
                    return False
            elif _table_less(step):
                seen = True
            elif type(step) not in _TABLE_BLIND and (seen or repeated):
                return False
        return True

    return allowed(manager, manager.steps > 1) and seen


def _retabled(manager: PassManager, table: Any, check: bool | None) -> PassManager | None:
    """``manager`` with every ``Decompose`` that has no table, keeps nothing and has no
    rewrite limit taking ``table`` instead (nested managers too), or None where it
    holds none. Raises what ``Decompose`` raises for a table it does not take."""
    if type(manager) is not PassManager:
        return None
    passes: list[Any] = []
    changed = False
    for step in manager.passes:
        if _table_less(step):
            step = attrs.evolve(step, table=table, check=step.check if check is None else check)
            changed = True
        elif type(step) is PassManager:  # a subclass may run its passes otherwise
            inner = _retabled(step, table, check)
            if inner is not None:
                step, changed = inner, True
        passes.append(step)
    if not changed:
        return None
    return PassManager(
        passes,
        steps=manager.steps,
        linker=manager.linker,
        verify=manager.verify,
        instruments=manager.instruments,
        fingerprint=manager.fingerprint,
        name=manager.name,
    )


def _closed(manager: PassManager) -> bool:
    """Whether only epass's code saw the programs ``manager`` made: it has no
    instruments and holds only table-less ``Decompose`` steps and table-blind passes
    (nested managers too). Any other pass, or an instrument, may keep a program
    (a pass's output that the next one leaves unchanged is the pipeline's output)."""
    return not manager.instruments and all(_epass_only(step) for step in manager.passes)


def _epass_only(step: Any) -> bool:
    if type(step) is PassManager:
        return _closed(step)
    return _table_less(step) or type(step) in _TABLE_BLIND


def _table_less(step: Any) -> bool:
    return (
        type(step) is Decompose  # a subclass may read its table otherwise
        and step.table is None
        and not step.keep
        and step.max_rewrites is None
    )


def _taken(manager: PassManager, table: Any, check: bool | None) -> PassManager | None:
    """:func:`_retabled`, or None where ``Decompose`` does not take the table."""
    try:
        return _retabled(manager, table, check)
    except EpassError:
        return None


def _how(records: tuple[PassRecord, ...]) -> tuple[str, str | None, int | None]:
    """How the last ``Decompose`` among ``records`` (nested ones too) made its
    program, as the switch's log says it."""
    found = [r for r in _flattened(records) if r.name == Decompose.name and "method" in r.notes]
    if not found:  # the manager skipped it: nothing to decompose
        return "no-op", None, 0
    notes, modified = found[-1].notes, found[-1].modified
    if notes["method"] == "incremental":
        return ("incremental" if modified else "no-op"), None, notes.get("rewritten")
    return "retrace", notes.get("fallback") or notes.get("decision"), None


def _flattened(records: tuple[PassRecord, ...]) -> list[PassRecord]:
    return [r for record in records for r in (record, *_flattened(record.children))]

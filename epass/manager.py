"""PassManager: runs passes on an ExportedProgram, verifying and linking each result.

The passes given are resolved into a plan by :mod:`epass.planning`, with the manager as
the class its groups nest as; what each pass left is checked by :mod:`epass._outcome`.

One concept: running a pipeline, in the steps each pass goes through (prepare its view,
call it, check what it wrote and returned, verify, link, record).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import torch
from torch.export import ExportedProgram

from epass import (
    _heap,
    _lease,
    _outcome,
    _program,
    _snapshot,
    _validated,
    building,
    planning,
    protocol,
    verification,
)
from epass.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    PassError,
    StateConflictError,
    StateMutationError,
)
from epass.instrumentation import Dispatch, instrument_list
from epass.linker import STORE_LOCK, Journal, StateLinker
from epass.protocol import FxPass, PassModel
from epass.records import OpDelta, PassInfo, PassRecord, PipelineResult, op_targets
from epass.watch import StoreWatch

__all__ = [
    "PassManager",
    "PassRecord",
    "PipelineResult",
    "as_pipeline",
    "create_pass",
    "resolve_pass",
    "to_text",
]

logger = logging.getLogger("epass")


@attrs.define
class _Run:
    """What the passes of one pipeline run share."""

    dispatch: Dispatch
    journal: Journal
    # Whose dicts the link reports call the user's: a nested pipeline's are the
    # outermost caller's.
    user: ExportedProgram
    current: ExportedProgram
    # current's graph module while only epass's own code has held it since this run
    # made it (docs/concepts.md, "Who may edit what"): the one graph a pass may be
    # given to edit in place.
    owned: torch.fx.GraphModule | None = None
    # current's call_function target count, while no pass has edited it since.
    targets: Counter[Any] | None = None
    # The verification's walk over current's calls, while current is the program
    # it checked (it serves the checks of a pass that edits current in place).
    walk: tuple[ExportedProgram, verification.CallWalk] | None = None


@attrs.define
class _Prepared:
    """What the manager holds while a pass runs: its view and the before-snapshot."""

    model: PassModel
    view: ExportedProgram
    snapshot: _outcome.Snapshot
    nodes_before: int
    # The graph module an epass pass may edit without reaching a program anyone
    # outside epass's code holds (a copy made for it, or the run's own), else None.
    private_gm: torch.fx.GraphModule | None
    # current's target count, when the pass gets current's own graph (else it is
    # counted after the pass, and only when the pass modified the program).
    targets_before: Counter[Any] | None
    # For a built-in pass: what it may edit in place and the graphs it built
    # (epass._graph.editable_graph), else None.
    lease: _lease.Lease | None = None
    # What the output's checks compare with when the pass may edit current's graph
    # in place (verification.before, read before it ran), else None: current itself.
    source: verification.Before | None = None
    seconds: float = 0.0
    # What the manager says of the pass beyond its own result (a skip it could not
    # decide, a flag it did not keep).
    notices: tuple[protocol.Notice, ...] = ()


def _checked(model: PassModel) -> bool:
    """Whether nothing ``model``'s pass declares is believed: a pass epass does not
    define (epass's own passes hold a lease), other than a nested pipeline and an
    :class:`FxPass` (epass's code, which run what they hold under the same rules).
    It gets a private copy and a snapshot, and its output is never the run's own."""
    p = model.pass_
    return not (model.takes_lease or isinstance(p, PassManager) or type(p) is FxPass)


def _output(
    returned: _outcome.Returned, prepared: _Prepared, current: ExportedProgram
) -> tuple[ExportedProgram, bool]:
    """The program the run goes on with after a pass, and whether it is new."""
    program = returned.program
    if not returned.modified:
        # modified=False means the output is the input program, by contract.
        return current, False
    if program is not prepared.view or _checked(prepared.model):
        # The linker re-points the output at the store's dicts; a program held
        # outside epass's code (the caller's own input, a memoized earlier result,
        # a view its pass may have kept) is never re-pointed.
        program = _program.shallow_clone(program)
    return program, True


def _notices(
    out: Any, prepared: _Prepared, returned: _outcome.Returned
) -> tuple[protocol.Notice, ...]:
    """What the pass's record says: the pass's own notices, then the manager's (a
    skip it could not decide, a flag it did not keep, a plain path its lease took)."""
    stepped_aside = [] if prepared.lease is None else prepared.lease.stepped_aside
    return (
        *protocol.notices_of(out),
        *prepared.notices,
        *returned.notices,
        *(protocol.Notice("torch", why) for why in stepped_aside),
    )


class PassManager:
    """Runs a sequence of passes, verifying and linking the state after each one.

    Args:
        passes: pass objects, functions, torch.fx ``PassBase`` instances, names
            from the registry or pipeline text, or what :mod:`epass.building` built.
        steps: repeat the whole sequence up to this many times, stopping after a
            round in which no pass modified the program.
        linker: the :class:`StateLinker` that reconciles each result's state.
        verify: run torch's verifier and the state checks after every pass.
        instruments: objects with ``before_pass`` / ``after_pass`` / ... hooks.
        fingerprint: also hash the store's tensor bytes, dtype, shape, strides and
            storage offset around each pass, to catch writes that bypass
            ``_version`` (such as ``.data`` assignments).
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
            raise ArgumentTypeError(
                f"PassManager takes a list of passes, got {type(passes).__name__}; "
                "use PassManager.from_text for a textual pipeline"
            )
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ArgumentValueError(f"steps must be a positive int, got {steps!r}")
        if linker is not None and not isinstance(linker, StateLinker):
            raise ArgumentTypeError(f"linker must be a StateLinker, got {type(linker).__name__}")
        self.models: tuple[PassModel, ...] = planning.plan(passes, PassManager)
        self.steps = steps
        self.linker = linker if linker is not None else StateLinker()
        self.verify = verify
        self.instruments = instrument_list(instruments)
        self.fingerprint = fingerprint
        self.name = name

    @property
    def passes(self) -> list[Any]:
        """The pass objects, in order, after merging: those given (names made into
        passes, torch.fx passes wrapped in :class:`~epass.FxPass`)."""
        return [m.pass_ for m in self.models]

    def __repr__(self) -> str:
        names = ", ".join(m.name for m in self.models)
        return f"PassManager([{names}], steps={self.steps})"

    @classmethod
    def from_text(cls, text: str, **kwargs: Any) -> PassManager:
        """Build a manager from pipeline text, such as ``"decompose, repeat(2, [dce])"``.

        Keyword arguments go to the constructor. See ``docs/pipelines.md`` for the
        grammar; errors are :class:`epass.PipelineError` with a caret line.
        """
        return cls(building.build_text(text), **kwargs)

    def to_text(self) -> str:
        """The pipeline text that :meth:`from_text` reads back into this pipeline.

        Raises ValueError when a pass is not registered or has an option with no
        textual form. ``steps > 1`` prints as ``repeat(steps, [...])``.
        """
        text = planning.to_text(self.models, PassManager)
        return f"repeat({self.steps}, [{text}])" if self.steps > 1 else text

    def run(self, ep: ExportedProgram) -> ExportedProgram:
        """Run the pipeline and return the resulting program."""
        with _heap.old_objects_frozen():
            return self._execute(ep, inherited=(), parent=None).program

    def __call__(self, ep: ExportedProgram) -> PipelineResult:
        """Run the pipeline and return the program, ``modified`` and the records."""
        with _heap.old_objects_frozen():
            return self._execute(ep, inherited=(), parent=None)

    # The pass is called straight from this loop, not from a helper: torch's tracer
    # symbolizes the whole Python stack for each node it creates without a stack
    # trace, so every frame between the caller and a retracing pass costs time
    # per node (benchmarks/bench_core.py measures a bare run_decompositions()
    # called from 20 more frames).
    def _execute(
        self,
        ep: ExportedProgram,
        *,
        inherited: Sequence[Any],
        parent: PassInfo | None,
        user: ExportedProgram | None = None,
    ) -> PipelineResult:
        run = self._start(ep, inherited, parent, user)
        depth = 0 if parent is None else parent.depth + 1
        records: list[PassRecord] = []
        modified = False
        try:
            for step in range(self.steps):
                round_modified = False
                ran: list[str] = []
                for index, model in enumerate(self.models):
                    p = model.pass_
                    info = PassInfo(
                        p, model.name, index, step, depth, parent, self, previous=tuple(ran)
                    )
                    try:
                        prepared = self._prepare(model, info, run)
                        if isinstance(prepared, PassRecord):  # skipped
                            record = prepared
                        else:
                            start = time.perf_counter()
                            try:
                                if isinstance(p, PassManager):
                                    out: Any = p._execute(
                                        prepared.view,
                                        inherited=run.dispatch.instruments,
                                        parent=info,
                                        user=run.user,
                                    )
                                else:
                                    with _lease.granted(prepared.lease):
                                        out = p(prepared.view)
                            # sys.exit() in a pass fails that pass; the process goes on.
                            except (Exception, SystemExit) as exc:
                                self._raise_failure(p, info, exc, prepared)
                            prepared.seconds = time.perf_counter() - start
                            record = self._finish(run, info, out, prepared)
                    except PassError as exc:
                        self._report_failure(run.dispatch, info, run.current, exc)
                        raise
                    except Exception as exc:
                        error = PassError(f"{type(exc).__name__}: {exc}", **info.location())
                        self._report_failure(run.dispatch, info, run.current, error)
                        raise error from exc
                    ran.append(info.name)
                    records.append(record)
                    round_modified |= record.modified
                modified |= round_modified
                if not round_modified:
                    break
        except BaseException:
            run.journal.rollback()
            raise
        return self._end(run, PipelineResult(run.current, modified, tuple(records)), parent)

    def _start(
        self,
        ep: ExportedProgram,
        inherited: Sequence[Any],
        parent: PassInfo | None,
        user: ExportedProgram | None,
    ) -> _Run:
        """Check the input and tell the instruments a pipeline starts."""
        if not isinstance(ep, ExportedProgram):
            raise ArgumentTypeError(
                f"{self.name} expects an ExportedProgram, got {type(ep).__name__}; "
                "call torch.export.export(module, args) first"
            )
        dispatch = Dispatch([*inherited, *self.instruments])
        if dispatch:
            dispatch.call("before_pipeline", self, ep, parent=parent)
        return _Run(dispatch, Journal(), ep if user is None else user, ep)

    def _end(self, run: _Run, result: PipelineResult, parent: PassInfo | None) -> PipelineResult:
        """Tell the instruments the pipeline ended, then keep its store writes."""
        if run.dispatch:
            try:
                run.dispatch.call("after_pipeline", self, result, parent=parent)
            except BaseException:
                run.journal.rollback()
                raise
        run.journal.commit()
        return result

    def _prepare(self, model: PassModel, info: PassInfo, run: _Run) -> _Prepared | PassRecord:
        """Check preconditions, skip a no-op, or build the pass's private view."""
        p, current, dispatch = model.pass_, run.current, run.dispatch
        nodes_before = len(current.graph.nodes)
        checked = _checked(model)
        copy_graph, lease, may_edit = self._ownership(model, run)
        # A nested pipeline reads the current dicts as they are (it never inserts
        # into them, and its own passes get copies), so that its link reports say
        # whose dicts its outputs hold; one with the in_place policy gets copies,
        # since it would write into them.
        copy_state = not isinstance(p, PassManager) or p.linker.policy == "in_place"
        with STORE_LOCK:  # a consistent copy while other runs write the store
            view = _program.private_view(current, copy_graph=copy_graph, copy_state=copy_state)
            watch = StoreWatch.of([current], fingerprint=self.fingerprint)
        # Such a pass's hooks see the copy the pass will get, never current itself.
        seen = view if checked else current
        if model.requires is not None and model.requires(seen) is False:
            raise PassError("its precondition (requires) does not hold", **info.location())
        notices: tuple[protocol.Notice, ...] = ()
        reason = model.skip_reason(seen) if model.skip_reason is not None else None
        if isinstance(reason, protocol.Notice):  # it could not tell: run it, and say why
            notices, reason = (reason,), None
        if reason:
            return self._skip(info, run, str(reason), nodes_before)
        if dispatch:
            dispatch.call("before_pass", info, current, info=info)
        # Only a checked pass's snapshot tells what it did: its copy against current.
        program = _snapshot.ProgramSnapshot(view, copied_from=current) if checked else None
        # A pass handed current's own graph could edit it: count its ops first.
        if not copy_graph and run.targets is None:
            run.targets = op_targets(current)
        source = None
        if may_edit and self.verify:  # current will not show what it was
            walk = run.walk[1] if run.walk is not None and run.walk[0] is current else None
            source = verification.before(current, walk)
        prepared = _Prepared(
            model=model,
            view=view,
            snapshot=_outcome.Snapshot(view, watch, program),
            nodes_before=nodes_before,
            private_gm=view.graph_module if copy_graph else run.owned,
            targets_before=None if copy_graph else run.targets,
            lease=lease,
            source=source,
            notices=notices,
        )
        if may_edit:  # current's count would not survive an edit in place
            run.targets = None
        logger.debug("start %s (position %d, step %d)", info.name, info.index, info.step)
        return prepared

    @staticmethod
    def _ownership(model: PassModel, run: _Run) -> tuple[bool, _lease.Lease | None, bool]:
        """Whether the pass gets a copy of current's graph, its lease, and whether
        it may edit current's graph in place.

        Only epass's own passes may edit a graph in place, and only current's while
        the run owns it: a graph this run made that no code outside epass has seen
        (no instrument watches, no pass that is not epass's got it or returned it,
        and it is not the caller's). Every other pass gets a private copy.
        """
        if _checked(model):
            return True, None, False
        own = not (
            bool(run.dispatch)
            or run.current.graph_module is not run.owned
            or _lease.shares_graph(run.current.graph_module, run.user.graph_module)
        )
        copy_graph = model.changes_input and not own
        # A built-in pass copies for itself what it edits, unless it holds a lease
        # on current's graph; under a lease, the graphs it builds are recorded (no
        # one else holds them, so its output is this run's own). Instruments see
        # every program, so no program is the run's own while they watch.
        lease = None
        if model.takes_lease and not run.dispatch:
            lease = _lease.Lease(run.current.graph_module if own else None)
        may_edit = (model.changes_input or lease is not None) and own
        return copy_graph, lease, may_edit

    @staticmethod
    def _skip(info: PassInfo, run: _Run, reason: str, nodes: int) -> PassRecord:
        """The record of a pass skipped as a no-op, told to the instruments."""
        record = PassRecord(
            info.name,
            info.index,
            info.step,
            0.0,
            False,
            nodes,
            nodes,
            skipped=True,
            skip_reason=reason,
            depth=info.depth,
        )
        logger.debug("skip %s: %s", info.name, reason)
        if run.dispatch:
            run.dispatch.call("pass_skipped", info, run.current, record, info=info)
        return record

    @staticmethod
    def _report_failure(
        dispatch: Dispatch, info: PassInfo, program: ExportedProgram, error: PassError
    ) -> None:
        # A nested pipeline reports its own failures; the outer levels do not repeat them.
        if dispatch and not error.reported:
            error.reported = True
            dispatch.call("pass_failed", info, program, error, info=info)

    def _raise_failure(
        self, p: Any, info: PassInfo, exc: Exception | SystemExit, prepared: _Prepared
    ) -> NoReturn:
        """Raise the PassError for an exception the pass raised."""
        # A write into the store cannot be undone; say so rather than hide it.
        if not isinstance(exc, StateMutationError):  # a nested one already named it
            try:
                _outcome.check_store(prepared.snapshot, info)
            except StateMutationError as mutation:
                raise mutation from exc
        if not isinstance(exc, PassError):
            raise PassError(f"{type(exc).__name__}: {exc}", **info.location()) from exc
        if isinstance(p, PassManager):
            # Same error object, class and attributes (keys, instrument...), named at
            # this level.
            exc.nest(**info.location())
        raise exc

    def _check_output(
        self, run: _Run, info: PassInfo, prepared: _Prepared, program: ExportedProgram
    ) -> list[Any] | None:
        """Verify a pass's changed output; its call targets, None when unverified."""
        if not prepared.model.takes_lease:
            # A mark of validation is believed only on a program that no code outside
            # epass has held since it was made; this one came from such code.
            _validated.forget_validated(program)
        if self.verify:
            source = run.current if prepared.source is None else prepared.source
            walk = _outcome.verify_output(program, source, info, run.walk and run.walk[1])
            run.walk = (program, walk)
            return walk.targets
        return None

    def _finish(self, run: _Run, info: PassInfo, out: Any, prepared: _Prepared) -> PassRecord:
        """Check the store, verify and link the pass's output, and record the run;
        ``run.current`` becomes the output."""
        model, current = prepared.model, run.current
        p = model.pass_
        logger.debug("end %s in %.4fs", info.name, prepared.seconds)
        _outcome.check_store(prepared.snapshot, info)
        returned = _outcome.returned(
            out, prepared.snapshot, info, changes_input=model.changes_input
        )
        program, modified = _output(returned, prepared, current)
        targets = self._check_output(run, info, prepared, program) if modified else None
        if model.ensures is not None and model.ensures(program) is False:
            raise PassError(
                "its postcondition (ensures) does not hold on its result", **info.location()
            )
        link = None
        delta: Mapping[str, int] = {}
        if modified:
            try:
                linked = self.linker.link(
                    current, program, pass_name=info.name, journal=run.journal, user=run.user
                )
            except StateConflictError as exc:  # the linker knows the pass by name only
                raise StateConflictError(exc.reason, keys=exc.keys, **info.location()) from None
            link = linked.report
            before = prepared.targets_before
            if before is None:  # current's graph went to the pass as a copy
                before = run.targets if run.targets is not None else op_targets(current)
            run.targets = op_targets(program) if targets is None else Counter(targets)
            delta = OpDelta(before, run.targets)
        record = PassRecord(
            name=info.name,
            index=info.index,
            step=info.step,
            seconds=prepared.seconds,
            modified=modified,
            nodes_before=prepared.nodes_before,
            nodes_after=len(program.graph.nodes),
            op_delta=delta,
            link=link,
            depth=info.depth,
            children=out.records if isinstance(p, PassManager) else (),
            notes=_outcome.notes(out),
            notices=_notices(out, prepared, returned),
        )
        if run.dispatch:
            run.dispatch.call("after_pass", info, program, record, info=info)
        self._advance(run, prepared, program)
        return record

    @staticmethod
    def _advance(run: _Run, prepared: _Prepared, program: ExportedProgram) -> None:
        """Make ``program`` the run's current program, and say whether the run owns
        its graph: only after epass's own pass, over a graph this run made."""
        lease = prepared.lease
        if not prepared.model.takes_lease:
            # Code outside epass held it (a pass, or a nested pipeline's instruments
            # and passes): it may keep it, so nothing of it is edited in place again.
            run.owned = None
        elif program.graph_module is prepared.private_gm:
            run.owned = prepared.private_gm
        elif program is not run.current and lease is not None and lease.owns(program):
            run.owned = program.graph_module  # over a graph the pass edited or built
        else:
            run.owned = None
        run.current = program


def resolve_pass(p: Any, position: int | None = None) -> Any:
    """A pass object for ``p``: registered names and pipeline text made into passes,
    torch.fx passes wrapped in :class:`~epass.FxPass`, other passes as they are."""
    return planning.model(p, PassManager, position).pass_


def create_pass(spec: str, /, **options: Any) -> Any:
    """Make a pass from a registered name and options, or from pipeline text.

    ``create_pass("cast-dtype", dtype=torch.bfloat16)`` and
    ``create_pass("cast-dtype(dtype=bfloat16)")`` give the same pass. Text holding
    several passes (``"decompose, dce"``) gives a nested :class:`PassManager`.
    The building is :func:`epass.building.make`'s.
    """
    return planning.made(building.make(spec, options), PassManager)


def to_text(passes: Iterable[Any]) -> str:
    """Pass objects (or their models) as pipeline text that
    :meth:`PassManager.from_text` reads back (:func:`epass.planning.to_text`).

    Raises:
        ValueError: a pass is not registered, or has an option that pipeline text
            cannot set or write.
    """
    return planning.to_text(passes, PassManager)


def as_pipeline(pipeline: Any) -> PassManager | None:
    """``pipeline`` as a :class:`PassManager`: a manager as it is, a list of passes or
    one pass wrapped, None for none (the hand-offs' ``pipeline=`` argument)."""
    if pipeline is None:
        return None
    if isinstance(pipeline, PassManager):
        return pipeline
    if isinstance(pipeline, Sequence) and not isinstance(pipeline, (str, bytes)):
        return PassManager(pipeline)
    return PassManager([pipeline])

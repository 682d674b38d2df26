"""The switch under which ``ExportedProgram.run_decompositions`` is served by epass's
``Decompose``, whoever calls it (what it served goes to a log: :mod:`epass._served`).

While a scope holds it, torch's class carries a wrapper in place of its own method.
Outside every scope the wrapper calls torch's own method with the same arguments, so
it behaves as that method does; the last scope to leave puts torch's object back. A
scope is context-local (:data:`_SCOPE`, a context variable: another thread or task
keeps torch's method) unless it is the process-wide one of ``python -m
epass.fast_decompositions``. A call the engine cannot take exactly, and every call
made while one is being served (``Decompose``'s own retrace calls the method), goes
to torch's own method, never to the switched one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
from torch.export import ExportedProgram

from epass import _program
from epass._decomp.table import as_dict
from epass._served import DecompositionLog, ServedDecomposition
from epass._torch import fakes, internals
from epass.errors import DecompositionError, DecompositionMismatchError, EpassError
from epass.passes.decompose import Decompose, DecomposeResult

__all__ = [
    "NOT_TAKEN",
    "Lowered",
    "Lowering",
    "fast_decompositions",
    "installed",
    "process_log",
    "process_wide",
    "switched",
    "torchs_method",
]

_NAME = "run_decompositions"


@attrs.frozen
class Lowered:
    """What a scope's lowering made of a program at its first ``run_decompositions``
    call: ``program``, and ``how``, ``reason`` and ``rewritten`` as in
    :class:`ServedDecomposition` when the lowering decomposed it with the caller's
    table (``how`` None: it did not, and the call is served on ``program``)."""

    program: ExportedProgram
    how: str | None = None
    reason: str | None = None
    rewritten: int | None = None
    pipeline: str | None = None


Lowering = Callable[[ExportedProgram, Any, bool | None], Lowered | None]
"""A hand-off's lowering of its private programs: called with a program, the
caller's table (:data:`NOT_TAKEN` where the engine cannot take the call) and the
scope's check mode; None for a program it does not lower (or lowered already)."""

NOT_TAKEN: Any = object()


@attrs.define(eq=False)
class _Scope:
    """One holder of the switch: its log, its check mode, the dicts a result may
    hold as they are (a hand-off's private programs'), the scope it nests in, and
    whether its block is still running (a task started in the block keeps a copy of
    the context, and with it the scope, after the block ends)."""

    log: DecompositionLog
    check: bool | None
    private: tuple[dict[str, Any], ...]
    parent: _Scope | None
    running: bool = True
    lowering: Lowering | None = None

    def record(self, entry: ServedDecomposition) -> None:
        scope: _Scope | None = self
        while scope is not None:
            scope.log.add(entry)
            scope = scope.parent
        if _PROCESS is not None and _PROCESS is not self:  # never a block's parent
            _PROCESS.log.add(entry)

    def holds(self, store: dict[str, Any]) -> bool:
        return any(store is mine for mine in self.private)

    def lower(self, ep: ExportedProgram, table: Any) -> Lowered | None:
        """The lowering of ``ep`` by this scope or one it nests in, if one takes it."""
        scope: _Scope | None = self
        while scope is not None:
            if scope.lowering is not None:
                lowered = scope.lowering(ep, table, self.check)
                if lowered is not None:
                    return lowered
            scope = scope.parent
        return None


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "epass_fast_decompositions", default=None
)
# Set while a call is being served: every call it makes (Decompose's retrace) goes to
# torch's own method.
_SERVING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "epass_serving_decompositions", default=False
)
_PROCESS: _Scope | None = None  # python -m epass.fast_decompositions: every thread
_LOCK = threading.Lock()  # guards the count of holders and torch's class attribute
_holders = 0
_original: Any = None  # what the class held when the first holder came
_installed: Any = None  # what the switch put there


def installed() -> bool:
    """Whether torch's class carries the switch now (some scope holds it)."""
    return _holders > 0


def _install() -> None:
    global _holders, _original, _installed
    with _LOCK:
        if _holders == 0:
            _original = ExportedProgram.__dict__[_NAME]
            _installed = _switched_method(_original)
            setattr(ExportedProgram, _NAME, _installed)
        _holders += 1


def _uninstall() -> None:
    global _holders, _original, _installed
    with _LOCK:
        _holders -= 1
        if _holders == 0:
            # Put torch's object back, unless another library has since put its own
            # wrapper on top of ours; ours then keeps calling torch's method
            # (it holds it), as it does outside every scope.
            if ExportedProgram.__dict__.get(_NAME) is _installed:
                setattr(ExportedProgram, _NAME, _original)
            _original = _installed = None


def _switched_method(original: Callable[..., ExportedProgram]) -> Callable[..., ExportedProgram]:
    @functools.wraps(original)
    def run_decompositions(self: ExportedProgram, *args: Any, **kwargs: Any) -> ExportedProgram:
        scope = None if _SERVING.get() else _current()
        if scope is None:
            return original(self, *args, **kwargs)
        return _serve(original, scope, self, args, kwargs)

    return run_decompositions


def _current() -> _Scope | None:
    """The scope serving calls in this context: the innermost running block's, else
    the process-wide one."""
    scope = _SCOPE.get()
    while scope is not None and not scope.running:
        scope = scope.parent
    return scope or _PROCESS


@contextlib.contextmanager
def switched(
    *,
    check: bool | None = None,
    private: Iterable[ExportedProgram] = (),
    log: DecompositionLog | None = None,
    lowering: Lowering | None = None,
) -> Iterator[DecompositionLog]:
    """Serve ``run_decompositions`` in this context while the block runs; yields the
    log (``log``, or a new one). ``private``: programs whose dicts a served result
    may hold (a hand-off's private programs, which the relink governs); a result of
    any other program holds dicts of its own. ``lowering``: what makes the first
    call on a hand-off's private program (its pipeline, decomposing with the
    caller's table)."""
    outer = _SCOPE.get()
    stores = tuple(store for ep in private for store in (ep.state_dict, ep.constants))
    if outer is not None:
        stores += outer.private
    if check is None:  # the enclosing block's, or the process-wide switch's
        enclosing = _current()
        check = None if enclosing is None else enclosing.check
    scope = _Scope(DecompositionLog() if log is None else log, check, stores, outer)
    scope.lowering = lowering
    _install()
    try:
        token = _SCOPE.set(scope)
        try:
            yield scope.log
        finally:
            scope.running = False
            _SCOPE.reset(token)
    finally:
        _uninstall()


@contextlib.contextmanager
def torchs_method() -> Iterator[None]:
    """Leave ``run_decompositions`` to torch's own method in this context while the
    block runs, whatever block or process-wide switch encloses it (a hand-off told
    not to serve)."""
    token = _SERVING.set(True)
    try:
        yield
    finally:
        _SERVING.reset(token)


def fast_decompositions(
    *, check: bool | None = None
) -> contextlib.AbstractContextManager[DecompositionLog]:
    """Serve every ``ExportedProgram.run_decompositions`` call made in this context
    (a consumer's own included) with epass's :class:`~epass.Decompose`.

    Each call returns the program torch's method would return (graph, signature,
    range constraints, module call graph), holding the caller's tensor objects in
    dicts of its own, its input untouched; what the engine cannot take exactly is
    handed to torch's own method. Other threads and contexts keep torch's method;
    scopes nest, and torch's method is back on its class once no scope holds it.

    Args:
        check: also run torch's retrace and raise
            :class:`~epass.errors.DecompositionMismatchError` where the programs
            differ (``None`` reads ``EPASS_DECOMPOSE_CHECK``).

    Returns:
        A context manager yielding a :class:`DecompositionLog`.

    Example::

        with epass.fast_decompositions() as log:
            onnx_program = torch.onnx.export(ep, args, dynamo=True)
        print(log.summary())
    """
    return switched(check=check)


def process_wide(*, check: bool | None = None) -> Callable[[], None]:
    """Serve ``run_decompositions`` in every thread and context of this process until
    the returned function is called; its log is :func:`process_log`."""
    global _PROCESS
    with _LOCK:
        if _PROCESS is not None:
            raise EpassError("the process-wide switch is already on")
        _PROCESS = _Scope(DecompositionLog(), check, (), None)
    _install()
    done = threading.Lock()

    def stop() -> None:
        global _PROCESS
        if not done.acquire(blocking=False):
            return
        with _LOCK:
            _PROCESS = None
        _uninstall()

    return stop


def process_log() -> DecompositionLog | None:
    """The process-wide switch's log (None when it is off)."""
    scope = _PROCESS
    return None if scope is None else scope.log


# --- serving one call ------------------------------------------------------------------


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool] | None:
    """``(decomp_table, decompose_custom_triton_ops)`` from a call's arguments, or None
    for arguments of another shape (torch's own method takes them, or raises)."""
    names = ("decomp_table", "decompose_custom_triton_ops")
    if len(args) > len(names) or set(kwargs) - set(names[len(args) :]):
        return None
    bound = dict(zip(names, args, strict=False)) | kwargs
    return bound.get("decomp_table"), bound.get("decompose_custom_triton_ops", False)


def _reusable(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with a table that can be read only once (an iterator or a
    generator of pairs, which torch's method reads into a dict) read into a list, so
    that torch's method, when it takes the call, gets every entry epass read."""
    if args:
        table = args[0]
        if _one_shot(table):
            return (list(table), *args[1:]), kwargs
    elif _one_shot(kwargs.get("decomp_table")):
        return args, {**kwargs, "decomp_table": list(kwargs["decomp_table"])}
    return args, kwargs


def _one_shot(table: Any) -> bool:
    try:
        return table is not None and iter(table) is table
    except TypeError:  # not iterable: torch's method raises its own error
        return False


def _refusal(ep: ExportedProgram, arguments: tuple[Any, bool] | None) -> str | None:
    """Why torch's own method takes this call (None: the engine may)."""
    if arguments is None:
        return "arguments other than (decomp_table, decompose_custom_triton_ops)"
    if arguments[1] is not False:
        return "decompose_custom_triton_ops=True"
    if type(ep) is not ExportedProgram:
        return f"a subclass of ExportedProgram ({type(ep).__name__})"
    if fakes.detect_fake_mode([]) is not None:
        # torch's method puts the caller's fake mode aside (a private helper); the
        # engine would trace its templates under it
        return "called under a fake tensor mode or a tracing context"
    return None


def _serve(
    original: Callable[..., ExportedProgram],
    scope: _Scope,
    ep: ExportedProgram,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> ExportedProgram:
    began = time.perf_counter()
    nodes = len(ep.graph.nodes)
    args, kwargs = _reusable(args, kwargs)
    arguments = _arguments(args, kwargs)
    table = None if arguments is None else arguments[0]
    described = "default" if table is None else _describe(table)
    token = _SERVING.set(True)
    try:
        reason = _refusal(ep, arguments)
        served: tuple[ExportedProgram, str, str | None, int | None] | None = None
        lowered = scope.lower(ep, table if reason is None else NOT_TAKEN)
        pipeline = None if lowered is None else lowered.pipeline
        if lowered is not None and lowered.how is not None:
            out = _new(lowered.program, ep)
            served = (_held(out, ep, scope), lowered.how, lowered.reason, lowered.rewritten)
        elif lowered is not None:
            ep = lowered.program
        if served is None and reason is None:
            served, reason = _decompose(ep, table, scope)
        if served is None:
            # On a view with dicts of its own: its retrace may lift a constant into
            # the dict of the program it is given.
            out = _held(original(_view(ep, scope), *args, **kwargs), ep, scope)
            served = (out, "torch", reason, None)
    finally:
        _SERVING.reset(token)
    out, how, why, rewritten = served
    seconds = time.perf_counter() - began
    entry = ServedDecomposition(how, why, seconds, nodes, rewritten, described, pipeline)
    scope.record(entry)
    return out


def _describe(table: Any) -> str:
    try:  # a CustomDecompTable is materialized here, from epass's walk
        return f"{len(as_dict(table))} entries"
    except (TypeError, ValueError):
        return type(table).__name__


def _decompose(
    ep: ExportedProgram, table: Any, scope: _Scope
) -> tuple[tuple[ExportedProgram, str, str | None, int | None] | None, str | None]:
    """The engine's program and how it was made, or None and why torch's own method
    takes the call. Re-raises what torch's retrace raised."""
    try:
        decompose = Decompose(table=table, check=scope.check)
    except EpassError as exc:  # torch's method raises its own error, or takes it
        return None, f"a table epass does not take: {exc}"
    view = _view(ep, scope)
    try:
        result = decompose(view)
    except DecompositionMismatchError:
        raise
    except DecompositionError as exc:
        failure = exc.__cause__
    except Exception as exc:  # an epass failure: torch's method takes the call
        return None, f"epass failed: {internals.unexpected(exc)}"
    else:
        return (_program_of(result, view, ep, scope), *_how(result)), None
    if isinstance(failure, Exception):
        raise failure  # what torch's own method raised, outside the handler
    return None, "the retrace failed without an exception of torch's"  # pragma: no cover


def _view(ep: ExportedProgram, scope: _Scope) -> ExportedProgram:
    """``ep`` with dicts of its own, unless they are a hand-off's private ones: a
    retrace may lift a constant into the dicts of the program it is given."""
    own = scope.holds(ep.state_dict) and scope.holds(ep.constants)
    return _program.private_view(ep, copy_graph=False, copy_state=not own)


def _how(result: DecomposeResult) -> tuple[str, str | None, int | None]:
    if result.method == "incremental":
        return ("incremental" if result.modified else "no-op"), None, result.rewritten
    return "retrace", result.fallback or result.decision, None


def _program_of(
    result: DecomposeResult, view: ExportedProgram, ep: ExportedProgram, scope: _Scope
) -> ExportedProgram:
    """The program to return: always a new one (torch's method never returns its
    input), holding the hand-off's private dicts where ``ep`` holds them."""
    # Where the graph's code did not change, ``program`` is the input; ``made`` is
    # the program the path made, with the meta a retrace gives every node.
    out = result.made if result.made is not None else result.program
    return _held(_new(out, view), ep, scope)


def _new(out: ExportedProgram, given: ExportedProgram) -> ExportedProgram:
    """``out``, or a copy of it where it is the program the call was given."""
    if out is given:
        return _program.private_view(given, copy_graph=True, copy_state=False)
    return out


def _held(out: ExportedProgram, ep: ExportedProgram, scope: _Scope) -> ExportedProgram:
    """``out`` holding ``ep``'s dicts where they are a hand-off's private ones and
    ``out`` holds exactly their entries; otherwise dicts of its own (never the
    caller's: a consumer may write into the program it gets back)."""
    for field in ("state_dict", "constants"):
        mine, theirs = getattr(ep, field), getattr(out, field)
        if scope.holds(mine):
            if theirs is not mine and _same_entries(mine, theirs):
                _program.set_state(out, **{field: mine})
        elif theirs is mine:
            _program.set_state(out, **{field: dict(mine)})
    return out


def _same_entries(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[key] is b[key] for key in a)

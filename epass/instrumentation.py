"""The instrument hooks, and ``Dispatch``, which the manager calls them through.

The manager knows where each call comes from, so it hands the nesting in:
pass hooks get a :class:`~epass.records.PassInfo` (``depth``, ``parent``, ``path``,
``manager``), and the pipeline hooks get ``parent``, the info of the pass that runs
a nested pipeline (None for a top-level run), as MLIR's pass instrumentation does.
:func:`instrument_list` checks what a manager is given as instruments.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from torch.export import ExportedProgram

from epass.errors import ArgumentTypeError, InstrumentError
from epass.records import PassInfo, PassRecord, PipelineResult

__all__ = ["HOOKS", "Dispatch", "Instrument", "instrument_list"]


class Instrument:
    """Base class with no-op hooks; override the ones you need.

    Any object with some of these methods works as an instrument; missing hooks
    are not called. Hooks must not mutate the programs they are shown. The
    pipeline hooks may leave out the ``parent`` parameter; their ``manager`` is the
    :class:`~epass.PassManager` that runs (typed ``Any`` here: the engine sits above).
    """

    def before_pipeline(
        self, manager: Any, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        """Called once before the first pass of a pipeline (and of each nested one);
        ``parent`` is None for a top-level run."""

    def after_pipeline(
        self, manager: Any, result: PipelineResult, parent: PassInfo | None = None
    ) -> None:
        """Called once after the last pass, with the pipeline's result."""

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        """Called before a pass runs, with its input program."""

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        """Called after a pass ran and its output was verified and linked."""

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        """Called when a pass (or its verification) raised, with its input program."""

    def pass_skipped(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        """Called when a pass was skipped as a no-op."""


HOOKS = (
    "before_pipeline",
    "after_pipeline",
    "before_pass",
    "after_pass",
    "pass_failed",
    "pass_skipped",
)
_PIPELINE_HOOKS = ("before_pipeline", "after_pipeline")
# Hooks that close what a before-hook opened run in reverse registration order, as
# MLIR's do, so that nested instruments unwind like scopes: with [A, B], A's
# before_pass runs first and its after_pass last.
_UNWINDING = frozenset({"after_pipeline", "after_pass", "pass_failed"})


def _takes_parent(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "parent" or p.kind is p.VAR_KEYWORD for p in params)


class Dispatch:
    """Calls one hook on every instrument that has it; wraps failures in InstrumentError.

    ``before_pipeline``, ``before_pass`` and ``pass_skipped`` go to the instruments in
    registration order; ``after_pass``, ``pass_failed`` and ``after_pipeline`` in reverse.
    """

    def __init__(self, instruments: Sequence[Any]) -> None:
        self.instruments = tuple(instruments)
        self._bound: dict[str, list[tuple[Any, Any, bool]]] = {
            hook: [
                (i, fn, hook in _PIPELINE_HOOKS and _takes_parent(fn))
                for i in (reversed(self.instruments) if hook in _UNWINDING else self.instruments)
                if (fn := getattr(i, hook, None)) is not None
            ]
            for hook in HOOKS
        }

    def __bool__(self) -> bool:
        return bool(self.instruments)

    def call(
        self,
        hook: str,
        *args: Any,
        info: PassInfo | None = None,
        parent: PassInfo | None = None,
    ) -> None:
        """Call ``hook(*args)`` on each instrument; ``info`` names the pass in errors,
        ``parent`` goes to the pipeline hooks that take it."""
        for instrument, fn, takes_parent in self._bound[hook]:
            try:
                if takes_parent:
                    fn(*args, parent=parent)
                else:
                    fn(*args)
            except Exception as exc:
                name = type(instrument).__name__
                message = f"instrument {name!r} raised in {hook}: {type(exc).__name__}: {exc}"
                if hook == "pass_failed":  # the pass's own error would be lost otherwise
                    message += f"\n  while reporting: {args[-1]}"
                raise InstrumentError(
                    message,
                    instrument=name,
                    hook=hook,
                    pass_name=info.name if info else None,
                    index=info.index if info else None,
                    step=info.step if info else None,
                ) from exc


def instrument_list(instruments: Any) -> list[Any]:
    """``instruments`` as a list, each checked to be an instrument instance."""
    if isinstance(instruments, (str, bytes)) or not isinstance(instruments, Iterable):
        raise ArgumentTypeError(
            f"instruments must be a list of instruments, got {type(instruments).__name__}"
        )
    out = list(instruments)
    for i, instrument in enumerate(out):
        if isinstance(instrument, type):
            raise ArgumentTypeError(
                f"instruments[{i}] is the class {instrument.__name__}; pass an instance"
            )
        if not any(hasattr(instrument, hook) for hook in HOOKS):
            raise ArgumentTypeError(
                f"instruments[{i}] ({type(instrument).__name__}) is not an instrument "
                f"(an instrument has at least one of the hooks {', '.join(HOOKS)})"
            )
    return out

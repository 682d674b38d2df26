"""The ``Instrument`` hooks, ``PassInfo``, and the dispatcher the manager calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
from torch.export import ExportedProgram

from epass.errors import InstrumentError

if TYPE_CHECKING:
    from epass.manager import PassManager, PassRecord, PipelineResult

__all__ = ["Dispatch", "Instrument", "PassInfo"]


@attrs.frozen
class PassInfo:
    """Which pass is about to run, or ran: its object, name, position and nesting depth."""

    pass_: Any
    name: str
    index: int
    step: int
    depth: int = 0


class Instrument:
    """Base class with no-op hooks; override the ones you need.

    Any object with some of these methods works as an instrument; missing hooks
    are not called. Hooks must not mutate the programs they are shown.
    """

    def before_pipeline(self, manager: PassManager, program: ExportedProgram) -> None:
        """Called once before the first pass of a pipeline (and of each nested one)."""

    def after_pipeline(self, manager: PassManager, result: PipelineResult) -> None:
        """Called once after the last pass, with the pipeline's result."""

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        """Called before a pass runs, with its input program."""

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        """Called after a pass ran and its output was verified and linked."""

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        """Called when a pass (or its verification) raised, with its input program."""

    def pass_skipped(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        """Called when a pass was skipped as a no-op."""


_HOOKS = (
    "before_pipeline",
    "after_pipeline",
    "before_pass",
    "after_pass",
    "pass_failed",
    "pass_skipped",
)


class Dispatch:
    """Calls one hook on every instrument that has it; wraps failures in InstrumentError."""

    def __init__(self, instruments: Sequence[Any]) -> None:
        self.instruments = tuple(instruments)
        self._bound = {
            hook: [(i, getattr(i, hook)) for i in self.instruments if hasattr(i, hook)]
            for hook in _HOOKS
        }

    def __bool__(self) -> bool:
        return bool(self.instruments)

    def call(self, hook: str, *args: Any, info: PassInfo | None = None) -> None:
        for instrument, fn in self._bound[hook]:
            try:
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


class _Nesting:
    """Tracks where in a (possibly nested) pipeline the hooks are being called from.

    A nested manager's ``before_pipeline`` comes right after the ``before_pass`` of
    the manager-as-a-pass; anything else starts a new top-level run, which also
    drops state left behind by a run that failed (``after_pipeline`` is not called
    then).
    """

    def __init__(self) -> None:
        self.passes: list[PassInfo] = []
        self.managers: list[Any] = []

    def enter_pipeline(self, manager: Any) -> bool:
        """Returns True when this is a top-level pipeline."""
        if self.passes and self.passes[-1].pass_ is manager and self.managers:
            self.managers.append(manager)
            return False
        self.passes.clear()
        self.managers = [manager]
        return True

    def exit_pipeline(self, manager: Any) -> bool:
        """Returns True when the top-level pipeline ended."""
        if self.managers and self.managers[-1] is manager:
            self.managers.pop()
        return not self.managers

    def enter_pass(self, info: PassInfo) -> None:
        del self.passes[info.depth :]
        self.passes.append(info)

    def exit_pass(self, info: PassInfo) -> None:
        del self.passes[info.depth :]

    def path(self, info: PassInfo) -> str:
        """The pass's name prefixed by the names of the pipelines around it."""
        outer = [i.name for i in self.passes[: info.depth]]
        return "/".join([*outer, info.name])

    def manager_of(self, info: PassInfo) -> Any:
        """The manager whose pass list holds ``info``, or None."""
        for manager in reversed(self.managers):
            passes = getattr(manager, "passes", ())
            if info.index < len(passes) and passes[info.index] is info.pass_:
                return manager
        return None

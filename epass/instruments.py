"""Instrumentation: the ``Instrument`` hooks and the dispatcher the manager calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
from torch.export import ExportedProgram

from epass.errors import InstrumentError

if TYPE_CHECKING:
    from epass.manager import PassManager, PassRecord, PipelineResult

__all__ = ["Instrument", "PassInfo"]


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
                raise InstrumentError(
                    f"instrument {name!r} raised in {hook}: {type(exc).__name__}: {exc}",
                    instrument=name,
                    hook=hook,
                    pass_name=info.name if info else None,
                    index=info.index if info else None,
                    step=info.step if info else None,
                ) from exc

"""``Progress``: a live progress line for long pipelines, through the optional ``rich``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.export import ExportedProgram

from epass.instrumentation import Instrument
from epass.records import PassInfo, PassRecord, PipelineResult

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = ["Progress"]


class Progress(Instrument):
    """Show the running pass, the passes done, and the elapsed time.

    Needs ``rich`` (``pip install epass[rich]``); without it, or when the console
    is not a terminal, it shows nothing and costs next to nothing.

    Args:
        console: a ``rich.console.Console``; default: one on stderr.
        enabled: force the display on or off; default (None): only on a terminal.
        transient: erase the display when the pipeline ends.

    Example::

        PassManager(passes, instruments=[Progress()]).run(ep)
    """

    def __init__(
        self, console: Any = None, *, enabled: bool | None = None, transient: bool = True
    ) -> None:
        self.console = console
        self.enabled = enabled
        self.transient = transient
        self._progress: Any = None
        self._task: Any = None
        self._count = 0

    @property
    def active(self) -> bool:
        """Whether a display is live right now."""
        return self._progress is not None

    def _start(self, manager: PassManager) -> None:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress
        except ImportError:
            return
        console = self.console if self.console is not None else Console(stderr=True)
        enabled = console.is_terminal if self.enabled is None else self.enabled
        if not enabled:
            return
        self._count = len(manager.passes)
        self._progress = RichProgress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=self.transient,
        )
        self._progress.start()
        self._task = self._progress.add_task(manager.name, total=self._count)

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def before_pipeline(
        self, manager: PassManager, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self._stop()
            self._start(manager)

    def after_pipeline(
        self, manager: PassManager, result: PipelineResult, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self._stop()

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        if self._progress is not None:
            step = f" (step {info.step + 1})" if info.step else ""
            path = info.path.replace("/", " > ")
            self._progress.update(self._task, description=f"{path}{step}")

    def _advance(self, info: PassInfo) -> None:
        if self._progress is not None and info.depth == 0:
            done = info.step * self._count + info.index + 1
            total = (info.step + 1) * self._count
            self._progress.update(self._task, completed=done, total=total)

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        self._advance(info)

    def pass_skipped(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        self._advance(info)

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        # A failure ends the pipeline and after_pipeline is not called.
        self._stop()

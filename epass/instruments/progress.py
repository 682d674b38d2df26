"""``Progress``: a live progress line for long pipelines, and ``Spinner``, one for the
work around them (loading, screening, saving); both through the optional ``rich``."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch.export import ExportedProgram

from epass.instrumentation import Instrument
from epass.records import PassInfo, PassRecord, PipelineResult

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = ["Progress", "Spinner"]


def _rich_progress(console: Any, enabled: bool | None, transient: bool, *columns: str) -> Any:
    """A started ``rich.progress.Progress``, or None without rich or off a terminal."""
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
        return None
    console = console if console is not None else Console(stderr=True)
    if not (console.is_terminal if enabled is None else enabled):
        return None
    made: dict[str, Callable[[], Any]] = {
        "spinner": SpinnerColumn,
        "count": MofNCompleteColumn,
        "text": lambda: TextColumn("{task.description}"),
        "bar": BarColumn,
        "elapsed": TimeElapsedColumn,
    }
    progress = RichProgress(*(made[c]() for c in columns), console=console, transient=transient)
    progress.start()
    return progress


def _leaves(manager: Any) -> int:
    """How many passes one round of ``manager`` runs, those of nested pipelines
    counted one by one instead of the pipeline that holds them."""
    from epass.manager import PassManager

    return sum(_leaves(p) if isinstance(p, PassManager) else 1 for p in manager.passes)


class Progress(Instrument):
    """Show the running pass, the passes done of those planned, and the elapsed time.

    The count includes the passes of nested pipelines (``3/7 lower > fold-constants``),
    and grows by a round when a pipeline with ``steps`` starts another one.

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
        self._done = 0
        self._total = 0
        self._containers: set[int] = set()  # id() of running passes that run a pipeline

    @property
    def active(self) -> bool:
        """Whether a display is live right now."""
        return self._progress is not None

    def _start(self, manager: PassManager) -> None:
        self._progress = _rich_progress(
            self.console, self.enabled, self.transient, "spinner", "count", "text", "bar", "elapsed"
        )
        if self._progress is None:
            return
        self._done, self._total = 0, _leaves(manager)
        self._containers = set()
        self._task = self._progress.add_task(manager.name, total=self._total)

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
        elif self._progress is not None:
            from epass.manager import PassManager

            inner = parent.pass_
            if not isinstance(inner, PassManager) and id(inner) not in self._containers:
                self._containers.add(id(inner))  # planned as one pass: count its passes
                self._total += _leaves(manager) - 1

    def after_pipeline(
        self, manager: PassManager, result: PipelineResult, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self._stop()

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        if self._progress is None:
            return
        if info.step and info.index == 0 and info.manager is not None:  # another round
            self._total += _leaves(info.manager)
        step = f" (step {info.step + 1})" if info.step else ""
        self._progress.update(
            self._task,
            description=f"{info.path.replace('/', ' > ')}{step}",
            completed=self._done,
            total=self._total,
            refresh=True,  # every pass is shown, however short
        )

    def _advance(self, info: PassInfo, skipped: bool) -> None:
        from epass.manager import PassManager

        if self._progress is None:
            return
        inner = info.pass_
        if isinstance(inner, PassManager):  # its passes are counted one by one
            self._done += _leaves(inner) if skipped else 0  # skipped whole: none will be
        elif id(inner) in self._containers:
            self._containers.discard(id(inner))
        else:
            self._done += 1
        self._progress.update(self._task, completed=self._done, total=self._total)

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        self._advance(info, skipped=False)

    def pass_skipped(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        self._advance(info, skipped=True)

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        # A failure ends the pipeline and after_pipeline is not called.
        self._stop()


class Spinner:
    """A spinner line for work outside a pipeline: call it with a short text as each
    phase starts (``"loading model.pt2 (77 MB)"``); it spins with the elapsed time
    until the next text, and is erased when the ``with`` block ends.

    It is the ``progress`` callable ``epass.load`` and ``epass.save`` take. Like
    :class:`Progress` it needs ``rich`` and a terminal, and shows nothing otherwise.

    Args:
        console: a ``rich.console.Console``; default: one on stderr.
        enabled: force the display on or off; default (None): only on a terminal.

    Example::

        with Spinner() as spinner:
            ep = epass.load("model.pt2", progress=spinner)
    """

    def __init__(self, console: Any = None, *, enabled: bool | None = None) -> None:
        self.console = console
        self.enabled = enabled
        self.shown: list[str] = []  # every text shown, in order
        self._progress: Any = None
        self._task: Any = None
        self._off = False

    def __enter__(self) -> Spinner:
        return self

    def __call__(self, text: str) -> None:
        if self._off:
            return
        if self._progress is None:
            self._progress = _rich_progress(
                self.console, self.enabled, True, "spinner", "text", "elapsed"
            )
            if self._progress is None:
                self._off = True
                return
            self._task = self._progress.add_task(text, total=None)
        else:  # a new phase: its own elapsed time
            self._progress.reset(self._task, total=None, description=text)
        self.shown.append(text)
        self._progress.refresh()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._off = False

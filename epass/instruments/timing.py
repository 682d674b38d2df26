"""``Timing``: wall time per pass, aggregated over fixed-point steps and runs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs
from torch.export import ExportedProgram

from epass.instrumentation import Instrument
from epass.records import PassInfo, PassRecord, PipelineResult

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = ["Timing", "TimingRow"]


@attrs.define
class TimingRow:
    """The accumulated time of one pass (by its path in the pipeline).

    Attributes:
        path: the pass name, prefixed by enclosing pipelines (``"lower/cse"``).
        depth: nesting depth.
        runs: how many times the pass ran (steps and repeated pipeline runs).
        skipped: how many times it was skipped as a no-op.
        seconds: total time inside the pass call itself.
        overhead: total time the manager spent around the call (copying the graph,
            verifying, linking state).
        min_seconds / max_seconds: the fastest and slowest single run.
    """

    path: str
    depth: int
    runs: int = 0
    skipped: int = 0
    seconds: float = 0.0
    overhead: float = 0.0
    min_seconds: float = float("inf")
    max_seconds: float = 0.0

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.runs if self.runs else 0.0


class Timing(Instrument):
    """Measure each pass's wall time; ``table()`` renders the totals.

    Time is split into the pass call itself (``PassRecord.seconds``) and the
    manager's work around it (graph copy, verification, state linking). Rows are
    keyed by the pass's path, so a pass that runs in several fixed-point steps, or
    in several runs of the same pipeline, accumulates in one row. ``reset()``
    starts over. The manager's share (``mgr ms``) also holds the ``before_pass``
    hooks of instruments listed after this one and the ``after_pass`` hooks of
    those before it: list ``Timing`` first to keep it clean of the others.

    Example::

        timing = Timing()
        PassManager([Decompose()], instruments=[timing]).run(ep)
        print(timing.table())
    """

    def __init__(self) -> None:
        self.rows: dict[str, TimingRow] = {}
        self.pipeline_seconds = 0.0
        self._started: dict[int, float] = {}
        self._pipeline_start = 0.0

    def reset(self) -> None:
        """Forget all measurements."""
        self.rows.clear()
        self.pipeline_seconds = 0.0

    def _row(self, info: PassInfo) -> TimingRow:
        path = info.path
        row = self.rows.get(path)
        if row is None:
            row = self.rows[path] = TimingRow(path, info.depth)
        return row

    def before_pipeline(
        self, manager: PassManager, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self._pipeline_start = time.perf_counter()

    def after_pipeline(
        self, manager: PassManager, result: PipelineResult, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self.pipeline_seconds += time.perf_counter() - self._pipeline_start

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        self._started[info.depth] = time.perf_counter()

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        elapsed = time.perf_counter() - self._started.pop(info.depth, time.perf_counter())
        row = self._row(info)
        row.runs += 1
        row.seconds += record.seconds
        row.overhead += max(elapsed - record.seconds, 0.0)
        row.min_seconds = min(row.min_seconds, record.seconds)
        row.max_seconds = max(row.max_seconds, record.seconds)

    def pass_skipped(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        self._row(info).skipped += 1

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        self._started.pop(info.depth, None)

    def as_dicts(self) -> list[dict[str, Any]]:
        """The rows as JSON-ready dicts, in first-run order."""
        return [attrs.asdict(r) | {"mean_seconds": r.mean_seconds} for r in self.rows.values()]

    def table(self) -> str:
        """A text table: runs, total/mean/max time per pass, manager overhead, share.

        ``share`` is the pass's own time as a fraction of the top-level pipelines'
        wall time (nested rows are part of their pipeline's row).
        """
        header = (
            f"{'pass':<28} {'runs':>4} {'skip':>4} {'total s':>9} {'mean ms':>9} "
            f"{'max ms':>9} {'mgr ms':>8} {'share':>6}"
        )
        lines = [header, "-" * len(header)]
        wall = self.pipeline_seconds
        for r in self.rows.values():
            name = "  " * r.depth + r.path.rsplit("/", 1)[-1]
            share = f"{100 * r.seconds / wall:5.1f}%" if wall > 0 else "    -"
            max_ms = f"{1e3 * r.max_seconds:9.2f}" if r.runs else f"{'-':>9}"
            lines.append(
                f"{name:<28} {r.runs:>4} {r.skipped:>4} {r.seconds:>9.4f} "
                f"{1e3 * r.mean_seconds:>9.2f} {max_ms} {1e3 * r.overhead:>8.2f} {share:>6}"
            )
        lines.append("-" * len(header))
        lines.append(f"{'pipeline wall time':<28} {'':>4} {'':>4} {wall:>9.4f}")
        return "\n".join(lines)

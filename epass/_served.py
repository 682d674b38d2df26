"""The log of what the switch (:mod:`epass._switch`) served: each
``run_decompositions`` call, how the engine served it and why, counted and said in
one line."""

from __future__ import annotations

import threading
from collections import Counter

import attrs

__all__ = ["HOW", "DecompositionLog", "ServedDecomposition"]

HOW = ("incremental", "no-op", "retrace", "torch")
"""How a call was served: the engine rewrote only the nodes the table decomposes;
the engine found nothing to decompose; ``Decompose`` chose or fell back to torch's
retrace (``reason`` says why); the switch handed the call to torch's own method
(``reason`` says why)."""


@attrs.frozen
class ServedDecomposition:
    """One ``run_decompositions`` call made under the switch.

    Attributes:
        how: one of :data:`HOW`.
        reason: why the call was retraced or handed to torch (None otherwise).
        seconds: wall time of the call.
        nodes: nodes of the program's graph when it was called.
        rewritten: nodes the engine rewrote (None unless ``how`` is ``incremental``
            or ``no-op``).
        table: ``"default"`` or ``"<n> entries"``: the table the caller gave.
        pipeline: the name of the hand-off's pipeline that made the program, its
            ``Decompose`` taking the caller's table (None: ``Decompose`` alone).
    """

    how: str
    reason: str | None
    seconds: float
    nodes: int
    rewritten: int | None = None
    table: str = "default"
    pipeline: str | None = None


class DecompositionLog:
    """What a switch served, readable during and after its scope; thread-safe (the
    process-wide form records calls from every thread).

    Example::

        with epass.fast_decompositions() as log:
            out = ep.run_decompositions()
        print(log.summary())
        assert log.counts["torch"] == 0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: list[ServedDecomposition] = []

    def add(self, entry: ServedDecomposition) -> None:
        with self._lock:
            self._served.append(entry)

    @property
    def served(self) -> tuple[ServedDecomposition, ...]:
        """Every call, in the order they returned."""
        with self._lock:
            return tuple(self._served)

    @property
    def counts(self) -> dict[str, int]:
        """Calls per way of serving them, every key of :data:`HOW` present."""
        counted = Counter(entry.how for entry in self.served)
        return {how: counted[how] for how in HOW}

    @property
    def reasons(self) -> dict[str, int]:
        """Why calls were retraced or handed to torch, with how often."""
        return dict(Counter(f"{e.how}: {e.reason}" for e in self.served if e.reason))

    @property
    def seconds(self) -> float:
        """Wall time of all the calls together."""
        return sum(entry.seconds for entry in self.served)

    def summary(self) -> str:
        """One line, e.g. ``epass served 2 run_decompositions calls in 0.41 s: 1
        incremental, 1 no-op, 0 retrace, 0 torch``, the reasons, and the hand-off
        pipelines that made served programs."""
        served = self.served
        counts = ", ".join(f"{n} {how}" for how, n in self.counts.items())
        line = (
            f"epass served {len(served)} run_decompositions call"
            f"{'' if len(served) == 1 else 's'} in {self.seconds:.2f} s: {counts}"
        )
        notes = self.reasons
        notes.update(Counter(f"made by the pipeline {e.pipeline!r}" for e in served if e.pipeline))
        if notes:
            line += " (" + "; ".join(f"{n}x {why}" for why, n in notes.items()) + ")"
        return line

    def __repr__(self) -> str:
        return f"<DecompositionLog: {self.summary()}>"

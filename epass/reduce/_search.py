"""The search: cut the tail, then the head, then delta debugging over the roots and
the cuts until no single step keeps the failure; simplify shapes where it can."""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
from torch.export import ExportedProgram

from epass.errors import ArgumentValueError
from epass.reduce._oracle import Oracle, Outcome
from epass.reduce._shapes import is_dynamic, specialize
from epass.reduce._slice import Root, Slice, Source
from epass.reduce._watchdog import Abandoned, Died, within

__all__ = ["Budget", "ReduceProgress", "Search", "Stop", "Terminated"]

logger = logging.getLogger("epass")

T = TypeVar("T")


class Stop(Exception):
    """The budget ran out: ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the search is by a handler its caller installs: it ends
    the search as Ctrl-C does, keeping the smallest program found."""


@attrs.frozen
class ReduceProgress:
    """Where a reduction is: after ``step`` candidates, the smallest failing program
    has ``nodes`` nodes (of ``nodes_before``), ``seconds`` after the start, in
    ``phase`` (``"tail"``, ``"head"``, ``"minimize"``, ``"shapes"``)."""

    step: int
    nodes: int
    nodes_before: int
    seconds: float
    phase: str


class Budget:
    """A time and a step budget; :meth:`charge` raises :class:`Stop` when either is spent."""

    def __init__(self, seconds: float | None, steps: int | None) -> None:
        for name, value in (("time_limit", seconds), ("max_steps", steps)):
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ArgumentValueError(
                    f"{name} must be None or a finite number above 0, got {value!r}"
                )
        if steps is not None and not isinstance(steps, int):
            raise ArgumentValueError(f"max_steps must be None or an int, got {steps!r}")
        self.start = time.perf_counter()
        self.seconds = seconds
        self.steps = steps

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float | None:
        """Seconds left (None: no time limit)."""
        return None if self.seconds is None else max(0.0, self.seconds - self.elapsed())

    def run(self, work: Callable[[], T]) -> T:
        """``work()`` in a child process killed when the time is spent
        (:class:`Stop`) or on Ctrl-C (KeyboardInterrupt), so that a hung pass stops
        nothing else; :class:`Died` when it ends without an answer."""
        try:
            return within(self.left(), work)
        except Abandoned:
            raise Stop("time limit") from None

    def charge(self, done: int) -> None:
        if self.steps is not None and done >= self.steps:
            raise Stop("step limit")
        if self.seconds is not None and self.elapsed() >= self.seconds:
            raise Stop("time limit")


def _chunks(items: Sequence[T], n: int) -> list[list[T]]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(list(items[start:end]))
        start = end
    return [c for c in out if c]


class Search:
    """Shrinks a slice of ``source`` while ``oracle`` says the failure is kept; the
    smallest failing program found is ``best`` (with ``best_nodes`` nodes)."""

    def __init__(
        self,
        source: Source,
        oracle: Oracle,
        budget: Budget,
        progress: Callable[[ReduceProgress], Any] | None,
        nodes_before: int,
        first: ExportedProgram,
        outcome: Outcome,
    ) -> None:
        self.source = source
        self.oracle = oracle
        self.budget = budget
        self.progress = progress
        self.nodes_before = nodes_before
        self.steps = 1  # the first program, the whole one rebuilt, failed
        self.phase = "start"
        self.current = source.normal(source.initial())
        self.best = first
        self.best_nodes = len(first.graph.nodes)
        self.best_outcome = outcome
        self.cache: dict[Any, bool] = {self._key(self.current): True}

    @staticmethod
    def _key(piece: Slice) -> Any:
        return (tuple((r.node, r.kind) for r in piece.roots), piece.cuts)

    # --- one candidate ----------------------------------------------------------------

    def test(self, piece: Slice) -> bool:
        """Build ``piece`` and run the pipeline on it; True (and ``piece`` becomes
        the current slice) when the failure is kept."""
        piece = self.source.normal(piece)
        key = self._key(piece)
        if key in self.cache:
            return self.cache[key]
        self.budget.charge(self.steps)
        self.steps += 1
        try:
            program = self.source.build(piece)
        except Exception as exc:  # a slice torch's verifier rejects: not a candidate
            logger.debug("reduce: a slice did not build: %r", exc)
            self.cache[key] = False
            return False
        return self._judge(key, piece, program)

    def _judge(self, key: Any, piece: Slice, program: ExportedProgram) -> bool:
        assert program.example_inputs is not None
        args, kwargs = program.example_inputs
        try:
            outcome = self.budget.run(lambda: self.oracle.run(program, args, kwargs))
        except Died as exc:  # a crash is not the failure kept
            logger.debug("reduce: %s", exc)
            outcome = None
        kept = self.oracle.keeps(outcome)
        self.cache[key] = kept
        if kept:
            assert outcome is not None
            self.current = piece
            nodes = len(program.graph.nodes)
            if nodes <= self.best_nodes:
                self.best, self.best_nodes, self.best_outcome = program, nodes, outcome
        if self.progress is not None:
            self.progress(
                ReduceProgress(
                    self.steps,
                    self.best_nodes,
                    self.nodes_before,
                    self.budget.elapsed(),
                    self.phase,
                )
            )
        return kept

    # --- the phases -------------------------------------------------------------------

    def run(self) -> str:
        """Run every phase; returns why it stopped: ``"done"``, ``"time limit"``,
        ``"step limit"``, ``"interrupted"`` (Ctrl-C) or ``"terminated"``
        (:class:`Terminated`)."""
        try:
            self.phase = "shapes"
            self.shapes()
            for phase in (self.tail, self.head, self.minimize):
                self.phase = phase.__name__
                phase()
            self.phase = "shapes"
            if self.shapes():
                self.phase = "minimize"
                self.minimize()
            return "done"
        except Stop as stop:
            return stop.reason
        except KeyboardInterrupt as exc:
            return "terminated" if isinstance(exc, Terminated) else "interrupted"

    def units(self) -> list[str]:
        """The calls the current slice computes, items of multi-output ops left out."""
        return [
            n
            for n in self.source.computed(self.current)
            if self.source.nodes[n].target is not operator.getitem
        ]

    def _with_items(self, names: Sequence[str]) -> list[str]:
        """``names`` and the items (``getitem`` nodes) of those that return several."""
        out = list(names)
        for name in names:
            out += [u.name for u in self.source.nodes[name].users if u.target is operator.getitem]
        return out

    def tail(self) -> None:
        """Binary search for the shortest prefix of the calls that keeps the failure:
        the values it computes that later calls read become its outputs."""
        units = self.units()
        piece = self.current
        lo, hi = 0, len(units)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.test(self._prefix(piece, set(self._with_items(units[:mid])))):
                hi = mid
            else:
                lo = mid

    def _prefix(self, piece: Slice, prefix: set[str]) -> Slice:
        needed = self.source.needed(piece)
        roots = [r for r in piece.roots if r.node in prefix]
        taken = {r.node for r in roots}
        for name in sorted(prefix, key=self.source.order.__getitem__):
            node = self.source.nodes[name]
            if name in taken or not self.source.tensor(name):
                continue
            if any(u.name in needed and u.name not in prefix for u in node.users):
                roots.append(Root(name))
        return Slice(tuple(roots), piece.cuts)

    def head(self) -> None:
        """Binary search for the longest prefix of the calls that can be cut off
        (the values it hands on become inputs) keeping the failure."""
        units = self.units()
        piece = self.current
        roots = {r.node for r in piece.roots}
        lo, hi = 0, len(units)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            cut = {n for n in self._with_items(units[:mid]) if self.source.cuttable(n)}
            if self.test(Slice(piece.roots, piece.cuts | (cut - roots))):
                lo = mid
            else:
                hi = mid

    def minimize(self) -> None:
        """Delta debugging until no single step keeps the failure: drop roots, cut
        nodes, and move an output up to the values its node reads."""
        while True:
            changed = self._ddmin(self._roots, self._drop)
            changed |= self._ddmin(self._cuttable, self._cut)
            changed |= self._hoist()
            if not changed:
                return

    def _roots(self, piece: Slice) -> list[Root]:
        return list(piece.roots) if len(piece.roots) > 1 else []

    def _drop(self, piece: Slice, chunk: list[Any]) -> Slice | None:
        roots = tuple(r for r in piece.roots if r not in chunk)
        return Slice(roots, piece.cuts) if roots else None

    def _cuttable(self, piece: Slice) -> list[str]:
        roots = {r.node for r in piece.roots}
        return [
            n for n in self.source.computed(piece) if n not in roots and self.source.cuttable(n)
        ]

    def _cut(self, piece: Slice, chunk: list[Any]) -> Slice | None:
        return Slice(piece.roots, piece.cuts | frozenset(chunk))

    def _ddmin(
        self,
        items_of: Callable[[Slice], list[Any]],
        apply: Callable[[Slice, list[Any]], Slice | None],
    ) -> bool:
        """Remove chunks of items, halving their size when none can go, down to
        single items (Zeller's ddmin, complements only)."""
        changed, n = False, 2
        while True:
            items = items_of(self.current)
            if not items:
                return changed
            n = min(n, len(items))
            for chunk in _chunks(items, n):
                candidate = apply(self.current, chunk)
                if candidate is not None and self.test(candidate):
                    changed, n = True, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    return changed
                n = min(2 * n, len(items))

    def _hoist(self) -> bool:
        """Replace an output by the values its node reads (one node less)."""
        for root in self.current.roots:
            node = self.source.nodes[root.node]
            if root.kind != "output" or node.op != "call_function":
                continue
            inputs = [
                Root(i.name)
                for i in node.all_input_nodes
                if i.op == "call_function" and self.source.tensor(i.name)
            ]
            others = tuple(r for r in self.current.roots if r != root)
            fresh = tuple(r for r in inputs if r not in others)
            if fresh and self.test(Slice(others + fresh, self.current.cuts)):
                return True
        return False

    def shapes(self) -> bool:
        """Make the sizes static, when the program still fails with them; the static
        program is then the one reduced further. True when it was."""
        program = self.best
        if not is_dynamic(program):
            return False
        self.budget.charge(self.steps)
        self.steps += 1
        try:
            static = specialize(program)
        except Exception as exc:
            logger.debug("reduce: the sizes stay symbolic: %r", exc)
            return False
        before = (self.source, self.current)
        self.source = Source(static, self.source.values)
        if not self._judge(("static", self.steps), self.source.initial(), static):
            self.source, self.current = before
            return False
        self.cache = {}
        return True

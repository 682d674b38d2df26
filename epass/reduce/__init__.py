"""``reduce``: shrink a program on which a pipeline fails (or drifts) to the few
nodes that still make it fail, by delta debugging over its graph.

Every candidate is a valid program (torch's verifier passes) built from a slice of
the user's program: the nodes some roots (outputs, buffer writes, effects) need,
with chosen nodes turned into inputs fed with the values they took on the real
inputs. A candidate shares the user's tensors, but the pipeline runs on a private
copy of it, in a child process the search kills when its time is up (a thread it
abandons where fork cannot be used): the user's program and tensors are never
modified, whatever a pass does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from torch.export import ExportedProgram

from epass import _paths, io
from epass.errors import ArgumentTypeError, ArgumentValueError
from epass.instruments.divergence import node_values
from epass.instruments.numerics import random_inputs
from epass.instruments.reproducer import save_program, write_pipeline
from epass.manager import PassManager, as_pipeline
from epass.reduce._oracle import KINDS, Oracle, Outcome
from epass.reduce._search import Budget, ReduceProgress, Search, Stop, Terminated
from epass.reduce._slice import Source
from epass.reduce._watchdog import Died

__all__ = [
    "FILES",
    "KINDS",
    "Outcome",
    "ReduceProgress",
    "ReduceResult",
    "Terminated",
    "check_output",
    "reduce",
]

# What a reduction writes into its folder (passes.pkl when the passes pickle).
FILES = frozenset(
    {"program.pt2", "graph.json", "pipeline.txt", "passes.pkl", "failure.txt", "repro.py"}
)


def check_output(
    directory: str | os.PathLike[str], *, inputs: Sequence[str | os.PathLike[str]] = ()
) -> Path:
    """Check, before a reduction starts, that ``directory`` can take its files: not a
    symlink, not a file, holding none of ``inputs`` and nothing but an earlier
    reduction's files, in a folder that takes new entries.

    Raises:
        SaveError: naming the path and why.
    """
    return _paths.check_output_directory(directory, replaceable=FILES, inputs=inputs)


@attrs.frozen
class ReduceResult:
    """The smallest program found on which the pipeline still fails the same way.

    Attributes:
        program: that program (its ``example_inputs`` are the values it runs on).
        failure: how the pipeline fails on it (:class:`Outcome`).
        pipeline: the pipeline, as a manager.
        nodes_before / nodes_after: the node counts of the user's program and of
            ``program``.
        seconds: how long the reduction took.
        steps: how many candidates it built and ran.
        stopped: why it stopped: ``"done"`` (no single step keeps the failure),
            ``"time limit"``, ``"step limit"``, ``"interrupted"`` (Ctrl-C) or
            ``"terminated"`` (SIGTERM, where the caller raises :class:`Terminated`
            on it, as ``epass reduce`` does).
        rtol / atol: the tolerance of a drift.
    """

    program: ExportedProgram
    failure: Outcome
    pipeline: PassManager
    nodes_before: int
    nodes_after: int
    seconds: float
    steps: int
    stopped: str
    rtol: float
    atol: float

    def summary(self) -> str:
        """One line: ``reduced 211 -> 4 nodes in 6.2 s (57 steps): pass 'x' drifts: ...``."""
        text = (
            f"reduced {self.nodes_before} -> {self.nodes_after} nodes in {self.seconds:.1f} s "
            f"({self.steps} steps): {self.failure}"
        )
        return text if self.stopped == "done" else f"{text} [stopped: {self.stopped}]"

    def write(self, directory: str | os.PathLike[str], *, imports: Sequence[str] = ()) -> Path:
        """Write ``program.pt2`` (with ``graph.json``, to load it back node for node),
        ``pipeline.txt``, ``passes.pkl`` (when the passes pickle), ``failure.txt`` and
        a ``repro.py`` that replays the failure, into the folder ``directory``.

        The files are written into a new folder beside it, renamed into place: the
        folder is there whole or not at all, and replaces only an earlier
        reduction's folder. Raises SaveError (naming the path) when ``directory``
        is a symlink or a file, holds anything else, or cannot be created
        (:func:`check_output`).
        """
        where = check_output(directory)
        with io.atomic_directory(where) as work:
            save_program(self.program, work)
            (work / "failure.txt").write_text(str(self.failure) + "\n", "utf-8", "backslashreplace")
            numerics = {"rtol": self.rtol, "atol": self.atol}
            write_pipeline(
                work,
                self.pipeline.passes,
                f"{self.summary()}\n",
                verify=self.pipeline.verify,
                imports=imports,
                numerics=numerics if self.failure.kind == "drift" else None,
            )
        return where


def reduce(
    ep: ExportedProgram,
    pipeline: Any,
    *,
    failure: str = "auto",
    match: str | None = None,
    in_pass: str | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    inputs: tuple[Any, ...] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    time_limit: float | None = None,
    max_steps: int | None = None,
    progress: Callable[[ReduceProgress], Any] | None = None,
) -> ReduceResult:
    """Shrink ``ep`` (never modified) to a small program on which ``pipeline`` (a
    manager, a list of passes or pipeline text) fails the same way.

    Args:
        failure: what must keep happening: ``"error"`` (the same pass raises the
            same error type, or an error matching ``match``), ``"drift"`` (the same
            pass drifts, as ``NumericsCheck`` judges each pass against the program
            before it, with ``rtol`` / ``atol``), or ``"auto"``: whichever ``ep`` shows.
        in_pass: the pass that must fail or drift (default: the one that does on ``ep``).
        inputs / kwargs: what to run ``ep`` on (default its ``example_inputs``, else
            random inputs); a node turned into an input is fed the value it took.
        time_limit / max_steps: a budget in seconds (finite, above 0) and in
            candidates run; when it is spent (or on Ctrl-C) the smallest program
            found so far is returned. The time limit holds against a pass that
            hangs: each candidate runs in a forked child process, killed when the
            time is up or on Ctrl-C, even in C code that holds the GIL; only the
            outcome comes back. Where fork cannot be used (not Linux, or CUDA in
            use) it runs in a thread that is abandoned then (left to run in the
            background, on its own copies; docs/debugging.md).
        progress: called with a :class:`ReduceProgress` after each candidate.

    Every candidate runs on a private copy of its state tensors and inputs, so
    that no pass, failing or not, changes ``ep``'s tensors or the next candidate's.

    Returns a :class:`ReduceResult`; ``result.write(directory)`` writes the program
    and a ``repro.py``. Raises ArgumentValueError when the pipeline does not fail
    (that way) on ``ep``, or does not finish on it within ``time_limit``.

    Example::

        result = epass.reduce(ep, "decompose, my-lowering", failure="drift")
        print(result.summary())  # reduced 812 -> 5 nodes in 9.1 s (63 steps): ...
        result.write("reduced")
    """
    manager = _pipeline(ep, pipeline)
    args, kw = _inputs(ep, inputs, kwargs)
    oracle = Oracle(manager, kind=failure, match=match, in_pass=in_pass, rtol=rtol, atol=atol)
    budget = Budget(time_limit, max_steps)
    source = Source(ep, node_values(ep, args, kw))
    first, outcome = _first(source, oracle, budget, ep, (args, kw))
    nodes_before = len(ep.graph.nodes)
    search = Search(source, oracle, budget, progress, nodes_before, first, outcome)
    stopped = search.run()
    return _result(search, stopped)


def _result(search: Search, stopped: str) -> ReduceResult:
    """The smallest failing program ``search`` found, with what finding it took."""
    oracle = search.oracle
    return ReduceResult(
        program=search.best,
        failure=search.best_outcome,
        pipeline=oracle.pipeline,
        nodes_before=search.nodes_before,
        nodes_after=search.best_nodes,
        seconds=search.budget.elapsed(),
        steps=search.steps,
        stopped=stopped,
        rtol=oracle.rtol,
        atol=oracle.atol,
    )


def _pipeline(ep: Any, pipeline: Any) -> PassManager:
    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(f"reduce takes an ExportedProgram, got {type(ep).__name__}")
    manager = as_pipeline(
        PassManager.from_text(pipeline) if isinstance(pipeline, str) else pipeline
    )
    if manager is None:
        raise ArgumentTypeError("reduce needs a pipeline")
    return manager


def _first(
    source: Source,
    oracle: Oracle,
    budget: Budget,
    ep: ExportedProgram,
    inputs: tuple[tuple[Any, ...], Mapping[str, Any]],
) -> tuple[ExportedProgram, Outcome]:
    """The whole program rebuilt as the reduction builds every candidate (flat inputs
    and outputs, the values it runs on as example inputs), and how the pipeline
    fails on it: the failure every candidate must keep. The time limit holds here
    too: a pipeline that does not finish leaves nothing to keep."""

    def outcome(program: ExportedProgram, args: tuple[Any, ...], kwargs: Any) -> Outcome:
        try:
            return oracle.keep(budget.run(lambda: oracle.run(program, args, kwargs)))
        except Died as exc:
            raise ArgumentValueError(
                f"the pipeline ended the process it ran in: {exc}; a crash cannot be reduced"
            ) from None

    try:
        try:
            first = source.build(source.initial())
            assert first.example_inputs is not None
            return first, outcome(first, *first.example_inputs)
        except Stop:
            raise
        except Exception as exc:
            outcome(ep, *inputs)  # says precisely what is missing when ep does not fail
            raise ArgumentValueError(
                f"the pipeline fails on the program ({oracle.reference}) but not on the "
                f"program rebuilt from its graph with flat inputs and outputs "
                f"({type(exc).__name__}: {exc}); it cannot be reduced"
            ) from exc
    except Stop:
        raise ArgumentValueError(
            f"the pipeline did not finish on the program within time_limit "
            f"({budget.seconds:g} s), before its failure was known; nothing was reduced"
        ) from None


def _inputs(
    ep: ExportedProgram, inputs: tuple[Any, ...] | None, kwargs: Mapping[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if inputs is not None:
        return tuple(inputs), dict(kwargs or {})
    if ep.example_inputs is not None:
        args, kw = ep.example_inputs
        return tuple(args), dict(kw)
    return random_inputs(ep), {}

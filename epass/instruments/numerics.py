"""``NumericsCheck``: run each pass's output and name the first pass whose numbers drift."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.export import ExportedProgram

from epass.errors import ArgumentValueError, NumericsDriftError
from epass.instrumentation import Instrument
from epass.instruments.divergence import first_divergence, rerun_tagged
from epass.instruments.values import Drift, NodeDrift, clone, compare_outputs, run_program
from epass.records import PassInfo, PassRecord

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = [
    "Drift",
    "NumericsCheck",
    "NumericsDriftError",
    "compare_outputs",
    "random_inputs",
    "run_program",
]

logger = logging.getLogger("epass")


def random_inputs(program: ExportedProgram, seed: int = 0) -> tuple[Any, ...]:
    """Inputs of the shapes and dtypes the program's user inputs were traced with.

    For a program without ``example_inputs``; a dynamic dimension gets size 2.
    """
    generator = torch.Generator().manual_seed(seed)
    user = set(program.graph_signature.user_inputs)
    args: list[Any] = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in user:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"cannot make an input for {node.name!r}: no tensor metadata")
        shape = [d if isinstance(d, int) else 2 for d in val.shape]
        if val.dtype.is_floating_point:
            args.append(torch.randn(shape, dtype=val.dtype, generator=generator))
        elif val.dtype == torch.bool:
            args.append(torch.zeros(shape, dtype=torch.bool))
        else:
            args.append(torch.randint(0, 2, shape, dtype=val.dtype, generator=generator))
    return tuple(args)


class NumericsCheck(Instrument):
    """Run every modified program on fixed inputs and compare its outputs.

    Args:
        inputs: positional inputs; default: the program's ``example_inputs``.
        kwargs: keyword inputs (with ``inputs``); default: those of ``example_inputs``.
        rtol / atol: the tolerance, as in ``torch.isclose``.
        reference: what to compare against. ``None`` compares each pass's output
            with the output of the program before it (so the drifting pass is named
            even when a later pass drifts further); ``"input"`` compares every
            pass with the pipeline's input program; a callable (an eager module)
            is called once on the inputs, anything else is taken as the expected
            outputs themselves.
        raise_on_drift: stop the pipeline at the first drifting pass (the manager
            reports it as an ``InstrumentError`` naming ``NumericsCheck``).
        clone_state: see :func:`run_program`.
        localize: at the first drifting pass, find the first node whose values
            part (``first_drift.node``): the pass runs once more, on a copy of its
            input whose nodes carry debug handles and whose state tensors are its
            own (what the pass writes there reaches no user tensor), and both
            programs are run node by node on the same inputs
            (:func:`~epass.instruments.divergence.first_divergence`).

    After a run, ``checks`` lists a :class:`Drift` per modified pass and
    ``first_drift`` is the first one out of tolerance (or None). The user's
    program, its state tensors and the input tensors are never written to.

    Example::

        check = NumericsCheck(rtol=1e-5, atol=1e-6)
        PassManager(passes, instruments=[check]).run(ep)
        if check.first_drift:
            print(check.first_drift)  # "bad-pass: DRIFT max_abs=2.1 max_rel=4.7"
    """

    def __init__(
        self,
        inputs: tuple[Any, ...] | None = None,
        *,
        kwargs: Mapping[str, Any] | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
        reference: Any = None,
        raise_on_drift: bool = False,
        clone_state: str = "auto",
        localize: bool = True,
    ) -> None:
        self.inputs = None if inputs is None else tuple(inputs)
        self.kwargs = dict(kwargs or {})
        self.rtol = rtol
        self.atol = atol
        self.reference = reference
        self.raise_on_drift = raise_on_drift
        self.clone_state = clone_state
        self.localize = localize
        self.checks: list[Drift] = []
        # The program each running pass was given, while it runs (for localize).
        self._given: dict[tuple[str, int], ExportedProgram] = {}
        self.first_drift: Drift | None = None
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self._expected: Any = None

    def _run(self, program: ExportedProgram) -> Any:
        return run_program(program, self._args, self._kwargs, clone_state=self.clone_state)

    def before_pipeline(
        self, manager: PassManager, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        if parent is not None:
            return
        self.checks = []
        self.first_drift = None
        if self.inputs is not None:
            self._args, self._kwargs = self.inputs, self.kwargs
        elif program.example_inputs is not None:
            args, kwargs = program.example_inputs
            self._args, self._kwargs = tuple(args), dict(kwargs)
        else:
            raise ArgumentValueError(
                "the program has no example_inputs; pass NumericsCheck(inputs=(...))"
            )
        ref = self.reference
        if ref is None or (isinstance(ref, str) and ref == "input"):
            self._expected = self._run(program)
        elif callable(ref):
            args, kwargs = clone(self._args), clone(self._kwargs)
            with torch.no_grad():
                self._expected = clone(ref(*args, **kwargs))
        else:
            self._expected = ref

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        if self.localize and self.first_drift is None:
            self._given[(info.path, info.step)] = program

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        path = info.path
        given = self._given.pop((path, info.step), None)
        # A nested pipeline's passes were checked one by one already.
        if not record.modified or record.children:
            return
        try:
            outputs = self._run(program)
        except Exception as exc:
            drift = Drift(path, info.step, math.inf, math.inf, False, f"running it raised {exc!r}")
        else:
            drift = compare_outputs(
                outputs, self._expected, rtol=self.rtol, atol=self.atol, path=path, step=info.step
            )
            if self.reference is None:
                self._expected = outputs
        if not drift.ok and self.first_drift is None and given is not None and not drift.detail:
            drift = attrs.evolve(drift, node=self._localize(info, given, program))
        self.checks.append(drift)
        logger.debug("numerics %s", drift)
        if drift.ok or self.first_drift is not None:
            return
        self.first_drift = drift
        logger.info("numerics: first drifting pass: %s", drift)
        if self.raise_on_drift:
            raise NumericsDriftError(f"pass {path!r} drifted beyond tolerance: {drift}")

    def _localize(
        self, info: PassInfo, before: ExportedProgram, after: ExportedProgram
    ) -> NodeDrift | None:
        """The first diverging node of a drifting pass, or None (logged) when it
        cannot be told."""
        try:
            before, after = rerun_tagged(info.pass_, before)
        except Exception as exc:  # compare what the pipeline made, by name
            logger.debug("numerics: %s did not run again on a tagged copy: %r", info.path, exc)
        try:
            return first_divergence(
                before,
                after,
                self._args,
                self._kwargs,
                rtol=self.rtol,
                atol=self.atol,
                clone_state=self.clone_state,
            )
        except Exception as exc:
            logger.info("numerics: the diverging node of %s is unknown: %r", info.path, exc)
            return None

    def report(self) -> str:
        """One line per checked pass, which pass drifted first and, when found,
        its first diverging node."""
        lines = [str(d) for d in self.checks]
        first = self.first_drift
        lines.append(f"first drifting pass: {first.path}" if first else "no pass drifted")
        if first is not None and first.node is not None:
            lines.append(f"first diverging node: {first.node}")
        return "\n".join(lines)

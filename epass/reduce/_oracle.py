"""What must keep happening while a program shrinks: the pipeline fails (in a given
pass, with an error of a given type or matching a pattern), or a pass's outputs
drift past a tolerance."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
from torch.export import ExportedProgram

from epass.errors import ArgumentValueError, InstrumentError, PassError
from epass.instruments import NumericsCheck
from epass.instruments.values import clone, private_copy
from epass.manager import PassManager

__all__ = ["KINDS", "Oracle", "Outcome"]

KINDS = ("auto", "error", "drift")


@attrs.frozen
class Outcome:
    """How a pipeline run went wrong.

    Attributes:
        kind: ``"error"`` (a pass raised) or ``"drift"`` (a pass's outputs drifted).
        pass_name: the pass that raised or drifted (its path in nested pipelines
            for a drift).
        error_type: the type of the error the pass raised (its cause's), or "".
        message: the error's first line, or the drift.
    """

    kind: str
    pass_name: str
    error_type: str
    message: str

    def __str__(self) -> str:
        if self.kind == "drift":
            return f"pass {self.pass_name!r} drifts: {self.message}"
        return f"pass {self.pass_name!r} raises {self.error_type}: {self.message}"


class Oracle:
    """Runs the pipeline on a program and tells whether the failure is the one kept.

    Args:
        pipeline: the passes, as a manager (its steps and verify setting are used).
        kind: ``"error"``, ``"drift"``, or ``"auto"``: whatever the first program does.
        match: a regular expression the error message must match (errors only).
        in_pass: the pass that must fail or drift; by default the one that did on
            the first program.
        rtol / atol: the tolerance of a drift (``NumericsCheck``'s).
    """

    def __init__(
        self,
        pipeline: PassManager,
        *,
        kind: str = "auto",
        match: str | None = None,
        in_pass: str | None = None,
        rtol: float = 1e-4,
        atol: float = 1e-5,
    ) -> None:
        if kind not in KINDS:
            raise ArgumentValueError(f"the failure kind must be one of {KINDS}, got {kind!r}")
        self.pipeline = pipeline
        self.kind = kind
        self.pattern = re.compile(match) if match is not None else None
        self.in_pass = in_pass
        self.rtol = rtol
        self.atol = atol
        self.reference: Outcome | None = None

    def run(
        self, program: ExportedProgram, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Outcome | None:
        """How the pipeline goes wrong on ``program`` (None: it does not).

        The pipeline runs on a private copy (graph, dicts, state tensors, inputs): a
        pass that writes into what it is given, failing or not, changes neither
        ``program`` (nor the user's tensors it shares) nor the next candidate.
        """
        program = private_copy(program)
        args, kwargs = clone(tuple(args)), clone(dict(kwargs))
        check = None
        if self.kind != "error":
            check = NumericsCheck(
                args, kwargs=kwargs, rtol=self.rtol, atol=self.atol, localize=False
            )
        manager = PassManager(
            self.pipeline.passes,
            steps=self.pipeline.steps,
            verify=self.pipeline.verify,
            instruments=[check] if check is not None else [],
        )
        try:
            manager.run(program)
        except PassError as exc:
            if self.kind == "drift" or isinstance(exc, InstrumentError):
                return None  # the check itself could not run the program
            cause = exc.__cause__ or exc
            first = str(exc).strip().splitlines()
            text = first[0] if first else ""
            return Outcome("error", str(exc.pass_name), type(cause).__name__, text)
        except Exception:  # the program cannot even run: not the failure kept
            return None
        drift = check.first_drift if check is not None else None
        if drift is None:
            return None
        return Outcome("drift", drift.path, "", str(drift).removeprefix(f"{drift.path}: "))

    def keep(self, outcome: Outcome | None) -> Outcome:
        """Keep ``outcome``, the first program's, as the failure to keep; raises
        ArgumentValueError when it is not a failure of the kind asked for."""
        if outcome is None or not self._wanted(outcome):
            what = {"auto": "fail or drift", "error": "fail", "drift": "drift"}[self.kind]
            got = f" ({outcome})" if outcome is not None else ""
            where = f" in pass {self.in_pass!r}" if self.in_pass else ""
            pattern = f" matching {self.pattern.pattern!r}" if self.pattern else ""
            raise ArgumentValueError(
                f"the pipeline does not {what}{where}{pattern} on the program{got}; "
                "there is nothing to reduce"
            )
        self.reference = outcome
        self.kind = outcome.kind  # later runs look for that kind only
        return outcome

    def _wanted(self, outcome: Outcome) -> bool:
        if self.kind != "auto" and outcome.kind != self.kind:
            return False
        if self.in_pass is not None and outcome.pass_name != self.in_pass:
            return False
        return self.pattern is None or bool(self.pattern.search(outcome.message))

    def keeps(self, outcome: Outcome | None) -> bool:
        """Whether ``outcome`` is the failure kept: the same kind, in the same pass,
        with the same error type (or an error matching the pattern)."""
        ref = self.reference
        if outcome is None or ref is None or not self._wanted(outcome):
            return False
        if (outcome.kind, outcome.pass_name) != (ref.kind, ref.pass_name):
            return False
        return (
            outcome.kind == "drift"
            or self.pattern is not None
            or (outcome.error_type == ref.error_type)
        )

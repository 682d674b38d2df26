"""The epass error hierarchy: every error names the pass, key or position at fault."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DecompositionMismatchError",
    "EpassError",
    "IncrementalDecompositionError",
    "InstrumentError",
    "OrderingError",
    "PassError",
    "StateConflictError",
    "StateMutationError",
    "VerificationError",
]


class EpassError(Exception):
    """Base class of every error epass raises on purpose."""


class DecompositionMismatchError(EpassError, AssertionError):
    """``Decompose(check=True)``: the incremental path differs from torch's retrace.

    Attributes:
        difference: the first differing node (or signature part), described.
    """

    def __init__(self, difference: str) -> None:
        super().__init__(
            f"the incremental decomposition differs from run_decompositions: {difference}"
        )
        self.difference = difference


class IncrementalDecompositionError(EpassError, RuntimeError):
    """``Decompose(method="incremental")`` cannot promise torch's program; the
    message names the reason (the node, op or program feature)."""


class OrderingError(EpassError, ValueError):
    """A pipeline breaks a pass's declared ``run_before`` / ``run_after`` constraint."""


class PassError(EpassError):
    """A pass failed inside a pipeline; the user's program is as it was before.

    Attributes:
        pass_name: the failing pass.
        index: its position in the pipeline (0-based).
        step: the fixed-point round (0-based).
        previous: names of the passes that ran before it in this round.
    """

    def __init__(
        self,
        message: str,
        *,
        pass_name: str | None = None,
        index: int | None = None,
        step: int | None = None,
        previous: Sequence[str] = (),
    ) -> None:
        self.pass_name = pass_name
        self.index = index
        self.step = step
        self.previous = tuple(previous)
        self.reason = message
        super().__init__(self._render(message))

    def _render(self, message: str) -> str:
        if self.pass_name is None:
            return message
        where = f"pass {self.pass_name!r}"
        if self.index is not None:
            where += f" (position {self.index}"
            where += f", step {self.step})" if self.step is not None else ")"
        text = f"{where} failed: {message}"
        if self.previous:
            text += f"\n  passes before it: {', '.join(self.previous)}"
        return text

    def add_note_line(self, line: str) -> None:
        """Append a line to the message (for instance, where a reproducer was written)."""
        self.args = (f"{self.args[0]}\n  {line}",)


class VerificationError(PassError):
    """A pass produced a program that fails torch's verifier or epass's state checks."""


class StateConflictError(PassError):
    """Under the ``strict`` policy, a pass changed the value of existing state keys.

    Attributes:
        keys: the changed keys, as ``"state_dict:<key>"`` / ``"constants:<key>"``.
    """

    def __init__(self, message: str, *, keys: Sequence[str] = (), **kwargs: object) -> None:
        self.keys = tuple(keys)
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class StateMutationError(PassError):
    """A pass wrote into a tensor of the shared store in place.

    Attributes:
        keys: the mutated entries, as ``"state_dict:<key>"`` / ``"constants:<key>"``.
    """

    def __init__(self, message: str, *, keys: Sequence[str] = (), **kwargs: object) -> None:
        self.keys = tuple(keys)
        super().__init__(message, **kwargs)  # type: ignore[arg-type]


class InstrumentError(PassError):
    """An instrument raised in one of its hooks; the pipeline stopped cleanly.

    Attributes:
        instrument: the instrument's class name.
        hook: the hook that raised.
    """

    def __init__(self, message: str, *, instrument: str, hook: str, **kwargs: object) -> None:
        self.instrument = instrument
        self.hook = hook
        super().__init__(message, **kwargs)  # type: ignore[arg-type]

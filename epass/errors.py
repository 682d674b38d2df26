"""Every public epass error: all are ``EpassError`` and name the pass, key or position at fault.

=================================  ============================================================
error                              raised when
=================================  ============================================================
``PassError``                      a pass failed inside a pipeline (subclasses say how)
``VerificationError``              a pass's output fails torch's verifier or the state checks
``StateConflictError``             ``strict`` linking found changed state keys
``StateMutationError``             a pass wrote into a tensor of the shared store
``InstrumentError``                an instrument raised in one of its hooks
``OrderingError``                  a pipeline breaks a ``run_before`` / ``run_after`` constraint
``ProgramError``                   a program is inconsistent (``verify_program``)
``RegistryError``                  a pass name cannot be registered or resolved
``PipelineError``                  pipeline text does not parse or names something unknown
``DecompositionError``             torch's decomposition failed on a node
``DecompositionMismatchError``     check mode: the incremental path differs from torch's
``IncrementalDecompositionError``  ``method="incremental"`` cannot promise torch's program
``NumericsDriftError``             ``NumericsCheck`` found outputs beyond tolerance
``ArgumentTypeError``              an argument has the wrong type (also a ``TypeError``)
``ArgumentValueError``             an argument has a bad value (also a ``ValueError``)
``LoadError``                      a file cannot be loaded as a program
``UnsafeArchiveError``             an untrusted archive holds a member that could run code
``SaveError``                      a program or report could not be written (nothing changed)
``HandOffError``                   a backend hand-off got something it cannot convert
``CliError``                       the ``epass`` command stops with a one-line message
=================================  ============================================================

Errors that describe bad arguments also derive from the matching builtin
(``TypeError``, ``ValueError``, ``LookupError``...), so existing ``except`` clauses
keep working.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "CliError",
    "DecompositionError",
    "DecompositionMismatchError",
    "EpassError",
    "HandOffError",
    "IncrementalDecompositionError",
    "InstrumentError",
    "LoadError",
    "NumericsDriftError",
    "OptionError",
    "OrderingError",
    "PassError",
    "PipelineError",
    "PluginError",
    "ProgramError",
    "RegistryError",
    "SaveError",
    "StateConflictError",
    "StateMutationError",
    "UnknownPassError",
    "UnsafeArchiveError",
    "VerificationError",
]


class EpassError(Exception):
    """Base class of every error epass raises on purpose."""


class ArgumentTypeError(EpassError, TypeError):
    """An argument of an epass function or class has the wrong type."""


class ArgumentValueError(EpassError, ValueError):
    """An argument of an epass function or class has a value it cannot take."""


class HandOffError(EpassError, TypeError):
    """A backend hand-off (``epass.executorch``) got something it cannot convert."""


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


class ProgramError(EpassError, ValueError):
    """A program is inconsistent: torch's verifier or the state checks reject it.

    Attributes:
        problems: one readable line per problem found.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        self.problems = tuple(problems)
        super().__init__(message)


class PassError(EpassError):
    """A pass failed inside a pipeline; the user's program is as it was before.

    Attributes:
        pass_name: the failing pass.
        index: its position in the pipeline (0-based).
        step: the fixed-point round (0-based).
        previous: names of the passes that ran before it in this round.
        reason: the message without the location.
        reported: whether instruments were already told (``pass_failed``) about
            this error; the manager of a nested pipeline reports it once.
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
        self.reported = False
        self._locate(message, pass_name, index, step, previous)
        super().__init__(self._render(message))

    def _locate(
        self,
        message: str,
        pass_name: str | None,
        index: int | None,
        step: int | None,
        previous: Sequence[str],
    ) -> None:
        self.pass_name = pass_name
        self.index = index
        self.step = step
        self.previous = tuple(previous)
        self.reason = message

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

    def nest(
        self,
        *,
        pass_name: str | None,
        index: int | None = None,
        step: int | None = None,
        previous: Sequence[str] = (),
    ) -> None:
        """Name the enclosing pipeline's pass as the location: a nested pipeline
        failed with this error, which keeps its class and attributes."""
        message = f"in nested pipeline: {self}"
        self._locate(message, pass_name, index, step, previous)
        self.args = (self._render(message),)

    def add_note_line(self, line: str) -> None:
        """Append a line to the message (for instance, where a reproducer was written)."""
        self.args = (f"{self.args[0]}\n  {line}",)


class VerificationError(PassError):
    """A pass produced a program that fails torch's verifier or epass's state checks."""


class _StateEntriesError(PassError):
    """A pass did something forbidden to particular entries of the shared store.

    Attributes:
        keys: the entries, as ``"state_dict:<key>"`` / ``"constants:<key>"``.
    """

    def __init__(
        self,
        message: str,
        *,
        keys: Sequence[str] = (),
        pass_name: str | None = None,
        index: int | None = None,
        step: int | None = None,
        previous: Sequence[str] = (),
    ) -> None:
        self.keys = tuple(keys)
        super().__init__(message, pass_name=pass_name, index=index, step=step, previous=previous)


class StateConflictError(_StateEntriesError):
    """Under the ``strict`` policy, a pass changed the value of existing state keys.

    Attributes:
        keys: the changed keys, as ``"state_dict:<key>"`` / ``"constants:<key>"``.
    """


class StateMutationError(_StateEntriesError):
    """A pass wrote into a tensor of the shared store in place.

    Attributes:
        keys: the mutated entries, as ``"state_dict:<key>"`` / ``"constants:<key>"``.
    """


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


class RegistryError(EpassError, LookupError):
    """A pass name cannot be registered or resolved."""

    def __str__(self) -> str:  # LookupError would quote the message like a KeyError
        return str(self.args[0]) if self.args else ""


class UnknownPassError(RegistryError):
    """No pass is registered under a name.

    Attributes:
        name: the name asked for.
        suggestions: close registered names, best first.
    """

    def __init__(self, name: str, suggestions: tuple[str, ...] = ()) -> None:
        self.name = name
        self.suggestions = suggestions
        hint = f"; did you mean {suggestions[0]!r}?" if suggestions else ""
        super().__init__(f"unknown pass {name!r}{hint}")


class PluginError(RegistryError):
    """A registered pass could not be loaded, or two providers claim one name."""


class PipelineError(EpassError, ValueError):
    """Pipeline text that does not parse or names something unknown.

    ``str(error)`` is the one-line reason followed by the text and a caret line
    under the offending column.

    Attributes:
        reason: the one-line reason (with the column).
        text: the pipeline text.
        column: 1-based column of the problem.
    """

    def __init__(self, message: str, text: str, pos: int, hint: str = "") -> None:
        self.text = text
        self.pos = pos
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line_end = len(text) if line_end < 0 else line_end
        self.line = text.count("\n", 0, pos) + 1
        self.column = pos - line_start + 1
        where = f"column {self.column}"
        if self.line > 1:
            where = f"line {self.line}, {where}"
        self.reason = f"{message} at {where}{hint}"
        self.context = f"  {text[line_start:line_end]}\n  {' ' * (pos - line_start)}^"
        super().__init__(f"{self.reason}\n{self.context}")


class OptionError(PipelineError, ArgumentTypeError):
    """A pass option whose value does not fit the type the pass declares.

    Raised when a pipeline is built, before anything runs, for options given in
    text and as Python keywords alike. It is a :class:`PipelineError` (the caret
    points at the value; for keywords the text is the call written out) and an
    :class:`ArgumentTypeError`.

    Attributes:
        pass_name: the registry name of the pass.
        option: the option's name.
        expected: the declared type, as text.
        message: the reason without the location.
    """

    def __init__(
        self,
        message: str,
        text: str,
        pos: int,
        *,
        pass_name: str,
        option: str,
        expected: str,
    ) -> None:
        self.pass_name = pass_name
        self.option = option
        self.expected = expected
        self.message = message
        super().__init__(message, text, pos)


class DecompositionError(EpassError, RuntimeError):
    """``run_decompositions`` failed; names the graph node and op it failed on.

    Attributes:
        node: the name of the node being executed when tracing failed (or None).
        op: that node's target as text (or None).
        suggestion: an actionable workaround, when one is known (or None).
    """

    def __init__(
        self, message: str, *, node: str | None, op: str | None, suggestion: str | None
    ) -> None:
        super().__init__(message)
        self.node = node
        self.op = op
        self.suggestion = suggestion


class NumericsDriftError(EpassError, AssertionError):
    """Raised by ``NumericsCheck(raise_on_drift=True)``; names the pass and the error."""


class LoadError(EpassError, ValueError):
    """A file could not be loaded as a program: missing, not a .pt2 archive, or corrupt.

    Attributes:
        path: the file.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        self.path = path
        super().__init__(message)


class UnsafeArchiveError(LoadError):
    """An archive holds a member that loading it without trust would not allow.

    Raised before torch reads the file: nothing in it has been executed.

    Attributes:
        path: the file.
        member: the offending archive member.
    """

    def __init__(self, message: str, *, path: str = "", member: str = "") -> None:
        self.member = member
        super().__init__(message, path=path)


class SaveError(EpassError, OSError):
    """A program or report could not be written; the target path is as it was before."""


class CliError(EpassError):
    """A failure the ``epass`` command reports as one line, with its exit code.

    Attributes:
        reason: the line printed after ``epass: error:``.
        code: the exit code (1: a pass or a check failed; 2: bad arguments or files).
        context: further lines (the caret under a pipeline syntax error).
    """

    def __init__(self, reason: str, code: int = 2, context: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.context = context

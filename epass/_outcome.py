"""What a pass left, checked: the store tensors it wrote, the program and modified flag
it returned (and whether it edited its view in place), whether its output verifies.

The manager takes a :class:`Snapshot` of a pass's view before the pass runs, and reads
the pass's outcome through these checks afterwards; each error names the pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from torch.export import ExportedProgram

from epass import _snapshot, verification
from epass.errors import PassError, ProgramError, StateMutationError, VerificationError
from epass.protocol import Notice, PassResult
from epass.records import PassInfo
from epass.watch import StoreWatch

__all__ = ["Returned", "Snapshot", "check_store", "notes", "returned", "verify_output"]


class Snapshot:
    """A pass's view as the pass got it, graph side and store side.

    The graph side (``_snapshot.ProgramSnapshot``, taken for every pass that is not
    epass's own) tells what the pass edited in its view; the store side (a
    :class:`StoreWatch`) which store tensors it wrote.
    """

    def __init__(
        self,
        view: ExportedProgram,
        watch: StoreWatch,
        program: _snapshot.ProgramSnapshot | None,
    ) -> None:
        self.view = view
        self.watch = watch
        self.program = program

    def difference(self) -> str | None:
        """What the pass edited in its view (:meth:`ProgramSnapshot.difference`), or
        None: nothing, or the pass is epass's own and took no snapshot."""
        return None if self.program is None else self.program.difference(self.view)

    def program_difference(self) -> str | None:
        """:meth:`difference` but for the view's own dicts' entries."""
        return None if self.program is None else self.program.program_difference(self.view)

    def store_writes(self) -> list[str]:
        """The store entries written in place since the snapshot (:meth:`StoreWatch.touched`)."""
        return self.watch.touched()


def check_store(snapshot: Snapshot, info: PassInfo) -> None:
    """Raise StateMutationError when an entry the store held before the pass was
    written in place: the same tensor objects, compared by version (and by
    fingerprint). Entries added or replaced meanwhile by other runs (other
    threads, pipelines started from inside the pass) are not this pass's writes.
    """
    touched = snapshot.store_writes()
    if touched:
        raise StateMutationError(
            f"it wrote in place into shared state tensors {touched}; a pass must "
            "create new tensors instead of mutating the ones it is given",
            keys=touched,
            **info.location(),
        )


@attrs.frozen
class Returned:
    """What a pass handed back, as the manager takes it.

    Attributes:
        program: the program it returned.
        modified: whether it modified the program: its own flag for a pass epass
            defines, else also whatever its view shows it edited.
        notices: what the manager says of the pass (a flag it did not keep).
    """

    program: ExportedProgram
    modified: bool
    notices: tuple[Notice, ...] = ()


def returned(out: Any, snapshot: Snapshot, info: PassInfo, *, changes_input: bool) -> Returned:
    """The program a pass returned (``out``) and whether it modified it.

    For a pass that is not epass's own (it got a snapshot), nothing it declares is
    believed: an edit of its view counts as a modification whatever flag it returned
    (with a notice), and an edit under ``changes_input = False`` fails it.

    Raises:
        PassError: ``out`` carries no program and flag, or the pass edited a view it
            declared it would not edit.
    """
    edited = snapshot.difference()
    broken = None if changes_input or edited is None else snapshot.program_difference()
    if broken is not None:
        raise PassError(
            f"it declares changes_input = False but changed {broken} in the program it "
            "was given; it was given a private copy, so nothing reached the caller's "
            "program: set changes_input = True or build a new program",
            **info.location(),
        )
    program, flag = _program_and_flag(out, snapshot, info)
    if flag is None:  # its view, returned bare: modified when edited
        return Returned(program, edited is not None)
    if flag or edited is None:
        return Returned(program, flag)
    text = f"it returned modified=False but changed {edited}: taken as modified"
    return Returned(program, True, (Notice("declaration", text),))


def _program_and_flag(
    out: Any, snapshot: Snapshot, info: PassInfo
) -> tuple[ExportedProgram, bool | None]:
    """The program ``out`` carries and its flag: True for a bare program other than
    the view, None for the view returned bare (its snapshot tells)."""
    if isinstance(out, ExportedProgram):
        if out is not snapshot.view:
            return out, True
        if snapshot.program is None:
            # An epass pass returns a PassResult; a bare view cannot be told.
            raise PassError(
                "it returned the program it was given, but its __call__ is annotated "
                "to return a PassResult; return PassResult(program, modified)",
                **info.location(),
            )
        return out, None
    if isinstance(out, PassResult):
        return out.program, out.modified
    # Any result carrying a program and a modified flag: epass's names, or
    # ExecuTorch's ExportedProgramPassResult(exported_program, modified), read by
    # name so that the engine never imports ExecuTorch.
    flag = getattr(out, "modified", None)
    for field in _RESULT_PROGRAM_FIELDS:
        program = getattr(out, field, None)
        if isinstance(program, ExportedProgram) and isinstance(flag, bool):
            return program, flag
    raise PassError(
        f"it returned {out!r} ({type(out).__name__}); a pass must return an "
        "ExportedProgram or a result with a program and a modified flag: "
        "PassResult(program, modified), or ExecuTorch's "
        "ExportedProgramPassResult(exported_program, modified)",
        **info.location(),
    )


# The attribute names under which a pass result may carry its program.
_RESULT_PROGRAM_FIELDS = ("program", "exported_program")


def verify_output(
    program: ExportedProgram,
    source: ExportedProgram | verification.Before,
    info: PassInfo,
    previous: verification.CallWalk | None,
) -> verification.CallWalk:
    """Raise VerificationError, naming the pass, when its output does not verify;
    else return the walk over its calls (:func:`epass.verification.check_output`)."""
    try:
        return verification.check_output(program, source, previous)
    except Exception as exc:
        detail = str(exc) if isinstance(exc, ProgramError) else f"{type(exc).__name__}: {exc}"
        raise VerificationError(f"its output does not verify: {detail}", **info.location()) from exc


def notes(out: Any) -> dict[str, Any]:
    """The JSON-ready ``notes`` a pass's result carries, if any."""
    found = getattr(out, "notes", None)
    return dict(found) if isinstance(found, Mapping) else {}

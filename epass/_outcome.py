"""What a pass left, checked: the store tensors it wrote, the program and modified flag
it returned (and whether it edited its view in place), whether its output verifies.

The manager takes a :class:`Snapshot` of a pass's view before the pass runs, and reads
the pass's outcome through these checks afterwards; each error names the pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.export import ExportedProgram

from epass import _snapshot, verification
from epass.errors import PassError, ProgramError, StateMutationError, VerificationError
from epass.protocol import PassResult
from epass.records import PassInfo
from epass.watch import StoreWatch

__all__ = ["Snapshot", "check_store", "notes", "returned", "verify_output"]


class Snapshot:
    """A pass's view as the pass got it, graph side and store side.

    The graph side (``_snapshot.ProgramSnapshot``) tells whether the pass edited its view
    in place; the store side (a :class:`StoreWatch`) which store tensors it wrote.
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

    def graph_changed(self) -> bool:
        """Whether the view's graph (structure or node meta) was edited in place."""
        return self.program is not None and self.program.graph_changed(self.view)

    def changed(self) -> bool:
        """Whether the view was edited in place: graph, meta, signature, state keys or entries."""
        return self.program is not None and self.program.changed(self.view)

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


def returned(
    out: Any, snapshot: Snapshot, info: PassInfo, *, changes_input: bool
) -> tuple[ExportedProgram, bool]:
    """The program a pass returned (``out``) and whether it modified it; a pass that
    returned its own view modified it when it edited it in place (``changes_input``:
    what the pass declares about its input).

    Raises:
        PassError: ``out`` carries no program and flag, or the pass edited a view it
            promised not to edit, or returned one whose edits cannot be told.
    """
    if isinstance(out, ExportedProgram):
        if out is not snapshot.view:
            return out, True
        if snapshot.program is None:
            # It got no snapshot on the strength of its annotation, so whether it
            # edited its view cannot be told: refuse rather than guess.
            raise PassError(
                "it returned the program it was given, but its __call__ is annotated "
                "to return a PassResult; return PassResult(program, modified)",
                **info.location(),
            )
        return out, _edited(snapshot, info, changes_input)
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


def _edited(snapshot: Snapshot, info: PassInfo, changes_input: bool) -> bool:
    """Whether a pass that returned its own view edited it in place."""
    if not changes_input and snapshot.graph_changed():
        # The view's graph is its input's graph (possibly the caller's), handed over
        # uncopied on the pass's promise not to edit it.
        raise PassError(
            "it declares changes_input = False but edited the graph it was given in "
            "place; set changes_input = True (the manager then hands it a private "
            "copy) or build a new graph",
            **info.location(),
        )
    return snapshot.changed()


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

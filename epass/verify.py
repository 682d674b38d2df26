"""Program checks run after each pass: torch's verifier plus state/signature consistency."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from epass.errors import ArgumentTypeError, ProgramError

__all__ = ["state_problems", "verify_program"]


def state_problems(ep: ExportedProgram) -> list[str]:
    """Every way the signature and the state dicts disagree, as readable lines."""
    problems: list[str] = []
    sd, consts = ep.state_dict, ep.constants
    for spec in ep.graph_signature.input_specs:
        target = spec.target
        if spec.kind == InputKind.PARAMETER:
            if target not in sd:
                problems.append(f"parameter {target!r} is missing from state_dict")
            elif not isinstance(sd[target], torch.nn.Parameter):
                problems.append(f"parameter {target!r} is not an nn.Parameter")
        elif spec.kind == InputKind.BUFFER:
            if spec.persistent:
                if target not in sd:
                    problems.append(f"persistent buffer {target!r} is missing from state_dict")
            elif target not in consts:
                problems.append(f"non-persistent buffer {target!r} is missing from constants")
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            if target not in consts:
                problems.append(f"constant {target!r} is missing from constants")
            elif not isinstance(consts[target], torch.Tensor):
                problems.append(f"constant {target!r} is not a tensor")
        elif spec.kind == InputKind.CUSTOM_OBJ and target not in consts:
            problems.append(f"custom object {target!r} is missing from constants")
    return problems


def verify_program(ep: ExportedProgram) -> None:
    """Run ``ep.validate()`` and the state checks.

    Raises:
        ArgumentTypeError: ``ep`` is not an ExportedProgram.
        ProgramError: torch's verifier rejects the program, or its state and
            signature disagree (``problems`` lists every disagreement).
    """
    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(f"verify_program takes an ExportedProgram, got {type(ep).__name__}")
    try:
        ep.validate()
    except Exception as exc:
        raise ProgramError(f"{type(exc).__name__}: {exc}", [str(exc)]) from exc
    problems = state_problems(ep)
    if problems:
        raise ProgramError("inconsistent program state:\n  " + "\n  ".join(problems), problems)

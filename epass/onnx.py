"""ONNX hand-off: run a pipeline, export with ``torch.onnx.export(..., dynamo=True)``,
and give the resulting program the user's state back."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _handoff
from epass.errors import ArgumentTypeError, ArgumentValueError, EpassError
from epass.linker import LinkReport, StateLinker

__all__ = ["export"]

logger = logging.getLogger("epass")


def export(
    ep_or_module: ExportedProgram | torch.nn.Module,
    args: tuple[Any, ...] = (),
    *,
    pipeline: Any = None,
    serve_decompositions: bool = True,
    **onnx_kwargs: Any,
) -> Any:
    """Run ``pipeline`` on the program, export it to ONNX, and relink its state.

    ``torch.onnx.export`` decomposes the program once more and keeps the result as
    ``onnx_program.exported_program``, with a ``state_dict`` of its own. This function
    links that program back to the user's: afterwards its ``state_dict`` and
    ``constants`` are the user's dict objects holding the user's tensor objects.
    Where torch added entries (such as lifted constants), that dict is the
    program's own, holding the user's tensor objects and the added ones; the
    user's dict never gains them (see the StateLinker's ``share`` policy).

    Args:
        ep_or_module: an ExportedProgram, or a module to export first with
            ``torch.export.export`` (``dynamic_shapes``, ``kwargs`` and ``strict``
            from ``onnx_kwargs`` are used for that).
        args: example positional inputs.
        pipeline: a PassManager, a list of passes, a single pass, or None. With a
            table-less ``Decompose`` it runs at the exporter's decomposition, with the
            exporter's table (docs/onnx.md, "Where the pipeline runs").
        serve_decompositions: serve the exporter's own ``run_decompositions`` call
            with epass's ``Decompose`` (:func:`epass.fast_decompositions`); False
            leaves it to torch, also inside a ``fast_decompositions()`` block. What was
            served is logged at DEBUG level and recorded in the log of any
            ``fast_decompositions()`` block around this call.
        **onnx_kwargs: passed to ``torch.onnx.export`` (``dynamo`` must stay True).

    Returns:
        The ``torch.onnx.ONNXProgram``.

    Example::

        onnx_program = epass.onnx.export(ep, args, pipeline=[epass.Decompose()])
        assert onnx_program.exported_program.state_dict is ep.state_dict
    """
    if onnx_kwargs.pop("dynamo", True) is not True:
        raise ArgumentValueError("epass.onnx.export needs the dynamo exporter; drop dynamo=False")
    ep = _program_of(ep_or_module, args, onnx_kwargs)
    serve = serve_decompositions
    hand_off = _handoff.start(
        {"forward": ep}, pipeline, "torch.onnx.export", serve=serve, at_decomposition=True
    )
    onnx_program = hand_off.call(
        torch.onnx.export, hand_off.private["forward"], tuple(args), dynamo=True, **onnx_kwargs
    )
    if onnx_program is None:  # pragma: no cover - only for dynamo=False
        raise EpassError("torch.onnx.export returned no ONNXProgram")
    if onnx_program.exported_program is None:
        raise ArgumentValueError("this ONNXProgram carries no exported_program to relink")
    hand_off.relink("forward", onnx_program.exported_program)
    if hand_off.served is not None:
        logger.debug("torch.onnx.export: %s", hand_off.served.summary())
    return onnx_program


def relink(
    onnx_program: Any, program: ExportedProgram, *, user: ExportedProgram | None = None
) -> LinkReport:
    """Point ``onnx_program.exported_program`` at ``program``'s dicts and tensors.

    Returns the link report; ``report.shared`` is False when the exporter added an
    entry or changed an existing entry's value, in which case the exported program
    keeps a dict of its own (every unchanged entry still the original object, and
    ``program``'s dicts gain nothing). The report's ``owners`` say which dicts are
    ``user``'s (default: ``program``'s).
    """
    exported = onnx_program.exported_program
    if exported is None:
        raise ArgumentValueError("this ONNXProgram carries no exported_program to relink")
    linker = StateLinker()
    return linker.link(program, exported, pass_name="torch.onnx.export", user=user).report


def _program_of(
    ep_or_module: ExportedProgram | torch.nn.Module, args: tuple[Any, ...], onnx_kwargs: Any
) -> ExportedProgram:
    """The program to export: ``ep_or_module`` itself, or the module exported with the
    export arguments among ``onnx_kwargs`` (``kwargs`` and ``dynamic_shapes`` stay
    there: the exporter names the axes given as strings, as it does for its own
    capture)."""
    if isinstance(ep_or_module, ExportedProgram):
        return ep_or_module
    if isinstance(ep_or_module, torch.nn.Module):
        shapes = onnx_kwargs.get("dynamic_shapes")
        if shapes is None and onnx_kwargs.get("dynamic_axes") is not None:
            raise ArgumentValueError(
                "epass.onnx.export exports the module with torch.export.export, which "
                "does not read dynamic_axes; give dynamic_shapes instead (a string "
                "names an axis, as in {0: 'batch'})"
            )
        return torch.export.export(
            ep_or_module,
            tuple(args),
            kwargs=onnx_kwargs.get("kwargs"),
            dynamic_shapes=_export_dims(shapes),
            strict=onnx_kwargs.pop("strict", False),
        )
    raise ArgumentTypeError(
        "epass.onnx.export takes an ExportedProgram or an nn.Module, "
        f"got {type(ep_or_module).__name__}"
    )


def _export_dims(shapes: Any) -> Any:
    """``dynamic_shapes`` for ``torch.export.export``: an axis named by a string, which
    only the exporter reads, is ``Dim.DYNAMIC`` (as the exporter's own capture makes
    it)."""
    if isinstance(shapes, str):
        return torch.export.Dim.DYNAMIC
    if isinstance(shapes, dict):
        return {key: _export_dims(value) for key, value in shapes.items()}
    if isinstance(shapes, (list, tuple)):
        made = [_export_dims(value) for value in shapes]
        return made if isinstance(shapes, list) else tuple(made)
    return shapes

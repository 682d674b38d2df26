"""IREE hand-off: run a pipeline and export its output with iree-turbine's
``iree.turbine.aot.export``, from a private program that IREE may edit."""

from __future__ import annotations

from typing import Any

from torch.export import ExportedProgram

from epass import _handoff
from epass.errors import ArgumentTypeError

__all__ = ["export"]

_CONSUMER = "iree.turbine.aot.export"


def export(
    ep: ExportedProgram,
    *,
    pipeline: Any = None,
    serve_decompositions: bool = True,
    **iree_kwargs: Any,
) -> Any:
    """Run ``pipeline`` on ``ep`` and export the result with iree-turbine.

    iree-turbine edits the graph of the program it is given in place (it rewrites
    ``lift_fresh_copy`` and inserts ``as_strided`` nodes while importing). Here it
    gets a private program: its own graph and dicts, holding the user's tensors and
    only the entries the signature references. So its edits never reach the user's
    program, even when the pipeline changed nothing (or there is no pipeline) and
    its output is the user's program itself. iree-turbine does not decompose the
    program again: hand it a decomposed one (``presets.lower()``). An IREE that
    writes into the user's tensors is named in a :class:`~epass.StateMutationError`.

    Args:
        ep: the user's ExportedProgram (never modified).
        pipeline: a PassManager, a list of passes, a single pass, or None.
        serve_decompositions: serve any ``run_decompositions`` call iree-turbine
            makes with epass's ``Decompose`` (:func:`epass.fast_decompositions`,
            whose log around this call records it); False leaves it to torch, also
            inside a ``fast_decompositions()`` block.
        **iree_kwargs: passed to ``iree.turbine.aot.export`` (``module_name``,
            ``function_name``, ``arg_device``, ...).

    Returns:
        iree-turbine's ``ExportOutput``; ``.compile(save_to=None,
        target_backends="llvm-cpu")`` builds the VM flatbuffer.

    Example::

        output = epass.iree.export(ep, pipeline=presets.lower())
        binary = output.compile(save_to=None, target_backends="llvm-cpu")
    """
    from iree.turbine import aot

    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(
            f"epass.iree.export takes an ExportedProgram, got {type(ep).__name__}"
        )
    hand_off = _handoff.start({"forward": ep}, pipeline, _CONSUMER, serve=serve_decompositions)
    return hand_off.call(aot.export, hand_off.private["forward"], **iree_kwargs)

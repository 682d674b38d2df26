"""Apache TVM hand-off: run a pipeline and import its output into Relax with
``tvm.relax.frontend.torch.from_exported_program``, from a private program."""

from __future__ import annotations

from typing import Any

import attrs
from torch.export import ExportedProgram

from epass import _handoff
from epass._served import DecompositionLog
from epass.errors import ArgumentTypeError
from epass.manager import PipelineResult
from epass.passes import Decompose

__all__ = ["TVMImport", "from_exported_program"]

_CONSUMER = "tvm.relax.frontend.torch.from_exported_program"


@attrs.frozen
class TVMImport:
    """TVM's Relax module, and what epass gave TVM.

    Attributes:
        mod: the ``tvm.IRModule`` TVM built (function ``main``). With TVM's default
            ``keep_params_as_input=False`` its weights are bound as constants that
            read the user's tensor memory without copying.
        program: the pipeline's output (sharing the user's state), or the user's
            program without a pipeline.
        pipeline: the pipeline's result, or None without a pipeline.
        tvm_decomposed: whether TVM ran ``run_decompositions()`` on the program
            again (``run_ep_decomposition``); False when the program had nothing
            left to decompose.
        served: how epass served TVM's ``run_decompositions`` calls (None when
            ``serve_decompositions=False`` left them to torch).
    """

    mod: Any
    program: ExportedProgram
    pipeline: PipelineResult | None
    tvm_decomposed: bool
    served: DecompositionLog | None = None


def needs_decomposition(ep: ExportedProgram) -> bool:
    """Whether ``run_decompositions()`` would still change ``ep``: False for a
    program a pipeline already decomposed (one walk over the nodes, no tracing)."""
    return Decompose().skip_reason(ep) is None


def from_exported_program(
    ep: ExportedProgram,
    *,
    pipeline: Any = None,
    serve_decompositions: bool = True,
    **tvm_kwargs: Any,
) -> TVMImport:
    """Run ``pipeline`` on ``ep`` and import the result into TVM's Relax.

    TVM gets a private program: its own graph and dicts, holding the user's tensors
    and only the entries the signature references (TVM binds every value of
    ``constants`` in order, so an entry the program does not reference would shift
    the bindings). TVM decomposes every program it imports once more; that is
    skipped (``run_ep_decomposition=False``) when the program has nothing left to
    decompose, such as the output of ``Decompose()`` or ``presets.lower()``. An
    explicit ``run_ep_decomposition`` in ``tvm_kwargs`` wins. A TVM that writes
    into the user's tensors is named in a :class:`~epass.StateMutationError`.

    Args:
        ep: the user's ExportedProgram (never modified).
        pipeline: a PassManager, a list of passes, a single pass, or None.
        serve_decompositions: serve TVM's own ``run_decompositions`` call with
            epass's ``Decompose`` (:func:`epass.fast_decompositions`); False
            leaves it to torch, also inside a ``fast_decompositions()`` block.
        **tvm_kwargs: passed to ``from_exported_program`` (``keep_params_as_input``,
            ``unwrap_unit_return_tuple``, ``custom_convert_map``, ...).

    Returns:
        A :class:`TVMImport`; ``result.mod`` is the ``tvm.IRModule``.

    Example::

        result = epass.tvm.from_exported_program(ep, pipeline=presets.lower())
        assert not result.tvm_decomposed
        executable = tvm.compile(result.mod, target="llvm")
    """
    from tvm.relax.frontend.torch import from_exported_program as tvm_import

    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(
            f"epass.tvm.from_exported_program takes an ExportedProgram, got {type(ep).__name__}"
        )
    hand_off = _handoff.start({"forward": ep}, pipeline, _CONSUMER, serve=serve_decompositions)
    private = hand_off.private["forward"]
    if "run_ep_decomposition" not in tvm_kwargs:
        tvm_kwargs["run_ep_decomposition"] = needs_decomposition(private)
    mod = hand_off.call(tvm_import, private, **tvm_kwargs)
    return TVMImport(
        mod=mod,
        program=hand_off.programs["forward"],
        pipeline=hand_off.pipelines.get("forward"),
        tvm_decomposed=bool(tvm_kwargs["run_ep_decomposition"]),
        served=hand_off.served,
    )

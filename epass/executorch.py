"""ExecuTorch hand-off: run a pipeline, call ``to_edge`` (or ``to_edge_transform_and_lower``)
on private dict copies, and give every edge program the user's state back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from epass import _graph, _handoff
from epass._served import DecompositionLog
from epass.errors import HandOffError
from epass.linker import LinkReport
from epass.manager import PipelineResult

__all__ = ["EdgeResult", "to_edge", "to_edge_transform_and_lower"]

_FIELDS = ("state_dict", "constants")


@attrs.frozen
class EdgeResult:
    """ExecuTorch's edge manager, relinked to the user's state, and what happened.

    Attributes:
        edge: the ``EdgeProgramManager``; each method's ``exported_program()`` holds
            the user's ``state_dict`` and ``constants`` dicts wherever ExecuTorch
            changed no existing entry.
        programs: per method, the pipeline's output, sharing the user's state (the
            program handed to ExecuTorch; where the pipeline ran at ``to_edge``'s
            own decomposition, the program it made there), or the user's program
            without a pipeline.
        pipelines: per method, the pipeline's result (empty without a pipeline).
        links: per method, how the edge program's state was linked back: entries
            ExecuTorch added (such as the scalars it lifts; the edge program then
            holds a dict of its own, and the user's dict never gains them), removed
            (delegated weights leave the edge program; the user's dict keeps them)
            or changed (a new tensor in place of the user's, such as a contiguous
            copy of a view; the edge program then keeps a dict of its own and the
            user's dict is untouched).
        served: how epass served ExecuTorch's own ``run_decompositions`` calls
            (None when ``serve_decompositions=False`` left them to torch).
    """

    edge: Any
    programs: Mapping[str, ExportedProgram]
    pipelines: Mapping[str, PipelineResult]
    links: Mapping[str, LinkReport]
    served: DecompositionLog | None = None

    @property
    def shared(self) -> bool:
        """True when every edge program's dicts are the user's dict objects."""
        return all(r.shared for r in self.links.values())

    def exported_program(self, method_name: str = "forward") -> ExportedProgram:
        """The edge program of one method (``edge.exported_program(method_name)``)."""
        return self.edge.exported_program(method_name)  # type: ignore[no-any-return]

    def to_executorch(self, *args: Any, **kwargs: Any) -> Any:
        """``edge.to_executorch(...)``: the ``ExecutorchProgramManager``."""
        return self.edge.to_executorch(*args, **kwargs)

    def summary(self) -> str:
        """One line per method, e.g. ``forward: user's dicts; 2 entries no longer used ...``."""
        return "\n".join(f"{name}: {r.summary()}" for name, r in self.links.items())


def _programs(
    ep_or_module: Any, args: tuple[Any, ...] | None, kwargs: dict[str, Any], caller: str
) -> dict[str, ExportedProgram]:
    dynamic_shapes = kwargs.pop("dynamic_shapes", None)
    strict = kwargs.pop("strict", False)
    if isinstance(ep_or_module, ExportedProgram):
        return {"forward": ep_or_module}
    if isinstance(ep_or_module, Mapping):
        bad = [k for k, v in ep_or_module.items() if not isinstance(v, ExportedProgram)]
        if bad:
            raise HandOffError(f"epass.executorch.{caller}: methods {bad} are not ExportedPrograms")
        return dict(ep_or_module)
    if isinstance(ep_or_module, torch.nn.Module):
        if args is None:
            raise HandOffError(f"epass.executorch.{caller} needs example args to export a module")
        ep = torch.export.export(
            ep_or_module, tuple(args), dynamic_shapes=dynamic_shapes, strict=strict
        )
        return {"forward": ep}
    raise HandOffError(
        f"epass.executorch.{caller} takes an ExportedProgram, a dict of them or an "
        f"nn.Module, got {type(ep_or_module).__name__}"
    )


def _hand_off(
    ep_or_module: Any,
    args: tuple[Any, ...] | None,
    pipeline: Any,
    kwargs: dict[str, Any],
    caller: str,
    convert: Any,
    serve: bool,
    at_decomposition: bool = False,
) -> EdgeResult:
    sources = _programs(ep_or_module, args, kwargs, caller)
    # ExecuTorch writes into the dicts of the program it is given (it replaces
    # non-contiguous constants by contiguous copies) and may edit its graph: it gets
    # private programs holding the same tensors, and only what each signature
    # references (it rejects a constant without an input spec).
    hand_off = _handoff.start(
        sources, pipeline, caller, serve=serve, at_decomposition=at_decomposition, shown=True
    )
    private = hand_off.private
    given: ExportedProgram | dict[str, ExportedProgram]
    given = private["forward"] if list(private) == ["forward"] else dict(private)
    # The keys handed over, before ExecuTorch runs: a served run_decompositions
    # gives it a program holding the private dicts, into which it lifts scalars.
    keys = {(n, f): set(getattr(p, f)) for n, p in private.items() for f in _FIELDS}
    edge = hand_off.call(convert, given, **kwargs)
    for name in private:
        handed = hand_off.handed(name)  # what a pipeline run at to_edge's call gave it
        if handed is not None:
            keys.update({(name, f): set(handed[f]) for f in _FIELDS})
    links: dict[str, LinkReport] = {}
    for name in edge.methods:
        program = edge.exported_program(name)
        for field in _FIELDS:
            store, new = getattr(hand_off.programs[name], field), getattr(program, field)
            _reuse_equal(store, new)
            _rename_collisions(program, new, store, keys.get((name, field), set()))
        links[name] = hand_off.relink(name, program)
    return EdgeResult(
        edge=edge,
        programs=dict(hand_off.programs),
        pipelines=dict(hand_off.pipelines),
        links=links,
        served=hand_off.served,
    )


def _reuse_equal(store: Mapping[str, Any], new: dict[str, Any]) -> None:
    """Put the store's tensor back where ExecuTorch lifted an equal one under its key.

    ``to_edge`` lifts the scalars a graph creates (``_lifted_tensor_constant1``) anew
    on every call; handing over a program that already holds them (an edge
    program's own) would otherwise change them. Only tensors of the same layout
    are compared, so a contiguous copy of a view is still reported as changed.
    """
    for key, value in new.items():
        old = store.get(key)
        if old is None or old is value:
            continue
        if not (isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor)):
            continue
        if (
            type(old) is not type(value)
            or old.dtype != value.dtype
            or old.shape != value.shape
            or old.stride() != value.stride()
            or old.device != value.device
            or old.device.type == "meta"
        ):
            continue
        if torch.equal(old, value):
            new[key] = old


def _rename_collisions(
    program: ExportedProgram, new: dict[str, Any], store: Mapping[str, Any], given: set[str]
) -> None:
    """Give the entries ExecuTorch added a key of their own where the store already
    holds another value under that key.

    ExecuTorch names the scalars it lifts by position (``_lifted_tensor_constant2``),
    per program: a program handed over may hold other values under those names.
    Renaming the edge program's entry (its dict key and input spec target) keeps
    both, and reports the entry as added rather than as a changed value.
    """
    for key in list(new):
        if key in given or key not in store or new[key] is store[key]:
            continue
        fresh = _graph.unique_key(key, store, new, program.state_dict, program.constants)
        new[fresh] = new.pop(key)
        for spec in program.graph_signature.input_specs:
            if spec.target == key:
                spec.target = fresh


def to_edge(
    ep_or_module: ExportedProgram | Mapping[str, ExportedProgram] | torch.nn.Module,
    args: tuple[Any, ...] | None = None,
    *,
    pipeline: Any = None,
    serve_decompositions: bool = True,
    **kwargs: Any,
) -> EdgeResult:
    """Run ``pipeline`` on the program, convert it with ExecuTorch's ``to_edge``, and
    relink the edge programs to the user's state.

    ``to_edge`` returns programs with ``state_dict`` dicts of their own and writes
    contiguous copies of non-contiguous constants into the dicts of the program it is
    given. Here it is given private dict copies (the same tensors); afterwards each
    edge program's ``state_dict`` and ``constants`` are the user's dict objects
    holding the user's tensors, wherever ExecuTorch added and changed no entry;
    otherwise the edge program holds a dict of its own with the user's tensor
    objects, and the user's dict is untouched (see :class:`EdgeResult`).

    A pipeline such as ``presets.lower()`` (a table-less ``Decompose()``, then only
    passes that neither match nor make operators) runs at ``to_edge``'s own
    decomposition when calls are served, that ``Decompose`` taking ExecuTorch's table
    (``preserve_ops`` kept, nothing decomposed twice); any other runs before it.

    Args:
        ep_or_module: an ExportedProgram, a dict of method name to ExportedProgram,
            or a module to export first with ``torch.export.export`` (``args``,
            and ``dynamic_shapes`` and ``strict`` from ``kwargs``, are used for that).
        args: example positional inputs (needed for a module only).
        pipeline: a PassManager, a list of passes, a single pass, or None.
        serve_decompositions: serve ExecuTorch's own ``run_decompositions`` calls
            with epass's ``Decompose`` (:func:`epass.fast_decompositions`;
            ``result.served`` says how); False leaves them to torch, also inside
            a ``fast_decompositions()`` block.
        **kwargs: passed to ``executorch.exir.to_edge`` (``compile_config``,
            ``constant_methods``).

    Returns:
        An :class:`EdgeResult`; ``result.edge`` is the ``EdgeProgramManager``.

    Example::

        result = epass.executorch.to_edge(ep, pipeline=presets.lower())
        assert result.exported_program().state_dict is ep.state_dict
        pte = result.to_executorch().buffer
    """
    from executorch.exir import to_edge as et_to_edge

    # to_edge decomposes each program first thing, with its own table (less the
    # operators compile_config preserves): the pipeline runs there.
    return _hand_off(
        ep_or_module,
        args,
        pipeline,
        kwargs,
        "to_edge",
        et_to_edge,
        serve_decompositions,
        at_decomposition=True,
    )


def to_edge_transform_and_lower(
    ep_or_module: ExportedProgram | Mapping[str, ExportedProgram] | torch.nn.Module,
    args: tuple[Any, ...] | None = None,
    *,
    pipeline: Any = None,
    partitioner: Any = None,
    serve_decompositions: bool = True,
    **kwargs: Any,
) -> EdgeResult:
    """Like :func:`to_edge`, with ExecuTorch's ``to_edge_transform_and_lower``:
    the backend behind ``partitioner`` takes over what it supports.

    Weights a delegate takes over leave the edge program's signature; the link
    report lists them as removed and the user's dict keeps them.

    Args:
        ep_or_module: as for :func:`to_edge`.
        args: example positional inputs (needed for a module only).
        pipeline: a PassManager, a list of passes, a single pass, or None.
        partitioner: a partitioner or a list of them (``XnnpackPartitioner()``).
        serve_decompositions: as for :func:`to_edge`.
        **kwargs: passed to ``to_edge_transform_and_lower`` (``transform_passes``,
            ``compile_config``, ``constant_methods``).

    Returns:
        An :class:`EdgeResult`.

    Example::

        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )

        result = epass.executorch.to_edge_transform_and_lower(
            ep, pipeline=presets.lower(), partitioner=[XnnpackPartitioner()]
        )
        pte = result.to_executorch().buffer
    """
    from executorch.exir import to_edge_transform_and_lower as et_lower

    if partitioner is not None:
        kwargs["partitioner"] = partitioner
    return _hand_off(
        ep_or_module,
        args,
        pipeline,
        kwargs,
        "to_edge_transform_and_lower",
        et_lower,
        serve_decompositions,
    )

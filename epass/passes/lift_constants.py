"""LiftConstants: turn tensor ``get_attr`` nodes into lifted constant inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputSpec

from epass import _program
from epass.passes import _graph
from epass.protocol import PassResult

__all__ = ["LiftConstants", "lift_constants"]


def _tensor_attrs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                nodes.append(node)
    return nodes


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
    return obj


def lift_constants(ep: ExportedProgram, gm: torch.fx.GraphModule) -> ExportedProgram:
    """Build a program from ``ep`` with graph ``gm`` (a graph copy derived from ``ep``'s),
    lifting every tensor ``get_attr`` of ``gm`` to a ``CONSTANT_TENSOR`` input.

    ``gm`` is edited in place. Each attribute becomes one new key of ``constants``
    holding the very tensor object (no copy), named after the attribute (suffixed
    when the name is taken).
    """
    kinds = _graph.input_kinds(ep)
    constants = dict(ep.constants)
    new_specs: dict[str, InputSpec] = {}
    lifted: dict[str, torch.fx.Node] = {}
    for node in _tensor_attrs(gm):
        target = str(node.target)
        placeholder = lifted.get(target)
        if placeholder is None:
            value = _attr(gm, target)
            key = _graph.unique_key(target.replace(".", "_"), ep.state_dict, constants)
            placeholder = _graph.new_state_placeholder(
                gm, kinds, "c_" + key, value, _graph.InputKind.CONSTANT_TENSOR
            )
            if "val" not in placeholder.meta and "val" in node.meta:
                placeholder.meta["val"] = node.meta["val"]
            constants[key] = value
            new_specs[placeholder.name] = _graph.constant_spec(placeholder.name, key)
            lifted[target] = placeholder
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
    _graph.fill_meta(gm)
    for target in lifted:
        owner, _, attr = target.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        delattr(module, attr)
    return _graph.build_program(ep, gm, new_specs=new_specs, constants=constants)


@attrs.define(eq=False)
class LiftConstants:
    """Lift tensor ``get_attr`` nodes to placeholders with ``CONSTANT_TENSOR`` specs.

    torch.export's verifier rejects tensor attributes, so a graph rewrite that
    registers a tensor on the GraphModule (``gm.register_buffer`` + ``get_attr``)
    cannot become a program by itself. Give such a rewrite as ``fx``: it runs on a
    copy of the graph, and whatever tensors it left as attributes are lifted. Used
    alone, the pass lifts the tensor attributes of a program built without the
    verifier.

    Graph: each tensor ``get_attr`` becomes a placeholder before the user inputs.
    State: **adds** one ``constants`` entry per attribute, holding the same tensor
    object; changes and removes nothing. With the default policy the store gains
    the entries and the output shares the user's dicts.

    Args:
        fx: optional ``GraphModule -> GraphModule | None`` rewrite to run first.

    Example::

        def add_bias(gm):
            gm.register_buffer("bias", torch.ones(4))
            ...  # insert get_attr("bias") nodes
        out = PassManager([LiftConstants(fx=add_bias)]).run(ep)
    """

    name: ClassVar[str] = "lift-constants"
    changes_input: ClassVar[bool] = False

    fx: Callable[[torch.fx.GraphModule], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )

    def __call__(self, ep: ExportedProgram) -> PassResult:
        if self.fx is None:
            if not _tensor_attrs(ep.graph_module):
                return PassResult(ep, False)
            gm = _graph.copy_graph(ep)
        else:
            gm = _graph.copy_graph(ep)
            before = _program.graph_code(gm)
            out = self.fx(gm)
            if isinstance(out, torch.fx.GraphModule):
                gm = out
            if _program.graph_code(gm) == before:
                return PassResult(ep, False)
        return PassResult(lift_constants(ep, gm), True)

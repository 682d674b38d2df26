"""The one walk for which nodes of a graph write in place into which tensors,
following views, items of multi-output ops and the bodies of higher-order ops to the
tensors they alias: verification and the built-in passes all ask it."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature

from epass import _graph, _operators

__all__ = ["InPlaceWrites", "in_place_writes", "mutated_nodes"]


class InPlaceWrites:
    """Which nodes of one graph write in place into which tensors: the answer of
    :func:`in_place_writes`, the one walk verification and the built-in passes share.

    Attributes:
        roots: every node's alias root: the node itself, or for a view, an item of a
            multi-output op (``unbind``, ``split``) or an in-place result, the root
            of the tensor it aliases (a placeholder, or a node creating a tensor).
        writers: each node that writes in place (a mutable schema, or a higher-order
            op such as ``torch.cond`` or ``while_loop`` whose bodies write an
            operand) -> the alias roots it writes.
    """

    __slots__ = ("roots", "writers")

    def __init__(
        self,
        roots: Mapping[torch.fx.Node, torch.fx.Node],
        writers: Mapping[torch.fx.Node, frozenset[torch.fx.Node]],
    ) -> None:
        self.roots = roots
        self.writers = writers

    @property
    def written(self) -> set[torch.fx.Node]:
        """The alias roots whose memory the graph writes."""
        return {r for hit in self.writers.values() for r in hit}

    def mutated(self) -> set[torch.fx.Node]:
        """The nodes whose value changes while the graph runs: every alias of a
        written root."""
        written = self.written
        return {n for n, r in self.roots.items() if r in written}


def in_place_writes(gm: torch.fx.GraphModule) -> InPlaceWrites:
    """One walk over ``gm``'s graph: which nodes write in place into which tensors,
    following views, items of multi-output ops and the bodies of higher-order ops
    (``torch.cond`` branches, ``while_loop`` bodies) to the tensors they alias."""
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    writers: dict[torch.fx.Node, frozenset[torch.fx.Node]] = {}

    def roots_of(value: Any) -> frozenset[torch.fx.Node]:
        return frozenset(
            root.get(v, v) for v in _graph.leaves(value) if isinstance(v, torch.fx.Node)
        )

    for node in gm.graph.nodes:
        root[node] = node
        if node.op != "call_function":
            continue
        first = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(first, torch.fx.Node):
            root[node] = root.get(first, first)  # an item of unbind, split, chunk...
            continue
        schema = _operators.op_schema(node.target)
        if schema is None:
            operands = _body_writes(gm, node)
            if operands:
                writers[node] = roots_of(operands)
            continue
        returns_alias, written_args = _ALIASES.get(node.target) or _aliases(node.target, schema)
        if returns_alias and isinstance(first, torch.fx.Node):
            root[node] = root.get(first, first)  # a view or an in-place result
        if written_args is None:
            continue
        writers[node] = roots_of(
            [
                node.args[i] if i < len(node.args) else node.kwargs.get(name)
                for i, name in written_args
            ]
        )
    return InPlaceWrites(root, writers)


# Per operator overload: whether a result aliases an input, and the arguments it
# writes (position, name), None when its schema is not mutable. Reading a schema's
# alias information from C++ costs more than the rest of the walk; overloads live
# for the whole process, so holding them as keys frees nothing that could be reused.
_ALIASES: dict[Any, tuple[bool, tuple[tuple[int, str], ...] | None]] = {}


def _aliases(target: Any, schema: Any) -> tuple[bool, tuple[tuple[int, str], ...] | None]:
    written = (
        tuple(
            (i, arg.name)
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        if schema.is_mutable
        else None
    )
    found = _ALIASES[target] = (any(r.alias_info for r in schema.returns), written)
    return found


def _body_writes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.Node]:
    """The operands that a higher-order op's bodies (``get_attr`` graph arguments)
    write in place. Bodies take the op's last operands, in order."""
    args = _graph.leaves((node.args, node.kwargs))
    bodies = [
        body
        for leaf in args
        if isinstance(leaf, torch.fx.Node) and leaf.op == "get_attr"
        for body in (_graph.attribute(gm, str(leaf.target)),)
        if isinstance(body, torch.fx.GraphModule)
    ]
    operands = [leaf for leaf in args if isinstance(leaf, torch.fx.Node) and leaf.op != "get_attr"]
    out: list[torch.fx.Node] = []
    for body in bodies:
        params = [n for n in body.graph.nodes if n.op == "placeholder"]
        hit = [p for p in in_place_writes(body).written if p.op == "placeholder"]
        if not hit:
            continue
        if len(params) > len(operands):  # an unknown convention: blame every operand
            out += operands
            continue
        mine = operands[len(operands) - len(params) :]
        out += [mine[params.index(p)] for p in hit]
    return out


def mutated_nodes(
    gm: torch.fx.GraphModule, sig: ExportGraphSignature | None = None
) -> set[torch.fx.Node]:
    """Nodes whose value changes while the graph runs (:meth:`InPlaceWrites.mutated`:
    every alias of a tensor written in place, by an op or a higher-order op's body),
    plus, when ``sig`` is given, the inputs the signature says are mutated (their
    value differs between calls)."""
    mutated = in_place_writes(gm).mutated()
    if sig is None:
        return mutated
    targets = set(sig.buffers_to_mutate.values()) | set(sig.user_inputs_to_mutate.values())
    names = {
        s.arg.name
        for s in sig.input_specs
        if hasattr(s.arg, "name") and (s.target in targets or s.arg.name in targets)
    }
    mutated.update(n for n in _graph.placeholders(gm) if n.name in names)
    return mutated

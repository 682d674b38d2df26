"""Slices of a program: what to keep (the roots: outputs, buffer writes, effects)
and where to cut (nodes whose values become inputs), built into valid programs
that share the user's tensors."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    SymIntArgument,
    TensorArgument,
)

from epass import _graph, _program

__all__ = ["Root", "Slice", "Source"]

# Output kinds that write state: kept as such while their buffer (or input) is kept.
_MUTATIONS = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)


@attrs.frozen
class Root:
    """A value a slice keeps: a user output, a buffer (or input) write, or an effect
    (a node with no users that must still run: an assertion, an in-place write).

    Attributes:
        node: the node's name in the source program.
        kind: ``"output"``, ``"mutation"`` or ``"effect"``.
        spec: a mutation's output spec in the source program.
    """

    node: str
    kind: str = "output"
    spec: OutputSpec | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Slice:
    """A part of the source program: the nodes the roots need, with the nodes in
    ``cuts`` turned into inputs (their own inputs are then not needed)."""

    roots: tuple[Root, ...]
    cuts: frozenset[str] = frozenset()


class Source:
    """The program being reduced, its nodes by name, and the value each node took
    on the inputs the reduction runs (which cut nodes become as inputs)."""

    def __init__(self, ep: ExportedProgram, values: Mapping[str, Any]) -> None:
        self.ep = ep
        self.values = dict(values)
        self.nodes = {n.name: n for n in ep.graph.nodes}
        self.order = {n.name: i for i, n in enumerate(ep.graph.nodes)}
        self.specs = _graph.specs_by_name(ep.graph_signature)
        self.holders = {s.target: name for name, s in self.specs.items() if s.target is not None}

    # --- what a slice holds ---------------------------------------------------------

    def initial(self) -> Slice:
        """The whole program: its outputs, its state writes and its effects."""
        roots: list[Root] = []
        outputs = _graph.leaves(self.ep.graph.output_node().args[0])
        for spec, node in zip(self.ep.graph_signature.output_specs, outputs, strict=True):
            if not isinstance(node, torch.fx.Node):
                continue
            kind = "mutation" if spec.kind in _MUTATIONS else "output"
            roots.append(Root(node.name, kind, spec if kind == "mutation" else None))
        roots += [Root(name, "effect") for name in self.effects(self.nodes)]
        return Slice(tuple(roots))

    def effects(self, names: Iterable[str]) -> list[str]:
        """The nodes among ``names`` that have no users and must run anyway."""
        return [
            n
            for n in names
            if (node := self.nodes[n]).op == "call_function"
            and not node.users
            and node.is_impure(impure_random=False)
        ]

    def tensor(self, name: str) -> bool:
        """Whether the node's value (as recorded, and in its meta) is a tensor."""
        node = self.nodes[name]
        return isinstance(self.values.get(name), torch.Tensor) and isinstance(
            node.meta.get("val"), torch.Tensor
        )

    def cuttable(self, name: str) -> bool:
        """Whether the node can become an input: a call computing one tensor."""
        return self.nodes[name].op == "call_function" and self.tensor(name)

    def needed(self, piece: Slice) -> set[str]:
        """The nodes the roots need, walking up from them and stopping at cuts."""
        seen: set[str] = set()
        stack = [r.node for r in piece.roots]
        stack += [self._holder(r) for r in piece.roots if r.kind == "mutation"]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            node = self.nodes[name]
            if name in piece.cuts and node.op == "call_function":
                continue
            stack.extend(i.name for i in node.all_input_nodes)
        return seen

    def normal(self, piece: Slice) -> Slice:
        """``piece`` with only the cuts it reaches, roots in program order."""
        needed = self.needed(piece)
        roots = sorted(set(piece.roots), key=lambda r: (self.order[r.node], r.kind))
        return Slice(tuple(roots), frozenset(piece.cuts & needed))

    def computed(self, piece: Slice) -> list[str]:
        """The call nodes a slice computes (not cut), in program order."""
        needed = self.needed(piece)
        return sorted(
            (n for n in needed if self.nodes[n].op == "call_function" and n not in piece.cuts),
            key=self.order.__getitem__,
        )

    def _holder(self, root: Root) -> str:
        """The placeholder of the buffer (or input) a mutation root writes."""
        assert root.spec is not None
        return self.holders.get(root.spec.target) or str(root.spec.target)

    # --- building ---------------------------------------------------------------------

    def build(self, piece: Slice) -> ExportedProgram:
        """The slice as a program: a new graph over the user's tensors, validated by
        torch's verifier, with the recorded values of its inputs as example inputs."""
        needed = self.needed(piece)
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        attributes: dict[str, Any] = {}
        user: list[str] = []
        for node in self.ep.graph.nodes:  # the program's own inputs, state first
            if node.op == "placeholder" and node.name in needed:
                env[node] = self._placeholder(graph, node.name, node.meta)
                if self.specs[node.name].kind == InputKind.USER_INPUT:
                    user.append(node.name)
        for node in self.ep.graph.nodes:  # then the cuts, as user inputs
            if node.name in piece.cuts and node.name in needed and node.op != "placeholder":
                env[node] = self._placeholder(graph, node.name, {"val": node.meta["val"]})
                user.append(node.name)
        for node in self.ep.graph.nodes:
            if node.name not in needed or node in env or node.op == "output":
                continue
            env[node] = graph.node_copy(node, env.__getitem__)
            env[node].meta = _program.copy_meta(node.meta)
            if node.op == "get_attr":
                attributes[str(node.target)] = self._attribute(str(node.target))
        ordered = [r for r in piece.roots if r.kind == "mutation"]
        ordered += [r for r in piece.roots if r.kind == "output"]
        if not ordered:  # torch cannot save a program without outputs: effects give one
            ordered = [Root(r.node) for r in piece.roots if self.tensor(r.node)][:1]
        graph.output(tuple(env[self.nodes[r.node]] for r in ordered))
        gm = torch.fx.GraphModule(attributes, graph)
        program = _program.new_program(
            self.ep,
            gm,
            self._signature(graph, ordered),
            *self._state(needed),
            module_call_graph=_program.flat_call_graph(
                len(user), sum(r.kind == "output" for r in ordered)
            ),
        )
        _program.prune_range_constraints(program)
        program.example_inputs = (tuple(self.values[name] for name in user), {})
        return program

    def _placeholder(
        self, graph: torch.fx.Graph, name: str, meta: Mapping[str, Any]
    ) -> torch.fx.Node:
        node = graph.placeholder(name)
        if node.name != name:  # fx renames names that shadow builtins (``input``)
            _program.keep_node_name(graph, node, name)
        node.meta = _program.copy_meta(dict(meta))
        return node

    def _attribute(self, target: str) -> Any:
        value = operator.attrgetter(target)(self.ep.graph_module)
        if isinstance(value, torch.fx.GraphModule):  # a cond branch, a loop body
            return _program.copy_graph_module(value)
        return value

    def _signature(self, graph: torch.fx.Graph, roots: list[Root]) -> ExportGraphSignature:
        inputs = []
        for node in graph.nodes:
            if node.op != "placeholder":
                break
            spec = self.specs.get(node.name)  # None for a cut
            if spec is None:
                spec = InputSpec(InputKind.USER_INPUT, TensorArgument(name=node.name), None)
            inputs.append(spec)
        outputs = []
        for root in roots:
            val = self.nodes[root.node].meta.get("val")
            arg: Any = (
                SymIntArgument(name=root.node)
                if isinstance(val, torch.SymInt)
                else TensorArgument(name=root.node)
            )
            kind = root.spec.kind if root.spec is not None else OutputKind.USER_OUTPUT
            target = root.spec.target if root.spec is not None else None
            outputs.append(OutputSpec(kind, arg, target))
        return ExportGraphSignature(input_specs=inputs, output_specs=outputs)

    def _state(self, needed: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The user's state entries the slice reads (the same tensor objects)."""
        targets = {
            s.target for name, s in self.specs.items() if name in needed and s.target is not None
        }
        state = {k: v for k, v in self.ep.state_dict.items() if k in targets}
        constants = {k: v for k, v in self.ep.constants.items() if k in targets}
        return state, constants

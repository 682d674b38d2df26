"""ProgramSnapshot: what a program looked like when a pass got it, to tell later
whether the pass edited it in place (graph, node meta, signature, state keys), and
the node-meta snapshots and graph code that tell an edit of a graph alone."""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

from epass import _program

__all__ = ["ProgramSnapshot", "graph_code", "meta_changed", "meta_snapshot"]


def meta_snapshot(gm: torch.fx.GraphModule) -> list[Any]:
    """A copy of every node's ``meta`` (containers copied, leaves shared), in graph
    order, nested graphs included: what :func:`meta_changed` compares against."""
    return [
        _program.copy_meta(node.meta)
        for _, m in _program.graph_modules(gm)
        for node in m.graph.nodes
    ]


def meta_changed(gm: torch.fx.GraphModule, snapshot: list[Any], *, ignore: str = "") -> bool:
    """Whether any node's ``meta`` of ``gm`` differs from ``snapshot`` (the key
    ``ignore`` aside)."""
    metas = [node.meta for _, m in _program.graph_modules(gm) for node in m.graph.nodes]
    if ignore:
        metas = [
            {k: v for k, v in meta.items() if k != ignore} if ignore in meta else meta
            for meta in metas
        ]
    if len(metas) != len(snapshot):
        return True
    for now, before in zip(metas, snapshot, strict=True):
        try:
            # dict equality compares identical leaves by identity, so shared fake
            # tensors are never compared element-wise.
            if now != before:
                return True
        except Exception:  # a leaf replaced by a tensor or another odd value
            return True
    return False


def graph_code(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """The recompiled code of ``gm`` and of every GraphModule nested in it (``torch.cond``
    branches), so that a pass that edits only a branch counts as a change."""
    out = []
    for name, module in gm.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()
            out.append((name, module.code))
    return out


def _argument_values(value: Any) -> Any:
    """``value`` (a node's args or kwargs) with every list, tuple and dict rebuilt:
    fx's argument lists can still be edited through ``list.__setitem__``, so the
    snapshot keeps their values, not the lists."""
    kind = type(value)
    if isinstance(value, (list, tuple)):
        return (kind, tuple(_argument_values(v) for v in value))
    if isinstance(value, dict):
        return (kind, tuple((k, _argument_values(v)) for k, v in value.items()))
    return value


def _structure(gm: torch.fx.GraphModule) -> list[Any]:
    return [
        (
            name,
            m,
            m.graph,
            [
                (n, n.op, n.name, n.target, _argument_values(n.args), _argument_values(n.kwargs))
                for n in m.graph.nodes
            ],
        )
        for name, m in _program.graph_modules(gm)
    ]


def _other_fields(ep: ExportedProgram, copy: bool = False) -> tuple[Any, ...]:
    """The program's fields besides graph, signature and state that a pass may edit:
    range constraints, module call graph, example inputs, verifiers, graph-module
    meta. ``copy`` takes containers' copies (for a program the pass will hold)."""
    fields = (
        ep.range_constraints,
        ep.module_call_graph,
        ep.example_inputs,
        ep.verifiers,
        ep.graph_module.meta,
    )
    if not copy:
        return fields
    return tuple(_program.copy_meta(f) for f in fields)


_FIELD_NAMES = (
    "range_constraints",
    "module_call_graph",
    "example_inputs",
    "verifiers",
    "graph_module.meta",
)


def _differ(a: Any, b: Any) -> bool:
    try:
        # Containers compare identical items by identity first: shared tensors are
        # never compared element-wise.
        return bool(a != b)
    except Exception:  # an item replaced by a tensor or another odd value
        return True


def _signature_rows(sig: ExportGraphSignature) -> list[Any]:
    rows: list[Any] = [(s.kind, repr(s.arg), s.target, s.persistent) for s in sig.input_specs]
    rows += [(s.kind, repr(s.arg), s.target) for s in sig.output_specs]
    return rows


def _entries(d: dict[str, Any]) -> list[tuple[str, Any]]:
    return list(d.items())


def _same_entries(now: list[tuple[str, Any]], before: list[tuple[str, Any]]) -> bool:
    return len(now) == len(before) and all(
        k == k0 and v is v0 for (k, v), (k0, v0) in zip(now, before, strict=True)
    )


class ProgramSnapshot:
    """What a program looked like when a pass got it: graph structure (nodes, the
    values of their arguments and their targets, nested graphs), node meta,
    signature, the other fields a pass may edit, and which object each state key
    held. Taken in O(nodes + entries); no tensor is read.

    :meth:`difference` says what was edited in place since, or None. When ``ep``'s
    graph was just copied from ``copied_from``'s, that program's node meta serves as
    the snapshot of the meta.
    """

    def __init__(self, ep: ExportedProgram, *, copied_from: ExportedProgram | None = None) -> None:
        self.graph_module = ep.graph_module
        self.structure = _structure(ep.graph_module)
        if copied_from is not None:
            # ``ep``'s graph is a fresh copy of ``copied_from``'s, which the pass does
            # not hold: its node meta is the snapshot, with nothing copied again.
            self.meta = [
                node.meta
                for _, m in _program.graph_modules(copied_from.graph_module)
                for node in m.graph.nodes
            ]
        else:
            self.meta = meta_snapshot(ep.graph_module)
        self.signature = _signature_rows(ep.graph_signature)
        self.fields = (
            _other_fields(copied_from) if copied_from is not None else _other_fields(ep, True)
        )
        self.state = _entries(ep.state_dict)
        self.constants = _entries(ep.constants)

    def graph_difference(self, ep: ExportedProgram) -> str | None:
        """What differs in the graph (structure or node meta) from the snapshot."""
        gm = ep.graph_module
        if gm is not self.graph_module:
            return "its graph module"
        try:
            structure = _structure(gm)
        except Exception:  # an argument with an odd __eq__ or iteration
            return "its graph"
        if len(structure) != len(self.structure):
            return "its nested graphs"
        for (name, m, g, nodes), (_, m0, g0, nodes0) in zip(structure, self.structure, strict=True):
            where = f"graph {name!r}" if name else "the graph"
            if m is not m0 or g is not g0 or len(nodes) != len(nodes0):
                return f"{where}: its nodes"
            for now, before in zip(nodes, nodes0, strict=True):
                if _differ(now, before):
                    return f"{where}: node {before[2]!r} (its target or arguments)"
        if meta_changed(gm, self.meta):
            return "the meta of a node"
        return None

    def difference(self, ep: ExportedProgram) -> str | None:
        """What of ``ep`` differs from the snapshot: graph, meta, signature, other
        fields, or the keys and objects of its dicts; None when nothing does."""
        if not _same_entries(_entries(ep.state_dict), self.state):
            return "its state_dict entries"
        if not _same_entries(_entries(ep.constants), self.constants):
            return "its constants entries"
        return self.program_difference(ep)

    def program_difference(self, ep: ExportedProgram) -> str | None:
        """:meth:`difference` but for the dicts' entries: what ``changes_input = False``
        promises to leave (every pass gets its own copies of the dicts)."""
        if _differ(_signature_rows(ep.graph_signature), self.signature):
            return "its graph signature"
        for name, now, before in zip(_FIELD_NAMES, _other_fields(ep), self.fields, strict=True):
            if _differ(now, before):
                return f"its {name}"
        return self.graph_difference(ep)

    def graph_changed(self, ep: ExportedProgram) -> bool:
        """Whether the graph (structure or node meta) differs from the snapshot."""
        return self.graph_difference(ep) is not None

    def changed(self, ep: ExportedProgram) -> bool:
        """Whether ``ep`` differs from the snapshot (:meth:`difference`)."""
        return self.difference(ep) is not None

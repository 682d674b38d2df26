"""The lease: the graph a pipeline lets the built-in pass it calls edit in place, the
graphs a pass built for itself, and whether two modules share a graph."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import attrs
import torch
from torch.export import ExportedProgram

__all__ = ["Lease", "granted", "note_built", "shares_graph", "take_lease"]


@attrs.define(eq=False)
class Lease:
    """What a pipeline lets the built-in pass it is calling do with graphs.

    ``graph_module`` is the graph module of the pass's input that the pass may edit in
    place instead of copying (:func:`epass._graph.editable_graph`), when nobody outside the run
    holds it; else None. ``built`` holds the graphs the pass built for itself while
    it ran (copies, new graphs): nobody else holds those either, so a program over
    one of them is the run's own, and the next pass may edit it in place too.
    ``stepped_aside`` holds why a fast path the lease allows was not taken (a torch
    internal missing or misbehaving), for the pass's record.
    """

    graph_module: torch.fx.GraphModule | None
    built: list[torch.fx.Graph] = attrs.field(factory=list)
    used: bool = False
    stepped_aside: list[str] = attrs.field(factory=list)

    def owns(self, ep: ExportedProgram) -> bool:
        """Whether ``ep``'s graph is one nobody outside the run holds."""
        graph = ep.graph_module.graph
        leased = self.graph_module is not None and graph is self.graph_module.graph
        return leased or any(graph is g for g in self.built)


_LEASE: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("epass_lease", default=None)


@contextlib.contextmanager
def granted(held: Lease | None) -> Iterator[Lease | None]:
    """While a pipeline calls one pass: ``held`` is its lease (None: it has none).
    Only this thread (context) sees it."""
    token = _LEASE.set(held)
    try:
        yield held
    finally:
        _LEASE.reset(token)


def step_aside(why: str) -> None:
    """Tell the running pipeline, if any, that the pass it calls took the plain path
    instead of a fast one, and why (shown as a notice of the pass)."""
    held = _LEASE.get()
    if held is not None:
        held.stepped_aside.append(why)


def note_built(graph: torch.fx.Graph) -> None:
    """Tell the running pipeline, if any, that ``graph`` is new: built by the pass it
    calls (a copy, the splice's output), held by nobody else."""
    held = _LEASE.get()
    if held is not None:
        held.built.append(graph)


def take_lease(ep: ExportedProgram) -> torch.fx.GraphModule | None:
    """``ep``'s own graph module when the running pipeline leased it to the pass it
    calls (nobody outside the run holds it: :func:`granted`), else None.

    A lease is good for one call, so a helper the pass runs cannot take it again. A
    leased module keeps its node names and is not tagged:
    :func:`epass._graph.build_program` finds each placeholder's spec by name. A pass
    that takes it must return a program built from it (its input is gone), or leave
    it as it was and return its input unmodified.
    """
    held = _LEASE.get()
    if held is None or held.used or held.graph_module is not ep.graph_module:
        return None
    held.used = True
    return ep.graph_module


def _graph_objects(gm: torch.nn.Module) -> set[int]:
    """Ids of every GraphModule in ``gm``'s module tree and of their Graphs."""
    ids: set[int] = set()
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            ids.add(id(module))
            ids.add(id(module.graph))
    return ids


def shares_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """Whether mutating ``a``'s graphs in place could change ``b``'s: they are the same
    module, or share a Graph or a nested GraphModule (a ``torch.cond`` branch)."""
    if a is b:
        return True
    return not _graph_objects(a).isdisjoint(_graph_objects(b))

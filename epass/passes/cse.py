"""CSE: common-subexpression elimination that leaves random and side-effecting ops alone."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops

from epass import _graph, _writes
from epass._torch import pytree
from epass.options import checked
from epass.protocol import PassResult, RewriteCounter

__all__ = ["CSE", "CSEResult"]


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _banned(gm: torch.fx.GraphModule) -> set[Any]:
    """Operator packets CSEPass must leave alone in this graph.

    CSEPass bans by packet, so one unsafe node bans its whole packet: a coarse
    choice that can only cost missed merges, never wrong ones.
    """
    banned: set[Any] = set(get_CSE_banned_ops())
    writes = _writes.in_place_writes(gm)
    mutated = writes.mutated()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        tags = getattr(target, "tags", ())
        if node.is_impure() or node in writes.writers or torch.Tag.nondeterministic_seeded in tags:
            banned.add(_packet(target))
        elif any(i in mutated for i in node.all_input_nodes):
            # Reads a value an in-place op changes while the graph runs: two
            # identical reads on either side of the write differ. (Functional
            # graphs read a mutated buffer's old value throughout, so they are safe.)
            banned.add(_packet(target))
    return banned


def _merge(gm: torch.fx.GraphModule, banned: set[Any], counter: RewriteCounter) -> torch.fx.Graph:
    """A copy of ``gm``'s graph in which each node computing what an earlier node
    computes (same target, same arguments after earlier merges) is replaced by
    that node, as far as ``counter`` allows: ``CSEPass.call``'s sweep, one merge
    at a time."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    seen: dict[Any, tuple[torch.fx.Node, Any]] = {}

    def substitute(value: Any) -> tuple[tuple[Any, ...], Any]:
        leaves, spec = pytree.tree_flatten(value)
        return tuple(env.get(v, v) if isinstance(v, torch.fx.Node) else v for v in leaves), spec

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or _packet(node.target) in banned:
            env[node] = graph.node_copy(node, env.__getitem__)
            continue
        args, kwargs = substitute(node.args), substitute(node.kwargs)
        token = (node.target, args, kwargs)
        key = (node.target, hash((args[0], kwargs[0])))
        earlier = seen.get(key)
        if earlier is not None and earlier[1] == token and counter.allow(node.target, node.name):
            env[node] = earlier[0]
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        seen.setdefault(key, (env[node], token))
    return graph


@attrs.frozen
class CSEResult(PassResult):
    """A :class:`PassResult` with the merge count in ``notes``
    (:class:`~epass.protocol.RewriteCounter`)."""

    notes: dict[str, Any] = attrs.field(factory=dict)


@checked
@attrs.define(eq=False)
class CSE:
    """Merge nodes that compute the same operator on the same inputs.

    The sweep of ``torch.fx.passes.dialect.common.cse_pass.CSEPass``, which hashes
    ``(target, args, kwargs)`` in one topological sweep. CSEPass bans only a fixed
    list of random and in-place packets and is documented as unsafe on graphs
    with mutation; added on top, the banned set is computed per graph: every
    packet with a node that is impure (``Node.is_impure``: assertions, side
    effects), writes in place (an in-place op, or a ``torch.cond`` /
    ``while_loop`` whose body does), is tagged ``nondeterministic_seeded``
    (random), or reads a value that such a write changes (so the training IR with
    in-place buffer updates stays correct). When nothing merges, the input
    program is returned.

    Each merge is one rewrite (:class:`~epass.protocol.RewriteCounter`):
    ``max_rewrites`` makes only the first N merges, and the result's notes say how
    many it made and which node was the last merged away.

    State: nothing is added, changed or removed; the output shares the user's
    dicts. Works on training-IR and decomposed programs.

    Example::

        out = PassManager([Decompose(), CSE()]).run(ep)
    """

    name: ClassVar[str] = "cse"
    changes_input: ClassVar[bool] = False

    max_rewrites: int | None = None

    def with_max_rewrites(self, limit: int | None) -> CSE:
        """This pass, making only its first ``limit`` merges."""
        return attrs.evolve(self, max_rewrites=limit)

    def __call__(self, ep: ExportedProgram) -> CSEResult:
        counter = RewriteCounter(self.max_rewrites)
        if _graph.reads_attributes(ep.graph_module):
            # Submodules (nested graphs) go with the graph: copied first.
            gm = _graph.copy_graph(ep)
            graph = _merge(gm, _banned(gm), counter)
            new_gm = torch.fx.GraphModule(gm, graph)
        else:
            # _merge copies each node it keeps; the input's graph is only read.
            gm = ep.graph_module
            graph = _merge(gm, _banned(gm), counter)
            new_gm = _graph.adopt_graph(ep, graph) if counter.count else gm
        if not counter.count:
            return CSEResult(ep, False, notes=counter.notes)
        new_gm.graph.eliminate_dead_code()
        return CSEResult(_graph.build_program(ep, new_gm), True, notes=counter.notes)

"""CSE: common-subexpression elimination that leaves random and side-effecting ops alone."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops

from epass import _dce, _graph, _lease, _writes
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
    impure = _dce.impure_test()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        tags = getattr(target, "tags", ())
        if impure(node) or node in writes.writers or torch.Tag.nondeterministic_seeded in tags:
            banned.add(_packet(target))
        elif any(i in mutated for i in node.all_input_nodes):
            # Reads a value an in-place op changes while the graph runs: two
            # identical reads on either side of the write differ. (Functional
            # graphs read a mutated buffer's old value throughout, so they are safe.)
            banned.add(_packet(target))
    return banned


def _token(node: torch.fx.Node, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """What two nodes that compute the same value share: target, arguments and
    keyword arguments in order (fx keeps arguments as hashable immutable lists)."""
    return (node.target, args, tuple(kwargs.items()))


def _merge(gm: torch.fx.GraphModule, banned: set[Any], counter: RewriteCounter) -> torch.fx.Graph:
    """A copy of ``gm``'s graph in which each node computing what an earlier node
    computes (same target, same arguments after earlier merges) is replaced by
    that node, as far as ``counter`` allows: ``CSEPass.call``'s sweep, one merge
    at a time."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    seen: dict[Any, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or _packet(node.target) in banned:
            env[node] = graph.node_copy(node, env.__getitem__)
            continue
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        token = _token(node, args, kwargs)
        earlier = seen.get(token)
        if earlier is not None and counter.allow(node.target, node.name):
            env[node] = earlier
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
        seen.setdefault(token, env[node])
    return graph


def _merge_in_place(
    gm: torch.fx.GraphModule, banned: set[Any], counter: RewriteCounter
) -> list[torch.fx.Node]:
    """:func:`_merge` in ``gm``'s own graph: each node merged away hands its users to
    the earlier node and is left without users (for dead-code elimination). A
    later node's arguments already name the node each was merged into, so its
    token is what :func:`_merge` computes through its map. Returns the nodes whose
    inputs were repointed."""
    seen: dict[Any, torch.fx.Node] = {}
    repointed: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or _packet(node.target) in banned:
            continue
        token = _token(node, node.args, node.kwargs)
        earlier = seen.get(token)
        if earlier is not None and counter.allow(node.target, node.name):
            repointed.extend(node.users)
            node.replace_all_uses_with(earlier)
            continue
        seen.setdefault(token, node)
    return repointed


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
    _takes_lease: ClassVar[bool] = True

    max_rewrites: int | None = None

    def with_max_rewrites(self, limit: int | None) -> CSE:
        """This pass, making only its first ``limit`` merges."""
        return attrs.evolve(self, max_rewrites=limit)

    def __call__(self, ep: ExportedProgram) -> CSEResult:
        counter = RewriteCounter(self.max_rewrites)
        leased = _lease.take_lease(ep)
        if leased is not None:  # this run's own graph: merged where it is
            repointed = _merge_in_place(leased, _banned(leased), counter)
            if not counter.count:
                return CSEResult(ep, False, notes=counter.notes)
            _dce.eliminate_dead_code(leased)
            program = _graph.build_program(ep, leased, erased_only=True, repointed=repointed)
            return CSEResult(program, True, notes=counter.notes)
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
        _dce.eliminate_dead_code(new_gm)
        return CSEResult(_graph.build_program(ep, new_gm), True, notes=counter.notes)

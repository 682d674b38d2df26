"""CSE: common-subexpression elimination that leaves random and side-effecting ops alone."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

from epass import _graph
from epass.options import checked
from epass.protocol import PassResult

__all__ = ["CSE"]


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _banned(gm: torch.fx.GraphModule) -> set[Any]:
    """Operator packets CSEPass must leave alone in this graph.

    CSEPass bans by packet, so one unsafe node bans its whole packet: a coarse
    choice that can only cost missed merges, never wrong ones.
    """
    banned: set[Any] = set(get_CSE_banned_ops())
    writes = _graph.in_place_writes(gm)
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


@checked
@attrs.define(eq=False)
class CSE:
    """Merge nodes that compute the same operator on the same inputs.

    Built on ``torch.fx.passes.dialect.common.cse_pass.CSEPass``, which hashes
    ``(target, args, kwargs)`` in one topological sweep. CSEPass bans only a fixed
    list of random and in-place packets and is documented as unsafe on graphs
    with mutation; added on top, the banned set is computed per graph: every
    packet with a node that is impure (``Node.is_impure``: assertions, side
    effects), writes in place (an in-place op, or a ``torch.cond`` /
    ``while_loop`` whose body does), is tagged ``nondeterministic_seeded``
    (random), or reads a value that such a write changes (so the training IR with
    in-place buffer updates stays correct). When nothing merges, the input
    program is returned.

    State: nothing is added, changed or removed; the output shares the user's
    dicts. Works on training-IR and decomposed programs.

    Example::

        out = PassManager([Decompose(), CSE()]).run(ep)
    """

    name: ClassVar[str] = "cse"
    changes_input: ClassVar[bool] = False

    def __call__(self, ep: ExportedProgram) -> PassResult:
        gm = _graph.copy_graph(ep)
        result = CSEPass(banned_ops=_banned(gm)).call(gm)
        if not result.modified:
            return PassResult(ep, False)
        new_gm = result.graph_module
        new_gm.graph.eliminate_dead_code()
        return PassResult(_graph.build_program(ep, new_gm), True)

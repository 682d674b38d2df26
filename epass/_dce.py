"""Dead code: which nodes are impure, erasing the dead ones, and the nested submodules
torch's cleanup would delete with them (the built-in DCE, CSE, folding and rewrites)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from epass import _graph, _operators

__all__ = ["eliminate_dead_code", "impure_test", "keeping_nested_submodules"]


def impure_test() -> Callable[[torch.fx.Node], bool]:
    """``Node.is_impure`` for the nodes of one pass run, asked once per operator
    overload: for an ``OpOverload`` torch's answer depends on the operator alone (a
    mutable schema, the side-effect and effect registries), not on the node."""
    known: dict[Any, bool] = {}

    def impure(node: torch.fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or not _operators.is_op_overload(target):
            return bool(node.is_impure())
        answer = known.get(target)
        if answer is None:
            answer = known[target] = bool(node.is_impure())
        return answer

    return impure


def eliminate_dead_code(gm: torch.fx.GraphModule) -> bool:
    """``gm.graph.eliminate_dead_code()``: erase, newest first, every node without
    users that ``Node.is_impure`` does not keep. Asked only of nodes without users
    (torch asks every node, and lints the graph first); torch's own for a graph
    that reads attributes, whose nested graphs it cleans as well. Returns whether
    anything was erased."""
    if _graph.reads_attributes(gm):
        return bool(gm.graph.eliminate_dead_code())
    changed = False
    impure = impure_test()
    for node in reversed(gm.graph.nodes):
        if not node.users and not impure(node):
            gm.graph.erase_node(node)
            changed = True
    return changed


@contextlib.contextmanager
def keeping_nested_submodules(gm: torch.fx.GraphModule) -> Iterator[None]:
    """Put back each submodule the block deleted whose parent is still there below
    ``gm``: torch's ``delete_all_unused_submodules`` (``subgraph_rewriter`` calls it)
    deletes the modules inside a module a get_attr reads (a nested cond's branches)."""
    before = [(name, module) for name, module in gm.named_modules() if "." in name]
    try:
        yield
    finally:
        present = dict(gm.named_modules())  # parents come first in ``before``
        for name, module in before:
            parent, _, leaf = name.rpartition(".")
            if name not in present and parent in present:
                present[parent].add_module(leaf, module)
                present[name] = module

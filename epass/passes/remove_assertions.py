"""RemoveAssertions: drop runtime assertion nodes and what only they used."""

from __future__ import annotations

import logging
from typing import ClassVar

import attrs
import torch
from torch.export import ExportedProgram

from epass import _graph, _operators
from epass.options import checked
from epass.protocol import PassResult

__all__ = ["ASSERTION_OPS", "RemoveAssertions", "RemoveAssertionsResult"]

logger = logging.getLogger("epass")

#: Schema names of the operators removed: runtime checks and range constraints.
ASSERTION_OPS = frozenset(
    {
        "aten::_assert_scalar",
        "aten::_assert_tensor_metadata",
        "aten::_assert_async",
        "aten::_functional_assert_async",
        "aten::_functional_assert_scalar",
        "aten::sym_constrain_range",
        "aten::sym_constrain_range_for_size",
        "aten::_functional_sym_constrain_range",
        "aten::_functional_sym_constrain_range_for_size",
    }
)


@attrs.frozen
class RemoveAssertionsResult(PassResult):
    """A :class:`PassResult` that also counts the assertion nodes removed."""

    removed: int = 0


def _is_assertion(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    schema = _operators.op_schema(node.target)
    return schema is not None and schema.name in ASSERTION_OPS


@checked
@attrs.define(eq=False)
class RemoveAssertions:
    """Remove runtime assertion nodes (``aten._assert_scalar``,
    ``aten._assert_tensor_metadata``, ``sym_constrain_range*``, the functional
    ``_assert_async`` variants and their kin; see :data:`ASSERTION_OPS`).

    The inputs that only fed assertions (``u0 >= 0``, dependency tokens) are
    removed too, walking back from each removed node, so the pass costs O(nodes)
    and leaves no dead code. The program's range constraints are kept: they
    describe valid inputs, and only the runtime checks go.

    State: nothing is added, changed or removed. Works on training-IR and
    decomposed programs. Returns a :class:`RemoveAssertionsResult` whose
    ``removed`` counts the assertion nodes.

    Example::

        result = RemoveAssertions()(ep)
        print(result.removed)
    """

    name: ClassVar[str] = "remove-asserts"
    changes_input: ClassVar[bool] = False
    _takes_lease: ClassVar[bool] = True

    def __call__(self, ep: ExportedProgram) -> RemoveAssertionsResult:
        assertions = [n for n in ep.graph.nodes if _is_assertion(n)]
        if not assertions:
            return RemoveAssertionsResult(ep, False)
        gm = _graph.editable_graph(ep)
        if gm is not ep.graph_module:  # a copy to edit
            assertions = [n for n in gm.graph.nodes if _is_assertion(n)]
        removed = 0
        # Newest first: a functional assertion's token is used only by later ones.
        for node in reversed(assertions):
            if node.users:
                continue
            inputs = node.all_input_nodes
            gm.graph.erase_node(node)
            removed += 1
            _erase_dead_producers(gm, inputs)
        if not removed:
            return RemoveAssertionsResult(ep, False)
        logger.info("remove-asserts: %d assertion nodes removed", removed)
        program = _graph.build_program(ep, gm, erased_only=True)
        return RemoveAssertionsResult(program, True, removed=removed)


def _erase_dead_producers(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function" or node.is_impure() or node.graph is None:
            continue
        stack.extend(node.all_input_nodes)
        gm.graph.erase_node(node)

"""Simplify shapes: a program whose symbolic sizes are made the sizes of the values
the reduction runs it on."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _graph, _program

__all__ = ["is_dynamic", "specialize"]


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def is_dynamic(program: ExportedProgram) -> bool:
    """Whether a placeholder of ``program`` has a symbolic size."""
    return any(_symbolic(n.meta.get("val")) for n in _graph.placeholders(program.graph_module))


def specialize(program: ExportedProgram) -> ExportedProgram:
    """``program`` with static sizes: each user input's fake value made that of its
    example input, every value computed again from them, and the size computations
    that became plain numbers folded into the nodes that read them.

    Raises when the graph cannot be computed again (a ``cond`` branch, an op with
    no fake kernel); the reduction then keeps the symbolic program.
    """
    if program.example_inputs is None:
        raise ValueError("the program has no example inputs to take sizes from")
    gm = _program.copy_graph_module(program.graph_module)
    user = iter(program.example_inputs[0])
    specs = _graph.specs_by_name(program.graph_signature)
    for node in _graph.placeholders(gm):
        if specs[node.name].kind != _graph.InputKind.USER_INPUT:
            continue
        value = next(user)
        if _symbolic(node.meta.get("val")):
            node.meta["val"] = _graph.fake_value(gm, value)
    _graph.fill_meta(gm, force=True)
    _fold_numbers(gm)
    gm.recompile()
    out = _program.new_program(
        program,
        gm,
        copy.deepcopy(program.graph_signature),
        dict(program.state_dict),
        dict(program.constants),
    )
    _program.prune_range_constraints(out)
    out.example_inputs = program.example_inputs
    return out


def _fold_numbers(gm: torch.fx.GraphModule) -> None:
    """Replace every call whose value is now a plain number (``sym_size`` of a static
    tensor, arithmetic on such sizes) by that number in the calls that read it."""
    for node in list(gm.graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or type(value) not in (int, float, bool):
            continue
        readers = [u for u in node.users if u.op == "call_function"]
        if len(readers) != len(node.users):
            continue  # an output: it stays a node

        def number(n: torch.fx.Node, node: torch.fx.Node = node, value: Any = value) -> Any:
            return value if n is node else n

        for user in readers:
            user.args = torch.fx.node.map_arg(user.args, number)
            user.kwargs = torch.fx.node.map_arg(user.kwargs, number)
        if not node.users and not node.is_impure():
            gm.graph.erase_node(node)

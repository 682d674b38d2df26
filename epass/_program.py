"""Programs as epass builds them: the one place that calls the ExportedProgram
constructor or sets a program's fields without it, the graph-module copies a program's
private view is made of, and the reads of graph modules that building needs.

One concept: the ExportedProgram object (its construction and fields), whichever pass
or loader asks. The torch internals it leans on are reached through
:mod:`epass._torch`; ``tests/test_program.py`` fails loudly when torch changes what
they do.
"""

from __future__ import annotations

import collections
import copy
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

from epass import _lease, _validated
from epass._torch import internals, programs
from epass._torch.programs import pytree

__all__ = [
    "after_erasure",
    "copy_call_graph",
    "copy_graph_module",
    "copy_meta",
    "flat_call_graph",
    "flat_inputs",
    "graph_module_without_code",
    "graph_modules",
    "graphs",
    "keep_node_name",
    "new_program",
    "private_view",
    "prune_range_constraints",
    "set_signature",
    "set_state",
    "shallow_clone",
]


def set_state(
    ep: ExportedProgram,
    state_dict: dict[str, Any] | None = None,
    constants: dict[str, Any] | None = None,
) -> None:
    """Point ``ep`` at the given dict objects without copying or re-validating."""
    if state_dict is not None:
        programs.set_fields(ep, state_dict=state_dict)
    if constants is not None:
        programs.set_fields(ep, constants=constants)


def set_signature(ep: ExportedProgram, signature: ExportGraphSignature) -> None:
    """Point ``ep`` at ``signature`` without re-validating."""
    programs.set_fields(ep, graph_signature=signature)


def shallow_clone(ep: ExportedProgram) -> ExportedProgram:
    """A new ExportedProgram object sharing every field (graph and dicts) with ``ep``."""
    clone = copy.copy(ep)
    _validated.carry_mark(ep, clone)
    return clone


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Copy a GraphModule's graph (and those of nested GraphModules), sharing tensors.

    Node ``meta`` containers are copied at every level (:func:`copy_meta`), so no
    edit through the copy reaches ``gm``; fake values and other leaves are shared.
    """
    new_graph = copy.deepcopy(gm.graph)
    _keep_node_names(gm.graph, new_graph)
    for node in new_graph.nodes:
        node.meta = copy_meta(node.meta)
    root: dict[str, Any] = {}
    for node in new_graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        value = operator.attrgetter(target)(gm)
        if isinstance(value, torch.fx.GraphModule):
            value = copy_graph_module(value)
        root[target] = value
    new_gm = torch.fx.GraphModule(root, new_graph, gm.__class__.__name__)
    new_gm.meta.update(copy_meta(gm.meta))
    return new_gm


_CONTAINERS = (dict, list, tuple, set, collections.OrderedDict, collections.defaultdict)


def copy_meta(value: Any) -> Any:
    """``value`` with every nested dict, list, tuple and set copied; leaves (fake
    tensors, strings, types, other objects) are shared.

    ``node.meta`` holds containers that passes edit in place (``nn_module_stack``,
    ``source_fn_stack``, custom annotations); a graph copy with this meta shares
    none of them with the original.
    """
    kind = type(value)
    if kind not in _CONTAINERS:
        return value
    if kind is tuple:
        # Most tuples in meta hold strings and types only (nn_module_stack entries).
        if not any(type(v) in _CONTAINERS for v in value):
            return value
        return tuple(copy_meta(v) for v in value)
    if kind is list:
        return [copy_meta(v) for v in value]
    if kind is set:
        return set(value)
    out = copy.copy(value)  # keeps a defaultdict's factory
    for key, item in value.items():
        out[key] = copy_meta(item)
    return out


def _keep_node_names(old: torch.fx.Graph, new: torch.fx.Graph) -> None:
    """Give copied nodes their original names.

    fx's namespace renames nodes whose names shadow Python builtins (``input`` becomes
    ``input_1``) when a graph is copied, although torch.export created them with those
    names; the signature refers to nodes by name, so the copy must keep them.
    """
    for a, b in zip(old.nodes, new.nodes, strict=True):
        if a.name != b.name:
            keep_node_name(new, b, a.name)


def keep_node_name(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> None:
    """Name ``node`` of ``graph`` exactly ``name``, which fx's namespace would rename
    (``input`` becomes ``input_1``), and reserve the name in the namespace."""
    programs.reserve_name(graph, node, name)


def private_view(
    ep: ExportedProgram, *, copy_graph: bool, copy_state: bool = True
) -> ExportedProgram:
    """A program a pass may own: private dict copies (same tensors) unless
    ``copy_state`` is False, and a private graph and signature when ``copy_graph``
    is set."""
    view = shallow_clone(ep)
    if copy_state:
        programs.set_fields(view, state_dict=dict(ep.state_dict), constants=dict(ep.constants))
    # Small containers a pass may edit in place (the kwargs dict of the example
    # inputs, the verifier list): copied, so no edit reaches ``ep``.
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        programs.set_fields(view, example_inputs=(args, dict(kwargs)))
    programs.set_fields(view, verifiers=list(ep.verifiers))
    if copy_graph:
        programs.set_fields(
            view,
            graph_module=copy_graph_module(ep.graph_module),
            graph_signature=copy.deepcopy(ep.graph_signature),
            module_call_graph=copy_call_graph(ep.module_call_graph),
            range_constraints=dict(ep.range_constraints),
        )
    return view


def copy_call_graph(call_graph: list[Any]) -> list[Any]:
    """``copy.deepcopy(call_graph)`` that shares the leaf treespecs of its signatures.

    torch deprecated ``LeafSpec`` (2.13) and warns (``FutureWarning``, located in
    ``copyreg.py``) whenever one is constructed, as a deep copy does for every leaf;
    the user did nothing to cause it. A leaf spec is immutable, so the copy shares it.
    """
    memo: dict[int, Any] = {}
    for entry in call_graph:
        signature = getattr(entry, "signature", None)
        specs = [getattr(signature, "in_spec", None), getattr(signature, "out_spec", None)]
        while specs:
            spec = specs.pop()
            if not isinstance(spec, pytree.TreeSpec):
                continue
            if spec.is_leaf():
                memo[id(spec)] = spec
            else:
                specs.extend(programs.spec_children(spec))
    return copy.deepcopy(call_graph, memo)


def graph_module_without_code(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A ``GraphModule`` over ``graph`` (with an empty root, so ``graph`` names no
    attribute) that generates its Python code only when something reads or calls
    it: torch's ``_LazyGraphModule``. For a graph that goes into a program, whose
    constructor makes its own module and code, generating the code twice costs a
    tenth of the incremental decomposition of a large program."""
    return programs.lazy_graph_module(torch.nn.Module(), graph)


def new_program(
    ep: ExportedProgram,
    gm: torch.fx.GraphModule,
    signature: ExportGraphSignature,
    state_dict: dict[str, Any],
    constants: dict[str, Any],
    *,
    module_call_graph: Any = None,
    keep_dialect: bool = True,
) -> ExportedProgram:
    """A new, validated program with ``ep``'s other fields and ``gm`` as its graph:
    the one place epass calls the ``ExportedProgram`` constructor.

    Range constraints are recomputed for ``gm``. ``module_call_graph`` replaces
    ``ep``'s (copied either way). ``keep_dialect=False`` gives the program torch's
    default verifier (the ATEN dialect), as ``run_decompositions`` does. Callers
    derive the signature and dicts with ``epass._graph.build_program`` or, for a
    decomposed graph, as the retrace does.
    """
    # The constructor makes the graph module without its code
    # (programs.construct_without_code): that code generation is a fifth of an incremental
    # decomposition, and the next pass usually rebuilds the graph before anyone reads it.
    out = programs.construct_without_code(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=state_dict,
        range_constraints=programs.updated_range_constraints(gm, ep.range_constraints),
        module_call_graph=copy_call_graph(
            ep.module_call_graph if module_call_graph is None else module_call_graph
        ),
        # Containers of their own: the new program is handed to code that may edit
        # it (the caller, a consumer), and none of its containers is ``ep``'s.
        example_inputs=_own_example_inputs(ep.example_inputs),
        constants=constants,
        verifiers=list(ep.verifiers) if keep_dialect else None,
    )
    _validated.mark_validated(out)  # the constructor's last step was validate()
    return out


def _own_example_inputs(example_inputs: Any) -> Any:
    """``example_inputs`` with its kwargs dict copied (the tensors are shared)."""
    if example_inputs is None:
        return None
    args, kwargs = example_inputs
    return args, dict(kwargs)


def after_erasure(
    ep: ExportedProgram,
    signature: ExportGraphSignature,
    state_dict: dict[str, Any],
    constants: dict[str, Any],
    repointed: Iterable[torch.fx.Node] = (),
) -> ExportedProgram | None:
    """The program :func:`new_program` makes from ``ep``'s own graph module after a
    pass only erased nodes of it (with ``Graph.erase_node``, which refuses a node
    that still has users) and pointed the inputs of the nodes ``repointed`` at
    nodes it already had, made without the constructor; None where that cannot be
    shown to be the same.

    The constructor validates every node again and the graph's lint walks them all
    (tens of milliseconds a pass at a few thousand nodes). That adds nothing here:
    ``ep`` passed validation (:func:`epass._validated.mark_validated`, or its
    constructor), and every node left was one of its nodes, unchanged but for the
    inputs of ``repointed``. So what is checked again is what the edit could break:
    that each input of a repointed node is in the graph before it (the lint's order
    check, for those nodes), and what reads more than one node (the signature against
    the graph's inputs and outputs, the module call graph). Range constraints and
    guards are recomputed as the constructor computes them. Any other field is
    ``ep``'s, as the constructor would take it; the module call graph is ``ep``'s own
    list, as its graph module is (``ep`` was consumed: its graph is the one the pass
    edited). A graph with submodules (``cond`` branches: a ``get_attr`` left to a deleted one
    only the verifier's walk finds) or repeated items is left to the constructor.
    """
    gm = ep.graph_module
    if not _validated.has_mark(ep) or next(gm.children(), None) is not None:
        return None
    repointed = tuple(repointed)
    _check_order(gm.graph, repointed)
    if _repeats_an_item(repointed):
        return None
    out = copy.copy(ep)
    try:
        values = programs.one_value_module(gm)
        programs.set_fields(
            out,
            graph_signature=signature,
            state_dict=state_dict,
            constants=constants,
            range_constraints=programs.updated_range_constraints(values, ep.range_constraints),
            guards_code=programs.graph_guards_code(values),
        )
        programs.verify_beyond_nodes(out)
    except Exception as exc:  # an internal missing or misbehaving: the constructor
        # (which raises again what a real problem raised here) makes the program.
        _lease.step_aside(f"rebuilt with torch's constructor: {internals.unexpected(exc)}")
        return None
    _validated.mark_validated(out)
    return out


def _check_order(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> None:
    """``graph.lint()``'s checks of the inputs of ``nodes``: each is a node of
    ``graph``, still in it, that comes before the node using it. (An erased node
    has no inputs left: ``erase_node`` clears them.)"""
    for node in nodes:
        for arg in node.all_input_nodes:
            # An erased node is out of the list: its successor no longer points back.
            if arg.graph is not graph or arg.next.prev is not arg or not arg < node:
                raise RuntimeError(
                    f"argument {arg.name!r} of node {node.name!r} is not a node of the "
                    "graph defined before it; a pass that only erases nodes must point "
                    "uses at earlier ones"
                )


def _repeats_an_item(nodes: Iterable[torch.fx.Node]) -> bool:
    """Whether one of ``nodes`` takes an item another takes too (constructor: one)."""
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args[0], node.args[1]
            users = source.users if isinstance(source, torch.fx.Node) else ()
            if any(
                o.target is operator.getitem and o.args[1] == index for o in users if o is not node
            ):
                return True
    return False


def flat_inputs(ep: ExportedProgram, args: Any, kwargs: Any) -> list[Any]:
    """What ``ep.graph_module`` takes for the call ``ep.module()(*args, **kwargs)``:
    the state placeholders' values, then the user inputs flattened by the program's
    input spec (``ExportedProgram._graph_module_flat_inputs``)."""
    return programs.graph_module_flat_inputs(ep, args, kwargs)


def prune_range_constraints(ep: ExportedProgram) -> None:
    """Drop the range constraints of symbols no value of ``ep``'s graph mentions (a
    program cut out of a bigger one keeps the shape environment's ranges for every
    symbol it ever had; a program with static sizes then has none)."""
    used: set[Any] = set()
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        values = val if isinstance(val, (list, tuple)) else (val,)
        for v in values:
            dims = list(v.shape) if isinstance(v, torch.Tensor) else [v]
            for d in dims:
                if isinstance(d, torch.SymInt):
                    used |= d.node.expr.free_symbols
    programs.set_fields(
        ep, range_constraints={k: v for k, v in ep.range_constraints.items() if k in used}
    )


def flat_call_graph(inputs: int, outputs: int) -> list[Any]:
    """A module call graph for a program taking ``inputs`` positional tensors and
    returning a tuple of ``outputs``: its one root entry, with no submodule entries
    (``unflatten`` then gives one flat module)."""
    from torch.export import ModuleCallEntry, ModuleCallSignature

    in_spec = pytree.tree_flatten((tuple(range(inputs)), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(outputs)))[1]
    signature = ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec)
    return [ModuleCallEntry(fqn="", signature=signature)]


def graphs(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The graph of ``gm`` and of every GraphModule in its module tree (``torch.cond``
    branches, ``while_loop`` bodies, and theirs), each once, in module order."""
    return [m.graph for _, m in graph_modules(gm)]


def graph_modules(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """``gm`` and every GraphModule in its module tree, with their names."""
    return [(n, m) for n, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]

"""Size queries as the retrace makes, keeps and binds them: the node whose value first
holds a size (where a decomposition's query of it is placed), the DCE that keeps the
program's queries a decomposition reads, and the runtime-assertion pass that binds
the new ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Container
from typing import Any

import torch

from epass._decomp import table
from epass._decomp.safety import Fallback
from epass._torch import fakes

__all__ = [
    "RUNTIME_ASSERT_TRACE",
    "carriers",
    "drop_dead",
    "origin",
    "rebind_sizes",
    "same_symint",
    "size_nodes",
    "size_of",
]


def size_of(value: Any, dim: int) -> Any:
    """Size ``dim`` of a tensor value, or None."""
    if isinstance(value, torch.Tensor) and dim < value.dim():
        return value.shape[dim]
    return None


def same_symint(s: Any, wanted: torch.SymInt) -> bool:
    """Whether ``s`` is the very SymInt ``wanted`` is (its node, not its expression)."""
    return isinstance(s, torch.SymInt) and s.node is wanted.node


def size_nodes(value: Any) -> set[Any]:
    """The SymNodes a value (a tensor, or tensors in a tuple or list) holds as a size,
    stride, storage offset or element count."""
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return {
        s.node
        for t in tensors
        if isinstance(t, torch.Tensor)
        for s in (*t.shape, *t.stride(), t.storage_offset(), t.numel())
        if isinstance(s, torch.SymInt)
    }


def carriers(inp: torch.fx.Node, expr: Any) -> list[torch.fx.Node]:
    """``inp`` and its ancestors whose value holds ``expr`` (a size, stride, offset or
    element count), linked to ``inp`` through such values, in graph order."""

    def holds(n: torch.fx.Node) -> bool:
        v = n.meta.get("val")
        tensors = v if isinstance(v, (list, tuple)) else [v]
        return any(
            isinstance(t, torch.Tensor)
            and any(
                isinstance(s, torch.SymInt) and s.node.expr == expr
                for s in (*t.shape, *t.stride(), t.storage_offset(), t.numel())
            )
            for t in tensors
        )

    seen = {inp}
    todo = [inp]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen and a.op != "placeholder" and holds(a):
                seen.add(a)
                todo.append(a)
    order = {n: i for i, n in enumerate(inp.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def origin(
    inp: torch.fx.Node,
    dim: int,
    expr: Any,
    rerun: Callable[[torch.fx.Node, Any, Any], Any],
    copied: Container[torch.fx.Node],
) -> tuple[torch.fx.Node, int]:
    """The node whose result first holds the very SymInt that is size ``dim`` of
    ``inp``'s value (an expression ``expr``, not a symbol), and the dimension holding
    it there whose size node the trace makes first: the last for a node copied from the
    program (``copied``: its result's sizes are compared from the last), the first for
    a node a decomposition made. The operators from the first ancestor holding
    ``expr`` to ``inp`` run again (``rerun``: a node's value on the arguments given) as
    the retrace runs them. A decomposition's node is asked whether it is contiguous
    without adding a guard.

    Raises:
        Fallback: where that node is not certain to make the size's node at once.
    """
    chain = carriers(inp, expr)
    again: dict[torch.fx.Node, Any] = {}
    for n in chain:
        if not (n.op == "call_function" and callable(n.target)):
            raise Fallback(f"the size {expr} of {inp.name} comes from {n.name}")
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: again.get(a, a))
        again[n] = rerun(n, args, kwargs)
    wanted = size_of(again[inp], dim)
    for n in chain:
        value = again[n]
        if wanted.node not in size_nodes(value):
            continue
        if (
            n.target is operator.getitem
            or not isinstance(value, torch.Tensor)
            # The retrace compares a program node's sizes, guarding as it goes.
            or not (value.is_contiguous() if n in copied else _made_at_once(value))
        ):
            raise Fallback(
                f"the size {expr} of {inp.name} is first held by {n.name}, "
                "whose trace may not make its node at once"
            )
        dims = [d for d, s in enumerate(value.shape) if same_symint(s, wanted)]
        if not dims:
            raise Fallback(f"the size {expr} of {inp.name} is not a size of {n.name}")
        return n, dims[-1] if n in copied else dims[0]
    raise Fallback(f"the size {expr} of {inp.name} is held by no node before it")


def _made_at_once(value: torch.Tensor) -> bool:
    """Whether a decomposition's result makes its size nodes as the trace wraps it,
    first dimension first: contiguous, or channels-last with 4 dimensions (a
    convolution on a permuted input, as ConvNeXt's blocks make). Asked without a guard;
    check mode compares both kinds with the retrace's graph (tests/decomp/test_shapes.py)."""
    return fakes.is_contiguous_or_false(value) or fakes.is_contiguous_or_false(
        value, torch.channels_last
    )


def drop_dead(
    graph: torch.fx.Graph,
    merged: dict[torch.fx.Node, torch.fx.Node],
    copied: Container[torch.fx.Node],
) -> None:
    """Delete dead nodes as the retrace does. Its trace loses every dead node without
    effects (the DCE after tracing), except a size query of the program's own
    (``copied``) that a decomposition reads (:func:`_keep_read_queries`); its
    runtime-assertion pass then replaces each node computing a size an earlier live
    node computes (``merged``) by that node, and deletes nothing more: what only the
    replaced node read stays, dead (a step of size arithmetic, say)."""
    live = _keep_read_queries(graph, merged, copied)
    bound: dict[torch.fx.Node, torch.fx.Node] = {}  # first binding -> the live node now
    for node in list(graph.nodes):  # in order, as the pass walks the graph
        first = merged.get(node)
        if first is None:
            continue
        existing = bound.get(first, first)
        if existing in live:
            node.replace_all_uses_with(existing)
            graph.erase_node(node)
        else:  # the first node computing it was dead and went with the DCE
            bound[first] = node


def _keep_read_queries(
    graph: torch.fx.Graph,
    merged: dict[torch.fx.Node, torch.fx.Node],
    copied: Container[torch.fx.Node],
) -> set[torch.fx.Node]:
    """Run the DCE, keeping each size query of the program's (``copied``) that a live
    node of a decomposition computes again (``merged``): the retrace's trace reads that
    size from the program's node, live then even where only a dead view read it. The
    nodes left."""
    queries = {q for q in merged.values() if q in copied and q.target in table.SIZE_OPS}
    before = {q: (q.prev, q.args, q.kwargs) for q in queries}  # DCE clears the args
    graph.eliminate_dead_code()
    live = set(graph.nodes)
    for query in queries - live:
        if not any(first is query and node in live for node, first in merged.items()):
            continue
        # Made again where it was.
        anchor, args, kwargs = before[query]
        while anchor not in live:
            anchor = anchor.prev
        with graph.inserting_after(anchor):
            again = graph.create_node(query.op, query.target, args, kwargs, query.name)
        again.meta = dict(query.meta)
        live.add(again)
        for node, first in list(merged.items()):
            if first is query:
                merged[node] = again
    return live


# The stack trace the retrace gives the nodes its runtime-assertion pass adds
# (``torch/export/exported_program.py``, ``_decompose_and_get_gm_with_new_signature_constants``).
RUNTIME_ASSERT_TRACE = (
    'File "torch/fx/passes/runtime_assert.py", line 24, in insert_deferred_runtime_asserts'
)


def rebind_sizes(gm: torch.fx.GraphModule, fake_mode: Any) -> None:
    """Run the retrace's runtime-assertion pass, which binds every size query to a
    node of its own: after the placeholders, or as arithmetic on sizes it has."""
    shape_env = fake_mode.shape_env
    # The pass only adds asserts the graph lacks; those export added are there already.
    if shape_env is None or not fakes.insert_runtime_asserts(gm, shape_env, RUNTIME_ASSERT_TRACE):
        raise Fallback("a new size query without a shape environment to bind it")
    # No DCE after it: the retrace runs none either, and keeps what it leaves dead.
    gm.recompile()

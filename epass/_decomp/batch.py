"""One trace for many templates: the calls a program needs traced together, and the
graph split back into one template per call."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs
import torch

from epass._decomp import keys, shapes, table, tracing
from epass._decomp.safety import Fallback
from epass._torch import fakes as torch_fakes
from epass._torch import tracing as torch_tracing
from epass._torch.programs import pytree

__all__ = ["Pending", "batchable", "trace_batch"]


@attrs.frozen(eq=False)
class Pending:
    """A template decomposing a program needs, neither in memory nor on disk."""

    key: Any
    disk_key: keys.DiskKey | None
    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    values: list[Any]
    grads: list[bool]


# fx names a node after its target, plus ``_<n>`` when the name is taken.
_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")
_SUFFIXED = re.compile(r"_\d+$")


def trace_batch(
    calls: list[Pending], tables: table.Tables, fake_mode: Any, overrides: tracing.Overrides
) -> dict[Any, tracing.Template]:
    """The templates of ``calls`` from one ``make_fx`` call, by key: each op runs on
    its own fresh inputs, exactly as :func:`tracing.trace` runs it, and the graph is split
    back into one template per call, each the graph :func:`tracing.trace` gives.

    A call whose part of the graph fails a check of :func:`tracing.trace`, or is not its
    own (a node reading another call's nodes), is left out; so is every call when the
    trace fails or creates symbols. Those are traced one at a time, as before.
    """
    bounds: list[tuple[int, int]] = []
    shape_env = fake_mode.shape_env
    known = shapes.snapshot(shape_env)
    with shapes.as_traced(fake_mode, suppress=False):
        fakes = keys.fresh_fakes(
            fake_mode, (v for c in calls for v in c.values), (g for c in calls for g in c.grads)
        )
    try:
        gm = tracing.capture(_run_each(calls, bounds), fakes, tables, fake_mode, overrides)
    except Exception:  # each call's own trace raises (or not) as it always did
        return {}
    if shapes.snapshot(shape_env) != known:
        # New symbols, or a guard one of the calls would have taught alone.
        if known is not None:
            torch_fakes.forget_symbols(shape_env, known[1])
        return {}
    return _split(list(gm.graph.nodes), len(fakes), calls, bounds, tables)


def _run_each(calls: list[Pending], bounds: list[tuple[int, int]]) -> Callable[..., Any]:
    """The function a batch traces: each call in turn on its own inputs. ``bounds``
    gets the range of the graph's nodes each call created."""
    plans = [pytree.tree_flatten((c.args, c.kwargs)) for c in calls]

    def fn(*xs: Any) -> Any:
        graph = torch_tracing.traced_graph()
        outs = []
        pos = 0
        for call, (flat, spec) in zip(calls, plans, strict=True):
            # Nodes are appended as they are created: a call owns the ones created
            # while it ran, factory ops (no inputs) included.
            start = len(graph.nodes)
            # Each call its own blank meta: a decomposition may annotate it.
            mine = xs[pos : pos + len(call.values)]
            outs.append(tracing.call(call.op, flat, spec, mine, tracing.blank_node()))
            bounds.append((start, len(graph.nodes)))
            pos += len(call.values)
        return tuple(outs)

    return fn


def _split(
    nodes: list[torch.fx.Node],
    n_inputs: int,
    calls: list[Pending],
    bounds: list[tuple[int, int]],
    tables: table.Tables,
) -> dict[Any, tracing.Template]:
    """The batch's graph (``nodes``, the first ``n_inputs`` of them its inputs) split
    into the calls' templates, by key (none when a node is claimed twice or by no call)."""
    output = nodes[-1]
    results = output.args[0]
    if (
        any(n.op != "placeholder" for n in nodes[:n_inputs])
        or output.op != "output"
        or not isinstance(results, tuple)
        or len(results) != len(calls)
        or [b[0] for b in bounds] != [n_inputs] + [b[1] for b in bounds[:-1]]
        or bounds[-1][1] != len(nodes) - 1
    ):
        return {}  # some node claimed twice or by no call
    templates: dict[Any, tracing.Template] = {}
    pos = 0
    for call, (start, end), result in zip(calls, bounds, results, strict=True):
        placeholders = nodes[pos : pos + len(call.values)]
        pos += len(call.values)
        template = _partition(placeholders, nodes[start:end], result, output, call.op, tables)
        if template is not None:
            templates[call.key] = template
    return templates


def _partition(
    placeholders: list[torch.fx.Node],
    body: list[torch.fx.Node],
    result: Any,
    output: torch.fx.Node,
    op: Any,
    tables: table.Tables,
) -> tracing.Template | None:
    """One call's part of a batched trace as the graph its own trace gives (None:
    it cannot be told apart from the rest, or fails a check of :func:`tracing.trace`)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, ph in enumerate(placeholders):
        # make_fx names its inputs arg0_1, arg1_1, ... by position.
        name = f"arg{i}_1"
        new = graph.create_node("placeholder", name, name=name, type_expr=ph.type)
        new.meta = ph.meta
        env[ph] = new

    def mapped(n: torch.fx.Node) -> torch.fx.Node:
        return env[n]  # KeyError: a node of another call

    try:
        for node in body:
            match = _NAME.match(node.name)
            assert match is not None
            base = match.group(1)
            target = node.target
            natural = getattr(getattr(target, "overloadpacket", target), "__name__", "")
            if _SUFFIXED.search(base) or _SUFFIXED.search(re.sub(r"\W", "_", str(natural))):
                # A name that ends in digits of its own: the trace's name is not
                # known from the batch's.
                return None
            new = graph.create_node(
                node.op,
                target,
                torch.fx.node.map_arg(node.args, mapped),
                torch.fx.node.map_arg(node.kwargs, mapped),
                name=base,
                type_expr=node.type,
            )
            new.meta = node.meta
            env[node] = new
        out = graph.output(torch.fx.node.map_arg(result, mapped))
    except KeyError:
        return None
    out.meta = dict(output.meta)
    try:
        tracing.check_template(graph, op, tables)
    except Fallback:
        return None
    return tracing.Template(graph, len(placeholders), *tracing.split_meta(graph))


def batchable(call: Pending) -> bool:
    # Symbolic templates are traced one at a time: calls sharing a symbol would
    # share its size nodes, and each trace's guards stay its own.
    return "'sym'" not in repr(call.key[2])

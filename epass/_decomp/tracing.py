"""Tracing one decomposition into a template: the graph, and which node meta it takes
from the node it replaces."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from epass import _operators
from epass._decomp import keys, safety, shapes, state, table
from epass._decomp.safety import Fallback
from epass._torch import fakes as torch_fakes
from epass._torch import tracing as torch_tracing
from epass._torch.programs import pytree

__all__ = [
    "INHERITED_META",
    "Overrides",
    "Template",
    "blank_node",
    "call",
    "capture",
    "check_template",
    "split_meta",
    "symbol_count",
    "trace",
]

# The CompositeImplicitAutograd override of the table a trace runs under: a session
# (see ``templates``) enters it at its first trace and leaves it at its end.
Overrides = Callable[[], contextlib.AbstractContextManager[None]]


# The retrace runs each node under a copy of that node's meta, and the tracer copies
# these fields from it onto every node it creates; the tracer itself may overwrite
# them meanwhile (``original_aten`` is set around each ATen call and reset to None
# after it). ``custom`` is merged and ``nn_module_stack`` follows its own rule.
INHERITED_META = tuple(
    f
    for f in torch_tracing.copied_meta_fields()
    if f not in ("from_node", "custom", "nn_module_stack")
)


class _Inherited:
    """Template meta value standing for "the rewritten node's own value, if any"."""

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        self.field = field

    def __copy__(self) -> _Inherited:
        return self  # the tracer copies meta values; the marker must stay itself

    def __deepcopy__(self, memo: Any) -> _Inherited:
        return self

    def __repr__(self) -> str:
        return f"<the rewritten node's {self.field}>"


_MARKERS = {f: _Inherited(f) for f in INHERITED_META}


@attrs.frozen(eq=False)
class Template:
    """A traced decomposition. ``inherited`` maps each node to the meta fields it takes
    from the node being rewritten; ``own`` to the fields the tracer set itself.
    ``taught``: the program's shape environment before and after the trace, when
    tracing it taught the environment something (a guard, a narrower range): the
    retrace teaches it the same, and a process reading the template from disk must
    too (``shapes.lesson``)."""

    graph: torch.fx.Graph
    n_inputs: int
    inherited: Mapping[torch.fx.Node, tuple[str, ...]]
    own: Mapping[torch.fx.Node, Mapping[str, Any]]
    taught: tuple[shapes.Snapshot | None, shapes.Snapshot | None] | None = None


def split_meta(
    graph: torch.fx.Graph,
) -> tuple[dict[torch.fx.Node, tuple[str, ...]], dict[torch.fx.Node, dict[str, Any]]]:
    inherited: dict[torch.fx.Node, tuple[str, ...]] = {}
    own: dict[torch.fx.Node, dict[str, Any]] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inherited[node] = tuple(
            f for f in INHERITED_META if isinstance(node.meta.get(f), _Inherited)
        )
        own[node] = {
            f: node.meta[f]
            for f in INHERITED_META
            if f in node.meta and not isinstance(node.meta[f], _Inherited)
        }
    return inherited, own


def symbol_count(shape_env: Any) -> Any:
    if shape_env is None:
        return None
    return (len(shape_env.var_to_range), shape_env.unbacked_symint_counter)


def blank_node() -> torch.fx.Node:
    """The node meta each decomposition runs under: no annotations, and a marker for
    every field the rewritten node's own value will fill in."""
    blank = torch.fx.Graph().placeholder("blank")
    blank.meta["custom"] = {}
    blank.meta.update(_MARKERS)
    return blank


def call(op: Any, flat: list[Any], spec: Any, xs: Iterable[Any], blank: torch.fx.Node) -> Any:
    """Run ``op`` on the traced inputs ``xs`` (the tensor leaves of ``flat``),
    functionalized as export does, and return its result (for an in-place operator,
    the new value of the tensor it writes, which its result aliases). Raise
    :class:`safety.Fallback` when it mutates anything else, or changes the metadata of
    what it writes."""
    xs = list(xs)
    funs = [torch_tracing.to_fun(x) for x in xs]
    it = iter(funs)
    filled = [next(it) if isinstance(a, torch.fx.Node) else a for a in flat]
    a, k = pytree.tree_unflatten(filled, spec)
    at = safety.written_argument(op)
    written = None if at is None or at >= len(a) else a[at]
    # The retrace runs each node under that node's meta (the interpreter's
    # set_current_meta), which drops annotations of the tracer's own frames.
    with torch_tracing.current_meta(blank):
        out = op(*a, **k)
    for f, x in zip(funs, xs, strict=True):
        if isinstance(f, torch.Tensor) and torch_tracing.mutated(f, x, data=f is not written):
            raise Fallback(f"the decomposition of {op} mutates an input")
    return pytree.tree_map(torch_tracing.from_fun, out)


def capture(
    fn: Callable[..., Any],
    fakes: list[Any],
    tables: table.Tables,
    fake_mode: Any,
    overrides: Overrides,
    frames: bool = False,
) -> torch.fx.GraphModule:
    """``make_fx(fn)(*fakes)`` under the stack a template trace runs in. ``frames``:
    record on each node the ``forward`` frames it was made in, as the retrace's tracer
    does for a node with no stack trace of its own (a region's body)."""
    # The same stack as AOTAutograd's graph capture inside export's retrace, less the
    # CompositeImplicitAutograd override: patching every such operator costs more
    # than most traces, so a session enters it once for all of a program's traces.
    with overrides(), fake_mode, state.backend_decomps_off():
        return torch_tracing.make_fx_as_export(fn, fakes, dict(tables.python), frames=frames)


def check_template(graph: torch.fx.Graph, op: Any, tables: table.Tables) -> None:
    """Raise :class:`safety.Fallback` when a traced decomposition of ``op`` cannot be spliced."""
    for node in graph.nodes:
        if node.op == "get_attr":
            raise Fallback(f"the decomposition of {op} creates constants")
        if node.op == "call_function" and _operators.is_op_overload(node.target):
            if _operators.is_mutable_op(node.target):
                raise Fallback(f"the decomposition of {op} leaves a mutating op")
            if table.left_behind(node.target, tables) or (
                # Written into, such an operator's output is a view functionalization
                # writes back through; an op of the program the engine tracks as a
                # view by its schema, which for these says none.
                node.target in table.EMITTED_AS_ITSELF and op in table.FUNCTIONALIZED
            ):
                raise Fallback(f"the decomposition of {op} leaves {node.target} behind")
        elif node.op == "call_function" and not safety.is_plain_call(node.target):
            raise Fallback(f"the decomposition of {op} calls {node.target!r}")


def trace(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: list[Any],
    grads: list[bool],
    tables: table.Tables,
    fake_mode: Any,
    overrides: Overrides,
    frames: bool = False,
) -> Template:
    """Trace ``op`` on fresh fake inputs with the table, functionalized as export does
    (``frames``: see :func:`capture`)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    blank = blank_node()

    def fn(*xs: Any) -> Any:
        return call(op, flat, spec, xs, blank)

    shape_env = fake_mode.shape_env
    before = symbol_count(shape_env)
    known = shapes.snapshot(shape_env)
    with shapes.as_traced(fake_mode, suppress=False):
        fakes = keys.fresh_fakes(fake_mode, inputs, grads)
    gm = capture(fn, fakes, tables, fake_mode, overrides, frames)
    if shape_env is not None and symbol_count(shape_env) != before:
        # The retrace, which runs instead, would list them among its program's ranges.
        torch_fakes.forget_symbols(shape_env, known[1] if known is not None else ())
        raise Fallback(f"the decomposition of {op} creates new symbols")
    check_template(gm.graph, op, tables)
    after = shapes.snapshot(shape_env)
    taught = None if after == known else (known, after)
    return Template(gm.graph, len(inputs), *split_meta(gm.graph), taught=taught)

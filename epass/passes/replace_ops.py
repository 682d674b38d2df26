"""ReplaceOps: swap operators, trace Python replacements in, or rewrite subgraph patterns."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx import subgraph_rewriter

from epass import _graph, _program
from epass._decomp import state
from epass.errors import ArgumentTypeError
from epass.options import checked
from epass.passes.lift_constants import lift_constants
from epass.protocol import PassResult

__all__ = ["ReplaceOps"]


def _ops(value: Mapping[Any, Any]) -> dict[Any, Any]:
    table = dict(value)
    for op, replacement in table.items():
        if not _program.is_op_overload(op):
            raise ArgumentTypeError(
                f"ReplaceOps keys must be operator overloads such as "
                f"torch.ops.aten.gelu.default, got {op!r}"
            )
        if not callable(replacement):
            raise ArgumentTypeError(f"replacement for {op} must be an operator or a function")
    return table


def _patterns(value: Iterable[Any]) -> tuple[tuple[Callable[..., Any], Callable[..., Any]], ...]:
    pairs = tuple(tuple(p) for p in value)
    for pair in pairs:
        if len(pair) != 2 or not all(callable(f) for f in pair):
            raise ArgumentTypeError("patterns must be (pattern, replacement) pairs of functions")
    return pairs  # type: ignore[return-value]


_inside = threading.local()


def _not_reentrant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a decomposition-table entry whose own operator calls stay as they are.

    While a replacement runs (on this thread), every replaced operator it calls
    returns ``NotImplemented``, which tells torch's tracer to keep the call as it
    is; so ``gelu -> lambda x: F.gelu(x, approximate="tanh")`` does not recurse.
    """

    @functools.wraps(fn)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False):
            return NotImplemented
        _inside.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.active = False

    return replacement


def _traced(
    replacement: Callable[..., Any], gm: torch.fx.GraphModule, taken: set[str]
) -> torch.fx.GraphModule:
    """``replacement`` traced to a GraphModule whose tensor attributes (the tensors it
    creates, such as ``torch.tensor([...])``) have names that neither ``gm`` nor an
    earlier pattern (``taken``, updated) uses.

    The subgraph rewriter copies a replacement GraphModule's attributes into ``gm``
    (a plain function's are lost, leaving ``get_attr`` nodes without a value), but
    keeps an attribute ``gm`` already has under the same name, so names must be fresh.
    """
    traced = torch.fx.symbolic_trace(replacement)
    for node in traced.graph.nodes:
        if node.op != "get_attr":
            continue
        index = 0
        while hasattr(gm, f"replacement_constant_{index}") or (
            f"replacement_constant_{index}" in taken
        ):
            index += 1
        name = f"replacement_constant_{index}"
        taken.add(name)
        setattr(traced, name, getattr(traced, str(node.target)))
        node.target = name
    traced.recompile()
    return traced


@checked
@attrs.define(eq=False)
class ReplaceOps:
    """Replace operators by other operators or by traced Python functions, and
    rewrite subgraph patterns.

    * ``ops`` maps an ATen overload to its replacement. An overload replacement
      (``{aten.relu.default: aten.gelu.default}``) retargets the nodes in place;
      the arguments must fit the new operator. A Python function is traced into
      the graph in place of each call, taking the operator's arguments; this uses
      ``ExportedProgram.run_decompositions`` with a one-entry table, so torch does
      the tracing (dynamic shapes included). Like any retrace it functionalizes a
      training-IR program (in-place ops become buffer-mutation outputs).
    * ``patterns`` are ``(pattern, replacement)`` pairs of functions written with
      ``torch.ops.aten`` overloads, applied with
      ``torch.fx.subgraph_rewriter.replace_pattern_with_filters``; added on top,
      new nodes get fake values (the export verifier needs them) and tensors a
      replacement creates are lifted to constants.

    State: nothing changes; tensors created by a pattern replacement are **added**
    as constants. Works on training-IR and decomposed programs (match the ops of
    the form you have: ``aten.linear`` in the training IR, ``aten.addmm`` after
    decomposition).

    Example::

        def tanh_gelu(x, approximate="none"):
            return torch.nn.functional.gelu(x, approximate="tanh")

        out = PassManager([ReplaceOps({aten.gelu.default: tanh_gelu})]).run(ep)
    """

    name: ClassVar[str] = "replace-ops"
    changes_input: ClassVar[bool] = False

    ops: dict[Any, Callable[..., Any]] = attrs.field(factory=dict, converter=_ops)
    patterns: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...] = attrs.field(
        default=(), converter=_patterns
    )

    def __call__(self, ep: ExportedProgram) -> PassResult:
        present = {n.target for n in ep.graph.nodes if n.op == "call_function"}
        traced = {
            op: _not_reentrant(fn)
            for op, fn in self.ops.items()
            if op in present and not _program.is_op_overload(fn)
        }
        modified = False
        if traced:
            ep = state.run_decompositions(ep, traced)
            modified = True
        retarget = {op: new for op, new in self.ops.items() if _program.is_op_overload(new)}
        if not retarget and not self.patterns:
            return PassResult(ep, modified)
        gm = _graph.copy_graph(ep)
        changed = False
        for node in gm.graph.nodes:
            new = retarget.get(node.target) if node.op == "call_function" else None
            if new is not None:
                node.target = new
                node.meta.pop("val", None)
                changed = True
        taken: set[str] = set()
        for pattern, replacement in self.patterns:
            replaced = subgraph_rewriter.replace_pattern_with_filters(
                gm, pattern, _traced(replacement, gm, taken)
            )
            changed |= bool(replaced)
        if not changed:
            return PassResult(ep, modified)
        # lift_constants fills the fake values in, once the created tensors are inputs.
        return PassResult(lift_constants(ep, gm), True)

"""ReplaceOps: swap operators, trace Python replacements in, or rewrite subgraph patterns."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import attrs
from torch.export import ExportedProgram
from torch.fx import subgraph_rewriter

from epass import _graph, _program
from epass.errors import ArgumentTypeError
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
            op: fn
            for op, fn in self.ops.items()
            if op in present and not _program.is_op_overload(fn)
        }
        modified = False
        if traced:
            ep = ep.run_decompositions(traced)
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
        for pattern, replacement in self.patterns:
            replaced = subgraph_rewriter.replace_pattern_with_filters(gm, pattern, replacement)
            changed |= bool(replaced)
        if not changed:
            return PassResult(ep, modified)
        _graph.fill_meta(gm)
        return PassResult(lift_constants(ep, gm), True)

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

from epass import _dce, _graph, _operators
from epass._decomp import state
from epass.errors import ArgumentTypeError
from epass.options import checked
from epass.passes.lift_constants import lift_constants
from epass.protocol import Notice, PassResult, RewriteCounter

__all__ = ["ReplaceOps", "ReplaceOpsResult"]


def _ops(value: Mapping[Any, Any]) -> dict[Any, Any]:
    table = dict(value)
    for op, replacement in table.items():
        if not _operators.is_op_overload(op):
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


def _counted(
    fn: Callable[..., Any], op: Any, counter: RewriteCounter, nodes: list[str]
) -> Callable[..., Any]:
    """``fn`` as a table entry that asks ``counter`` before each call: the retrace
    calls it once per node of ``op``, in graph order (``nodes``), and a call the
    counter holds back returns ``NotImplemented``, which keeps that node as it is."""
    names = iter(nodes)

    @functools.wraps(fn)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        if not counter.allow(op, next(names, "?")):
            return NotImplemented
        return fn(*args, **kwargs)

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

    Rewrites are counted (:class:`~epass.protocol.RewriteCounter`): each node a
    traced function replaces, then each node retargeted, then each pattern match,
    in graph order; ``max_rewrites`` applies only the first N of them and the
    result's notes say how many it applied and which was the last.

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
    _takes_lease: ClassVar[bool] = True

    ops: dict[Any, Callable[..., Any]] = attrs.field(factory=dict, converter=_ops)
    patterns: tuple[tuple[Callable[..., Any], Callable[..., Any]], ...] = attrs.field(
        default=(), converter=_patterns
    )
    max_rewrites: int | None = None

    def with_max_rewrites(self, limit: int | None) -> ReplaceOps:
        """This pass, applying only its first ``limit`` rewrites."""
        return attrs.evolve(self, max_rewrites=limit)

    def __call__(self, ep: ExportedProgram) -> ReplaceOpsResult:
        counter = RewriteCounter(self.max_rewrites)
        ep, modified, bare = self._trace_in(ep, counter)
        # Only what can match is applied: the graph is copied for no rewrite.
        present = {(n.op, n.target) for n in ep.graph.nodes}
        retarget = {
            op: new
            for op, new in self.ops.items()
            if _operators.is_op_overload(new) and ("call_function", op) in present
        }
        patterns = [pair for pair in self.patterns if _may_match(pair[0], present)]
        if not retarget and not patterns:
            return ReplaceOpsResult(ep, modified, notes=counter.notes, bare=bare)
        # The run's own graph when it is leased (edited where it is), else a copy.
        gm = _graph.editable_graph(ep)
        changed = False
        for node in gm.graph.nodes:
            new = retarget.get(node.target) if node.op == "call_function" else None
            if new is not None and counter.allow(node.target, node.name):
                node.target = new
                node.meta.pop("val", None)
                changed = True
        taken: set[str] = set()
        for pattern, replacement in patterns:
            with _dce.keeping_nested_submodules(gm):
                replaced = subgraph_rewriter.replace_pattern_with_filters(
                    gm, pattern, _traced(replacement, gm, taken), match_filters=[_ask(counter)]
                )
            changed |= bool(replaced)
        if not changed:
            return ReplaceOpsResult(ep, modified, notes=counter.notes, bare=bare)
        # lift_constants fills the fake values in, once the created tensors are inputs.
        out = lift_constants(ep, gm)
        return ReplaceOpsResult(out, True, notes=counter.notes, bare=bare)

    def _trace_in(
        self, ep: ExportedProgram, counter: RewriteCounter
    ) -> tuple[ExportedProgram, bool, str | None]:
        """Trace the Python replacements in, with one retrace for all of them; says
        why that retrace ran bare, if it did (``state.run_decompositions``)."""
        calls = [n for n in ep.graph.nodes if n.op == "call_function"]
        traced = {
            op: _not_reentrant(_counted(fn, op, counter, [n.name for n in calls if n.target is op]))
            for op, fn in self.ops.items()
            if any(n.target is op for n in calls) and not _operators.is_op_overload(fn)
        }
        if not traced:
            return ep, False, None
        out, bare = state.run_decompositions(ep, traced)
        return out, True, bare


def _may_match(pattern: Callable[..., Any], present: set[tuple[str, Any]]) -> bool:
    """False when some call of ``pattern`` has no call of the same kind and target in
    the graph whose nodes' ``(op, target)`` are ``present``: the subgraph matcher
    matches a call only by an equal target, so such a pattern matches nowhere.
    True too when the pattern cannot be traced (the rewriter then says why)."""
    if isinstance(pattern, torch.fx.GraphModule):
        graph = pattern.graph
    else:  # traced each time: what a function traces to may change with its globals
        try:
            graph = torch.fx.symbolic_trace(pattern).graph
        except Exception:
            return True
    kinds = ("call_function", "call_method", "call_module")
    return all((n.op, n.target) in present for n in graph.nodes if n.op in kinds)


def _ask(counter: RewriteCounter) -> Callable[..., bool]:
    """A match filter that counts each match as one rewrite (named by the node whose
    value the match returns)."""

    def allow(match: Any, original_graph: Any, pattern_graph: Any) -> bool:
        nodes = [*getattr(match, "returning_nodes", []), *match.anchors]
        node = match.nodes_map.get(nodes[0], nodes[0]) if nodes else None
        if not isinstance(node, torch.fx.Node):
            return counter.allow("pattern", "?")
        return counter.allow(node.target, node.name)

    return allow


@attrs.frozen
class ReplaceOpsResult(PassResult):
    """A :class:`PassResult` with the rewrite count in ``notes``
    (:class:`~epass.protocol.RewriteCounter`), and ``bare``: set when the retrace that
    traced Python replacements in ran without epass's guard of torch's global state
    (a ``"torch"`` notice says why)."""

    notes: dict[str, Any] = attrs.field(factory=dict)
    bare: str | None = None
    notices: tuple[Notice, ...] = attrs.field(init=False)

    @notices.default
    def _notices(self) -> tuple[Notice, ...]:
        return () if self.bare is None else (Notice("torch", self.bare),)

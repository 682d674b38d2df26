"""Decompose: lower a program to core ATen (or any decomposition table)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram

from epass import _program
from epass.errors import ArgumentTypeError, DecompositionError
from epass.protocol import PassResult

__all__ = ["Decompose", "DecompositionError"]

_SDPA = "aten.scaled_dot_product_attention"


def _table(value: Mapping[Any, Any] | None) -> dict[Any, Any] | None:
    if value is None:
        return None
    not_a_table = ArgumentTypeError(
        f"Decompose(table=...) takes a mapping of operators, got {type(value).__name__}"
    )
    if isinstance(value, (str, bytes)):
        raise not_a_table
    try:
        table = dict(value)
    except (TypeError, ValueError):
        raise not_a_table from None
    for op in table:
        if not (_program.is_operator(op) or _program.is_op_packet(op)):
            raise ArgumentTypeError(
                "Decompose(table=...) keys must be operators such as "
                f"torch.ops.aten.gelu.default, got {op!r} ({type(op).__name__})"
            )
    return table


def _ops(value: Iterable[Any]) -> tuple[Any, ...]:
    ops = tuple(value)
    for op in ops:
        if not _program.is_operator(op):
            raise ArgumentTypeError(
                "Decompose(keep=...) takes ATen operators such as "
                f"torch.ops.aten.linear.default, got {op!r}"
            )
    return ops


# Call targets that retracing reproduces unchanged: Python arithmetic on sizes and
# tuple indexing. Any other non-operator target disables the no-op skip.
_SYM_FUNCTIONS = frozenset(
    getattr(torch, name)
    for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
    if hasattr(torch, name)
)


# Size queries on symbolic shapes: retracing re-emits them as they are.
_SIZE_OPS = frozenset(
    (
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    )
)


def _plain(target: Any) -> bool:
    module = getattr(target, "__module__", None)
    return module in ("_operator", "operator", "math", "builtins") or target in _SYM_FUNCTIONS


def _graphs(ep: ExportedProgram) -> Iterator[torch.fx.Graph]:
    for module in ep.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            yield module.graph


@attrs.define(eq=False)
class Decompose:
    """Run ``ExportedProgram.run_decompositions`` as a pass.

    Graph: retraces the program with the decomposition table. State: nothing is
    added, changed or removed; torch hands back a new ``state_dict`` dict over the
    same tensors, and the linker puts the store back in its place.

    No-op skip: when the input is already in the ATen dialect and no op in any of its
    graphs would be rewritten (none is in the table, none is a CompositeImplicitAutograd
    op the retrace decomposes, none mutates its inputs), :meth:`skip_reason` says so
    and the manager skips the retrace.

    Coalescing: a :class:`~epass.PassManager` merges adjacent ``Decompose`` passes into
    one retrace when that is provably the same (see :meth:`merge`), or when both set
    ``coalesce=True``.

    Args:
        table: ``None`` for torch's default core-ATen table; a mapping for exactly
            that table (``{}`` decomposes nothing but still functionalizes).
        keep: ops to leave undecomposed (removed from the table).
        coalesce: allow merging with an adjacent ``Decompose`` that also allows it,
            even where the merged table is not provably equivalent to running both
            (the merged pass uses the union of the tables; on an op in both, the
            earlier pass's decomposition wins).

    Example::

        out = PassManager([Decompose(keep=[torch.ops.aten.linear.default])]).run(ep)
    """

    name: ClassVar[str] = "decompose"
    changes_input: ClassVar[bool] = False

    table: dict[Any, Callable[..., Any]] | None = attrs.field(default=None, converter=_table)
    keep: tuple[Any, ...] = attrs.field(default=(), converter=_ops)
    coalesce: bool = False

    def decomp_table(self) -> dict[Any, Callable[..., Any]]:
        """The table handed to ``run_decompositions``."""
        table: Any
        table = torch.export.default_decompositions() if self.table is None else dict(self.table)
        for op in self.keep:
            table.pop(op, None)
        return table  # type: ignore[no-any-return]

    def __call__(self, ep: ExportedProgram) -> PassResult:
        # The default table is built by run_decompositions itself, exactly as a bare call.
        table = None if self.table is None and not self.keep else self.decomp_table()
        try:
            out = ep.run_decompositions(table)
        except Exception as exc:
            raise self._explain(ep, exc) from exc
        if out.graph_module.code == ep.graph_module.code and out.dialect == ep.dialect:
            return PassResult(ep, False)
        return PassResult(out, True)

    # --- no-op skip -------------------------------------------------------------

    def _rewrites(self, op: Any, kept: frozenset[Any], post_autograd: frozenset[Any]) -> bool:
        """Whether a retrace with this pass's table would rewrite the operator ``op``."""
        if op in _SIZE_OPS:
            return False
        if _program.is_mutable_op(op):
            return True  # functionalization replaces it
        cia = _program.is_cia_op(op)
        if cia and not _program.is_preservable_cia_op(op):
            return True  # export always decomposes aliasing/mutating CIA ops
        if op in kept:
            return False
        if self.table is not None:
            return op in self.table or op.overloadpacket in self.table
        if op in post_autograd:
            return True
        return cia and op not in _program.preserved_aten_cia_ops()

    def skip_reason(self, ep: ExportedProgram) -> str | None:
        """A reason when retracing ``ep`` with this table would change nothing.

        Cheap (one walk over the nodes, no tracing). ``None`` means "run it".
        """
        if ep.dialect != "ATEN":
            return None
        kept = frozenset(self.keep)
        post_autograd = (
            _program.core_aten_post_autograd_ops() if self.table is None else frozenset()
        )
        seen: set[Any] = set()
        hops = (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop)
        for graph in _graphs(ep):
            for node in graph.nodes:
                if node.op != "call_function" or node.target in seen:
                    continue
                target = node.target
                seen.add(target)
                if _program.is_op_overload(target):
                    if self._rewrites(target, kept, post_autograd):
                        return None
                elif target not in hops and not _plain(target):
                    return None  # an unknown callable: let the retrace decide
        table = "the default table" if self.table is None else "its table"
        return f"already ATen and no op in {table} or to decompose ({len(seen)} distinct targets)"

    # --- coalescing -------------------------------------------------------------

    def merge(self, other: Any) -> Decompose | None:
        """One ``Decompose`` doing the work of ``self`` followed by ``other``, or None.

        Called by the PassManager at construction for adjacent passes.

        Why merging is exact when the effective tables T1 (self) and T2 (other) are
        nested and agree on the ops they share (same decomposition callables):

        * A retrace with table T rewrites every node whose op is in T (or is a CIA op
          T does not preserve) with its decomposition, recursively, until no such op
          is left; the decompositions run on the same fake values either way, so the
          result is the normal form of the graph under the rewrite rules T.
        * T2 ⊆ T1: after the first retrace no op of T1, hence none of T2, is left,
          and every unpreserved CIA op is already gone, so the second retrace rewrites
          nothing. Running T1 alone is the same.
        * T1 ⊆ T2: the first retrace applies some of T2's rules, with the same
          callables; rewriting one node never changes another node's rule, so
          applying the rest afterwards reaches the same normal form as applying T2
          at once. Running T2 alone is the same.
        * Both retraces functionalize; the second one finds nothing left to do.

        When the tables are not nested this fails: with T1 = {b: b->c} and
        T2 = {a: a->b}, the sequence leaves ``b`` where a merged {a, b} table reaches
        ``c``. Such pairs merge only when both passes opt in with ``coalesce=True``.
        Default tables are compared through their ``keep`` lists only; a default
        table next to an explicit one is not compared (not provable without
        materializing CIA callables) and merges only on opt-in.
        """
        if not isinstance(other, Decompose):
            return None
        if self.table is None and other.table is None:
            mine, theirs = set(self.keep), set(other.keep)
            if mine <= theirs:  # self's table contains other's
                return self
            if theirs <= mine:
                return other
        elif self.table is not None and other.table is not None:
            t1, t2 = self._effective(), other._effective()
            if all(t1[k] is t2[k] for k in t1.keys() & t2.keys()):
                if t2.keys() <= t1.keys():
                    return self
                if t1.keys() <= t2.keys():
                    return other
        if self.coalesce and other.coalesce:
            return Decompose(table={**other.decomp_table(), **self.decomp_table()}, coalesce=True)
        return None

    def _effective(self) -> dict[Any, Callable[..., Any]]:
        assert self.table is not None
        kept = set(self.keep)
        return {k: v for k, v in self.table.items() if k not in kept}

    # --- errors -----------------------------------------------------------------

    def _explain(self, ep: ExportedProgram, exc: Exception) -> DecompositionError:
        text = str(exc)
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        match = re.search(r"While executing %(\w+)", text)
        node_name = match.group(1) if match else None
        node = None
        if node_name is not None:
            node = next((n for g in _graphs(ep) for n in g.nodes if n.name == node_name), None)
        op = str(node.target) if node is not None else None
        where = f"at node {node_name!r} ({op})" if node_name else "while retracing"
        source = ""
        if node is not None and node.meta.get("stack_trace"):
            lines = [s.strip() for s in node.meta["stack_trace"].strip().splitlines()]
            source = f"\n  source: {lines[-1]}" if lines else ""
        suggestion = None
        sdpa = [
            n.name
            for g in _graphs(ep)
            for n in g.nodes
            if n.op == "call_function" and str(n.target).startswith(_SDPA)
        ]
        if sdpa and "Cannot view a tensor" in text and self._decomposes_sdpa(ep):
            suggestion = (
                "the program has scaled_dot_product_attention nodes "
                f"({', '.join(sdpa[:4])}{', ...' if len(sdpa) > 4 else ''}); on torch "
                f"{torch.__version__} their decomposition returns outputs with other "
                "strides than the fused kernel, so a later .view() fails. Keep them: "
                "Decompose(keep=[torch.ops.aten.scaled_dot_product_attention.default]), "
                'or export the model with attn_implementation="eager"'
            )
        message = f"run_decompositions failed {where}: {type(exc).__name__}: {first}{source}"
        if suggestion:
            message += f"\n  fix: {suggestion}"
        return DecompositionError(message, node=node_name, op=op, suggestion=suggestion)

    def _decomposes_sdpa(self, ep: ExportedProgram) -> bool:
        sdpa = torch.ops.aten.scaled_dot_product_attention.default
        return sdpa not in self.keep and (self.table is None or sdpa in self.table)

"""Decompose: lower a program to core ATen (or any decomposition table).

One concept: the Decompose pass: its options, its choice of path, and its result.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal

import attrs
import torch
from torch.export import ExportedProgram

from epass import _operators, _program
from epass._decomp import identity, keys, safety, shapes, splice, state, templates
from epass._decomp.check import example_difference, first_difference
from epass._decomp.table import REGIONS, Tables, as_dict, rewrites, splices, split_table
from epass._torch import internals
from epass.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    DecompositionError,
    DecompositionMismatchError,
    IncrementalDecompositionError,
)
from epass.options import checked
from epass.protocol import Notice, PassResult, RewriteCounter

__all__ = ["Decompose", "DecomposeResult", "DecompositionError"]

Method = Literal["auto", "incremental", "retrace"]
METHODS = ("auto", "incremental", "retrace")
# Set to 1 to run every Decompose in check mode (both paths, compared).
CHECK_ENV = "EPASS_DECOMPOSE_CHECK"

_SDPA = "aten.scaled_dot_product_attention"

# The cost model of method="auto", in seconds of a first decomposition in a fresh
# process (measured on a 2-core machine with torch 2.13; only their ratios matter):
# entering the table's CompositeImplicitAutograd override and the first trace's
# warm-up, once per decomposition that traces; one batched trace of the missing
# static templates, fixed and per template; a template traced alone (symbolic ones);
# a retrace's fixed and per-node costs. A first incremental decomposition that traces
# (CPU time, fresh processes, empty cache) took 0.26 s for 3 templates of a 13-node
# program, 0.48 s for 24 of a 180-node one and 0.91 s for 17 of a 566-node one; first
# retraces of the same programs, 0.9 to 1.4 s, 1.5 to 1.7 s and 3.5 to 5.7 s. A
# program with symbolic sizes retraces at about twice the cost per node: first
# retraces of 5.2 s (ConvNeXt-T, 368 nodes, Dim.AUTO height and width), 4.6 s
# (MobileNet-v3-small, 403, dynamic batch), 7.1 s (EfficientViT-B0, 419, dynamic
# batch) and 8.3 to 12.2 s (GoogLeNet, 543, Dim.AUTO height and width).
_SESSION_SECONDS = 0.25
_BATCH_SECONDS = 0.05
_BATCH_TEMPLATE_SECONDS = 0.015
_TRACE_SECONDS = 0.035
_RETRACE_SECONDS = 0.9
_RETRACE_NODE_SECONDS = 0.0065
_RETRACE_SYMBOLIC_NODE_SECONDS = 0.012


def _table(value: Mapping[Any, Callable[..., Any]] | None) -> dict[Any, Any] | None:
    if value is None:
        return None
    not_a_table = ArgumentTypeError(
        f"Decompose(table=...) takes a mapping of operators, got {type(value).__name__}"
    )
    if isinstance(value, (str, bytes)):
        raise not_a_table
    try:
        table = as_dict(value)
    except (TypeError, ValueError):
        raise not_a_table from None
    for op in table:
        if not (_operators.is_operator(op) or _operators.is_op_packet(op)):
            raise ArgumentTypeError(
                "Decompose(table=...) keys must be operators such as "
                f"torch.ops.aten.gelu.default, got {op!r} ({type(op).__name__})"
            )
    return table


def _ops(value: Iterable[Any] | Any) -> tuple[Any, ...]:
    # One operator stands for a list of one; a packet for its default overload.
    items = (value,) if _operators.is_operator(value) or _operators.is_op_packet(value) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        items = (items,)
    ops = []
    for op in items:
        overload = op if _operators.is_operator(op) else _operators.overload_of(op)
        if overload is None:
            raise ArgumentTypeError(
                "Decompose(keep=...) takes ATen operators such as "
                f"torch.ops.aten.linear.default, got {op!r}"
            )
        ops.append(overload)
    return tuple(ops)


@attrs.frozen
class DecomposeResult(PassResult):
    """A :class:`PassResult` that also says which path produced the program.

    Attributes:
        method: ``"incremental"`` (only the decomposed nodes were rewritten) or
            ``"retrace"`` (``run_decompositions``).
        fallback: why the incremental path was not taken (None when it was, or when
            ``method="retrace"`` was asked for).
        rewritten: how many nodes the incremental path rewrote (None for a retrace).
        checked: whether both paths ran and were found equivalent.
        decision: set when ``method="auto"`` weighed the program: which path it
            chose and why (the templates to trace, neither in memory nor on disk,
            against the retrace's estimate) and, when it retraced, how many
            templates it traced for next time. None where there was nothing to
            weigh: ``method`` was given, or the program is one the incremental path
            cannot take (``fallback`` says why).
        cache: set when the incremental path traced its templates for this run
            alone, kept neither in memory for later runs nor on disk, and why (a
            decomposition of the table declares no cache identity; see
            docs/speed.md).
        notices: made from the above: a ``"fallback"`` notice when the program was
            retraced because the incremental path could not take it (not when
            ``method="retrace"`` asked for it, nor when auto chose the retrace as
            cheaper), a ``"cache"`` notice when templates were kept nowhere, and a
            ``"torch"`` notice from ``bare``.
        bare: set when the retrace ran without epass's guard of torch's global
            state, which leans on internals this torch lacks or changed, and why
            (the program is torch's all the same).
        made: the program the path made, also where ``program`` is the input
            because the graph's code did not change: it is the one
            ``run_decompositions`` returns, whose node meta (``original_aten``)
            is the retrace's (:func:`epass.fast_decompositions` returns it).
    """

    method: str = "retrace"
    fallback: str | None = None
    rewritten: int | None = None
    checked: bool = False
    decision: str | None = None
    cache: str | None = None
    counted: Mapping[str, Any] | None = None
    bare: str | None = None
    made: ExportedProgram | None = attrs.field(default=None, repr=False)
    notices: tuple[Notice, ...] = attrs.field(init=False)

    @notices.default
    def _notices(self) -> tuple[Notice, ...]:
        notices = []
        # When auto weighed the program and chose the retrace, ``fallback`` repeats
        # its decision: a choice for speed, not a path that could not be taken.
        if self.method == "retrace" and self.fallback and self.fallback != self.decision:
            notices.append(Notice("fallback", f"retraced: {self.fallback}"))
        if self.cache is not None:
            notices.append(Notice("cache", self.cache))
        if self.bare is not None:
            notices.append(Notice("torch", self.bare))
        return tuple(notices)

    @property
    def notes(self) -> dict[str, Any]:
        """JSON-ready summary, copied into the pass's record (``decision``: only when
        ``method="auto"`` weighed the program; ``rewrites``, ``last_rewrite`` and
        ``held_back``: only under ``max_rewrites``)."""
        notes: dict[str, Any] = {
            "method": self.method,
            "fallback": self.fallback,
            "rewritten": self.rewritten,
            "checked": self.checked,
        }
        if self.decision is not None:
            notes["decision"] = self.decision
        if self.cache is not None:
            notes["cache"] = self.cache
        if self.counted is not None:
            notes.update(self.counted)
        return notes


def _method(value: Method) -> str:
    if value not in METHODS:
        raise ArgumentValueError(f"Decompose(method=...) takes one of {METHODS}, got {value!r}")
    return value


def _limit(instance: Any, attribute: Any, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentValueError(
            f"Decompose(max_rewrites=...) takes None or an int >= 0, got {value!r}"
        )
    if instance.method == "retrace":
        raise ArgumentValueError(
            "Decompose(max_rewrites=...) splices nodes one by one on the incremental path; "
            "method='retrace' rewrites the whole program at once"
        )


def _check_enabled(check: bool | None) -> bool:
    if check is not None:
        return check
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


@checked
@attrs.define(eq=False)
class Decompose:
    """Lower the program with a decomposition table: the program
    ``ExportedProgram.run_decompositions`` returns, usually much faster.

    Graph: by default (``method="auto"``) only the nodes the table decomposes are
    rewritten, each with a cached trace of its decomposition, wherever that provably
    gives torch's program; otherwise the program is retraced with
    ``run_decompositions``. The result's ``notes`` (and the pass record) say which
    path ran and, for a retrace, why. State: nothing is added, changed or removed;
    a retrace gives a new ``state_dict`` dict over the same tensors, and the linker
    gives the output the user's dicts back.

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
        method: ``"auto"`` (incremental where safe, else retrace), ``"incremental"``
            (raise :class:`~epass.errors.IncrementalDecompositionError` naming the
            reason when it is not safe) or ``"retrace"`` (always torch's path).
        check: run both paths and raise
            :class:`~epass.errors.DecompositionMismatchError` naming the first
            differing node. ``None`` reads the ``EPASS_DECOMPOSE_CHECK``
            environment variable (``1`` turns it on).
        max_rewrites: decompose only the first N nodes the table rewrites (in graph
            order) and keep the others as they are, on the incremental path (its
            :class:`~epass.errors.IncrementalDecompositionError` says why when the
            program cannot take it; ``check`` is not run). The result's notes count
            the rewrites (:class:`~epass.protocol.RewriteCounter`), which is how
            :func:`~epass.bisect` names the one node whose decomposition breaks a
            program.

    Example::

        out = PassManager([Decompose(keep=[torch.ops.aten.linear.default])]).run(ep)
    """

    name: ClassVar[str] = "decompose"
    changes_input: ClassVar[bool] = False
    # It builds a new graph: under the manager's lease, its output is the run's own.
    _takes_lease: ClassVar[bool] = True

    table: dict[Any, Callable[..., Any]] | None = attrs.field(default=None, converter=_table)
    keep: tuple[Any, ...] = attrs.field(default=(), converter=_ops)
    coalesce: bool = False
    method: Method = attrs.field(default="auto", converter=_method)  # type: ignore[misc]
    check: bool | None = None
    max_rewrites: int | None = attrs.field(default=None, validator=_limit)

    def with_max_rewrites(self, limit: int | None) -> Decompose:
        """This pass, decomposing only the first ``limit`` nodes it would rewrite."""
        return attrs.evolve(self, max_rewrites=limit)

    def decomp_table(self) -> dict[Any, Callable[..., Any]]:
        """The table handed to ``run_decompositions``."""
        table: Any
        table = torch.export.default_decompositions() if self.table is None else dict(self.table)
        for op in self.keep:
            table.pop(op, None)
        return table  # type: ignore[no-any-return]

    def __call__(self, ep: ExportedProgram) -> DecomposeResult:
        if self.max_rewrites is not None:
            return self._limited(ep, self.max_rewrites)
        check = _check_enabled(self.check)
        fast: ExportedProgram | None = None
        rewritten: int | None = None
        fallback: str | None = None
        decision: str | None = None
        if self.method == "auto" and not check:
            decision, estimate, batched = self._weigh(ep)
            if decision is not None and decision.startswith("retrace"):
                began = time.perf_counter()
                ref, bare = self._retrace(ep)
                spent = time.perf_counter() - began
                decision += f"; {self._fill(ep, batched, estimate - spent)}"
                result = self._result(ep, ref, "retrace", decision, None, False, decision)
                return attrs.evolve(result, bare=bare)
        if self.method != "retrace":
            fast, rewritten, fallback = self._incremental(ep, check=check)
            if fast is None and self.method == "incremental":
                raise IncrementalDecompositionError(str(fallback))
        if fast is not None and not check:
            return self._result(ep, fast, "incremental", None, rewritten, False, decision)
        # What the incremental path left in the program's shape environment (the
        # engine proved it changed only what its traces taught): the retrace,
        # which runs on the same environment, must find nothing more to learn.
        shape_env = getattr(keys.detected_fake_mode(ep), "shape_env", None)
        known = shapes.snapshot(shape_env)
        ref, bare = self._retrace(ep)
        if fast is None:
            result = self._result(ep, ref, "retrace", fallback, None, False, decision)
            return attrs.evolve(result, bare=bare)
        difference = (
            first_difference(fast, ref)
            or shapes.learnt(known, shapes.snapshot(shape_env))
            or example_difference(fast, ref)
        )
        if difference is not None:
            raise DecompositionMismatchError(difference)
        return self._result(ep, fast, "incremental", None, rewritten, True)

    def _weigh(self, ep: ExportedProgram) -> tuple[str | None, float, int]:
        """Whether tracing the templates ``ep`` needs (those neither in memory nor on
        disk) would cost more than one retrace; says which path and why (None: no
        estimate, the incremental path decides and explains). Returns that, the
        retrace's estimate and how many templates one batched trace would take."""
        try:
            batched, alone, nodes = templates.template_work(ep, self._tables())
        except Exception:  # a program the incremental path cannot take: it explains
            return None, 0.0, 0
        trace = _trace_estimate(batched) + alone * _TRACE_SECONDS
        if alone and not batched:
            trace += _SESSION_SECONDS
        per_node = _RETRACE_SYMBOLIC_NODE_SECONDS if ep.range_constraints else _RETRACE_NODE_SECONDS
        retrace = _RETRACE_SECONDS + nodes * per_node
        if not batched + alone:
            return "incremental: every template it needs is in memory or on disk", retrace, 0
        why = (
            f"{batched + alone} templates to trace ({batched} in one batch, {alone} one at "
            f"a time; about {trace:.2f} s) against a retrace of {nodes} nodes "
            f"(about {retrace:.2f} s)"
        )
        return f"{'retrace' if trace > retrace else 'incremental'}: {why}", retrace, batched

    def _fill(self, ep: ExportedProgram, batched: int, budget: float) -> str:
        """Trace, for the next run, as many of the ``batched`` templates as one batch
        can in ``budget`` seconds (what the retrace left of its estimate), so that this
        run costs no more than the retrace was expected to; says what it did."""
        fits = 0
        if budget > _SESSION_SECONDS + _BATCH_SECONDS:
            fits = int((budget - _SESSION_SECONDS - _BATCH_SECONDS) // _BATCH_TEMPLATE_SECONDS)
        limit = min(batched, fits)
        if not batched:
            return (
                "traced nothing for next time: no two of its templates can share a "
                "batch (symbolic ones are traced one at a time)"
            )
        if limit <= 0:
            return (
                f"traced nothing for next time: a batch of the {batched} templates "
                f"(about {_trace_estimate(batched):.2f} s) does not fit in the "
                f"{max(budget, 0.0):.2f} s the retrace left of its estimate"
            )
        try:
            filled = templates.fill(ep, self._tables(), limit=limit)
        except Exception:
            filled = 0
        return (
            f"then traced {filled} of {batched} templates for next time, in one batch "
            f"that fits in the {budget:.2f} s the retrace left of its estimate"
        )

    def _limited(self, ep: ExportedProgram, limit: int) -> DecomposeResult:
        """The incremental path's program with only the first ``limit`` nodes decomposed."""
        tables = self._tables()
        counter = RewriteCounter(limit)
        for node in ep.graph.nodes:  # the order in which the engine splices them
            if splices(node, tables) and node.target not in REGIONS:
                counter.allow(node.target, node.name)
        fast, rewritten, fallback = self._incremental(ep, limit)
        if fast is None:
            raise IncrementalDecompositionError(
                f"max_rewrites counts the rewrites of the incremental path, which cannot "
                f"take this program: {fallback}"
            )
        result = self._result(ep, fast, "incremental", None, rewritten, False)
        return attrs.evolve(result, counted=counter.notes)

    def _incremental(
        self, ep: ExportedProgram, limit: int | None = None, check: bool = False
    ) -> tuple[ExportedProgram | None, int | None, str | None]:
        """The incremental path's program, or None and the reason it was not taken.

        Raises:
            DecompositionMismatchError: in check mode, when epass changed the program's
                shape environment outside a trace (it falls back otherwise).
        """
        try:
            if limit is None:
                out, rewritten = splice.decompose(ep, self._tables())
            else:
                out, rewritten = splice.decompose(ep, self._tables(), limit=limit)
        except shapes.Changed as exc:
            if check:
                raise DecompositionMismatchError(exc.reason) from exc
            return None, None, exc.reason
        except safety.Fallback as exc:
            return None, None, exc.reason
        except Exception as exc:  # torch's retrace decides, and explains its failure
            return None, None, internals.unexpected(exc)
        return out, rewritten, None

    def _tables(self) -> Tables:
        """This pass's table, split as ``run_decompositions`` splits it (cached)."""
        if self.table is None:
            return split_table(None, keep=self.keep)
        return split_table(self.decomp_table())

    def _retrace(self, ep: ExportedProgram) -> tuple[ExportedProgram, str | None]:
        """torch's program, and why the retrace ran bare, if it did."""
        # The default table is built by run_decompositions itself, exactly as a bare call.
        table = None if self.table is None and not self.keep else self.decomp_table()
        try:
            return state.run_decompositions(ep, table)
        except Exception as exc:
            raise self._explain(ep, exc) from exc

    def _result(
        self,
        ep: ExportedProgram,
        out: ExportedProgram,
        method: str,
        fallback: str | None,
        rewritten: int | None,
        checked: bool,
        decision: str | None = None,
    ) -> DecomposeResult:
        # A rewritten node changes the graph: its code need not be generated to know it.
        modified = (
            bool(rewritten)
            or out.dialect != ep.dialect
            or out.graph_module.code != ep.graph_module.code
        )
        cache = None
        if method == "incremental":
            cache = _cache_note(identity.cache_name(self._tables()), ep)
        return DecomposeResult(
            out if modified else ep,
            modified,
            method=method,
            fallback=fallback,
            rewritten=rewritten,
            checked=checked,
            decision=decision,
            cache=cache,
            made=out,
        )

    # --- no-op skip -------------------------------------------------------------

    def skip_reason(self, ep: ExportedProgram) -> str | Notice | None:
        """A reason when retracing ``ep`` with this table would change nothing.

        Cheap (one walk over the nodes, no tracing). ``None`` means "run it"; a
        :class:`Notice` means "run it" too, and says why it could not tell (a torch
        internal the answer leans on is missing or misbehaves on this release).
        """
        if ep.dialect != "ATEN":
            return None
        try:
            tables = self._tables()
        except Exception:  # a table torch cannot split: let the retrace decide
            return None
        try:
            return self._no_op(ep, tables)
        except Exception as exc:  # an internal the answer asks: the pass decides
            why = internals.unexpected(exc)
            return Notice("torch", f"not skipped: whether it is a no-op is unknown ({why})")

    def _no_op(self, ep: ExportedProgram, tables: Tables) -> str | None:
        """:meth:`skip_reason` of ``ep`` under ``tables``, asking internals."""
        seen: set[Any] = set()
        hops = (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop)
        for graph in _program.graphs(ep.graph_module):
            for node in graph.nodes:
                if node.op != "call_function" or node.target in seen:
                    continue
                target = node.target
                seen.add(target)
                if _operators.is_op_overload(target):
                    if rewrites(target, tables):  # the engine's own answer
                        return None
                elif target not in hops and not safety.is_plain_call(target):
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
        if self.max_rewrites is not None or other.max_rewrites is not None:
            return None  # a limit counts the rewrites of one pass
        merged = self._merge_tables(other)
        if merged is None:
            return None
        # The paths give the same program; a pass that forces one path decides, two
        # that force different paths do not merge. Check mode is kept if either asks.
        methods = {self.method, other.method} - {"auto"}
        if len(methods) > 1:
            return None
        method = methods.pop() if methods else "auto"
        checks = [c for c in (self.check, other.check) if c is not None]
        check = any(checks) if checks else None
        if (method, check) == (merged.method, merged.check):
            return merged
        return attrs.evolve(merged, method=method, check=check)

    def _merge_tables(self, other: Decompose) -> Decompose | None:
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
            return Decompose(
                table={**other.decomp_table(), **self.decomp_table()},
                coalesce=True,
                method=self.method,
                check=self.check,
            )
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
        graphs = _program.graphs(ep.graph_module)
        node = None
        if node_name is not None:
            node = next((n for g in graphs for n in g.nodes if n.name == node_name), None)
        op = str(node.target) if node is not None else None
        where = f"at node {node_name!r} ({op})" if node_name else "while retracing"
        source = ""
        if node is not None and node.meta.get("stack_trace"):
            lines = [s.strip() for s in node.meta["stack_trace"].strip().splitlines()]
            source = f"\n  source: {lines[-1]}" if lines else ""
        suggestion = None
        sdpa = [
            n.name
            for g in graphs
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


def _trace_estimate(batched: int) -> float:
    """The estimated cost of one batched trace of ``batched`` templates."""
    if not batched:
        return 0.0
    return _SESSION_SECONDS + _BATCH_SECONDS + batched * _BATCH_TEMPLATE_SECONDS


def _cache_note(name: identity.CacheName, ep: ExportedProgram) -> str | None:
    """Why templates of this decomposition were kept nowhere, if any were: the table
    has no name, or an operator of the program runs a kernel nothing names."""
    if name.why_not is not None:
        return f"templates traced for this run only, kept nowhere: {name.why_not}"
    if not name.unkept:
        return None
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    held = {t.name() for t in targets if not name.keeps(t)}
    why = [f"{op} ({reason})" for op, reason in name.unkept_why if op in held]
    if not why:
        return None
    return (
        "templates of operators whose CompositeImplicitAutograd kernel nothing names "
        f"traced for this run only, kept nowhere: {'; '.join(why)}"
    )

"""The splice engine: the program ``run_decompositions`` would give, by rewriting only
the nodes the table decomposes.

One concept: the splice, the node-by-node rewrite of a program with its templates.
"""

from __future__ import annotations

import collections
import copy
import operator
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _heap, _lease, _operators, _program, _tensors
from epass._decomp import (
    disk,
    keys,
    propagation,
    safety,
    shapes,
    signature,
    sizes,
    state,
    table,
    templates,
    views,
    writeback,
)
from epass._decomp.safety import Fallback
from epass._torch import fakes, programs, quiet

__all__ = ["decompose"]

_CARRIED_META = writeback.CARRIED_META


class _Builder(writeback.WriteBack):
    """Copies the graph node by node, splicing templates in and re-propagating values."""

    def __init__(
        self,
        tables: table.Tables,
        fake_mode: Any,
        session: templates.Session,
        plan: safety.Plan,
        old_graph: torch.fx.Graph,
        limit: int | None = None,
    ) -> None:
        self.tables = tables
        self.no_write = plan.no_write
        self.through = plan.through
        self.limit = limit
        self.fake_mode = fake_mode
        self.session = session
        # The program's shape environment, from here to the end of the decomposition.
        self.watch = session.watching(fake_mode)
        self.settled = propagation.Settled(old_graph, fake_mode.shape_env)
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, Any] = {}
        self.changed: set[torch.fx.Node] = set()
        self.sizes: dict[Any, torch.fx.Node] = {}
        # Each symbol an input's size is -> the first input and dimension holding it:
        # the tracer reads a symbol from the first tensor it saw hold it.
        self.symbols: dict[Any, tuple[torch.fx.Node, int]] = {}
        self.decomposed = 0
        self.new_sizes = False
        # Nodes computing a size an earlier node computes: the retrace's trace has
        # them, its runtime-assertion pass replaces them after its DCE (``sizes.drop_dead``).
        self.merged: dict[torch.fx.Node, torch.fx.Node] = {}
        # Size queries put after the node whose result first holds the size, with
        # that node and the dimension (``_place_size``).
        self.placed: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = {}
        # The nodes copied from the program: operators the retrace's functionalization
        # sees one by one, as it sees those a CompositeImplicitAutograd decomposition
        # calls but not those inside a Python decomposition.
        self.copied: set[torch.fx.Node] = set()
        # The aliases of each tensor written in place so far (see ``_written``).
        self.chains: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        # A view a decomposition returned -> the tensor it made and views.
        self.view_bases: dict[torch.fx.Node, torch.fx.Node] = {}
        # A chain of views a decomposition returned of a tensor it made (einsum's).
        self.view_chains: set[torch.fx.Node] = set()
        # A view made again after a write back into its base -> that base.
        self.written_back: dict[torch.fx.Node, torch.fx.Node] = {}
        # Each node's sizes as its first emission made them: expression -> node.
        self.view_sizes: dict[torch.fx.Node, dict[Any, torch.fx.Node]] = {}
        self.views = views.Views(plan.views, plan.through, self, self.emit_node)

    def _emit(
        self, target: Any, args: Any, kwargs: Any, name: str, meta: dict[str, Any]
    ) -> torch.fx.Node:
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta.update(meta)
        return node

    def _value(self, name: str, compute: Any) -> Any:
        """``compute()`` as the retrace's trace computes the value of ``name``
        (``shapes.as_traced``). What it teaches the shape environment (a size is not
        1, say), the retrace's trace of the same value teaches it too.

        Raises:
            Fallback: when it made a size static: computed as the trace computes it,
                no value the retrace keeps symbolic does that, so the retrace runs.
        """
        shape_env = self.fake_mode.shape_env
        before = shapes.static(shape_env)
        with self.watch.retrace(f"the value of {name}"), shapes.as_traced(self.fake_mode):
            value = compute()
        static = ", ".join(sorted(shapes.static(shape_env) - before))
        if static:
            raise Fallback(f"the value of {name} makes a size static ({static})")
        return value

    def _propagate(self, node: torch.fx.Node, old: Any) -> bool:
        """Recompute ``node``'s value from its inputs (``_value``); True when its
        metadata changed."""
        new = self._value(
            node.name,
            lambda: node.target(*keys.values_of(node.args), **keys.values_of(node.kwargs)),  # type: ignore[operator]
        )
        if old is not None and propagation.same_meta(new, old):
            node.meta["val"] = old
            return False
        node.meta["val"] = new
        return True

    def emit_node(self, node: torch.fx.Node) -> None:
        """Copy ``node``, or splice in its decomposition where the table rewrites it."""
        src = node.args[0] if node.target is operator.getitem else None
        if node.op == "get_attr":
            # A region's body (safety lets no other attribute through): the region's
            # trace runs it, and the program keeps no attribute.
            program = self.session.program
            assert program is not None
            self.env[node] = operator.attrgetter(str(node.target))(program.graph_module)
            return
        if isinstance(src, torch.fx.Node) and isinstance(self.env.get(src), (tuple, list)):
            # An item of a producer whose decomposition returned a tuple: that item.
            self.env[node] = self.env[src][node.args[1]]  # type: ignore[index]
        elif table.splices(node, self.tables) and (
            # a region's body has no attribute left to copy it with
            self.limit is None or self.decomposed < self.limit or node.target in table.REGIONS
        ):
            self.splice(node)
        else:
            self.copy(node)
        if node in self.views.views:
            self.views.created(node)

    def copy(self, node: torch.fx.Node) -> None:
        self.views.refresh(node)
        target = node.target
        if _operators.is_op_overload(target) and target not in table.SIZE_OPS:
            # The retrace names each node after its operator, as make_fx does.
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.env.__getitem__)
            new = self.graph.create_node(
                node.op, target, args, kwargs, target.overloadpacket.__name__, node.type
            )
            new.meta = _program.copy_meta(node.meta)
        else:
            new = self.graph.node_copy(node, lambda n: self.env[n])
            # node_copy shares the meta's containers with the program's node; the
            # output goes to code that may edit them (docs/concepts.md, ownership).
            new.meta = _program.copy_meta(node.meta)
            if node.target is operator.getitem and isinstance(new.args[0], torch.fx.Node):
                # The tracer unpacks a multi-output op's result inside that op's call:
                # each getitem records the producer's original_aten.
                producer = new.args[0].meta
                if "original_aten" in producer:
                    new.meta["original_aten"] = producer["original_aten"]
                else:
                    new.meta.pop("original_aten", None)
        if node.op == "call_function":
            if _operators.is_op_overload(node.target):
                new.args, new.kwargs = keys.normalize(node.target, new.args, dict(new.kwargs))
                if node.target in table.SIZE_OPS:
                    if isinstance(new.meta.get("val"), torch.SymInt):
                        self.views.read_size(new.meta["val"].node.expr, node)
                    new.meta.pop("original_aten", None)  # the retrace records none
                    # The retrace's runtime-assertion pass binds the size again, its
                    # metadata hook taking ``custom`` from the first input (a program
                    # read from a file keeps no empty ``custom``).
                    first = new.all_input_nodes[0].meta if new.all_input_nodes else {}
                    new.meta.setdefault("custom", first.get("custom", {}))
                else:
                    new.meta["original_aten"] = node.target
            old, moved = node.meta.get("val"), any(i in self.changed for i in node.all_input_nodes)
            if moved or (propagation.symbolic(old) and not self.settled.skip(node.name)):
                if self._propagate(new, old):
                    self.changed.add(node)
                elif not moved:
                    self.settled.taught_nothing(node.name)
            if node.target in table.SIZE_OPS or isinstance(new.meta.get("val"), torch.SymInt):
                self._bind(new)
        if node.op == "call_function" and "nn_module_stack" not in new.meta:
            # The retrace records the (empty) module stack of its tracer.
            new.meta["nn_module_stack"] = collections.OrderedDict()
        self.copied.add(new)
        self.env[node] = new

    def placeholder(self, node: torch.fx.Node, name: str) -> None:
        """Copy the placeholder ``node`` under the name the retrace gives it."""
        new = self.graph.placeholder(name, type_expr=node.type)
        if new.name != name:
            # fx renames names that shadow builtins (``input``); the signature names
            # the placeholders as the retrace does.
            _program.keep_node_name(self.graph, new, name)
        new.meta = _program.copy_meta(node.meta)
        v = node.meta.get("val")
        if isinstance(v, torch.SymInt):
            expr = self._expr(v)
            if expr is not None:
                self.sizes.setdefault(expr, new)
        elif isinstance(v, torch.Tensor):
            for dim, size in enumerate(v.shape):
                expr = self._expr(size)
                if expr is not None and expr.is_Symbol:
                    self.symbols.setdefault(expr, (new, dim))
        self.env[node] = new

    @staticmethod
    def _expr(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return v.node.expr
        return None

    def splice(self, node: torch.fx.Node) -> None:
        op = node.target
        regenerated = self.views.refresh(node)
        # Decompositions see the values as they are now, after upstream rewrites (a
        # decomposition may return other strides than the fused kernel did).
        mapped = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])
        if op in table.REGIONS:
            args, kwargs = mapped[0], dict(mapped[1])
            template, inputs = templates.region(
                op, args, kwargs, self.tables, self.fake_mode, self.session
            )
        else:
            args, kwargs = keys.normalize(op, mapped[0], dict(mapped[1]))
            # The node's own value is the operator's on these arguments while none of
            # them changed (a template read from disk must return its like).
            same = not regenerated and not any(i in self.changed for i in node.all_input_nodes)
            template, inputs = templates.find(
                op,
                args,
                kwargs,
                self.tables,
                self.fake_mode,
                self.session,
                node.meta.get("val") if same else None,
            )
        if any(t.target in table.EMITTED_AS_ITSELF for t in template.graph.nodes) and self._viewed(
            node
        ):
            # Functionalization records its output as a view of what it made, which
            # a write through the program's view writes back into; not mirrored.
            raise Fallback(f"a view written in place through ({node.name}) made as _unsafe_view")
        # An in-place op whose decomposition returns what it was to write (dropout_ in
        # eval) writes nothing: functionalization sees no write, and its views stay.
        writes = not safety.returns_its_input(template, inputs, args, op)
        if node in self.no_write and writes:
            raise Fallback(self.no_write[node])
        into_view = None
        if node not in self.no_write and node not in self.through:
            into_view = self._into_view(node, args)
        result, emitted = self._emit_template(node, template, inputs)
        self._record_view(result, emitted)
        self.views.place(node, regenerated, emitted, result)
        if op not in table.REGIONS:  # inlined whole, whatever the limit: no rewrite
            self.decomposed += 1
        if node in self.through:
            self._write_back(node, result)
            return
        if into_view is not None and result is not into_view[1]:
            result = self._write_into_view(node, result, into_view)
        new_val = keys.values_of(result) if result is not None else None
        for alias in self._written(node, writes=writes):
            # Every later read of the tensor an in-place node wrote (the tensor, and
            # the earlier in-place results aliasing it) reads the new value, as
            # functionalization makes it; earlier reads were copied already.
            self.env[alias] = result
            if not propagation.same_meta(new_val, alias.meta.get("val")):
                self.changed.add(alias)

    def _viewed(self, node: torch.fx.Node) -> bool:
        """Whether the program writes in place through a view of ``node``, or ``node``
        is such a view."""
        return node in self.views.views or any(
            info.owner is node for info in self.views.views.values()
        )

    def _emit_template(
        self, node: torch.fx.Node, template: Any, inputs: list[torch.fx.Node]
    ) -> tuple[Any, list[torch.fx.Node]]:
        """Emit ``template`` for ``node`` on ``inputs``: its result, and the nodes made."""
        meta = {k: node.meta[k] for k in _CARRIED_META if k in node.meta}
        meta.setdefault("nn_module_stack", collections.OrderedDict())
        local: dict[torch.fx.Node, Any] = {}
        stale: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # see _track_stale
        phs = iter(inputs)
        result: Any = None
        emitted = []
        for t in template.graph.nodes:
            if t.op == "placeholder":
                local[t] = next(phs)
            elif t.op == "output":
                result = torch.fx.node.map_arg(t.args[0], lambda n: local[n])
            else:
                val = t.meta.get("val")
                made = self._size_made_before(node, val)
                if made is not None:
                    local[t] = made
                    continue
                if isinstance(val, torch.SymInt) and t.target in table.SIZE_OPS:
                    self.views.read_size(val.node.expr, node)
                if (
                    isinstance(val, torch.SymInt)
                    and t.target in table.SIZE_OPS
                    and val.node.expr not in self.sizes
                ):
                    # A size query the graph has no node for: the retrace's
                    # runtime-assertion pass re-binds it (after the placeholders, or
                    # as arithmetic on sizes it has); decompose() runs that pass.
                    self.new_sizes = True
                    # A size of a value made before: placed where the trace makes it.
                    place = t.args[0].op == "placeholder"
                else:
                    place = False
                if not _operators.is_view_op(t.target):
                    for read in t.all_input_nodes:
                        if local[read] in stale:
                            made = self._regenerate(stale.pop(local[read]))
                            emitted.extend(made)
                            local[read] = made[-1]
                local[t] = new = self._emit_one(node, template, t, local, meta)
                holder = self._symbol_holder(new)
                if holder is not None:
                    new.args = holder
                elif place:
                    self._place_size(new)
                emitted.append(new)
                self._track_stale(new, stale)
                if isinstance(val, torch.SymInt) and not self.views.replaying:
                    self.view_sizes.setdefault(node, {}).setdefault(val.node.expr, new)
        if any(isinstance(n, torch.fx.Node) and n in stale for n in _tensors.tree_leaves(result)):
            raise Fallback(
                f"the decomposition of {node.name} returns a view of a tensor written back"
            )
        return result, emitted

    def _emit_one(
        self,
        node: torch.fx.Node,
        template: Any,
        t: torch.fx.Node,
        local: dict[torch.fx.Node, Any],
        meta: dict[str, Any],
    ) -> torch.fx.Node:
        """One node of a template, with the meta of the node it rewrites."""
        args_t = torch.fx.node.map_arg(t.args, lambda n: local[n])
        kwargs_t = torch.fx.node.map_arg(t.kwargs, lambda n: local[n])
        # Containers of its own, as the tracer copies each field it carries over:
        # the output goes to code that may edit them (docs/concepts.md, ownership).
        new = self._emit(t.target, args_t, kwargs_t, t.name, _program.copy_meta(meta))
        for field in template.inherited[t]:
            if field in node.meta:
                new.meta[field] = _program.copy_meta(node.meta[field])
        for field, value in template.own[t].items():
            new.meta[field] = value if field == "original_aten" else copy.copy(value)
        if "stack_trace" not in meta and t.meta.get("stack_trace"):
            # The node had no stack trace of its own (a region): the tracer recorded
            # the frames it ran in, the body's code.
            new.meta["stack_trace"] = t.meta["stack_trace"]
        if t.meta.get("custom"):
            # Annotations made while the decomposition ran (torch's dynamo
            # guard on a decomposition records itself here).
            new.meta["custom"] = _program.copy_meta({**meta.get("custom", {}), **t.meta["custom"]})
        new.meta["val"] = t.meta.get("val")
        if isinstance(new.meta.get("val"), torch.SymInt):
            self._bind(new)
        return new

    def _size_made_before(self, node: torch.fx.Node, val: Any) -> torch.fx.Node | None:
        """While a chain of views is made again after a write, the node that first
        made ``node``'s size ``val`` where ``node`` was made the first time.
        Functionalization replays a view with the arguments of its first call, the
        very SymInts computed then, so the tracer reads them from the nodes that
        computed them there, and makes no new ones."""
        if not self.views.replaying or not isinstance(val, torch.SymInt):
            return None
        return self.view_sizes.get(node, {}).get(val.node.expr)

    def _symbol_holder(self, new: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
        """For a template's query of a size that is an input's symbol, the input and
        dimension holding it first: the tracer reads a symbol from the first tensor it
        saw hold it, never from the tensor the decomposition asks, and so leaves that
        tensor dead where nothing else reads it (a view made again after a write).
        The runtime-assertion pass binds the symbol after the placeholders."""
        if new.target is not torch.ops.aten.sym_size.int:
            return None
        return self.symbols.get(self._expr(new.meta.get("val")))

    def _place_size(self, new: torch.fx.Node) -> None:
        """Put a template's query of a new size of an intermediate where the retrace's
        trace makes it: make_fx gives each symbolic size of an operator's result a
        lazy ``sym_size`` node, and wrapping the result as a functional tensor compares
        its sizes (its contiguity), which makes that node at once, after the operator
        and with its meta. A decomposition reading the size later reads that node; the
        runtime-assertion pass turns it into arithmetic on the inputs' sizes there.

        Raises:
            Fallback: where the node making the size is not certain.
        """
        if new.target is not torch.ops.aten.sym_size.int:
            return
        inp, dim = new.args
        if not isinstance(inp, torch.fx.Node) or inp.op == "placeholder":
            return
        found = self._origin(inp, dim, new.name)  # type: ignore[arg-type]
        if found is None:
            return
        safety.exact_here("a size query placed where the retrace makes it")
        origin, dim = found
        new.args = (origin, dim)  # the trace asks the node that made the size
        after = origin
        # The comparisons run from the last dimension; a decomposition's own result
        # makes its sizes from the first.
        descending = origin in self.copied
        while after.next in self.placed and self.placed[after.next][0] is origin:
            placed_dim = self.placed[after.next][1]
            if (placed_dim < dim) if descending else (placed_dim > dim):
                break
            after = after.next
        after.append(new)
        self.placed[new] = (origin, dim)
        meta = {k: origin.meta[k] for k in _CARRIED_META if k in origin.meta}
        for k in _CARRIED_META:
            new.meta.pop(k, None)
        new.meta.update(_program.copy_meta(meta))

    def _origin(self, inp: torch.fx.Node, dim: int, name: str) -> tuple[torch.fx.Node, int] | None:
        """The node whose result first holds the very SymInt that is size ``dim`` of
        ``inp``'s value (meta functions pass a size on by identity, or compute it
        anew), and the last dimension holding it there (the first compared): the
        operators from the first ancestor holding its expression to ``inp`` run
        again as the retrace runs them."""
        expr = self._expr(sizes.size_of(inp.meta.get("val"), dim))
        if expr is None or expr.is_Symbol:
            # The runtime-assertion pass binds a symbol after the placeholders,
            # wherever its query was.
            return None
        return sizes.origin(
            inp,
            dim,
            expr,
            lambda n, args, kwargs: self._value(
                name,
                lambda: n.target(*keys.values_of(args), **keys.values_of(kwargs)),
            ),
            self.copied,
        )

    def _bind(self, new: torch.fx.Node) -> None:
        """Record the size ``new`` computes; the retrace merges it into an earlier
        node computing the same expression (``sizes.drop_dead``)."""
        expr = self._expr(new.meta.get("val"))
        if expr is None:
            return
        existing = self.sizes.setdefault(expr, new)
        if existing is not new:
            self.merged[new] = existing

    def _written(self, node: torch.fx.Node, writes: bool = True) -> list[torch.fx.Node]:
        """``node`` and, for an in-place node, every alias of what it writes (the
        tensor and the in-place results before it): ``safety.unsafe_reason`` took
        only writes into intermediates that no view reads afterwards."""
        at = safety.written_argument(node.target)
        if at is None:
            return [node]
        written = safety.argument(node, at)
        chain = [*self.chains.get(written, [written]), node]
        for alias in chain:
            self.chains[alias] = chain
        if writes:
            self.views.written(chain[0])
        return chain


def decompose(
    ep: ExportedProgram,
    tables: table.Tables,
    limit: int | None = None,
) -> tuple[ExportedProgram, int]:
    """The program ``ep.run_decompositions`` would produce, by rewriting only the nodes
    the table decomposes. Returns it and the number of nodes rewritten.

    ``limit``: splice only the first ``limit`` nodes that would be spliced (in graph
    order) and copy the others as they are (``Decompose(max_rewrites=...)``).

    Raises:
        Fallback: when the result could differ from torch's; ``reason`` says why.

    Holds :data:`state.LOCK` throughout, with the garbage collector paused
    (:func:`_heap.collector_paused`).
    """
    with state.LOCK, _heap.collector_paused():
        session = templates.Session(tables)
        try:
            result = _decompose(ep, tables, session, limit)
            if session.watch is not None:  # made as the build began
                session.watch.verify("the decomposition")
            return result
        finally:
            session.close()
            disk.prune_soon()


def _decompose(
    ep: ExportedProgram, tables: table.Tables, session: templates.Session, limit: int | None
) -> tuple[ExportedProgram, int]:
    plan = safety.check(ep, tables)
    if plan.reason is not None:
        raise Fallback(plan.reason)
    fake_mode = keys.fake_mode_of(ep)
    with quiet.leaf_specs():  # ep.module() deep-copies the call graph
        shapes.run_guards(ep)
    session.program = ep
    session.grads = safety.retrace_grads(ep)
    builder = _Builder(tables, fake_mode, session, plan, ep.graph, limit)
    inputs = signature.retrace_inputs(ep)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for old_spec, new_spec in inputs:
        builder.placeholder(placeholders[old_spec.arg.name], new_spec.arg.name)
    _walk(builder, ep.graph)
    graph = builder.graph
    out_node = graph.output_node()
    for leaf in _tensors.tree_leaves(out_node.args[0]):
        if not isinstance(leaf, torch.fx.Node):
            raise Fallback("an output became a constant")
    sizes.drop_dead(graph, builder.merged, builder.copied)
    live = set(graph.nodes)
    for again in builder.written_back:
        # Read only by a size query the runtime-assertion pass replaced: the retrace's
        # trace read that size from the symbol it tracks, and lost the view as dead.
        if again in live and not again.users:
            graph.erase_node(again)
    gm = _program.graph_module_without_code(graph)
    gm.meta.update(_program.copy_meta(ep.graph_module.meta))
    _lease.note_built(graph)
    if builder.new_sizes:
        with builder.watch.retrace("the runtime-assertion pass"):
            sizes.rebind_sizes(gm, fake_mode)
    traced = {builder.env[placeholders[name]]: t for name, t in safety.state_tensors(ep).items()}
    _set_tensor_meta(graph, {builder.env[placeholders[name]] for name in session.grads}, traced)
    new_signature = signature.retrace_signature([new for _, new in inputs], ep.graph_signature, gm)
    module_call_graph = programs.updated_module_call_graph(ep, gm, new_signature)
    # A retrace's program: a new state_dict over the same tensors, the constants
    # dict itself, and the ATEN dialect's verifier.
    out = _program.new_program(
        ep,
        gm,
        new_signature,
        dict(ep.state_dict),
        ep.constants,
        module_call_graph=module_call_graph,
        keep_dialect=False,
    )
    builder.settled.finish()
    return out, builder.decomposed


def _set_tensor_meta(
    graph: torch.fx.Graph, grads: set[torch.fx.Node], traced: dict[torch.fx.Node, torch.Tensor]
) -> None:
    """Give every node whose value is a tensor the ``tensor_meta`` the retrace's tracer
    gives it, and no other node any (a program loaded from a file has none; consumers
    read it: OpenVINO takes input types from it).

    The retrace traces fakes of the state tensors themselves (``traced``), and the
    other values as they are now, under ``no_grad``: only the placeholders in
    ``grads`` require grad there. Then it puts back on each parameter and buffer
    placeholder the meta the program recorded for it, ``tensor_meta`` included
    where it had one: that one is kept as copied.
    """
    for node in graph.nodes:
        if node in traced and "tensor_meta" in node.meta:
            continue
        value = traced.get(node, node.meta.get("val"))
        if isinstance(value, torch.Tensor) and not value.is_sparse:
            meta = fakes.tensor_metadata(value)
            node.meta["tensor_meta"] = meta._replace(requires_grad=node in grads)
        else:
            node.meta.pop("tensor_meta", None)


def _walk(builder: _Builder, old_graph: torch.fx.Graph) -> None:
    """Copy every node after the placeholders into ``builder``, splicing templates in."""
    for node in old_graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            # Functionalization syncs each returned view of a tensor written in place.
            builder.views.refresh(node)
            out = torch.fx.node.map_arg(node.args, lambda n: builder.env[n])
            builder.graph.output(out[0])
            continue
        builder.emit_node(node)

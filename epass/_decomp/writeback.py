"""Writes through views, as the retrace's functionalization makes them: an in-place
write through a chain of views of an intermediate written back through each view's
inverse, and a write into a view a decomposition returned written back into what it
views. A mixin of the splice's builder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from epass import _operators
from epass._decomp import keys, propagation, safety, table, templates, tracing, views
from epass._decomp.safety import Fallback, View
from epass._decomp.views import Prefix

__all__ = ["CARRIED_META", "INVERSES", "VIEWS", "WriteBack"]

# Node meta the retrace carries from an original node onto the nodes it becomes.
CARRIED_META = ("stack_trace", "nn_module_stack", "custom")

_ATEN_VIEW = torch.ops.aten.view.default
# The view operators a write into a decomposition's result is written back through.
VIEWS = frozenset({_ATEN_VIEW})

_aten = torch.ops.aten
_Shape = Callable[[torch.fx.Node], list[Any]]
_Inverse = Callable[
    [torch.fx.Node, torch.fx.Node, tuple[Any, ...], _Shape], tuple[Any, tuple[Any, ...]]
]


def _scatter(op: Any) -> _Inverse:
    return lambda below, back, rest, shape: (op, (below, back, *rest))


def _permute_back(
    below: torch.fx.Node, back: torch.fx.Node, rest: tuple[Any, ...], shape: _Shape
) -> tuple[Any, tuple[Any, ...]]:
    dims = [d % len(rest[0]) for d in rest[0]]
    return _aten.permute.default, (back, [dims.index(i) for i in range(len(dims))])


# Each view operator a write may go through, as functionalization sees it, and how
# functionalization writes the view's new value back into the tensor below it
# (``FunctionalInverses``): the operator and its arguments, given the tensor below,
# the new value, the view's own arguments and the shape of a node as view arguments.
INVERSES: Mapping[Any, _Inverse] = {
    _aten.alias.default: lambda below, back, rest, shape: (_aten.alias.default, (back,)),
    _aten.slice.Tensor: _scatter(_aten.slice_scatter.default),
    _aten.select.int: _scatter(_aten.select_scatter.default),
    _aten.diagonal.default: _scatter(_aten.diagonal_scatter.default),
    _ATEN_VIEW: lambda below, back, rest, shape: (_ATEN_VIEW, (back, shape(below))),
    _aten._unsafe_view.default: lambda below, back, rest, shape: (
        _aten._unsafe_view.default,
        (back, shape(below)),
    ),
    _aten.permute.default: _permute_back,
    _aten.unsqueeze.default: lambda below, back, rest, shape: (
        _aten.squeeze.dim,
        (back, rest[0]),
    ),
    _aten.transpose.int: lambda below, back, rest, shape: (_aten.transpose.int, (back, *rest)),
    _aten.t.default: lambda below, back, rest, shape: (_aten.t.default, (back,)),
}
# The view operators a link of such a chain may be made as: one of them, applied to
# what the link views (``transpose`` as the table makes it: a ``permute``).
_MADE = frozenset(INVERSES) - {_aten.transpose.int, _aten.t.default, _aten._unsafe_view.default}


_BY_NAME = {op.name(): op for op in INVERSES}


def _seen(made: torch.fx.Node) -> Any:
    """The view operator functionalization saw where a decomposition made ``made``:
    the one its ``original_aten`` names (a template's meta may hold a copy of the
    operator object, so by name), else its own."""
    aten = made.meta.get("original_aten")
    return _BY_NAME.get(aten.name() if _operators.is_op_overload(aten) else None, made.target)


def _like(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether two nodes' values have the same shape, strides and dtype."""
    return bool(keys.describe_val(a.meta.get("val")) == keys.describe_val(b.meta.get("val")))


class WriteBack:
    """The builder's write-back methods; the builder provides the rest."""

    if TYPE_CHECKING:
        env: dict[torch.fx.Node, Any]
        changed: set[torch.fx.Node]
        chains: dict[torch.fx.Node, list[torch.fx.Node]]
        sizes: dict[Any, torch.fx.Node]
        through: Mapping[torch.fx.Node, torch.fx.Node]
        views: views.Views
        view_bases: dict[torch.fx.Node, torch.fx.Node]
        view_chains: set[torch.fx.Node]
        copied: set[torch.fx.Node]
        written_back: dict[torch.fx.Node, torch.fx.Node]
        tables: table.Tables
        fake_mode: Any
        session: templates.Session

        def _emit(
            self, target: Any, args: Any, kwargs: Any, name: str, meta: dict[str, Any]
        ) -> torch.fx.Node: ...

        new_sizes: bool

        def _value(self, name: str, compute: Any) -> Any: ...

        def _bind(self, new: torch.fx.Node) -> None: ...

        def _emit_template(
            self, node: torch.fx.Node, template: Any, inputs: list[torch.fx.Node]
        ) -> tuple[Any, list[torch.fx.Node]]: ...

    def _write_back(self, node: torch.fx.Node, result: torch.fx.Node) -> None:
        """``node`` wrote ``result`` through a chain of views of an intermediate: as
        functionalization, the views above the last are made again on the tensor's
        value, each view's inverse writes the result back into the one below, down to
        the tensor, and the chain is made again on the tensor's new value, all with
        ``node``'s meta. Other views of the tensor are made again where next read."""
        view = self.through[node]
        info = self.views.views[view]
        if len(info.chain) > 1:
            safety.exact_here("a write through a chain of views")
        owner = info.owner
        prefix = self.views.prefixes.get(owner)
        made = self.env[owner]
        if prefix is None and (made in self.view_bases or made in self.view_chains):
            prefix = self.views.prefixes[owner] = self._prefix(node, owner)
        steps = [] if prefix is None else list(prefix.steps)
        steps.extend(self._steps(info))
        under = [self.env[owner] if prefix is None else prefix.base]
        for target, rest in steps[:-1]:
            under.append(self._emit_traced(node, target, (under[-1], *rest)))
        back = result
        for (target, rest), below in zip(reversed(steps), reversed(under), strict=True):
            inverse, args = INVERSES[target](below, back, rest, self._shape_of)
            back = self._emit_traced(node, inverse, args)
        again = back
        made_again = []
        for target, rest in steps:
            again = self._emit_traced(node, target, (again, *rest))
            made_again.append(again)
        self.env[view] = self.env[node] = again
        value = back
        if prefix is not None:
            # The tensor is that view, made again where next read (``views``).
            prefix.base, value = back, made_again[len(prefix.steps) - 1]
        for alias in self.chains.get(owner, [owner]):
            # The tensor and the in-place results aliasing it read the new value.
            self.env[alias] = value
            if not propagation.same_meta(value.meta["val"], alias.meta.get("val")):
                self.changed.add(alias)
        self.views.written(owner)
        self.views.synced_now(view, node)

    def _prefix(self, node: torch.fx.Node, owner: torch.fx.Node) -> Prefix:
        """The views a decomposition made ``owner`` of a tensor of its own (matmul's
        of its bmm): the retrace writes back through them into that tensor as well,
        and reads ``owner`` made again from there after the write."""
        made = [self.env[owner]]
        while made[0].target in _MADE and isinstance(made[0].args[0], torch.fx.Node):
            below = made[0].args[0]
            if below.target not in _MADE or below in self.copied:
                break
            made.insert(0, below)  # the decomposition's chain of views
        base = made[0].args[0]
        if made[0].target not in _MADE or not isinstance(base, torch.fx.Node):
            raise Fallback(
                f"a write through a view ({node.target} at {node.name}) of a tensor "
                f"its decomposition makes a view ({owner.name})"
            )
        # Each as functionalization saw it: ``_unsafe_view``, made a ``view`` by the
        # table, is replayed and inverted as itself.
        return Prefix([(_seen(v), tuple(v.args[1:])) for v in made], base, made)

    def _steps(self, info: View) -> list[tuple[Any, tuple[Any, ...]]]:
        """Each view of ``info``'s chain as functionalization sees it, with its own
        arguments."""
        steps = []
        for link in info.chain:
            made, viewed = self.env[link], link.args[0]
            if not isinstance(made, torch.fx.Node) or not isinstance(viewed, torch.fx.Node):
                raise Fallback(f"a write through a view the table rewrites ({link.name})")
            if table.is_cia(link.target) and made.target not in _MADE and _like(made, viewed):
                continue  # made as the tensor itself (``flatten`` of one dimension)
            below = made.args[0] if made.args else None
            if (
                made.target not in _MADE
                or not isinstance(below, torch.fx.Node)
                or not _like(below, viewed)
            ):
                # The decomposition made something other than one invertible view of
                # what the link views.
                raise Fallback(f"a write through a view the table rewrites ({link.name})")
            if table.is_cia(link.target):
                # Decomposed before functionalization: it sees the view made.
                steps.append((made.target, tuple(made.args[1:])))
            else:
                mapped = torch.fx.node.map_arg((link.args, link.kwargs), self.env.__getitem__)
                args, _ = keys.normalize(link.target, mapped[0], dict(mapped[1]))
                steps.append((link.target, tuple(args[1:])))
        return steps

    def _record_view(self, result: Any, emitted: list[torch.fx.Node]) -> None:
        """Where a decomposition returns a ``view`` of a tensor it made itself (``linear``
        of a 3-d input: a view of its ``addmm``), remember that tensor: an in-place
        write into the view is written back into it (``_write_into_view``)."""
        if not isinstance(result, torch.fx.Node) or result.target not in VIEWS:
            return
        base = result.args[0]
        if (
            isinstance(base, torch.fx.Node)
            and base in emitted
            and base.target not in VIEWS
            and not _operators.is_view_op(base.target)
        ):
            self.view_bases[result] = base
        elif isinstance(base, torch.fx.Node) and base in emitted and base.target in _MADE:
            # A chain of views (einsum's): written back through as a chain (``_prefix``).
            self.view_chains.add(result)

    def _into_view(
        self, node: torch.fx.Node, args: Any
    ) -> tuple[torch.fx.Node, torch.fx.Node] | None:
        """For an in-place ``node`` writing into a tensor that is a view in the new graph,
        the view's base and the view; None where it writes into no view.

        Raises:
            Fallback: where the write cannot be written back as functionalization does.
        """
        at = safety.written_argument(node.target)
        if at is None or at >= len(args):
            return None
        written = args[at]
        if not isinstance(written, torch.fx.Node) or written.op != "call_function":
            return None
        schema = _operators.op_schema(written.target)
        if written.target not in table.EMITTED_AS_ITSELF and (
            # functionalization records such an operator's output as a view
            schema is None or not any(r.alias_info is not None for r in schema.returns)
        ):
            return None
        refused = (
            f"a write ({node.target} at {node.name}) into a tensor its decomposition "
            f"makes a view ({written.target})"
        )
        base = self.view_bases.get(written)
        if base is None or list(base.users) != [written]:
            raise Fallback(refused)
        owner = safety.argument(node, at)
        aliases = self.chains.get(owner, [owner])
        viewed = {v for v, info in self.views.views.items() if info.owner in aliases}
        # A view read only before the write (timm's MViT-v2 adds to a view of its
        # attention, then copies the sum back) is never synced: functionalization
        # makes nothing of it.
        read_after = sorted(v.name for v in viewed if _read_after(v, node, viewed))
        if read_after:
            raise Fallback(
                f"{refused}, of a tensor the program views and reads after it "
                f"({', '.join(read_after)})"
            )
        return base, written

    def _write_into_view(
        self, node: torch.fx.Node, result: Any, into: tuple[torch.fx.Node, torch.fx.Node]
    ) -> torch.fx.Node:
        """As functionalization writes ``node``'s ``result`` into a view of ``base``:
        ``view`` of the result back to the base's shape (the new base), and the view
        made again on it, both with ``node``'s meta and the view's ``original_aten``.
        Returns the view made again, which later reads read."""
        safety.exact_here("a write into a view a decomposition returns")
        base, view = into
        if not isinstance(result, torch.fx.Node):
            raise Fallback(f"the decomposition of {node.target} returned no node of its own")
        back = self._emit_like(node, _ATEN_VIEW, (result, self._shape_of(base)))
        again = self._emit_like(node, _ATEN_VIEW, (back, *view.args[1:]))
        for new in (back, again):
            new.meta["original_aten"] = view.meta.get("original_aten", view.target)
        self.view_bases[again] = back
        self.written_back[again] = back
        return again

    def _shape_of(self, base: torch.fx.Node) -> list[Any]:
        """The shape of ``base``'s value as ``view`` arguments: each symbolic size as
        the node that computes it, as the trace passes ``base.sym_sizes()``.

        Raises:
            Fallback: where the graph has no node for a size.
        """
        shape: list[Any] = []
        for dim, size in enumerate(base.meta["val"].shape):
            if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                bound = self.sizes.get(size.node.expr)
                if bound is None and size.node.expr.is_Symbol:
                    # The trace reads a symbol's size from the tensor; the
                    # runtime-assertion pass binds it after the placeholders.
                    bound = self._emit(_aten.sym_size.int, (base, dim), {}, "sym_size_int", {})
                    bound.meta["val"] = size
                    self._bind(bound)
                    self.new_sizes = True
                if bound is None:
                    raise Fallback(f"a write back into {base.name}: no node for its size {size}")
                shape.append(bound)
            else:
                shape.append(int(size))
        return shape

    def _emit_traced(self, node: torch.fx.Node, op: Any, args: tuple[Any, ...]) -> Any:
        """A view or a view's inverse that functionalization calls for ``node``'s
        write-back, or its decomposition where the table rewrites it
        (``select_scatter`` and ``transpose`` in torch's default table)."""
        if op in views.REPLAYED_AS:
            # Functionalization replays it as a plain view, under its own name.
            new = self._emit_like(node, views.REPLAYED_AS[op], args)
            new.meta["original_aten"] = op
            return new
        if not table.rewrites(op, self.tables):
            return self._emit_like(node, op, args)
        args, kwargs = keys.normalize(op, args, {})
        template, inputs = templates.find(
            op, args, kwargs, self.tables, self.fake_mode, self.session
        )
        result, _ = self._emit_template(node, template, inputs)
        if not isinstance(result, torch.fx.Node):
            raise Fallback(f"the decomposition of {op} returned no node of its own")
        return result

    def _emit_like(self, node: torch.fx.Node, target: Any, args: tuple[Any, ...]) -> torch.fx.Node:
        """A view operator (or its inverse) emitted with ``node``'s meta, as the trace
        records one it makes while running ``node``."""
        meta = {k: node.meta[k] for k in (*tracing.INHERITED_META, *CARRIED_META) if k in node.meta}
        meta["original_aten"] = target
        new = self._emit(target, args, {}, target.overloadpacket.__name__, meta)
        new.meta["val"] = self._value(new.name, lambda: target(*keys.values_of(args)))
        return new

    def _track_stale(self, new: torch.fx.Node, stale: dict[torch.fx.Node, Any]) -> None:
        """A view (any view operator) a decomposition makes of a view written back
        (``_write_into_view``), or of such a view: stale, as functionalization holds
        it. Its first read (by no view) reads it made again from the new base
        (``_regenerate``); the views first made are left dead, as the trace leaves
        them."""
        if not _operators.is_view_op(new.target) or not isinstance(new.args[0], torch.fx.Node):
            return
        parent = new.args[0]
        if parent in self.written_back:
            stale[new] = [parent, new]
        elif parent in stale:
            stale[new] = [*stale.pop(parent), new]

    def _regenerate(self, chain: list[torch.fx.Node]) -> list[torch.fx.Node]:
        """The views of ``chain`` (a view written back, then views of it a decomposition
        made) made again on the new base, with the meta of the last."""
        like = chain[-1]
        value = self.written_back[chain[0]]
        made = []
        for view in chain:
            meta = {k: v for k, v in like.meta.items() if k != "val"}
            # The view written back again keeps the name functionalization saw it
            # under (``_unsafe_view``); the decomposition's views their own.
            meta["original_aten"] = (
                view.meta.get("original_aten", view.target) if view is chain[0] else view.target
            )
            args, kwargs = (value, *view.args[1:]), dict(view.kwargs)
            value = self._emit(view.target, args, kwargs, view.target.overloadpacket.__name__, meta)
            value.meta["val"] = self._value(
                value.name,
                lambda a=args, k=kwargs, v=view: v.target(*keys.values_of(a), **keys.values_of(k)),
            )
            made.append(value)
        return made


def _read_after(view: torch.fx.Node, write: torch.fx.Node, views: set[torch.fx.Node]) -> bool:
    """Whether an operator other than the views ``views`` reads ``view`` after ``write``
    (the program's order), or the program returns it."""
    return any(user not in views and (user.op == "output" or user > write) for user in view.users)

"""Views of tensors written in place, regenerated as the retrace's functionalization
regenerates them.

A view of a tensor that has been written in place holds the tensor's value at the
time it was last synced. Functionalization regenerates it, replaying its whole chain
of view operators on the tensor's current value (through a view written through, for a
view of what that write returned), where it is next used after a write: read by an
operator that is not a view, or viewed again. A view made after a write is regenerated
at its first use, and the node made when it was created is left dead. The regenerated
nodes carry the using node's ``nn_module_stack`` and ``torch_fn``, the stack trace of
the view they replay, every link of its chain alike (of the write, for a view written
through), and the ``original_aten`` of the node they make again: the view operator, or
the operator a decomposition made it for (``split`` for the ``split_with_sizes`` of its
template).

A view a decomposition makes of such a tensor is regenerated the same way, where an
operator of that decomposition that is not a view first reads it (:meth:`Views.place`).

One concept: a view's life after an in-place write, from its creation to each
regeneration.
"""

from __future__ import annotations

import collections
import copy
import operator
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from epass import _operators, _tensors
from epass._decomp import keys
from epass._decomp.safety import Fallback, View, exact_here
from epass._decomp.table import SIZE_OPS

__all__ = ["REPLAYED_AS", "Regenerated", "Views"]

# Views functionalization replays (and inverts) as another view operator.
REPLAYED_AS = {torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default}

# The reader's fields a regenerated view takes.
_READER_META = ("nn_module_stack", "torch_fn")


class _Builder(Protocol):
    graph: torch.fx.Graph
    env: dict[torch.fx.Node, Any]
    changed: set[torch.fx.Node]
    chains: dict[torch.fx.Node, list[torch.fx.Node]]
    merged: dict[torch.fx.Node, torch.fx.Node]

    def _emit(
        self, target: Any, args: Any, kwargs: Any, name: str, meta: dict[str, Any]
    ) -> torch.fx.Node: ...

    def _value(self, name: str, compute: Any) -> Any: ...


class Regenerated:
    """The nodes one regeneration emitted, the value they give and the program's
    node they make again (None: a tensor made again, see :class:`Prefix`)."""

    def __init__(
        self, nodes: list[torch.fx.Node], value: torch.fx.Node, view: torch.fx.Node | None = None
    ) -> None:
        self.nodes = nodes
        self.value = value
        self.view = view


class Prefix:
    """A tensor written in place that is itself a view its decomposition made of a
    tensor of its own (matmul's ``view`` of its ``bmm``, einsum's views): functionalization
    writes back through those views into ``base`` and makes the tensor again from
    ``base`` where next read, each view of it too."""

    def __init__(
        self,
        steps: list[tuple[Any, tuple[Any, ...]]],
        base: torch.fx.Node,
        made: list[torch.fx.Node],
    ) -> None:
        self.steps = steps  # each view operator and its own arguments
        self.base = base  # what the first views now
        self.made = made  # the views as the decomposition made them (their meta)
        self.synced = 0  # the writes the tensor's value has seen


class Views:
    """Which views of tensors written in place hold a stale value, and their
    regeneration. ``emit`` copies or splices one node of the program, as the
    builder does."""

    def __init__(
        self,
        views: Mapping[torch.fx.Node, View],
        through: Mapping[torch.fx.Node, torch.fx.Node],
        builder: _Builder,
        emit: Callable[[torch.fx.Node], None],
    ) -> None:
        self.views = views
        self.through = through  # a write through a view -> that view (its result)
        self.builder = builder
        self.emit = emit
        self.generation: dict[torch.fx.Node, int] = {}  # owner -> writes so far
        self.synced: dict[torch.fx.Node, int] = {}  # view -> generation it holds
        self.copies: set[torch.fx.Node] = set()  # "views" whose nodes copy (reshape)
        self.writers: dict[torch.fx.Node, torch.fx.Node] = {}  # view -> last write through it
        self.prefixes: dict[torch.fx.Node, Prefix] = {}  # owner -> see Prefix
        self.remade: set[torch.fx.Node] = set()  # such tensors made again for a reader
        # A size a view made after a write computes of its own -> those views: the
        # retrace makes the size's node at once on the view it made then, which the
        # view made again at its first read replaces; a decomposition reading that
        # size keeps the first view in the graph, dead (see ``read_size``).
        self.own_sizes: dict[Any, list[torch.fx.Node]] = {}
        self.carriers: dict[tuple[torch.fx.Node, Any], set[torch.fx.Node]] = {}
        self.replaying = 0  # chains of views being made again

    def written(self, owner: torch.fx.Node) -> None:
        """A write into ``owner``: its views hold the value before it."""
        self.generation[owner] = self.generation.get(owner, 0) + 1

    def synced_now(self, view: torch.fx.Node, writer: torch.fx.Node) -> None:
        """``view`` was just made again on its tensor's current value, after the write
        ``writer`` through it: where it is made again later, its nodes carry
        ``writer``'s stack trace."""
        info = self.views[view]
        self.synced[view] = self.generation.get(info.owner, 0)
        self.writers[view] = writer

    def created(self, view: torch.fx.Node) -> None:
        """``view`` was just copied or spliced where the program makes it."""
        if self.replaying:
            return  # a link of a chain made again, not the view the program takes
        info = self.views[view]
        if any(w in self.copies for w in info.chain[:-1]) or not self._is_view(view, info):
            # A copy (a reshape that copies), or a view of one: never stale.
            self.copies.add(view)
            self.synced.pop(view, None)
            return
        generation = self.generation.get(info.owner, 0)
        if generation:
            for expr in _own_sizes(view, self.builder.env.get(view)):
                self.own_sizes.setdefault(expr, []).append(view)
        # Made after a write, a view is regenerated at its first read.
        self.synced[view] = generation if generation == 0 else -1

    def _carriers(self, view: torch.fx.Node, expr: Any) -> set[torch.fx.Node]:
        """``view`` and the program's nodes that hold its size ``expr`` as passed on
        from it: read from it, directly or through others holding that size too."""
        found = self.carriers.get((view, expr))
        if found is None:
            found = {view}
            todo = list(view.users)
            while todo:
                node = todo.pop()
                if node not in found and expr in _exprs(node.meta.get("val")):
                    found.add(node)
                    todo.extend(node.users)
            self.carriers[(view, expr)] = found
        return found

    def read_size(self, expr: Any, reader: torch.fx.Node) -> None:
        """``reader`` reads the size ``expr``.

        Raises:
            Fallback: where ``expr`` is a size a view made after a write computes and
                ``reader`` reads it from that view (or from a node it passed the size
                on to). A tensor of that size made otherwise has its own (Mixtral's
                sorted expert indices, beside the view of its routing weights).
        """
        for view in self.own_sizes.get(expr, ()):
            if not self._carriers(view, expr).isdisjoint(reader.all_input_nodes):
                raise Fallback(
                    f"{reader.name} reads a size ({expr}) that a view ({view.name}) of a "
                    "tensor written in place, made after the write, computes"
                )

    def refresh(self, reader: torch.fx.Node) -> list[Regenerated]:
        """Regenerate every view ``reader`` reads that is stale, before ``reader``; a
        view ``reader`` itself syncs what it views and is made again where read."""
        if reader in self.views and self.replaying:
            return []  # a link of a chain made again: on what it views now
        if reader in self.views:
            # Taking a view syncs what it views: functionalization makes a view of a
            # tensor written in place again here (dead unless read later), and so a
            # tensor made again from what its decomposition views.
            for read in reader.all_input_nodes:
                self._sync(read, reader)
                view = self.through.get(read, read)
                info = self.views.get(view)
                if info is not None and view in self.synced and view not in self.copies:
                    generation = self.generation.get(info.owner, 0)
                    if self.synced[view] != generation:
                        self._regenerate(view, info, reader)
                        self.synced[view] = generation
            return []  # a view itself: made again where it is read
        done = []
        for read in reader.all_input_nodes:
            chain = self.builder.chains.get(read)
            owner = chain[0] if chain is not None else read
            if owner in self.prefixes and read not in self.views:
                done.extend(self._sync(read, reader))
                continue
            # What a write through a view returns is that view: made again with it.
            view = self.through.get(read, read)
            info = self.views.get(view)
            if info is None or view not in self.synced:
                continue
            generation = self.generation.get(info.owner, 0)
            if self.synced[view] != generation:
                done.append(self._regenerate(view, info, reader))
                self.synced[view] = generation
            if view is not read:
                self.builder.env[read] = self.builder.env[view]
        return done

    def place(
        self,
        reader: torch.fx.Node,
        regenerated: list[Regenerated],
        emitted: list[torch.fx.Node],
        result: Any,
    ) -> None:
        """Put the nodes a decomposition of ``reader`` made (``emitted``, returning
        ``result``) where the retrace's functionalization makes them, for the tensors
        it reads whose memory was written in place: a view such a decomposition makes
        of one is made again where something that is not a view first reads it, and a
        view regenerated for ``reader`` is made there too, just before the views made
        of it.

        Raises:
            Fallback: where views of such a tensor are read in a way this does not
                follow (read both as they are and through a view, or by nothing that
                is not a view).
        """
        fresh = {r.value: r.nodes for r in regenerated}
        views_of = {r.value: r.view for r in regenerated}
        replayed = [] if reader in self.views else self._replay_viewed(reader, emitted, fresh)
        fresh.update((r.value, r.nodes) for r in replayed)
        roots = dict(fresh)
        for read in reader.all_input_nodes:
            value = self.builder.env.get(read)
            if isinstance(value, torch.fx.Node) and value not in roots and self._stale(read):
                roots[value] = []
        if reader in self.views:
            roots = fresh  # a view itself: regenerated where it is read (refresh)
        moves: dict[torch.fx.Node, list[tuple[torch.fx.Node, list[torch.fx.Node]]]] = {}
        returned = set(_tensors.tree_leaves(result))
        for root, nodes in roots.items():
            for first, end, made in _views_of(root, emitted, returned, root in fresh):
                moves.setdefault(first, []).append((end, nodes + made))
                if made and root in self.remade:
                    raise Fallback(
                        f"the decomposition of {reader.name} views a tensor made again "
                        "from what its own decomposition views, after a write through it"
                    )
                if made and root in fresh:
                    view = views_of.get(root)
                    if view is not None and any(user is not reader for user in view.users):
                        # torch makes it again twice then: for the decomposition, and
                        # as the view itself for its later reads.
                        raise Fallback(
                            f"a view ({view.name}) of a tensor written in place, made again "
                            f"where the decomposition of {reader.name} views it, is read again"
                        )
                    # Made again where the decomposition views it: inside the
                    # reader's call, with its stack trace.
                    for node in nodes:
                        _take_stack_trace(node, reader)
        for first, placed in moves.items():
            self._unbind_sizes(first, {n for _, nodes in placed for n in nodes}, emitted)
            # Read in argument order, each made again just before the reader.
            order = first.all_input_nodes
            for _, nodes in sorted(placed, key=lambda item: order.index(item[0])):
                for made in nodes:
                    first.prepend(made)

    def _replay_viewed(
        self,
        reader: torch.fx.Node,
        emitted: list[torch.fx.Node],
        fresh: Mapping[torch.fx.Node, list[torch.fx.Node]],
    ) -> list[Regenerated]:
        """A view of a tensor written in place that ``reader`` reads as it is now
        (synced after a write through it), and that ``reader``'s decomposition views:
        functionalization replays its chain from the tensor for those views, inside
        the reader's call; the view itself keeps its value for other reads.

        Raises:
            Fallback: where the decomposition also reads that view as it is.
        """
        env = self.builder.env
        done = []
        for read in reader.all_input_nodes:
            view = self.through.get(read, read)
            info = self.views.get(view)
            value = env.get(read)
            if (
                info is None
                or view in self.copies
                or not self.generation.get(info.owner, 0)
                or self.synced.get(view) != self.generation[info.owner]
                or not isinstance(value, torch.fx.Node)
                or value in fresh
            ):
                continue
            users = [n for n in emitted if value in n.all_input_nodes and n.target not in SIZE_OPS]
            viewing = [n for n in users if _operators.is_view_op(n.target) and n.args[0] is value]
            if not viewing:
                continue
            if len(viewing) != len(users):
                raise Fallback(
                    f"the decomposition of {reader.name} reads a view ({view.name}) of a "
                    "tensor written in place both as it is and through views of it"
                )
            again = self._regenerate(view, info, reader)
            env[view] = env[read] = value  # other reads still see it as it is
            for n in viewing:
                n.replace_input_with(value, again.value)
            done.append(Regenerated(again.nodes, again.value))
        return done

    def _unbind_sizes(
        self, first: torch.fx.Node, moving: set[torch.fx.Node], emitted: list[torch.fx.Node]
    ) -> None:
        """A size query of the decomposition, before ``first``, of a view about to be
        made again just before ``first``: the trace reads that size from the node
        that first computed it (``merged``), as the runtime-assertion pass binds it;
        bound so now, or the query would read the view before it is made."""
        for node in emitted:
            if node is first:
                return
            if node.target not in SIZE_OPS or node.args[0] not in moving:
                continue
            existing = self.builder.merged.pop(node, None)
            if existing is None:
                raise Fallback(
                    f"a decomposition reads a size ({node.name}) of a view of a tensor "
                    "written in place before the view is made again"
                )
            node.replace_all_uses_with(existing)
            node.graph.erase_node(node)

    def _sync(self, read: torch.fx.Node, reader: torch.fx.Node) -> list[Regenerated]:
        """Make ``read`` again for ``reader`` where it is a tensor written through a
        view of it and itself a view its decomposition made (:class:`Prefix`) that
        holds a value before the last write; no-op otherwise."""
        chain = self.builder.chains.get(read)
        owner = chain[0] if chain is not None else read
        prefix = self.prefixes.get(owner)
        if prefix is None or read in self.views:
            return []
        generation = self.generation.get(owner, 0)
        if prefix.synced == generation:
            return []
        made = self._remake(prefix, reader)
        if reader.op == "output":
            for node in made:
                _synced_as_the_trace_ends(node)
        for alias in chain or [read]:
            self.builder.env[alias] = made[-1]
        self.remade.add(made[-1])
        prefix.synced = generation
        return [Regenerated(made, made[-1])]

    def _stale(self, read: torch.fx.Node) -> bool:
        """Whether ``read`` (a node of the program) is a tensor written in place, or a
        view of one, read after a write: views made of it are made again where read."""
        info = self.views.get(read)
        if info is not None:
            return read not in self.copies and self.generation.get(info.owner, 0) > 0
        chain = self.builder.chains.get(read)
        owner = chain[0] if chain is not None else read  # written through a view too
        return self.generation.get(owner, 0) > 0

    def _remake(self, prefix: Prefix, reader: torch.fx.Node) -> list[torch.fx.Node]:
        """The views of ``prefix`` made again on what they view now, for ``reader``:
        with the meta of the views the decomposition made and the reader's module
        stack."""
        value, made = prefix.base, []
        for (target, rest), old in zip(prefix.steps, prefix.made, strict=True):
            args = (value, *rest)
            meta = {k: v for k, v in old.meta.items() if k != "val"}
            for field in _READER_META:
                if field in reader.meta:
                    meta[field] = copy.copy(reader.meta[field])
                else:
                    meta.pop(field, None)
            target = REPLAYED_AS.get(target, target)
            value = self.builder._emit(target, args, {}, target.overloadpacket.__name__, meta)
            value.meta["val"] = self.builder._value(
                value.name, lambda t=target, a=args: t(*keys.values_of(a))
            )
            made.append(value)
        return made

    def _is_view(self, view: torch.fx.Node, info: View) -> bool:
        """Whether the nodes made for ``view`` are view operators all the way down to
        what it views (a decomposition may copy instead: ``reshape``). A split the
        table rewrites is made as a tuple: each of its items must be."""
        env = self.builder.env
        base = info.chain[-2] if len(info.chain) > 1 else info.start
        target = env.get(base)
        made = env.get(view)
        if isinstance(target, (tuple, list)):
            # An item of a split the table rewrites: its template's item, a view of
            # what the split's own base is now.
            if made not in target:
                return False
            base = info.chain[-3] if len(info.chain) > 2 else info.start
            target = env.get(base)
        items = made if isinstance(made, (tuple, list)) else [made]
        return all(_views_down_to(item, target) for item in items)

    def _regenerate(self, view: torch.fx.Node, info: View, reader: torch.fx.Node) -> Regenerated:
        """``view`` made again for ``reader`` on what its tensor holds now: its chain of
        views replayed from the tensor, every node under one stack trace (the view's,
        or the write's for a view written through)."""
        builder = self.builder
        before = len(builder.graph.nodes)
        value = self._replay(view, info, reader)
        nodes = list(builder.graph.nodes)[before:]
        writer = self.writers.get(view)
        for node in nodes:
            if reader.op == "output":
                _synced_as_the_trace_ends(node)
                continue
            _take_stack_trace(node, writer if writer is not None else view)
            for field in _READER_META:
                if field in reader.meta:
                    node.meta[field] = copy.copy(reader.meta[field])
                else:
                    node.meta.pop(field, None)
        return Regenerated(nodes, value, view)

    def _replay(self, view: torch.fx.Node, info: View, reader: torch.fx.Node) -> torch.fx.Node:
        """Emit ``view``'s chain of views on its tensor's current value; the value."""
        if any(w.target is operator.getitem for w in info.chain):
            exact_here("an item of a split of a tensor written in place")
        builder = self.builder
        env = builder.env
        saved = {w: env.get(w) for w in (*info.chain, info.start)}
        prefix = self.prefixes.get(info.owner)
        written = self.through.get(info.start)
        if written is not None and written in self.views:
            # A view of what a write through a view returned: functionalization
            # replays it from the tensor, through the view written through.
            saved[written] = env.get(written)
            env[info.start] = self._replay(written, self.views[written], reader)
        elif prefix is not None and self.generation.get(info.owner, 0) > 0:
            # The tensor is a view of another: made again first, the chain on it.
            env[info.start] = self._remake(prefix, reader)[-1]
        parent = info.start
        self.replaying += 1
        try:
            for w in info.chain:
                # Each view emitted on the value its parent has now (propagated again).
                was_changed = parent in builder.changed
                builder.changed.add(parent)
                self.emit(w)
                if not was_changed:
                    builder.changed.discard(parent)
                parent = w
        finally:
            self.replaying -= 1
        value = env[view]
        for w, was in saved.items():
            if w is not view:
                env[w] = was
        return value


def _synced_as_the_trace_ends(node: torch.fx.Node) -> None:
    """Functionalization syncs a returned view as the trace ends, outside any module
    and operator call: the tracer's empty module stack, no stack trace, no operator."""
    node.meta.pop("stack_trace", None)
    node.meta.pop("torch_fn", None)
    node.meta["nn_module_stack"] = collections.OrderedDict()
    node.meta.pop("original_aten", None)


def _take_stack_trace(node: torch.fx.Node, source: torch.fx.Node) -> None:
    if "stack_trace" in source.meta:
        node.meta["stack_trace"] = source.meta["stack_trace"]
    else:
        node.meta.pop("stack_trace", None)


def _exprs(value: Any) -> set[Any]:
    """The symbolic sizes ``value`` holds: its shape's, or its own (a SymInt)."""
    if isinstance(value, torch.SymInt):
        return {value.node.expr}
    if isinstance(value, torch.Tensor):
        return {s.node.expr for s in value.shape if isinstance(s, torch.SymInt)}
    if isinstance(value, (tuple, list)):
        return set().union(*(_exprs(v) for v in value))
    return set()


def _own_sizes(view: torch.fx.Node, made: Any) -> list[Any]:
    """The symbolic sizes ``view``'s value computes of its own (``flatten`` of two
    dynamic dimensions: ``h*w``), not passed on from what it views."""
    if not isinstance(made, torch.fx.Node):
        return []
    val, below = made.meta.get("val"), view.args[0]
    below_val = below.meta.get("val") if isinstance(below, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(below_val, torch.Tensor):
        return []
    passed = {str(s) for s in below_val.shape}
    return [
        size.node.expr
        for size in val.shape
        if isinstance(size, torch.SymInt)
        and not size.node.expr.is_number
        and not size.node.expr.is_Symbol
        and str(size) not in passed
    ]


def _views_of(
    root: torch.fx.Node, emitted: list[torch.fx.Node], returned: set[Any], fresh: bool
) -> list[tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]]:
    """Where the views ``emitted`` makes of ``root`` are made again: for each view an
    operator that is not a view reads (first), that operator, the view, and the views
    from ``root`` to it. Nodes nothing reads and not ``returned`` are dead. ``fresh``:
    ``root`` is a view regenerated here, made again by each branch or direct read.

    Raises:
        Fallback: a view of a view already read, views branching from a view, a fresh
            ``root`` read in two ways, or a view nothing but views reads.
    """
    parent: dict[torch.fx.Node, torch.fx.Node] = {}  # a view made -> what it views
    children: dict[torch.fx.Node, int] = {}
    placed: list[tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]] = []
    read: set[torch.fx.Node] = set()  # views already read (and made again)
    direct = False  # root read as it is

    def refuse(node: torch.fx.Node) -> Fallback:
        return Fallback(
            f"a decomposition reads views of a tensor written in place in a way the "
            f"retrace makes otherwise ({node.name})"
        )

    for node in emitted:
        reads = [i for i in node.all_input_nodes if i is root or i in parent]
        if not reads or node.target in SIZE_OPS or not (node.users or node in returned):
            continue  # a size query reads no data; a dead node goes
        if _operators.is_view_op(node.target) and len(reads) == 1 and node.args[0] is reads[0]:
            base = reads[0]
            if base in read or (base is not root and children.get(base)):
                raise refuse(node)  # a view of a view already read, or a branch
            parent[node] = base
            children[base] = children.get(base, 0) + 1
            continue
        for view in node.all_input_nodes:
            if view is root:
                direct = True
            elif view in parent and view not in read:
                if children.get(view):
                    raise refuse(node)  # read before the views made of it
                chain = [view]
                while parent[chain[-1]] is not root:
                    chain.append(parent[chain[-1]])
                read.update(chain)
                placed.append((node, view, chain[::-1]))
    if fresh and (len(placed) > 1 or (placed and direct)):
        raise refuse(placed[-1][0])
    unread = [v for v in parent if v not in read and not children.get(v)]
    if unread:
        raise Fallback(
            f"a view its decomposition makes ({unread[0].name}) of a tensor written in "
            f"place is read by no operator of it"
        )
    if fresh and not placed and direct:
        # Read as it is: made again where the decomposition first reads it.
        first = next(n for n in emitted if root in n.all_input_nodes and n.target not in SIZE_OPS)
        return [(first, root, [])]
    return placed


def _views_down_to(node: Any, target: Any) -> bool:
    """Whether ``node`` is ``target`` or made from it by view operators alone (an
    item of a split counting as a view where the split is one)."""
    while isinstance(node, torch.fx.Node) and node is not target:
        if node.op != "call_function" or not (
            node.target is operator.getitem or _aliases(node.target)
        ):
            return False
        node = node.args[0] if node.args else None
    return node is target


def _aliases(target: Any) -> bool:
    schema = _operators.op_schema(target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)

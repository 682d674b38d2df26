"""Views of tensors written in place, regenerated as the retrace's functionalization
regenerates them.

A view of a tensor that has been written in place holds the tensor's value at the
time it was last synced. Functionalization regenerates it, replaying its chain of
view operators on the tensor's current value, where it is next read (by an operator
that is not itself a view) after a write; a view made after a write is regenerated
at its first read, and the node made when it was created is left dead. The
regenerated nodes carry the reading node's ``nn_module_stack`` and ``torch_fn``, the
stack trace of the view they replay (of the write, for a view written through), and the
view operator as ``original_aten``.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from epass import _program
from epass._decomp.safety import View, exact_here

__all__ = ["Regenerated", "Views"]

# The reader's fields a regenerated view takes.
_READER_META = ("nn_module_stack", "torch_fn")


class _Builder(Protocol):
    graph: torch.fx.Graph
    env: dict[torch.fx.Node, Any]
    changed: set[torch.fx.Node]


class Regenerated:
    """The nodes one regeneration emitted and the value they give."""

    def __init__(self, nodes: list[torch.fx.Node], value: torch.fx.Node) -> None:
        self.nodes = nodes
        self.value = value

    def move_before(self, node: torch.fx.Node) -> None:
        """Put the nodes just before ``node`` (inside a reader's decomposition, before
        its first use of the view)."""
        for emitted in self.nodes:
            node.prepend(emitted)


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
        info = self.views[view]
        if any(w in self.copies for w in info.chain[:-1]) or not self._is_view(view, info):
            # A copy (a reshape that copies), or a view of one: never stale.
            self.copies.add(view)
            self.synced.pop(view, None)
            return
        generation = self.generation.get(info.owner, 0)
        # Made after a write, a view is regenerated at its first read.
        self.synced[view] = generation if generation == 0 else -1

    def refresh(self, reader: torch.fx.Node) -> list[Regenerated]:
        """Regenerate every view ``reader`` reads that is stale, before ``reader``."""
        if reader in self.views:
            return []  # a view of a view: regenerated where that one is read
        done = []
        for read in reader.all_input_nodes:
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

    def _is_view(self, view: torch.fx.Node, info: View) -> bool:
        """Whether the nodes made for ``view`` are view operators all the way down to
        what it views (a decomposition may copy instead: ``reshape``)."""
        env = self.builder.env
        base = info.chain[-2] if len(info.chain) > 1 else info.start
        target = env.get(base)
        node = env.get(view)
        while isinstance(node, torch.fx.Node) and node is not target:
            # An item of a split is a view where the split is one.
            if node.op != "call_function" or not (
                node.target is operator.getitem or _aliases(node.target)
            ):
                return False
            node = node.args[0] if node.args else None
        return node is target

    def _regenerate(self, view: torch.fx.Node, info: View, reader: torch.fx.Node) -> Regenerated:
        if any(w.target is operator.getitem for w in info.chain):
            exact_here("an item of a split of a tensor written in place")
        builder = self.builder
        env = builder.env
        before = len(builder.graph.nodes)
        saved = {w: env.get(w) for w in info.chain}
        parent = info.start
        for w in info.chain:
            # Each view emitted on the value its parent has now (propagated again).
            was_changed = parent in builder.changed
            builder.changed.add(parent)
            self.emit(w)
            if not was_changed:
                builder.changed.discard(parent)
            parent = w
        value = env[view]
        for w in info.chain[:-1]:
            env[w] = saved[w]
        nodes = list(builder.graph.nodes)[before:]
        writer = self.writers.get(view)
        for node in nodes:
            if writer is not None:
                if "stack_trace" in writer.meta:
                    node.meta["stack_trace"] = writer.meta["stack_trace"]
                else:
                    node.meta.pop("stack_trace", None)
            for field in _READER_META:
                if field in reader.meta:
                    node.meta[field] = copy.copy(reader.meta[field])
                else:
                    node.meta.pop(field, None)
            if _program.is_op_overload(node.target):
                node.meta["original_aten"] = node.target
        return Regenerated(nodes, value)


def _aliases(target: Any) -> bool:
    schema = _program.op_schema(target)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)

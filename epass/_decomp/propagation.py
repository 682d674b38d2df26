"""Values propagated again through the copied graph, as the retrace's trace recomputes
them: which copied values need it (symbolic ones, unless settled), and whether a value
recomputed is the same (by its metadata).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from epass._decomp import keys, shapes
from epass._decomp.safety import Fallback

__all__ = ["Settled", "same_meta", "symbolic"]


def same_meta(a: Any, b: Any) -> bool:
    """Whether two values have the same metadata (shape, strides, dtype, offset and
    device; a size by its expression; a constant by its key)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        # Symbolic sizes compare by expression: ``==`` would ask the shape
        # environment (Min(64, 64*s0) == 64 holds there), and the retrace keeps
        # the expression its propagation computes.
        return bool(
            tuple(map(keys.sym_key, a.shape)) == tuple(map(keys.sym_key, b.shape))
            and tuple(map(keys.sym_key, a.stride())) == tuple(map(keys.sym_key, b.stride()))
            and a.dtype == b.dtype
            and keys.sym_key(a.storage_offset()) == keys.sym_key(b.storage_offset())
            and a.device == b.device
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_meta(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return (
            isinstance(a, torch.SymInt)
            and isinstance(b, torch.SymInt)
            and (a.node.expr == b.node.expr)
        )
    if type(a) is not type(b):
        return False
    try:
        return bool(keys.const_key(a) == keys.const_key(b))  # -0.0 is not 0.0; a NaN is itself
    except Fallback:
        return bool(a == b)


def symbolic(v: Any) -> bool:
    """Whether a tensor value has a symbolic size or stride. Its stored expressions
    are export's, simplified with what export knew then; the retrace propagates
    them again with what the shape environment knows now (Min(64, 64*s0) becomes 64)."""
    if not isinstance(v, torch.Tensor):
        return False
    return any(isinstance(x, torch.SymInt) for x in (*v.shape, *v.stride()))


# --- values whose recomputation taught nothing ------------------------------------

# A program's graph -> what its last decomposition that learnt nothing recomputed.
_SETTLED: weakref.WeakKeyDictionary[torch.fx.Graph, tuple[Any, ...]] = weakref.WeakKeyDictionary()


class _Same:
    """A value that compares equal only to the very same object (held, so that its id
    is never another's)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    __hash__ = None  # type: ignore[assignment]


def _structure(graph: torch.fx.Graph) -> list[Any]:
    """Each node's name, kind, target, arguments (nodes by name) and value (itself)."""
    return [
        (
            n.name,
            n.op,
            n.target,
            torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name),
            _Same(n.meta.get("val")),
        )
        for n in graph.nodes
    ]


def _counts(shape_env: Any) -> tuple[int, ...]:
    """What grows with anything a shape environment learns, cheap to read."""
    if shape_env is None:
        return ()
    return (
        len(shape_env.guards),
        len(shape_env.replacements),
        shape_env.num_deferred_runtime_asserts,
        len(shape_env.divisible),
        shape_env.unbacked_symint_counter,
    )


class Settled:
    """The symbolic values of ``graph`` that need not be recomputed in this
    decomposition: the incremental path recomputes a copied symbolic value only for
    what the computation teaches the shape environment, as the retrace's trace of it
    would. A decomposition of the same graph that learnt nothing at all, from the
    same knowledge, computed the same values from the same inputs and learnt nothing
    from any of them; so does this one, until it learns something (a template of
    another table, say). Nodes an upstream rewrite changed are recomputed anyway."""

    def __init__(self, graph: torch.fx.Graph, shape_env: Any) -> None:
        self.graph = graph
        self.shape_env = shape_env
        self.start = shapes.snapshot(shape_env)
        self.counts = _counts(shape_env)
        self.names: set[str] = set()
        self._known: frozenset[str] | None = None  # read at the first symbolic value
        self._structure: list[Any] | None = None

    def structure(self) -> list[Any]:
        if self._structure is None:
            self._structure = _structure(self.graph)
        return self._structure

    def skip(self, name: str) -> bool:
        """Whether the value of the node named ``name`` need not be recomputed."""
        if self._known is None:
            last = _SETTLED.get(self.graph)
            same = last is not None and last[0] == self.start and last[1] == self.structure()
            self._known = last[2] if same else frozenset()  # type: ignore[index]
        if name in self._known and _counts(self.shape_env) == self.counts:
            self.names.add(name)
            return True
        return False

    def taught_nothing(self, name: str) -> None:
        """The value of ``name``, recomputed from unchanged inputs, was the same."""
        self.names.add(name)

    def finish(self) -> None:
        """The decomposition is done: keep what it recomputed if it learnt nothing."""
        if self.names and shapes.snapshot(self.shape_env) == self.start:
            _SETTLED[self.graph] = (self.start, self.structure(), frozenset(self.names))
        else:
            _SETTLED.pop(self.graph, None)

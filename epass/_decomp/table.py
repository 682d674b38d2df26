"""A decomposition table split the way ``run_decompositions`` splits it, and the one
answer to "does this table rewrite op X"."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from epass import _operators
from epass._decomp import state
from epass._torch import operators

__all__ = [
    "as_dict",
    "DefaultSide",
    "DefaultSplit",
    "EMITTED_AS_ITSELF",
    "FUNCTIONALIZED",
    "REGIONS",
    "SIZE_OPS",
    "SPLITS",
    "Tables",
    "has_packet_keys",
    "is_cia",
    "left_behind",
    "rewrites",
    "splices",
    "split_table",
]


# Higher-order ops the retrace inlines whatever the table: its trace calls each one,
# which runs the body (a submodule) under the autocast or grad mode it names, so the
# body's operators land in the program, decomposed where the table says. Each maps to
# the position of its body among its arguments.
REGIONS = {
    torch.ops.higher_order.wrap_with_autocast: 4,
    torch.ops.higher_order.wrap_with_set_grad_enabled: 1,
}

# Size queries: the retrace re-emits them as they are.
SIZE_OPS = frozenset(
    (
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    )
)


@attrs.frozen(eq=False)
class Tables:
    """A decomposition table split into CompositeImplicitAutograd overrides and
    Python decompositions, exactly as ``run_decompositions`` splits it.

    Attributes:
        cia: CIA op -> callable (torch's preserve marker keeps the op).
        python: post-autograd op -> decomposition.
        token: hashable identity of the table's state, part of every template key.
    """

    cia: Mapping[Any, Callable[..., Any]]
    python: Mapping[Any, Callable[..., Any]]
    token: Any


SPLITS: collections.OrderedDict[Any, Tables] = collections.OrderedDict()


class _Same:
    """A key part standing for one object: equal only to a part holding that same
    object, which it keeps alive for as long as the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"_Same({self.obj!r})"


class DefaultSide(Mapping[Any, Callable[..., Any]]):
    """One side (``"cia"`` or ``"python"``) of torch's default table less ``keep``,
    split as ``run_decompositions`` splits it.

    Building that split walks every operator torch knows (about 0.3 s, once per
    process), while a program asks about a few dozen: a lookup answers for one
    operator from the same rules torch's table and split follow (pinned operator by
    operator against torch's own split by a test), and iterating builds torch's split
    itself, which lookups use from then on.
    """

    def __init__(self, split: DefaultSplit, side: str) -> None:
        self.split = split
        self._index = ("cia", "python").index(side)

    def _whole(self) -> Mapping[Any, Callable[..., Any]]:
        return self.split.materialize()[self._index]

    def __getitem__(self, op: Any) -> Callable[..., Any]:
        built = self.split.built
        side = built[self._index] if built is not None else None
        value: Callable[..., Any] | None = (
            side[op] if side is not None else self.split.lookup(op)[self._index]
        )
        if value is None:
            raise KeyError(op)
        return value

    def __iter__(self) -> Iterator[Any]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())


def _walk_meets(op: Any) -> bool:
    """Whether torch's walk of the loaded operators (``_collect_all_valid_cia_ops``, what
    its table and split take as preservable) meets this very object: its namespace's
    packet, and the overload that packet lists under its name. An object made by
    ``getattr(packet, "")`` is another object for the default overload, and the walk
    never meets it."""
    if op.namespace not in torch.ops:  # iterates what is loaded, creating nothing
        return False
    space = getattr(torch.ops, op.namespace)
    packet, name = operators.overload_key(op)
    return (
        isinstance(space, operators.OpNamespace)
        and packet.__name__ in space
        and getattr(space, packet.__name__) is packet
        and name in operators.op_overloads(packet, names=True)
        and getattr(packet, name) is op
    )


class DefaultSplit:
    """torch's default table less ``keep``: answered operator by operator, built whole
    on demand (see :class:`DefaultSide`)."""

    def __init__(self, keep: frozenset[Any]) -> None:
        self.keep = keep
        self.core = operators.core_aten_decompositions()
        self.built: tuple[dict[Any, Any], dict[Any, Any]] | None = None
        self._answers: dict[Any, tuple[Any, Any]] = {}

    def lookup(self, op: Any) -> tuple[Any, Any]:
        """``op``'s entry on the CIA side and on the Python side (None: no entry).

        torch's default table holds the core ATen decompositions and, for every
        CompositeImplicitAutograd op it may preserve (functional, not aliasing, with
        a kernel) outside a short ATen list it keeps, the op's own decomposition;
        ``keep`` comes off. The split moves every such preservable op to the CIA side,
        with the preserve marker where the table has no entry for it.
        """
        answer = self._answers.get(op)
        if answer is not None:
            return answer
        if _operators.is_op_overload(op):
            if state.is_preservable(op) and _walk_meets(op):
                answer = (self._entry(op) or operators.preserve_marker(), None)
            else:
                answer = (None, None if op in self.keep else self.core.get(op))
        else:
            answer = (None, None)  # the table's keys are operator overloads
        self._answers[op] = answer
        return answer

    def materialize(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """torch's split of the table (built once), from the same rules: every
        operator torch's walk finds preservable goes to the CIA side, every other
        entry of the core decompositions to the Python side. That is one walk where
        torch's table and split make two, each loading every C++ registration once per
        namespace (about 0.4 s in a fresh process). A core entry for a preservable
        operator the walk does not find is a case torch's split treats apart: the split
        is then torch's own. A test compares both sides with torch's, key by key."""
        with state.LOCK:
            if self.built is None:
                walked = state.patchable_ops()
                marker = operators.preserve_marker()
                cia = {op: self._entry(op) or marker for op in walked}
                python = {}
                for op, fn in self.core.items():
                    if op in self.keep or op in walked:
                        continue
                    if state.is_preservable(op):
                        return self._torch_split()
                    python[op] = fn
                self.built = (cia, python)
            return self.built

    def _entry(self, op: Any) -> Any:
        """The table's entry for ``op``, a preservable operator (None: none)."""
        if op in self.keep:
            return None
        if op in self.core:
            return self.core[op]
        if op.namespace == "aten" and op in operators.preserved_aten_cia_ops():
            return None
        return operators.decomp_for_cia(op)

    def _torch_split(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        full = torch.export.default_decompositions()
        for op in self.keep:
            full.pop(op, None)
        self.built = operators.split_decomp_table(dict(full.materialize()))
        return self.built


def split_table(
    table: Mapping[Any, Callable[..., Any]] | None, keep: tuple[Any, ...] = ()
) -> Tables:
    """Split ``table`` (``None``: torch's default table less ``keep``) like
    ``run_decompositions``.

    Splits are cached for the process (the last 32), keyed by the set of
    CompositeImplicitAutograd registrations (a newly registered op invalidates them)
    and by ``keep`` for the default table, or by the table's operators and callables
    for an explicit one. The key holds the callables themselves, never their ``id()``:
    a freed table's address can go to another function, which must not be served this
    table's templates. The key is the split's ``token``. The default table's sides
    answer lookups without building torch's split (see :class:`DefaultSide`).
    """
    regs = operators.cia_registrations()
    key: tuple[Any, ...]
    if table is None:
        key = ("default", regs, frozenset(keep))
    else:
        key = ("explicit", regs, frozenset((op, _Same(fn)) for op, fn in table.items()))
    with state.LOCK:
        cached = SPLITS.get(key)
        if cached is not None:
            SPLITS.move_to_end(key)
            return cached
    if table is None:
        split = DefaultSplit(frozenset(keep))
        tables = Tables(DefaultSide(split, "cia"), DefaultSide(split, "python"), key)
    else:
        cia, python = _split_explicit(dict(table))
        tables = Tables(cia, python, key)
    with state.LOCK:
        if any(k[1] != regs for k in SPLITS):
            SPLITS.clear()
        SPLITS[key] = tables
        while len(SPLITS) > 32:
            SPLITS.popitem(last=False)
    return tables


def as_dict(table: Mapping[Any, Callable[..., Any]]) -> dict[Any, Any]:
    """``dict(table)``. torch's ``CustomDecompTable`` (ExecuTorch's and OpenVINO's
    tables) materializes on reading, walking every namespace's C++ registrations;
    here from the one walk (:func:`state.patchable_ops`), to the same entries."""
    made = operators.materialized_table(table, state.patchable_ops)
    return dict(table) if made is None else made


def _split_explicit(table: dict[Any, Any]) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """torch's split of ``table`` (``_split_decomp_table_to_cia_and_python_decomp``),
    from one walk of the loaded operators (:func:`state.patchable_ops`) where torch's
    loads every C++ registration once per namespace (about 6 ms against 40 ms). A
    test compares both sides with torch's, for consumers' tables."""
    walked = set(state.patchable_ops())
    cia: dict[Any, Any] = {}
    for op in list(table):
        if op in walked:  # torch's override takes it, as the table says
            cia[op] = table.pop(op)
            walked.remove(op)
        elif state.is_preservable(op):  # an operator the walk does not meet
            if op.name().startswith("aten"):
                return operators.split_decomp_table(table)  # torch's own error
            cia[op] = table[op]  # and it stays on the Python side, as torch leaves it
    marker = operators.preserve_marker()
    for op in walked:  # the table deleted them: kept
        cia[op] = marker
    return cia, table


def has_packet_keys(tables: Tables) -> bool:
    """Whether the table's Python side has an operator packet key (which stands for
    every overload of the op)."""
    python = tables.python
    if isinstance(python, DefaultSide):
        return False  # torch's default table is keyed by overloads (a test pins it)
    return any(_operators.is_op_packet(k) for k in python)


# The operators that write nothing and return no view, which functionalization still
# replaces by a kernel of its own (a test pins this list against torch's Functionalize
# registrations; ``_to_copy`` has one too, and keeps the operator).
FUNCTIONALIZED = frozenset(
    (
        torch.ops.aten.lift.default,
        torch.ops.aten.lift_fresh_copy.default,
        torch.ops.aten._unsafe_view.default,
    )
)


def rewrites(op: Any, tables: Tables) -> bool:
    """Whether a retrace with ``tables`` replaces the operator overload ``op``.

    The one answer: ``Decompose.skip_reason`` skips a program only when this is
    False for every op in it, and the engine splices exactly the nodes it is True
    for. Functionalization replaces a mutating op, and the few others it has a
    kernel of its own for (``lift_fresh_copy`` becomes ``clone``); the Python table
    rewrites its ops (a packet key stands for every overload); a
    CompositeImplicitAutograd op is decomposed unless the table preserves it (torch's
    split marks the preserved).
    """
    if op in SIZE_OPS:
        return False
    if _operators.is_mutable_op(op) or op in FUNCTIONALIZED:
        return True
    if op in tables.python or op.overloadpacket in tables.python:
        return True
    if is_cia(op):
        return tables.cia.get(op) is not operators.preserve_marker()
    return False


# Of those, the ones whose kernel emits the operator itself (on the unwrapped tensor,
# recording its output as a view of its input): a retrace's program holds them
# wherever the table does not rewrite them otherwise (``reshape`` of a non-contiguous
# tensor under a table without torch's ``_unsafe_view`` entry, ONNX's).
EMITTED_AS_ITSELF = frozenset((torch.ops.aten._unsafe_view.default,))


def left_behind(op: Any, tables: Tables) -> bool:
    """Whether a functionalized trace with ``tables`` that emits the operator overload
    ``op`` left it where the retrace would go on to rewrite it: :func:`rewrites`, less
    the operators functionalization emits as themselves when nothing else rewrites
    them (:data:`EMITTED_AS_ITSELF`)."""
    if op in EMITTED_AS_ITSELF and not (
        op in tables.python or op.overloadpacket in tables.python or is_cia(op)
    ):
        return False
    return rewrites(op, tables)


def is_cia(op: Any) -> bool:
    """Whether ``op`` has a CompositeImplicitAutograd kernel (``_is_cia_op``)."""
    return operators.is_cia_op(op)


def splices(node: torch.fx.Node, tables: Tables) -> bool:
    """Whether the engine replaces ``node`` with its operator's decomposition: a
    call of an operator overload that :func:`rewrites` says the table rewrites, or a
    region (:data:`REGIONS`), which is always inlined."""
    if node.op != "call_function":
        return False
    if _operators.is_op_overload(node.target):
        return rewrites(node.target, tables)
    return node.target in REGIONS

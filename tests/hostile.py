"""Hostile third-party passes and instruments, and a complete snapshot of what user code
can observe of an ExportedProgram, by value and by identity.

The passes and instruments here do what epass cannot forbid: keep the programs they
are shown, hand old ones back, lie about ``modified`` and ``changes_input``, edit node
meta and fx's "immutable" argument lists in place, and fail half way through an edit.
Each one tells a :class:`Witness` what it was shown, as it was when its call returned,
so that a test can check afterwards that epass edited none of it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import hashlib
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import sympy
import torch
from torch.export import ExportedProgram

from epass import PassResult

__all__ = [
    "EDITS",
    "AfterKeeper",
    "Hoarder",
    "InPlace",
    "InputLiar",
    "Keeper",
    "Memoizer",
    "Raiser",
    "RaisingReader",
    "Reader",
    "Witness",
    "annotated",
    "clear_stacks",
    "differences",
    "retarget",
    "retarget_invalid",
    "reverse_val_lists",
    "setitem",
    "snapshot",
    "value",
    "write_meta",
]

aten = torch.ops.aten

# --------------------------------------------------------------------------------------
# The snapshot: everything a user can observe of a program, by value and by identity.
# --------------------------------------------------------------------------------------

# Values compared by type and text alone: they cannot be edited in place.
_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    slice,
    type(Ellipsis),
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def _digest(t: torch.Tensor) -> str:
    """The bytes of a real tensor (read through ctypes: torch does not need numpy)."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
    data = ctypes.string_at(flat.data_ptr(), flat.numel()) if flat.numel() else b""
    return hashlib.sha256(data).hexdigest()


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor by identity, layout, version and (for a real tensor) bytes."""
    try:
        layout: Any = (str(tuple(t.stride())), str(t.storage_offset()))
    except Exception:  # sparse and other layouts without strides
        layout = None
    try:
        version: Any = t._version
    except Exception:
        version = None
    real = type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
    data = (t.data_ptr(), _digest(t)) if real and t.device.type != "meta" else None
    shape = str(tuple(t.shape))
    return (
        "tensor",
        type(t).__name__,
        id(t),
        t.dtype,
        shape,
        layout,
        t.requires_grad,
        version,
        data,
    )


def value(obj: Any, _path: frozenset[int] = frozenset()) -> Any:
    """``obj`` as a comparable value: atoms by text; fx nodes by name and identity;
    tensors and symbols by identity and what they hold; every container (dict, list,
    tuple, set, dataclass) by identity and by the values it holds, all the way down;
    anything else by identity and ``repr``."""
    if isinstance(obj, _ATOMS):
        return (type(obj).__name__, repr(obj))
    if isinstance(obj, torch.fx.Node):
        return ("node", obj.name, id(obj))
    if isinstance(obj, torch.Tensor):
        return _tensor(obj)
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbol", type(obj).__name__, id(obj), str(obj))
    if isinstance(obj, sympy.Basic):
        return ("sympy", type(obj).__name__, str(obj))
    oid = id(obj)
    if oid in _path:
        return ("cycle", oid)
    inner = _path | {oid}
    kind = type(obj).__name__
    if isinstance(obj, type):
        return ("class", kind, oid, obj.__qualname__)
    if isinstance(obj, dict):
        items = tuple((value(k, inner), value(v, inner)) for k, v in dict.items(obj))
        return ("dict", kind, oid, items)
    if isinstance(obj, list):
        return ("list", kind, oid, tuple(value(v, inner) for v in list.__iter__(obj)))
    if isinstance(obj, tuple):
        return ("tuple", kind, oid, tuple(value(v, inner) for v in tuple.__iter__(obj)))
    if isinstance(obj, (set, frozenset)):
        return ("set", kind, oid, tuple(sorted(repr(value(v, inner)) for v in obj)))
    if callable(obj) and not dataclasses.is_dataclass(obj):  # an operator, a function
        return ("callable", repr(obj), oid)
    if dataclasses.is_dataclass(obj):
        fields = tuple(
            (f.name, value(getattr(obj, f.name), inner)) for f in dataclasses.fields(obj)
        )
        return ("dataclass", kind, oid, fields)
    return ("object", kind, oid, repr(obj))


class NodeSnapshot(NamedTuple):
    """One node as user code sees it."""

    name: str
    identity: int
    kind: str
    op: str
    target: Any
    args: Any
    kwargs: Any
    meta: Any
    users: tuple[str, ...]
    in_graph: bool


def _node(node: torch.fx.Node, graph: torch.fx.Graph) -> NodeSnapshot:
    return NodeSnapshot(
        name=node.name,
        identity=id(node),
        kind=type(node).__name__,
        op=node.op,
        target=value(node.target),
        args=value(node.args),
        kwargs=value(node.kwargs),
        meta=value(node.meta),
        users=tuple(u.name for u in node.users),
        in_graph=node.graph is graph,
    )


# Graph module attributes that recompile() replaces by equal values; the code they
# hold is compared by value ("code").
_RECOMPILED = frozenset({"_code", "_lineno_map", "_prologue_start", "forward"})


def snapshot(ep: ExportedProgram) -> dict[str, Any]:
    """Everything user code can observe of ``ep``: every attribute of the program (its
    dicts and their tensors, signature, range constraints, module call graph, example
    inputs, verifiers) by identity and by value, down to the bytes and ``_version`` of
    each real tensor; the graph module's attributes and generated code; and each node
    with its target, arguments (the values inside fx's argument lists, not only the
    lists' identities) and every meta container, by identity and by value."""
    gm = ep.graph_module
    graph = gm.graph
    program = {k: v for k, v in vars(ep).items() if k != "_graph_module"}
    return {
        "program attributes": tuple((k, type(v).__name__, id(v)) for k, v in vars(ep).items()),
        **{name.lstrip("_"): value(v) for name, v in program.items()},
        "graph module": (
            type(gm).__name__,
            id(gm),
            id(graph),
            graph is ep.graph,
            tuple((k, id(v)) for k, v in vars(gm).items() if k not in _RECOMPILED),
        ),
        "graph module meta": value(gm.meta),
        "graph module children": tuple(
            (name, id(sub), getattr(sub, "code", None)) for name, sub in gm.named_children()
        ),
        "graph module state": tuple(
            (name, value(t))
            for name, t in (*gm.named_parameters(remove_duplicate=False), *gm.named_buffers())
        ),
        "code": gm.code,
        "graph": str(graph),
        "nodes": tuple(_node(n, graph) for n in graph.nodes),
    }


def _short(v: Any, width: int = 160) -> str:
    text = repr(v)
    return text if len(text) <= width else text[: width - 3] + "..."


def _node_differences(
    before: tuple[NodeSnapshot, ...], after: tuple[NodeSnapshot, ...]
) -> list[str]:
    if [n.name for n in before] != [n.name for n in after]:
        gone = [n.name for n in before if n.name not in {m.name for m in after}]
        added = [n.name for n in after if n.name not in {m.name for m in before}]
        return [f"nodes: {len(before)} -> {len(after)}, removed {gone[:6]}, added {added[:6]}"]
    out = []
    for b, a in zip(before, after, strict=True):
        for field in NodeSnapshot._fields:
            old, new = getattr(b, field), getattr(a, field)
            if old == new:
                continue
            if field == "meta" and old[:3] == new[:3]:  # the same dict: say which keys
                keys = dict(old[3]).keys() | dict(new[3]).keys()
                changed = sorted(k[1] for k in keys if dict(old[3]).get(k) != dict(new[3]).get(k))
                out.append(f"node {b.name}: meta[{', '.join(changed)}] changed in place")
            elif field == "target":
                out.append(f"node {b.name}: target {old[1]} -> {new[1]}")
            else:
                out.append(f"node {b.name}: {field} {_short(old)} -> {_short(new)}")
    return out


def _dict_difference(key: str, old: tuple[Any, ...], new: tuple[Any, ...]) -> str:
    """How a dict's value (``value`` of a dict) changed: replaced, or which entries."""
    parts = []
    if old[2] != new[2]:
        parts.append("replaced by another dict")
    before, after = dict(old[3]), dict(new[3])
    added = [k[1] for k in after.keys() - before.keys()]
    removed = [k[1] for k in before.keys() - after.keys()]
    changed = [k[1] for k in before.keys() & after.keys() if before[k] != after[k]]
    for what, keys in (("added", added), ("removed", removed), ("changed", changed)):
        if keys:
            parts.append(f"{what} {', '.join(sorted(keys)[:6])}")
    return f"{key}: {'; '.join(parts) or 'reordered'}"


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What changed between two snapshots, one readable line per difference."""
    out: list[str] = []
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if key == "nodes":
            out += _node_differences(old or (), new or ())
        elif key == "graph":
            continue  # the node lines say it better
        elif key == "program attributes":
            was, now = dict((k, i) for k, _, i in old or ()), dict((k, i) for k, _, i in new or ())
            replaced = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
            out.append(f"the program's attributes {', '.join(replaced)} were set anew")
        elif _is_dict(old) and _is_dict(new):
            out.append(_dict_difference(key, old, new))
        else:
            out.append(f"{key}: {_short(old)} -> {_short(new)}")
    return out


def _is_dict(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 4 and v[0] == "dict"


# --------------------------------------------------------------------------------------
# The witness: what code outside epass was shown, as it was when that code returned.
# --------------------------------------------------------------------------------------


class Witness:
    """Records each program shown to user code (a pass, an instrument, the caller) as it
    was when that code returned, and what the run is expected to fail on."""

    def __init__(self) -> None:
        self.sightings: list[tuple[str, ExportedProgram, dict[str, Any]]] = []
        # The first hostile pass that must fail the run (it raised, or it edited a
        # program it declared changes_input = False for), with why.
        self.expected_failure: tuple[str, str] | None = None
        self.edits: list[tuple[str, str]] = []

    def saw(self, who: str, program: ExportedProgram) -> None:
        """``who`` was shown ``program``, as it is now, and returns."""
        snap = snapshot(program)
        for _, seen, seen_snap in self.sightings:
            if seen is program and seen_snap == snap:
                return  # nothing new to check
        self.sightings.append((who, program, snap))

    def expect_failure(self, name: str, why: str) -> None:
        if self.expected_failure is None:
            self.expected_failure = (name, why)

    def edited_since(self) -> list[str]:
        """One line for each program shown to user code that changed since it was shown."""
        now: dict[int, dict[str, Any]] = {}
        problems = []
        for who, program, snap in self.sightings:
            current = now.setdefault(id(program), snapshot(program))
            diff = differences(snap, current)
            if diff:
                problems.append(f"{who}, changed since: " + "; ".join(diff[:4]))
        return problems


# --------------------------------------------------------------------------------------
# Edits a hostile pass makes in place, each returning whether it changed anything.
# --------------------------------------------------------------------------------------


def _calls(ep: ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in ep.graph.nodes if n.op == "call_function"]


def retarget(ep: ExportedProgram) -> bool:
    """relu -> sigmoid everywhere (else the first add -> sub), recompiled: a valid edit."""
    nodes = [n for n in _calls(ep) if n.target is aten.relu.default]
    if nodes:
        for n in nodes:
            n.target = aten.sigmoid.default
    else:
        nodes = [n for n in _calls(ep) if n.target is aten.add.Tensor][:1]
        for n in nodes:
            n.target = aten.sub.Tensor
    ep.graph_module.recompile()
    return bool(nodes)


def retarget_invalid(ep: ExportedProgram) -> bool:
    """relu -> torch.relu (else add -> torch.add): not an ATen overload, so the program
    no longer validates; left without recompile()."""
    changed = False
    for n in _calls(ep):
        if n.target is aten.relu.default:
            n.target, changed = torch.relu, True
    if not changed:
        for n in _calls(ep):
            if n.target is aten.add.Tensor:
                n.target, changed = torch.add, True
                break
    return changed


def setitem(ep: ExportedProgram) -> bool:
    """Swaps the first two different items of the first list argument through
    ``list.__setitem__``, which fx's immutable_list does not guard."""
    for n in _calls(ep):
        for arg in n.args:
            if isinstance(arg, list) and len(arg) >= 2 and not _same(arg[0], arg[1]):
                first, second = arg[0], arg[1]
                list.__setitem__(arg, 0, second)
                list.__setitem__(arg, 1, first)
                return True
    return False


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, bool)) and a == b)


def clear_stacks(ep: ExportedProgram) -> bool:
    """``node.meta["nn_module_stack"].clear()`` on every node that has one."""
    changed = False
    for n in ep.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        if stack:
            stack.clear()
            changed = True
    return changed


def reverse_val_lists(ep: ExportedProgram) -> bool:
    """Reverses in place every ``meta["val"]`` that is a list (a multi-output op's)."""
    changed = False
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, list) and len(val) >= 2 and val[0] is not val[-1]:
            val.reverse()
            changed = True
    return changed


_WRITES = itertools.count()


def write_meta(ep: ExportedProgram) -> bool:
    """Writes into each call's meta dict: a key and a stack trace, new each time."""
    nodes = _calls(ep)
    tag = next(_WRITES)
    for n in nodes:
        n.meta["hostile"] = {"tag": tag}
        n.meta["stack_trace"] = f"edited by a hostile pass ({tag})"
    return bool(nodes)


EDITS: dict[str, Callable[[ExportedProgram], bool]] = {
    "retarget": retarget,
    "clear-stacks": clear_stacks,
    "setitem": setitem,
    "write-meta": write_meta,
    "val-lists": reverse_val_lists,
    "retarget-invalid": retarget_invalid,
}


# --------------------------------------------------------------------------------------
# Hostile passes.
# --------------------------------------------------------------------------------------


def _program_of(out: Any) -> ExportedProgram | None:
    if isinstance(out, PassResult):
        return out.program
    return out if isinstance(out, ExportedProgram) else None


def _result(ep: ExportedProgram, returns: str) -> Any:
    """``ep`` as a pass returns it: bare, or in a PassResult saying modified or not."""
    if returns == "bare":
        return ep
    return PassResult(ep, returns == "true")


class Hostile:
    """A third-party pass that tells its witness what it was shown and what it returned,
    as they were when its call returned (or raised). Subclasses say what it does in
    ``act``."""

    def __init__(self, name: str, witness: Witness) -> None:
        self.name = name
        self.witness = witness
        self.kept: list[ExportedProgram] = []

    def act(self, ep: ExportedProgram) -> Any:
        raise NotImplementedError

    def __call__(self, ep):  # type: ignore[no-untyped-def]
        out = None
        try:
            out = self.act(ep)
            return out
        finally:
            self.kept.append(ep)  # kept, as such passes do
            self.witness.saw(f"the program given to pass {self.name!r}", ep)
            returned = _program_of(out)
            if returned is not None and returned is not ep:
                self.witness.saw(f"the program pass {self.name!r} returned", returned)


class _Annotated(Hostile):
    """Annotated to return a PassResult: the manager takes it at its word for
    ``modified`` unless it checks."""

    def __call__(self, ep: ExportedProgram) -> PassResult:
        out = super().__call__(ep)
        assert isinstance(out, PassResult)
        return out


class InPlace(Hostile):
    """Edits the program it is given in place and returns it: bare (the manager must
    look), with ``modified=True``, or with ``modified=False`` (a lie when it edited)."""

    def __init__(self, name: str, witness: Witness, edit: str, returns: str) -> None:
        super().__init__(name, witness)
        self.edit, self.returns = edit, returns

    def act(self, ep: ExportedProgram) -> Any:
        if EDITS[self.edit](ep):
            self.witness.edits.append((self.name, self.edit))
        return _result(ep, self.returns)


class InputLiar(InPlace):
    """Declares ``changes_input = False``, then edits the program it is given anyway;
    the run must fail naming it."""

    changes_input = False

    def act(self, ep: ExportedProgram) -> Any:
        if EDITS[self.edit](ep):
            self.witness.expect_failure(self.name, f"declared changes_input = False, {self.edit}")
        return _result(ep, self.returns)


class Reader(Hostile):
    """Declares ``changes_input = False`` and keeps its word: it only reads."""

    changes_input = False

    def __init__(self, name: str, witness: Witness, returns: str) -> None:
        super().__init__(name, witness)
        self.returns = "false" if returns == "true" else returns

    def act(self, ep: ExportedProgram) -> Any:
        sum(len(n.meta) for n in ep.graph.nodes)
        return _result(ep, self.returns)


class Memoizer(Hostile):
    """Returns the program it returned on its first call, on every call, across runs."""

    def __init__(self, name: str, witness: Witness, returns: str) -> None:
        super().__init__(name, witness)
        self.returns = "true" if returns == "false" else returns
        self.memo: ExportedProgram | None = None

    def act(self, ep: ExportedProgram) -> Any:
        if self.memo is None:
            self.memo = ep
        return _result(self.memo, self.returns)


class Hoarder(Hostile):
    """Keeps every program it is given; returns the first one on every later call."""

    def act(self, ep: ExportedProgram) -> Any:
        old = self.kept[0] if self.kept else ep
        return old if old is ep else PassResult(old, True)


class Raiser(InPlace):
    """Edits the program it is given, then raises half way."""

    def act(self, ep: ExportedProgram) -> Any:
        EDITS[self.edit](ep)
        self.witness.expect_failure(self.name, f"raised after {self.edit}")
        raise RuntimeError(f"{self.name} fails half way through {self.edit}")


class RaisingReader(Raiser):
    """Declares ``changes_input = False``, edits anyway, then raises."""

    changes_input = False


def annotated(cls: type[Hostile]) -> type[Hostile]:
    """``cls`` with ``__call__`` annotated to return a PassResult."""
    return type(f"Annotated{cls.__name__}", (_Annotated, cls), {})


# --------------------------------------------------------------------------------------
# Instruments that keep every program they are shown.
# --------------------------------------------------------------------------------------


class Keeper:
    """An instrument with every hook, keeping every program it is shown."""

    def __init__(self, label: str, witness: Witness) -> None:
        self.label = label
        self.witness = witness
        self.kept: list[ExportedProgram] = []

    def _saw(self, hook: str, program: ExportedProgram) -> None:
        self.kept.append(program)
        self.witness.saw(f"the program shown to instrument {self.label!r} in {hook}", program)

    def before_pipeline(self, manager: Any, program: ExportedProgram, parent: Any = None) -> None:
        self._saw(f"before_pipeline({manager.name})", program)

    def after_pipeline(self, manager: Any, result: Any, parent: Any = None) -> None:
        self._saw(f"after_pipeline({manager.name})", result.program)

    def before_pass(self, info: Any, program: ExportedProgram) -> None:
        self._saw(f"before_pass({info.name})", program)

    def after_pass(self, info: Any, program: ExportedProgram, record: Any) -> None:
        self._saw(f"after_pass({info.name})", program)

    def pass_failed(self, info: Any, program: ExportedProgram, error: BaseException) -> None:
        self._saw(f"pass_failed({info.name})", program)

    def pass_skipped(self, info: Any, program: ExportedProgram, record: Any) -> None:
        self._saw(f"pass_skipped({info.name})", program)


class AfterKeeper:
    """An instrument with only ``after_pass``, keeping what it is shown."""

    def __init__(self, label: str, witness: Witness) -> None:
        self.label = label
        self.witness = witness
        self.kept: list[ExportedProgram] = []

    def after_pass(self, info: Any, program: ExportedProgram, record: Any) -> None:
        self.kept.append(program)
        self.witness.saw(f"the program shown to instrument {self.label!r} in after_pass", program)

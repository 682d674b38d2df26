"""A full fingerprint of an ExportedProgram: everything a user can observe of it, by
value and by identity (graph, code, node meta, signature, constraints, call graph,
example inputs, verifiers, dicts, tensors, their versions and bytes)."""

from __future__ import annotations

import collections
import ctypes
import hashlib
from typing import Any

import torch
from torch.export import ExportedProgram


def _tensor_digest(t: torch.Tensor) -> str:
    # Read through ctypes, not numpy: torch does not depend on numpy.
    flat = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
    data = ctypes.string_at(flat.data_ptr(), flat.numel()) if flat.numel() else b""
    return hashlib.sha256(data).hexdigest()


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor the user holds: its identity, kind, layout, flags, version and bytes."""
    return (
        "tensor",
        id(t),
        type(t).__name__,
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()) if t.layout == torch.strided else None,
        t.storage_offset() if t.layout == torch.strided else None,
        t.requires_grad,
        t._version,
        _tensor_digest(t),
    )


class _Alive:
    """Holds what a fingerprint names by identity, so that no object it names is
    freed and its id reused by another before the fingerprint is compared. Equal to
    every other: it takes no part in the comparison."""

    def __init__(self) -> None:
        self.objects: list[Any] = []

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Alive)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<objects kept alive>"


_ATOMS = (str, int, float, bool, complex, type(None), bytes, torch.dtype, torch.device)
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)


def _walk(value: Any, alive: _Alive) -> Any:
    """``value`` as plain data: containers by value and by the identity of each (a
    container shared with another program shows as the same id), tensors and fake
    values by identity, objects by type, identity and their attributes."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    alive.objects.append(value)
    if kind in _DICTS:
        return (kind.__name__, id(value), [(k, _walk(v, alive)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):  # torch.Size, TensorMetadata and other named tuples
        return (kind.__name__, id(value), [_walk(v, alive) for v in value])
    if kind in (set, frozenset):
        return (kind.__name__, id(value), sorted(map(repr, value)))
    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("value", kind.__name__, id(value))
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, type)):
        return ("callable", str(value))
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict) and kind.__module__.startswith("torch.fx"):
        # NodeSource (``from_node``) and other fx records a pass could edit in place.
        return (kind.__name__, id(value), _walk(fields, alive))
    return (kind.__name__, id(value), repr(value))


def _graph_modules(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    return [(n, m) for n, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)]


def _graphs(ep: ExportedProgram, alive: _Alive) -> list[Any]:
    """Each graph module of ``ep`` (nested ones too): its identity, its graph's, code,
    graph text, meta, attributes, and every node: identity, name and meta."""
    out = []
    for name, gm in _graph_modules(ep.graph_module):
        alive.objects.extend((gm, gm.graph))
        nodes = [(id(n), n.name, _walk(n.meta, alive)) for n in gm.graph.nodes]
        alive.objects.extend(gm.graph.nodes)
        attributes = [
            (key, id(value), type(value).__name__)
            for key, value in [*gm.named_parameters(), *gm.named_buffers(), *gm.named_children()]
        ]
        alive.objects.extend(v for _, v in [*gm.named_parameters(), *gm.named_buffers()])
        out.append(
            (
                name,
                id(gm),
                id(gm.graph),
                gm.code,
                str(gm.graph),
                _walk(gm.meta, alive),
                attributes,
                nodes,
            )
        )
    return out


def _entries(d: dict[str, Any], alive: _Alive) -> list[tuple[Any, ...]]:
    alive.objects.extend(d.values())
    return [
        (
            key,
            _tensor(value)
            if isinstance(value, torch.Tensor)
            else (id(value), type(value).__name__),
        )
        for key, value in d.items()
    ]


def _example_inputs(ep: ExportedProgram, alive: _Alive) -> Any:
    inputs = ep.example_inputs
    if inputs is None:
        return None
    alive.objects.append(inputs)
    leaves, spec = torch.utils._pytree.tree_flatten(inputs)
    alive.objects.extend(leaves)
    values = [_tensor(v) if isinstance(v, torch.Tensor) else _walk(v, alive) for v in leaves]
    args, kwargs = inputs
    return (id(inputs), id(args), id(kwargs), str(spec), values)


def _call_graph(ep: ExportedProgram, alive: _Alive) -> Any:
    entries = ep.module_call_graph
    alive.objects.append(entries)
    alive.objects.extend(entries)
    return (id(entries), [(id(e), e.fqn, repr(e.signature)) for e in entries])


def fingerprint(ep: ExportedProgram) -> dict[str, Any]:
    """Everything about ``ep`` that a pass must not change when it is the user's input:
    what a user can observe of the program, by value and by identity."""
    alive = _Alive()
    fields = vars(ep)
    alive.objects.extend(fields.values())
    return {
        "fields": sorted((key, id(value)) for key, value in fields.items()),
        "code": ep.graph_module.code,
        "graph": str(ep.graph),
        "graphs": _graphs(ep, alive),
        "signature": (id(ep.graph_signature), str(ep.graph_signature)),
        "range_constraints": sorted((str(k), str(v)) for k, v in ep.range_constraints.items()),
        "module_call_graph": _call_graph(ep, alive),
        "example_inputs": _example_inputs(ep, alive),
        "verifiers": (id(ep.verifiers), [v.__qualname__ for v in ep.verifiers]),
        "dialect": ep.dialect,
        "state_dict": (id(ep.state_dict), _entries(ep.state_dict, alive)),
        "constants": (id(ep.constants), _entries(ep.constants, alive)),
        "alive": alive,
    }


def without_versions(value: Any) -> Any:
    """A fingerprint with the tensors' version counters left out: for a consumer that
    bumps them (LiteRT) without writing into the tensors, whose bytes still count."""
    if isinstance(value, tuple) and value[:1] == ("tensor",):
        return (*value[:8], None, *value[9:])
    if isinstance(value, dict):
        return {k: without_versions(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(without_versions(v) for v in value)
    return value


def node_meta_fingerprint(ep: ExportedProgram) -> list[Any]:
    """Every graph of ``ep`` and its nodes' meta, as :func:`fingerprint` sees them."""
    alive = _Alive()
    return [_graphs(ep, alive), alive]

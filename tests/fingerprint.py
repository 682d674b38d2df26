"""A full fingerprint of an ExportedProgram: graph code, signature, dict and tensor
identities, bytes and version counters."""

from __future__ import annotations

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


def fingerprint(ep: ExportedProgram) -> dict[str, Any]:
    """Everything about ``ep`` that a pass must not change when it is the user's input."""

    def entries(d: dict[str, Any]) -> list[tuple[Any, ...]]:
        out = []
        for key, value in d.items():
            if isinstance(value, torch.Tensor):
                out.append(
                    (key, id(value), type(value).__name__, value._version, _tensor_digest(value))
                )
            else:
                out.append((key, id(value), type(value).__name__))
        return out

    return {
        "code": ep.graph_module.code,
        "graph": str(ep.graph),
        "graph_module": id(ep.graph_module),
        "submodules": [
            (name, getattr(sub, "code", None)) for name, sub in ep.graph_module.named_children()
        ],
        "signature": str(ep.graph_signature),
        "state_dict_id": id(ep.state_dict),
        "constants_id": id(ep.constants),
        "state_dict": entries(ep.state_dict),
        "constants": entries(ep.constants),
    }


def _meta_value(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("value", id(value))
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return ("values", id(value), tuple(_meta_value(v) for v in value))
    return (id(value) if isinstance(value, (dict, list)) else None, repr(value))


def node_meta_fingerprint(ep: ExportedProgram) -> list[Any]:
    """Every node's meta in ``ep``: each key, the identity of each value container and
    of each fake value, and the text of everything else."""
    return [
        (node.name, id(node.meta), [(k, _meta_value(v)) for k, v in node.meta.items()])
        for node in ep.graph.nodes
    ]

"""Archives: a .pt2 file read through torch once the screen has passed it, torch's zip
reader, and the serialization schema the screen walks."""

from __future__ import annotations

import types
from collections.abc import Collection
from typing import Any

import torch

__all__ = [
    "load_pt2_contents",
    "zip_reader",
    "record_size",
    "serialization_schema",
    "serialized_sym_ops",
]


def load_pt2_contents(f: Any) -> Any:
    """The contents of a .pt2 archive, through torch's archive loader (no fallback)."""
    from torch.export.pt2_archive._package import load_pt2

    return load_pt2(f)


def zip_reader(f: Any) -> Any:
    """torch's zip reader (``PyTorchFileReader``) over the file ``f``."""
    return torch._C.PyTorchFileReader(f)


def record_size(reader: Any, name: str) -> int:
    """The size of member ``name`` as torch's zip reader reads it. ``get_record_size``
    came with torch 2.13; before, the member is read once more to tell its size."""
    size = getattr(reader, "get_record_size", None)
    if size is not None:
        return int(size(name))
    return len(reader.get_record(name))


def serialization_schema() -> tuple[types.ModuleType, type[Any]]:
    """torch's serialization schema module (``ExportedProgram``, ``SCHEMA_VERSION``) and
    the base class of its tagged unions."""
    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    return schema, _Union


def serialized_sym_ops() -> Collection[Any]:
    """The symbolic-shape functions torch's serializer writes as node targets."""
    from torch._export.serde.serialize import _SYM_OPS

    return _SYM_OPS  # type: ignore[no-any-return]

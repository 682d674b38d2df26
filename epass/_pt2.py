""".pt2 archives as torch reads them: its loader (one load at a time), the members its
zip reader finds, and the serialization schema and names the screen checks against."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch.export import ExportedProgram

from epass._torch import archives, programs, quiet
from epass._torch.programs import pytree

__all__ = [
    "archive_records",
    "export_schema",
    "pytree_type_names",
    "read_program",
    "serialized_builtin_targets",
]


# torch's deserializer marks the one running in a module global
# (serde.serialize._CURRENT_DESERIALIZER) and fails when two overlap: loads run
# one at a time. Loads outside epass (a bare torch.export.load) are not covered.
_DESERIALIZING = threading.Lock()


def read_program(f: Any, *, trust: bool = False) -> ExportedProgram:
    """The ``"model"`` program of a .pt2 archive, through torch's archive loader.

    ``torch.export.load`` wraps the same loader but hides its error behind a log
    record and falls back to a legacy reader that unpickles without restriction;
    calling the loader directly gives torch's own exception and no fallback.
    ``trust=True`` calls ``torch.export.load`` itself, under the same lock.
    """
    with _DESERIALIZING, quiet.loader():
        if trust:
            return torch.export.load(f)
        contents = archives.load_pt2_contents(f)
    programs = contents.exported_programs
    if "model" not in programs:
        raise ValueError(f"the archive holds no 'model' program (found {sorted(programs)})")
    return programs["model"]


def archive_records(f: Any) -> dict[str, tuple[int, int]]:
    """Every member torch's zip reader finds in an archive, below its root folder:
    name -> (offset of its data in the file, size), as torch's loader will read it.

    The offset comes from the member's local header, read as torch reads it before
    the data (``get_record_offset``); the public ``PT2ArchiveReader`` gives names only.
    """
    reader = archives.zip_reader(f)
    return {
        name: (reader.get_record_offset(name), archives.record_size(reader, name))
        for name in reader.get_all_records()
    }


def export_schema() -> tuple[type, tuple[int, int], type]:
    """torch's serialization schema behind ``models/model.json``: the root dataclass
    (``torch._export.serde.schema.ExportedProgram``), the schema version this torch
    writes, and the base class of its tagged unions (one key per JSON object)."""
    schema, union = archives.serialization_schema()
    return schema.ExportedProgram, tuple(schema.SCHEMA_VERSION), union  # type: ignore[return-value]


@functools.cache
def serialized_builtin_targets() -> frozenset[str]:
    """Node targets that are not ``torch.ops`` operators, as torch's serializer writes
    them (``_operator.getitem``, ``torch.sym_max``): the symbolic-shape functions it
    serializes and the builtins its verifier allows."""
    ops = set(archives.serialized_sym_ops()) | set(programs.base_verifier()().allowed_builtin_ops())
    return frozenset(f"{op.__module__}.{op.__name__}" for op in ops)


def pytree_type_names() -> frozenset[str]:
    """The type names a serialized pytree spec may name (``builtins.tuple``...): the
    node types registered with torch's pytree in this process."""
    return frozenset(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)

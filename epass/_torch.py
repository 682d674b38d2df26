"""The torch release that runs: how epass names a torch internal this release lacks
(the one place that tells an internal missing from a bug of epass's own), the calls
that differ between the releases epass declares, and the warnings torch raises from
its own code on some of them, silenced where epass calls it."""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "RELEASE",
    "absent",
    "op_overloads",
    "quiet_leaf_specs",
    "quiet_loader",
    "record_size",
    "resolve",
    "unexpected",
]

RELEASE: str = torch.__version__.split("+")[0]
"""The running torch release without its build tag (``2.11.0`` for ``2.11.0+cu130``)."""


def resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module prefix, then
    attributes (of a class too: ``torch._ops.OpOverload._schema`` is not one).

    Raises:
        ImportError, AttributeError: when this torch has no such object.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {path!r} can be imported")


# Attributes that live on instances, not on their class: resolved on an example.
_INSTANCE_ATTRIBUTES = {
    "torch._ops.OpOverload._schema": lambda: torch.ops.aten.add.Tensor,
    "torch._ops.OpOverload._overloadpacket": lambda: torch.ops.aten.add.Tensor,
    "torch._ops.OpOverload._overloadname": lambda: torch.ops.aten.add.Tensor,
    "torch._ops.OpOverload.py_kernels": lambda: torch.ops.aten.add.Tensor,
    "torch._ops.OpOverload._dispatch_cache": lambda: torch.ops.aten.add.Tensor,
    "torch.fx.graph._Namespace._obj_to_name": lambda: torch.fx.Graph()._graph_namespace,
    "torch.nn.Module._buffers": torch.nn.Module,
}


def absent(paths: Iterable[str]) -> str | None:
    """The first of ``paths`` this torch lacks, or None. Imports the modules they
    name: for a failure's diagnosis, not for every run."""
    for path in paths:
        owner, _, name = path.rpartition(".")
        example = _INSTANCE_ATTRIBUTES.get(path)
        try:
            if example is not None:
                getattr(example(), name)
            elif path == "torch.export.exported_program.ExportedProgram._guards_code":
                if name not in resolve(owner).__annotations__:
                    return path
            else:
                resolve(path)
        except (ImportError, AttributeError):
            return path
    return None


def unexpected(exc: BaseException, internals: Iterable[str]) -> str:
    """What to say when torch raised ``exc`` inside code that leans on ``internals``:
    the internal this release lacks where one is missing, else the error itself;
    the release either way."""
    lines = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
    if isinstance(exc, (AttributeError, ImportError, NameError, TypeError)):
        missing = absent(internals)
        if missing is not None:
            return f"torch {RELEASE} has no {missing}, an internal epass needs here ({error})"
    return f"{error} (torch {RELEASE})"


def op_overloads(packet: Any) -> list[Any]:
    """Every overload of an operator packet, in the order torch walks them.

    ``OpOverloadPacket.op_overloads()`` came with torch 2.13; it is exactly this
    lookup of each name ``overloads()`` lists, which every declared release has.
    """
    return [getattr(packet, name) for name in packet.overloads()]


def record_size(reader: Any, name: str) -> int:
    """The size of member ``name`` as torch's zip reader (``PyTorchFileReader``) reads it.

    ``get_record_size`` came with torch 2.13; before, the reader tells the size only
    by reading the member, which costs a read of each member once more at load time.
    """
    size = getattr(reader, "get_record_size", None)
    if size is not None:
        return int(size(name))
    return len(reader.get_record(name))


# warnings.catch_warnings saves and restores the process's filter list: two threads
# that overlap would restore each other's filter, and leave it on for good.
_WARNINGS_LOCK = threading.RLock()


@contextlib.contextmanager
def _quiet(message: str, category: type[Warning]) -> Iterator[None]:
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)
        yield


def quiet_leaf_specs() -> contextlib.AbstractContextManager[None]:
    """Silence torch's ``LeafSpec`` ``FutureWarning`` (2.13 and later) while torch
    itself deep-copies a program's call graph (``run_decompositions`` and
    ``_get_updated_module_call_graph`` do): that one message, for that call. epass's
    own copies share leaf specs (``_program.copy_call_graph``) and raise none."""
    return _quiet(r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)


def quiet_loader() -> contextlib.AbstractContextManager[None]:
    """Silence the ``UserWarning`` torch 2.11 and 2.12 raise while loading an archive:
    they make each weight with ``torch.frombuffer`` over the bytes they read, which are
    not writable. The tensor is their only owner, so a write into it reaches nothing
    else. That one message, for that call."""
    return _quiet(r"The given buffer is not writable", UserWarning)

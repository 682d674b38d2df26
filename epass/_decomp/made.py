"""Who made a decomposition function: whether it is torch's code, holding nothing but
torch's code and plain data (torch's own functions are named by the slot torch
registers them in, :mod:`epass._decomp.identity`)."""

from __future__ import annotations

import enum
import functools
import inspect
import os
import threading
import types
from typing import Any

import torch

from epass._torch import operators

__all__ = ["label", "torch_made"]


_LOCK = threading.Lock()
# Verdicts on torch's own objects, keyed by the objects themselves (kept alive with
# the verdict, so that an address is never reused for another function).
_VERDICTS: dict[int, tuple[Any, bool]] = {}


@functools.cache
def _torch_root() -> str:
    return str(os.path.realpath(os.path.dirname(str(torch.__file__)))) + os.sep


def _torch_module(name: Any) -> bool:
    return isinstance(name, str) and (name == "torch" or name.startswith("torch."))


# Per code file: whether it lies in torch's installed package. Resolving a path is
# most of judging a function, and torch's decompositions share a handful of files.
_FILES: dict[str, bool] = {}


def _in_torch(code: types.CodeType) -> bool:
    name = code.co_filename
    found = _FILES.get(name)
    if found is None:
        try:
            found = os.path.realpath(name).startswith(_torch_root())
        except (OSError, ValueError, TypeError):
            found = False
        _FILES[name] = found
    return found


_DATA = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))
_TORCH_VALUES = (
    operators.OpOverload,
    operators.OpOverloadPacket,
    operators.HigherOrderOperator,
    torch.dtype,
    torch.layout,
    torch.memory_format,
    torch.device,
    operators.DispatchKey,
)


def _torch_made(obj: Any, seen: set[int], depth: int) -> bool:
    """Whether ``obj`` is code of the torch build, and holds nothing but torch's code
    and plain data: a function whose code object lies in torch's installed package
    (``functools.wraps`` copies names, never code), with its closure, defaults and
    wrapped objects checked the same way."""
    if depth > 64:
        return False
    if isinstance(obj, (*_DATA, *_TORCH_VALUES)):
        return True
    if id(obj) in seen:
        return True  # a cycle: judged where it started
    seen.add(id(obj))
    known = _VERDICTS.get(id(obj))  # judged whole before (torch's decompositions share parts)
    if known is not None and known[0] is obj:
        return known[1]
    step = depth + 1
    if isinstance(obj, (tuple, list, frozenset, set)):
        return all(_torch_made(x, seen, step) for x in obj)
    if isinstance(obj, dict):
        return all(_torch_made(item, seen, step) for item in obj.items())
    if isinstance(obj, types.ModuleType):
        return _torch_module(obj.__name__)
    if isinstance(obj, type):
        return _torch_module(obj.__module__) or obj.__module__ == "builtins"
    if isinstance(obj, enum.Enum):
        return _torch_made(type(obj), seen, step)
    if isinstance(obj, inspect.Signature):  # annotations are types; defaults are values
        defaults = [p.default for p in obj.parameters.values() if p.default is not p.empty]
        return _torch_made(defaults, seen, step)
    if isinstance(obj, functools.partial):
        return all(_torch_made(p, seen, step) for p in (obj.func, obj.args, obj.keywords))
    if isinstance(obj, types.MethodType):
        return _torch_made(obj.__func__, seen, step) and _torch_made(obj.__self__, seen, step)
    if isinstance(obj, types.BuiltinFunctionType):
        return _torch_module(getattr(obj, "__module__", None))
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        parts = [cells, obj.__defaults__, obj.__kwdefaults__, getattr(obj, "__wrapped__", None)]
        return _in_torch(obj.__code__) and all(_torch_made(p, seen, step) for p in parts)
    kind = type(obj)
    if _torch_module(kind.__module__) and hasattr(obj, "__dict__"):
        # torch's decorator objects (a type-promotion wrapper) and their fields
        return _torch_made(kind, seen, step) and _torch_made(vars(obj), seen, step)
    return False


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def torch_made(obj: Any) -> bool:
    """:func:`_torch_made`, cached per object."""
    with _LOCK:
        hit = _VERDICTS.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
    verdict = _torch_made(obj, set(), 0)
    with _LOCK:
        _VERDICTS[id(obj)] = (obj, verdict)
    return verdict


def label(obj: Any) -> str:
    """``module.qualname`` of a function (``partial(...)`` of a partial's)."""
    if isinstance(obj, functools.partial):
        return f"partial({label(obj.func)})"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"

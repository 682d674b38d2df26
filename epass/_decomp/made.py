"""Who made a decomposition function: torch's build, or the installed files of one
distribution; and its name when everything it reads is theirs or a constant.

torch's own functions are named by the slot torch registers them in (see
:mod:`epass._decomp.identity`); this module only says whether an object is torch's
code and holds nothing else. A consumer library's function (OpenVINO's, ExecuTorch's)
is named by its distribution's version and file, and by the values of everything it
reads, only when each of those is torch's code, the same distribution's code (its
file exactly as that version installed it, :mod:`epass._decomp.installed`) or an
immutable constant. A mutable container, another package's object or a file that is
not the installed one leaves it without a name, with the reason.
"""

from __future__ import annotations

import dis
import enum
import functools
import hashlib
import inspect
import json
import os
import sys
import threading
import types
from typing import Any

import torch

from epass._decomp import installed
from epass._torch import operators

__all__ = ["NotMade", "label", "library_name", "torch_made"]


class NotMade(Exception):
    """An object that is not made of one distribution's code and constants;
    ``reason`` says what it reads that is not."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
    # A torch.library.Library's handle on the dispatcher: the kernels it registered
    # are judged by the file that made it (:mod:`epass._decomp.kernels`).
    *(() if operators.DispatchModule is None else (operators.DispatchModule,)),
)
_PLAIN = (*_DATA, *_TORCH_VALUES)
_DATA_TYPES = frozenset(_DATA)  # by exact type: most of what a walk meets


def _torch_made(obj: Any, seen: dict[int, Any], depth: int) -> bool:
    """Whether ``obj`` is code of the torch build, and holds nothing but torch's code
    and plain data: a function whose code object lies in torch's installed package
    (``functools.wraps`` copies names, never code), with its closure, defaults and
    wrapped objects checked the same way. ``seen`` holds every object met, by
    address, and keeps it alive: a temporary freed in the walk would leave its
    address to the next one, which would pass unjudged."""
    if depth > 64:
        return False
    if type(obj) in _DATA_TYPES or isinstance(obj, _PLAIN):
        return True
    if id(obj) in seen:
        return True  # a cycle: judged where it started
    seen[id(obj)] = obj
    known = _VERDICTS.get(id(obj))  # judged whole before (torch's decompositions share parts)
    if known is not None and known[0] is obj:
        return known[1]
    step = depth + 1
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        parts = (obj.__defaults__, obj.__kwdefaults__, getattr(obj, "__wrapped__", None))
        return (
            _in_torch(obj.__code__)
            and _all_made(cells, seen, step)
            and _all_made(parts, seen, step)
        )
    if isinstance(obj, (tuple, list, frozenset, set)):
        return _all_made(obj, seen, step)
    if isinstance(obj, dict):
        return _all_made(obj.keys(), seen, step) and _all_made(obj.values(), seen, step)
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
        return _all_made((obj.func, obj.args, obj.keywords), seen, step)
    if isinstance(obj, types.MethodType):
        return _torch_made(obj.__func__, seen, step) and _torch_made(obj.__self__, seen, step)
    if isinstance(obj, types.BuiltinFunctionType):
        return _torch_module(getattr(obj, "__module__", None))
    kind = type(obj)
    if _torch_module(kind.__module__) and hasattr(obj, "__dict__"):
        # torch's decorator objects (a type-promotion wrapper) and their fields
        return _torch_made(kind, seen, step) and _torch_made(vars(obj), seen, step)
    return False


def _all_made(items: Any, seen: dict[int, Any], step: int) -> bool:
    # Plain data is judged here: most of what torch's functions hold is names and None.
    return all(type(x) in _DATA_TYPES or _torch_made(x, seen, step) for x in items)


@functools.lru_cache(maxsize=1024)
def _torch_path(filename: str) -> str:
    """``torch:`` and the path of a file of torch's inside its package."""
    return "torch:" + os.path.realpath(filename)[len(_torch_root()) :]


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


# The kinds whose verdict is kept by identity: functions and their bindings, as
# torch's registries hold them. A container's contents may change; these are read
# from their fields as they are when judged, as the top-level verdicts always were.
_KEPT_KINDS = (types.FunctionType, functools.partial, types.MethodType, type)


def torch_made(obj: Any) -> bool:
    """:func:`_torch_made`, cached per object. A walk that finds everything torch's
    also settles every function it met on the way (each reaches only objects the
    walk judged), so the functions torch's decompositions share are walked once."""
    with _LOCK:
        hit = _VERDICTS.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
    seen: dict[int, Any] = {}
    verdict = _torch_made(obj, seen, 0)
    with _LOCK:
        _VERDICTS[id(obj)] = (obj, verdict)
        if verdict:
            for address, met in seen.items():
                if isinstance(met, _KEPT_KINDS):
                    _VERDICTS.setdefault(address, (met, True))
    return verdict


def library_name(fn: Any) -> str:
    """The name of ``fn`` as one installed distribution's code: the distribution and
    its version, the function's module and qualified name, and a digest of what it
    reads (each function's file as installed, its closure, defaults and the globals
    its code names, by value). Made afresh at every call: a global rebound or a cell
    changed gives another name.

    Raises:
        NotMade: ``fn`` reads something that is neither torch's code, that
            distribution's code nor an immutable constant, or no distribution's files
            hold its code exactly as installed.
    """
    walk = _Walk()
    description = walk.describe(fn, 0)
    # Without a distribution it is torch's code and constants, in no slot torch knows.
    owner = "torch" if walk.distribution is None else "{}=={}".format(*walk.distribution)
    text = json.dumps(description, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return f"made:{owner}:{label(fn)}:{digest}"


def label(obj: Any) -> str:
    """``module.qualname`` of a function (``partial(...)`` of a partial's)."""
    if isinstance(obj, functools.partial):
        return f"partial({label(obj.func)})"
    module = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"


class _Walk:
    """One description of an object and everything it reads, by value: the
    distribution it finds first is the only one allowed besides torch."""

    def __init__(self) -> None:
        self.distribution: tuple[str, str] | None = None
        # Objects met before, by address (each kept alive here), and their index.
        self._seen: dict[int, int] = {}
        self._kept: list[Any] = []

    def own(self, filename: str, what: str) -> str:
        """The installed name of the file ``what`` lies in, which must belong to the
        walk's one distribution (the first file met sets it)."""
        found = installed.lookup(filename)
        if isinstance(found, installed.NotInstalled):
            raise NotMade(f"{what}: {found.reason}")
        dist = (found.distribution, found.version)
        if self.distribution is None:
            self.distribution = dist
        elif dist != self.distribution:
            raise NotMade(
                f"{what} is {dist[0]}'s code, beside {self.distribution[0]}'s: one "
                f"distribution's code is named, not two"
            )
        return found.name()

    def describe(self, obj: Any, depth: int) -> Any:
        if depth > 64:
            raise NotMade(f"{label(obj)} nests deeper than 64 objects")
        if isinstance(obj, float):
            return ["float", obj.hex()]
        if isinstance(obj, complex):
            return ["complex", obj.real.hex(), obj.imag.hex()]
        if isinstance(obj, _DATA):
            return [type(obj).__name__, repr(obj)]
        if isinstance(obj, _TORCH_VALUES):
            return ["torch", type(obj).__name__, str(obj)]
        index = self._seen.get(id(obj))
        if index is not None:
            return ["seen", index]  # a cycle, or an object read twice: named where met
        self._seen[id(obj)] = len(self._kept)
        self._kept.append(obj)
        return self._compound(obj, depth + 1)

    def _compound(self, obj: Any, step: int) -> Any:
        if type(obj) is tuple:
            return ["tuple", [self.describe(x, step) for x in obj]]
        if type(obj) is frozenset:
            items = [self.describe(x, step) for x in obj]
            return ["frozenset", sorted(items, key=json.dumps)]
        if isinstance(obj, types.ModuleType):
            return ["module", self._module(obj)]
        if isinstance(obj, type):
            return ["type", self._type(obj)]
        if isinstance(obj, enum.Enum):
            return ["enum", self._type(type(obj)), obj.name]
        if isinstance(obj, functools.partial):
            keywords = [[k, self.describe(v, step)] for k, v in sorted(obj.keywords.items())]
            return [
                "partial",
                self.describe(obj.func, step),
                self.describe(obj.args, step),
                keywords,
            ]
        if isinstance(obj, types.MethodType):
            return ["method", self.describe(obj.__func__, step), self.describe(obj.__self__, step)]
        if isinstance(obj, types.BuiltinFunctionType):
            module = getattr(obj, "__module__", None)
            if _torch_module(module) or module == "builtins":
                return ["builtin", module, obj.__qualname__]
            raise NotMade(f"it calls {module}.{obj.__qualname__}, which is not torch's")
        if isinstance(obj, types.FunctionType):
            return self._function(obj, step)
        kind = type(obj)
        if isinstance(obj, (torch.Tensor, torch.nn.Module)):
            raise NotMade(f"it reads a {kind.__qualname__}, whose values can change")
        if hasattr(obj, "__dict__") and not isinstance(obj, (list, dict, set, bytearray)):
            fields = [[k, self.describe(v, step)] for k, v in sorted(vars(obj).items())]
            return ["object", self._type(kind), fields]
        raise NotMade(f"it reads a {kind.__module__}.{kind.__qualname__}, which can change")

    def _module(self, module: types.ModuleType) -> str:
        if _torch_module(module.__name__):
            return module.__name__
        filename = getattr(module, "__file__", None)
        if filename is None:
            raise NotMade(f"it reads the module {module.__name__}, which has no file")
        return f"{module.__name__}@{self.own(filename, f'the module {module.__name__}')}"

    def _type(self, kind: type) -> str:
        if _torch_module(kind.__module__) or kind.__module__ == "builtins":
            return f"{kind.__module__}.{kind.__qualname__}"
        module = sys.modules.get(kind.__module__)
        if module is None or getattr(module, kind.__name__, None) is not kind:
            raise NotMade(f"it reads the class {kind.__qualname__}, which no module holds")
        return f"{kind.__qualname__}@{self._module(module)}"

    def _function(self, fn: types.FunctionType, step: int) -> Any:
        code = fn.__code__
        if _in_torch(code):
            where = _torch_path(code.co_filename)
        else:
            where = self.own(code.co_filename, label(fn))
        cells = [
            self.describe(c.cell_contents, step) if _filled(c) else None
            for c in fn.__closure__ or ()
        ]
        parts = [
            where,
            label(fn),
            code.co_firstlineno,
            cells,
            self.describe(fn.__defaults__ or (), step),
            [[k, self.describe(v, step)] for k, v in sorted((fn.__kwdefaults__ or {}).items())],
        ]
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            parts.append(["wrapped", self.describe(wrapped, step)])
        if not where.startswith("torch:"):  # torch's code is named by the build
            parts.append(self._globals(fn, step))
        return ["function", parts]

    def _globals(self, fn: types.FunctionType, step: int) -> list[Any]:
        """The globals ``fn``'s code loads by value, and the attributes it reads of
        them where they are the distribution's modules or classes (``cfg.FACTOR``,
        ``Settings.SCALE``: state no file names)."""
        read = []
        for chain in sorted(_global_chains(fn.__code__)):
            if chain[0] in _BY_NAME and chain[0] not in fn.__globals__:
                raise NotMade(
                    f"{label(fn)} reads attributes by name ({chain[0]}), which no name covers"
                )
            if chain[0] not in fn.__globals__:
                continue  # a builtin, or a name the code never finds
            value = fn.__globals__[chain[0]]
            steps = [self.describe(value, step)]
            for attribute in chain[1:]:
                if not self._holds_state(value):
                    break
                value = inspect.getattr_static(value, attribute, _MISSING)
                if value is _MISSING:
                    break
                steps.append([attribute, self.describe(value, step)])
            read.append([chain[0], steps])
        return read

    @staticmethod
    def _holds_state(obj: Any) -> bool:
        """Whether ``obj``'s attributes are state beside its file: a module, class,
        function or object of a class that is not torch's (torch's are named by the
        build); an object's include its class's (``options.scale`` set on the class)."""
        if isinstance(obj, types.ModuleType):
            return not _torch_module(obj.__name__)
        if isinstance(obj, types.FunctionType):
            return not _in_torch(obj.__code__)
        kind = obj if isinstance(obj, type) else type(obj)
        return not (_torch_module(kind.__module__) or kind.__module__ == "builtins")


_MISSING = object()
_ATTRIBUTE = ("LOAD_ATTR", "LOAD_METHOD")
# Builtins reading an attribute named at run time: what they read is named nowhere.
_BY_NAME = frozenset({"getattr", "vars"})


@functools.lru_cache(maxsize=4096)
def _global_chains(code: types.CodeType) -> frozenset[tuple[str, ...]]:
    """The globals ``code`` and the code nested in it (a comprehension, an inner
    function, a lambda) load, each with the attributes read of it right after
    (``("cfg", "FACTOR")``)."""
    found: set[tuple[str, ...]] = set()
    chain: list[str] = []
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            if chain:
                found.add(tuple(chain))
            chain = [str(instruction.argval)]
        elif instruction.opname in _ATTRIBUTE and chain:
            chain.append(str(instruction.argval))
        elif chain:
            found.add(tuple(chain))
            chain = []
    if chain:
        found.add(tuple(chain))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _global_chains(const)
    return frozenset(found)

"""Names of decomposition functions for cache keys: torch's own by identity, a user's
only through the identity it declares, an installed library's by its version, file
and what it reads; anything else has no name and is never cached.

A cache may only answer what it can name completely. No fingerprint of arbitrary
Python sees every value a function may read (a module attribute, an environment
variable, a list it closes over), so a user's function takes part only through a
declared ``cache_key`` (Inductor's rule for custom passes, ``uuid()``). A library's
function is named only when its code is the file its installed version put there
and everything it reads is torch's, that library's, or a constant
(:mod:`epass._decomp.made`).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from epass._decomp import disk, kernels, made, state
from epass._decomp.table import DefaultSide, Tables
from epass._torch import operators

__all__ = [
    "CACHE_KEY",
    "CacheName",
    "NAMED",
    "Unnamed",
    "cache_name",
    "declared_key",
    "library_kernels",
    "name_of",
    "name_table",
    "settings",
    "torch_name",
]

CACHE_KEY = "cache_key"
"""The attribute (a string, or a method returning one) by which a user's decomposition
declares its identity. Change it whenever the function's behaviour changes."""


class Unnamed(Exception):
    """A decomposition the cache cannot name; ``reason`` says which and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_LOCK = threading.Lock()


def _registered() -> dict[int, tuple[Any, str]]:
    """torch's decomposition registry by object: ``id -> (object, "kind:op")``."""
    found: dict[int, tuple[Any, str]] = {}
    for kind, table in operators.decomposition_registry().items():
        for op, fn in list(table.items()):
            found.setdefault(id(fn), (fn, f"{kind}:{op}"))
    return found


_REGISTRY: dict[int, tuple[Any, str]] = {}
_REGISTRY_SIZE = -1


def _registry_name(fn: Any, op: Any) -> str | None:
    """The name of ``fn`` in torch's decomposition registry (None: not there)."""
    registry = operators.decomposition_registry()
    for kind, table in registry.items():
        if table.get(op) is fn:
            return f"{kind}:{op}"
    global _REGISTRY, _REGISTRY_SIZE
    size = sum(len(t) for t in registry.values())
    with _LOCK:
        if size != _REGISTRY_SIZE:
            _REGISTRY, _REGISTRY_SIZE = _registered(), size
        hit = _REGISTRY.get(id(fn))
    return hit[1] if hit is not None and hit[0] is fn else None


def torch_name(fn: Any, op: Any) -> str | None:
    """The name of ``fn`` if it is torch's own: the very object torch registers for an
    operator (its decomposition registry, the preserve marker, an operator's Python
    CompositeImplicitAutograd kernel, or its ``_get_decomp_for_cia`` binding)."""
    if fn is operators.preserve_marker():
        return "torch:preserve"
    if (
        isinstance(fn, functools.partial)
        and getattr(fn.func, "__code__", None) is operators.cia_binding_code()
        and not fn.args
        and set(fn.keywords) == {"kernel"}
        and isinstance(fn.keywords["kernel"], operators.OpOverload)
    ):
        return f"torch:cia:{fn.keywords['kernel']}"
    if isinstance(op, operators.OpOverload):
        kernel = operators.python_kernels(op).get(operators.CIA_KEY)
        if kernel is fn and made.torch_made(fn):
            return f"torch:py_kernel:{op}"
    registered = _registry_name(fn, op)
    if registered is not None and made.torch_made(fn):
        return f"torch:{registered}"
    return None


def _label(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None and isinstance(fn, functools.partial):
        return f"partial({_label(fn.func)})"
    return str(name) if name is not None else type(fn).__name__


def declared_key(fn: Any) -> str | None:
    """The identity ``fn`` declares (its ``cache_key``), or None.

    Raises:
        TypeError: when ``cache_key`` is there but is not a string (or a method
            returning one), or when reading or calling it raises.
    """
    try:
        value = getattr(fn, CACHE_KEY, None)
    except Exception as exc:  # a property that raises
        raise TypeError(f"{_label(fn)}.{CACHE_KEY} raised {type(exc).__name__}: {exc}") from exc
    if value is None:
        return None
    if callable(value):
        try:
            value = value()
        except Exception as exc:  # named like a bad value: that one function is uncached
            raise TypeError(
                f"{_label(fn)}.{CACHE_KEY}() raised {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{_label(fn)}.{CACHE_KEY} must be a non-empty string (or a method returning "
            f"one), got {type(value).__name__}"
        )
    return value


def name_of(fn: Any, op: Any) -> str:
    """A name of the decomposition ``fn`` (the table's entry for ``op``) that is the
    same in every process running the same code and the same declarations: torch's
    own by identity, a user's by the identity it declares, and an installed
    library's by its version, file and what it reads (:func:`made.library_name`).

    Raises:
        Unnamed: ``fn`` is none of these.
    """
    own = torch_name(fn, op)
    if own is not None:
        return own
    try:
        declared = declared_key(fn)
    except TypeError as exc:
        raise Unnamed(str(exc)) from None
    if declared is not None:
        module = getattr(fn, "__module__", None) or type(fn).__module__
        return f"user:{module}.{_label(fn)}:{declared}"
    try:
        return made.library_name(fn)
    except made.NotMade as exc:
        raise Unnamed(
            f"{_label(fn)} ({op}) declares no cache identity ({CACHE_KEY}), and is not a "
            f"library's own code: {exc.reason}"
        ) from None


def name_table(entries: Iterable[tuple[str, Any, Callable[..., Any]]]) -> list[tuple[str, ...]]:
    """Names of a table's entries ``(side, op, fn)``, sorted.

    Raises:
        Unnamed: for the entries that cannot be named (all of them in its reason).
    """
    names = []
    unnamed = []
    for side, op, fn in entries:
        try:
            names.append((side, str(op), name_of(fn, op)))
        except Unnamed as exc:
            unnamed.append(exc.reason)
    if unnamed:
        more = f" and {len(unnamed) - 3} more" if len(unnamed) > 3 else ""
        raise Unnamed("; ".join(unnamed[:3]) + more)
    return sorted(names)


def library_kernels() -> list[str]:
    """The kernels registered from Python through ``torch.library`` for ATen or prims
    operators that are not torch's own (``"aten::gelu/CompositeImplicitAutograd"``):
    arbitrary Python behind an operator every decomposition may call (see
    :mod:`epass._decomp.kernels`, which reads them again at every registration)."""
    return list(kernels.registered().foreign)


def settings() -> tuple[tuple[str, Any], ...]:
    """The process-wide settings torch's decompositions read (the attention backend a
    ``scaled_dot_product_attention`` decomposes to, the default dtype of the tensors
    a decomposition creates, ...): part of every template key."""
    cuda = torch.backends.cuda
    found: list[tuple[str, Any]] = [
        ("default_dtype", str(torch.get_default_dtype())),
        ("deterministic", torch.are_deterministic_algorithms_enabled()),
        ("deterministic_warn", torch.is_deterministic_algorithms_warn_only_enabled()),
        ("matmul_precision", torch.get_float32_matmul_precision()),
        ("grad", torch.is_grad_enabled()),
        ("inference", torch.is_inference_mode_enabled()),
        ("autocast_cpu", torch.is_autocast_enabled("cpu")),
    ]
    getter: Mapping[str, str] = {
        "flash_sdp": "flash_sdp_enabled",
        "mem_efficient_sdp": "mem_efficient_sdp_enabled",
        "math_sdp": "math_sdp_enabled",
        "cudnn_sdp": "cudnn_sdp_enabled",
        "math_sdp_reduction": "fp16_bf16_reduction_math_sdp_allowed",
    }
    for label, name in getter.items():
        fn = getattr(cuda, name, None)
        found.append((label, fn() if callable(fn) else None))
    device = getattr(torch, "get_default_device", None)
    found.append(("default_device", str(device()) if callable(device) else None))
    return tuple(found)


@attrs.frozen
class CacheName:
    """What names one decomposition's templates in the caches.

    Attributes:
        table: a name of the table that is the same in every process running the same
            code and declarations (None: the table cannot be named, and its templates
            are traced afresh for this decomposition alone, never kept in memory or
            on disk for another).
        why_not: why the table has no name (None when it has one).
        settings: the process-wide settings torch's decompositions read.
        unkept: operators (``"mylib::foo"``, as ``OpOverload.name()`` spells them)
            whose decomposition runs a CompositeImplicitAutograd kernel that nothing
            names (registered from Python, or in C++ outside torch's source tree):
            their templates are traced for this decomposition alone, whatever the
            table's name.
        unkept_why: why, for each of ``unkept``.
    """

    table: str | None
    why_not: str | None
    settings: tuple[tuple[str, Any], ...]
    unkept: frozenset[str] = frozenset()
    unkept_why: tuple[tuple[str, str], ...] = ()

    def keeps(self, op: Any) -> bool:
        """Whether templates of the operator ``op`` are kept for later decompositions
        (in memory, and on disk where their key allows)."""
        if self.table is None:
            return False
        return (
            not self.unkept
            or not isinstance(op, operators.OpOverload)
            or (op.name() not in self.unkept)
        )


# Per table: the names of torch's own entries (fixed for the process), and the other
# entries, named again at every decomposition (a declaration may come, go or change).
NAMED: collections.OrderedDict[Any, tuple[str, list[Any]]] = collections.OrderedDict()


def cache_name(tables: Tables) -> CacheName:
    """The name of ``tables`` for this decomposition's template keys (see
    :class:`CacheName`). torch's own decompositions are named by identity, a user's
    only through the ``cache_key`` it declares, an installed library's by what it
    is (:func:`name_of`); Python kernels registered through ``torch.library`` by
    :mod:`epass._decomp.kernels`."""
    read = settings()
    registered = kernels.registered()
    library = registered.foreign
    unkept = frozenset(op for op, _ in registered.unkept)
    if library:
        more = f" and {len(library) - 2} more" if len(library) > 2 else ""
        why = (
            f"Python kernels registered through torch.library for {', '.join(library[:2])}"
            f"{more} cannot be named"
        )
        return CacheName(None, why, read, unkept, registered.unkept)
    with state.LOCK:
        known = NAMED.get(tables.token)
    if known is None:
        known = _name_entries(tables)
        with state.LOCK:
            NAMED[tables.token] = known
            while len(NAMED) > 64:
                NAMED.popitem(last=False)
    fixed, others = known
    if not others:
        return CacheName(fixed, None, read, unkept, registered.unkept)
    try:
        names = name_table(others)
    except Unnamed as exc:
        return CacheName(None, exc.reason, read, unkept, registered.unkept)
    return CacheName(disk.digest([fixed, names])[1], None, read, unkept, registered.unkept)


def _name_entries(tables: Tables) -> tuple[str, list[Any]]:
    """torch's own part of the table's name (a digest), and its other entries."""
    if isinstance(tables.cia, DefaultSide):
        split = tables.cia.split
        fixed: list[Any] = [
            "default",
            sorted(str(op) for op in split.keep),
            sorted(str(op) for op in operators.preserved_aten_cia_ops()),
            sorted(tables.token[1]),
        ]
        entries = [("python", op, fn) for op, fn in split.core.items()]
        entries += _python_cia_kernels()
    else:
        fixed = ["explicit", sorted(tables.token[1])]
        entries = [
            (side, op, fn)
            for side, part in (("cia", tables.cia), ("python", tables.python))
            for op, fn in part.items()
        ]
    names, others = [], []
    for side, op, fn in entries:
        own = f"dispatch:{fn}" if isinstance(fn, operators.DispatchKey) else torch_name(fn, op)
        if own is not None:
            names.append((side, str(op), own))
        else:
            others.append((side, op, fn))
    return disk.digest([*fixed, sorted(names)])[1], others


def _python_cia_kernels() -> list[tuple[str, Any, Any]]:
    """Every loaded operator's Python CompositeImplicitAutograd kernel: what its own
    decomposition runs, in torch's default table."""
    found = []
    for space_name in list(torch.ops):
        space = getattr(torch.ops, space_name)
        if not isinstance(space, operators.OpNamespace):
            continue
        for packet_name in list(space):
            packet = getattr(space, packet_name)
            for overload_name in list(packet):
                op = getattr(packet, overload_name)
                kernel = operators.python_kernels(op).get(operators.CIA_KEY)
                if kernel is not None:
                    found.append(("kernel", op, kernel))
    return found

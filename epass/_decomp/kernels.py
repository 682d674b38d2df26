"""The Python kernels registered through ``torch.library`` that a template may run,
and which of them no cache key can name.

A kernel registered from Python for an ATen or prims operator is arbitrary Python
behind an operator every decomposition may call: while one that is not torch's own
is registered, no table has a name. A CompositeImplicitAutograd kernel registered
from Python for another namespace's operator (a custom op's) is what that operator's
decomposition runs: its templates are traced for each run. torch registers hundreds
of kernels itself, from its own files (meta kernels, the prims).

Whose a kernel is, the dispatcher says only by the file that made the library that
registered it. That is evidence for torch's own files, but not for torch's front
doors (``torch.library.impl`` without a library, ``torch/_library``), which make
libraries for anyone's kernels: a kernel registered there is not torch's, but for a
``torch.library.custom_op`` operator, whose Python functions are read and judged.

The answer is read again whenever a library is made, destroyed or registers a key
it did not hold (:func:`operators.library_key_sets`), and a custom op's functions at
every call. A library registering a second kernel for a key it already holds
changes nothing Python can see; the first one was judged by the same file.

A CompositeImplicitAutograd kernel registered in C++ for an operator outside ATen
and prims (a C++ extension's custom op) is judged the same way, by where the
dispatcher says it was registered: torch's own lie in the source tree torch was
built from (read off the file torch's build generates to register ATen's own); any
other, or one whose place the dispatcher does not say, leaves that operator's
templates traced for each run.
These are read again whenever the set of CompositeImplicitAutograd registrations
changes, as it does when a library defines an operator.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
from collections.abc import Collection
from typing import Any

import attrs
import torch

from epass._decomp import made
from epass._torch import operators

__all__ = ["Kernels", "registered"]

_CIA = "CompositeImplicitAutograd"
_FRONT_DOORS = ("library.py", "_custom_ops.py", "_library/", "_custom_op/")
_CUSTOM_OPS = "_library/custom_ops.py"


@attrs.frozen
class Kernels:
    """The Python kernels of ``torch.library`` that are not torch's own.

    Attributes:
        foreign: ATen and prims kernels (``"aten::gelu/CompositeImplicitAutograd"``):
            while one is registered, no table has a name.
        unkept: operators of other namespaces (``"mylib::foo"``) whose
            CompositeImplicitAutograd kernel is not torch's, each with why: their
            templates are traced for each run.
    """

    foreign: tuple[str, ...]
    unkept: tuple[tuple[str, str], ...]


@attrs.define
class _Known:
    """What the last look found: each library's key set by address (kept alive) and
    its size, each key's verdict (None: torch's own; :data:`_CUSTOM_OPS`: a custom
    op's, judged at each call), and the custom ops judged with their functions."""

    count: int = -1
    libraries: dict[int, tuple[Collection[str], int]] = attrs.Factory(dict)
    verdicts: dict[str, str | None] = attrs.Factory(dict)
    # The answer but for custom ops, and each custom op's keys.
    foreign: list[str] = attrs.Factory(list)
    unkept: dict[str, str] = attrs.Factory(dict)
    custom_keys: dict[str, list[str]] = attrs.Factory(dict)
    custom: dict[str, tuple[tuple[Any, ...], str | None]] = attrs.Factory(dict)
    # C++ CompositeImplicitAutograd kernels outside torch's source tree, and the
    # registrations they were read from
    compiled: dict[str, str] = attrs.Factory(dict)
    registrations: frozenset[str] = frozenset()


_LOCK = threading.Lock()
_KNOWN = _Known()


def _considered(key: str) -> bool:
    # A key without a dispatch key is a kernel registered with the library's own,
    # none: torch.library registers it as CompositeImplicitAutograd.
    namespace, _, rest = key.partition("/")
    return namespace in ("aten", "prims") or rest.endswith(("/" + _CIA, "/"))


def registered() -> Kernels:
    """The Python kernels registered through ``torch.library`` that are not torch's
    own (see :class:`Kernels`). When nothing changed it costs a walk over the live
    libraries and over the functions of torch's custom ops (about 130 of each)."""
    impls = operators.library_impls()
    with _LOCK:
        key_sets = operators.library_key_sets()
        libraries = {id(s): (s, len(s)) for s in key_sets}
        changed = _changed(_KNOWN.libraries, libraries)
        registrations = operators.cia_registrations()
        python_changed = bool(changed) or _KNOWN.count != len(impls)
        if python_changed:
            _read_again(impls, changed, key_sets)
            _KNOWN.count, _KNOWN.libraries = len(impls), libraries
        if python_changed or registrations != _KNOWN.registrations:
            _KNOWN.compiled = _compiled(impls, registrations)
            _KNOWN.registrations = registrations
        foreign, unkept = list(_KNOWN.foreign), dict(_KNOWN.unkept)
        for qualname, keys in _KNOWN.custom_keys.items():
            why = _custom_op(qualname)
            if why is not None:
                _place(keys, why, foreign, unkept)
        for name, why in _KNOWN.compiled.items():
            unkept.setdefault(name, why)
    return Kernels(tuple(sorted(foreign)), tuple(sorted(unkept.items())))


def _compiled(impls: Collection[str], registrations: frozenset[str]) -> dict[str, str]:
    """The operators outside ATen and prims whose CompositeImplicitAutograd kernel
    was registered in C++ outside the source tree torch was built from, each with
    where. Read again whenever the registrations or the Python kernels change."""
    python = {k for k in list(impls) if _considered(k)}  # judged by the file instead
    root = _build_root()
    found: dict[str, str] = {}
    for name in registrations:
        namespace, _, op = name.partition("::")
        if namespace in ("aten", "prims"):
            continue  # torch's build's, or a Python kernel judged above
        if f"{namespace}/{op}/{_CIA}" in python or f"{namespace}/{op}/" in python:
            continue
        where = operators.registered_from(f"{namespace}/{op}/{_CIA}").replace("\\", "/")
        if not where:
            found[name] = f"{name} runs a C++ kernel the dispatcher does not say the place of"
        elif root is None or not where.startswith(root):
            found[name] = f"{name} runs a C++ kernel registered at {where}, not torch's own"
    return found


def _build_root() -> str | None:
    """The source tree torch was built from (``/pytorch/``), read off the file torch's
    build generates to register ATen's CompositeImplicitAutograd kernels (``linear``'s);
    None when the dispatcher names another file (an extension that replaced that
    kernel) or none: then no C++ kernel outside ATen counts as torch's."""
    where = operators.registered_from(f"aten/linear/{_CIA}").replace("\\", "/")
    head, found, _ = where.partition("/aten/src/ATen/RegisterCompositeImplicitAutograd")
    if not found:
        return None
    return head.removesuffix("/build") + "/"


def _read_again(impls: Collection[str], changed: set[str], key_sets: list[Collection[str]]) -> None:
    keys = {k for k in list(impls) if _considered(k)}
    for gone in _KNOWN.verdicts.keys() - keys:
        del _KNOWN.verdicts[gone]
    asked = {k for k in keys if k in changed or k not in _KNOWN.verdicts}
    # A library's kernels all carry the file that made the library (torch.library
    # hands it to the dispatcher once, at the library's birth), and a key is held by
    # one live library at a time: one question a library, ~20 us each.
    for key_set in key_sets:
        mine = [k for k in list(key_set) if k in asked]
        if mine:
            verdict = _judge(mine[0])
            for key in mine:
                _KNOWN.verdicts[key] = verdict
            asked.difference_update(mine)
    for key in asked:  # held by no library torch.library knows of: asked alone
        _KNOWN.verdicts[key] = _judge(key)
    _KNOWN.foreign, _KNOWN.unkept, _KNOWN.custom_keys = [], {}, {}
    for key, verdict in _KNOWN.verdicts.items():
        if verdict == _CUSTOM_OPS:
            _KNOWN.custom_keys.setdefault(_custom_op_name(key), []).append(key)
        elif verdict is not None:
            _place([key], verdict, _KNOWN.foreign, _KNOWN.unkept)


def _place(keys: list[str], why: str, foreign: list[str], unkept: dict[str, str]) -> None:
    for key in keys:
        namespace, _, rest = key.partition("/")
        op, _, dispatch_key = rest.rpartition("/")
        if namespace in ("aten", "prims"):
            foreign.append(f"{namespace}::{op}/{dispatch_key}")
        else:
            unkept[f"{namespace}::{op}"] = why


def _changed(
    before: dict[int, tuple[Collection[str], int]], now: dict[int, tuple[Collection[str], int]]
) -> set[str]:
    """The keys of every library made, destroyed or grown since ``before``: a key a
    library registers may now be another file's kernel."""
    keys: set[str] = set()
    for address in before.keys() | now.keys():
        old, new = before.get(address), now.get(address)
        if old is None or new is None or old[0] is not new[0] or old[1] != new[1]:
            for entry in (old, new):
                if entry is not None:
                    keys |= set(entry[0])
    return keys


@functools.cache
def _torch_root() -> str:
    return os.path.realpath(os.path.dirname(str(torch.__file__))) + os.sep


@functools.lru_cache(maxsize=256)
def _realpath(path: str) -> str:
    return os.path.realpath(path)  # a handful of files register thousands of kernels


def _judge(key: str) -> str | None:
    """None when the kernel of ``key`` is torch's own; else why not
    (:data:`_CUSTOM_OPS`: a custom op's, judged by its functions at each call)."""
    where = operators.registered_from(key)
    if not where:
        return "the dispatcher does not say where it was registered"
    root = _torch_root()
    real = _realpath(where)
    if not real.startswith(root):
        return f"registered from {where}"
    inside = real[len(root) :].replace(os.sep, "/")
    if inside == _CUSTOM_OPS:
        return _CUSTOM_OPS
    if inside.startswith(_FRONT_DOORS):
        return f"registered through torch's {inside}, for anyone's kernel"
    return None


def _custom_op_name(key: str) -> str:
    namespace, _, rest = key.partition("/")
    return f"{namespace}::{rest.rpartition('/')[0].split('.')[0]}"


def _custom_op(qualname: str) -> str | None:
    """None when the ``torch.library.custom_op`` operator ``qualname`` runs torch's
    functions alone; else why not. Judged again when one of its functions changed
    (``register_kernel`` replaces one without registering anything)."""
    functions = operators.custom_op_functions(qualname)
    if functions is None:
        return f"registered through torch's {_CUSTOM_OPS}, for anyone's kernel"
    known = _KNOWN.custom.get(qualname)
    if known is not None and _same(known[0], functions):
        return known[1]
    strange = [made.label(fn) for fn in functions if not made.torch_made(fn)]
    verdict = f"{qualname} runs {', '.join(strange)}, not torch's" if strange else None
    _KNOWN.custom[qualname] = (functions, verdict)
    return verdict


def _same(before: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    return len(before) == len(now) and all(map(operator.is_, before, now))

"""The on-disk decomposition-template cache: JSON entries in a private directory.

Stdlib only at import (``epass cache info`` starts without torch). An entry is data:
it is read with :func:`json.loads` and checked field by field; operators are looked up
by name among ``torch.ops.aten`` / ``torch.ops.prims`` only, and plain functions among
a fixed list. Nothing in an entry is ever imported, unpickled or evaluated.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from epass._version import __version__

__all__ = [
    "DIR_ENV",
    "FORMAT",
    "cache_info",
    "clear_cache",
    "SIZE_ENV",
    "clear",
    "directory",
    "info",
    "limit",
    "load",
    "prune",
    "store",
]

DIR_ENV = "EPASS_CACHE_DIR"
SIZE_ENV = "EPASS_CACHE_SIZE"
FORMAT = 1
# A version folder: a later format lives beside this one and never reads its files.
_SUBDIR = f"templates-v{FORMAT}"
_DEFAULT_LIMIT = 64 * 1024 * 1024
# An entry is a few kilobytes; anything much larger is not one of ours.
_MAX_ENTRY = 4 * 1024 * 1024
_HASH = re.compile(r"^[0-9a-f]{64}$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0, "writes": 0, "rejected": 0, "bypassed": 0}
_WARNED = False


def directory() -> Path | None:
    """The cache directory, or None when ``EPASS_CACHE_DIR`` is set and empty."""
    configured = os.environ.get(DIR_ENV)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "epass"


# Bytes, or a number with a binary unit: 500000, 64M, 64MiB, 1.5G (K, M, G, T; 1024-based).
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:I?B)?|B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BAD_SIZES: set[str] = set()


def limit() -> int:
    """The size bound in bytes (``EPASS_CACHE_SIZE``, default 64 MiB).

    A value that is not a size is reported once, naming it, and the default used.
    """
    text = os.environ.get(SIZE_ENV, "").strip()
    if not text:
        return _DEFAULT_LIMIT
    match = _SIZE.fullmatch(text)
    if match is None:
        with _LOCK:
            first = text not in _BAD_SIZES
            _BAD_SIZES.add(text)
        if first:
            warnings.warn(
                f"{SIZE_ENV}={text!r:.60} is not a size (bytes, or a number with K, M, G "
                f"or T, as in 64M); the template cache uses the default, "
                f"{_DEFAULT_LIMIT >> 20} MiB",
                RuntimeWarning,
                stacklevel=2,
            )
        return _DEFAULT_LIMIT
    number, unit = match.groups()
    whole, _, fraction = number.partition(".")
    if len(whole.lstrip("0")) > 18:
        return sys.maxsize  # more than any disk holds: no bound
    scale: int = _UNITS[(unit or "").upper()]
    fraction = fraction[:12]  # digits beyond a byte of the largest unit change nothing
    # Integer arithmetic: a float of many digits overflows.
    divisor: int = 10 ** len(fraction)
    return int(whole) * scale + int(fraction or "0") * scale // divisor


def _warn(message: str) -> None:
    global _WARNED
    with _LOCK:
        _STATS["rejected"] += 1
        if _WARNED:
            return
        _WARNED = True
    warnings.warn(
        f"epass template cache: {message}; ignored (it is rebuilt)", RuntimeWarning, stacklevel=3
    )


_T = TypeVar("_T")


def _quiet(default: Any) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """The disk cache never makes a decomposition fail or fall back: an error in it
    (whatever the environment or the directory holds) is reported once and costs
    the entry, nothing more."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def quiet(*args: Any, **kwargs: Any) -> _T:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                _warn(f"{fn.__name__} failed ({type(exc).__name__}: {exc!s:.200})")
                return default  # type: ignore[no-any-return]

        return quiet

    return wrap


def _entries_dir(create: bool) -> Path | None:
    root = directory()
    if root is None:
        return None
    path = root / _SUBDIR
    if create:
        try:
            # 0700: templates describe the user's programs (operators and shapes).
            os.makedirs(root, mode=0o700, exist_ok=True)
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError:
            return None
    for folder in (root, path):
        try:
            # The root may be a link the user made; the entries folder is ours.
            st = folder.stat() if folder is root else folder.lstat()
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            _warn(f"{folder} is a symbolic link; the disk cache is off")
            return None
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            _warn(f"{folder} belongs to another user")
            return None
        # Whoever can write here can plant entries (or swap the entries folder).
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            _warn(f"{folder} is writable by other users; the disk cache is off")
            return None
    return path


def digest(key: Any) -> tuple[str, str]:
    """The key's canonical text and its file name stem."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return text, hashlib.sha256(text.encode()).hexdigest()


def environment() -> dict[str, str]:
    """The key parts that name the software: a template is reused by the same build."""
    import torch

    return {
        "epass": __version__,
        "torch": str(torch.__version__),
        "torch_git": str(getattr(torch.version, "git_version", "")),
        "python": sys.version,
    }


@_quiet(None)
def load(key: Any) -> Any:
    """The template data stored under ``key``, or None (missing, or rejected)."""
    folder = _entries_dir(create=False)
    if folder is None:
        return None
    text, name = digest(key)
    path = folder / f"{name}.json"
    try:
        # Not following a link, and not waiting on a FIFO or a device for a writer.
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        with _LOCK:
            _STATS["misses"] += 1
        return None
    except OSError as exc:
        _warn(f"cannot read {path.name} ({exc})")
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
            raw = f.read(_MAX_ENTRY + 1) if regular else b""
    except OSError as exc:
        _warn(f"cannot read {path.name} ({exc})")
        return None
    problem, data = _parse(raw, text) if regular else ("is not a regular file", None)
    if problem:
        _warn(f"entry {path.name} {problem}")
        discard(key)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # the eviction order is by last use
    with _LOCK:
        _STATS["hits"] += 1
    return data


@_quiet(False)
def exists(key: Any) -> bool:
    """Whether an entry for ``key`` is on disk (not whether it is sound)."""
    folder = _entries_dir(create=False)
    return folder is not None and (folder / f"{digest(key)[1]}.json").is_file()


def _parse(raw: bytes, key_text: str) -> tuple[str, Any]:
    """What is wrong with the entry (empty: nothing) and its template."""
    if len(raw) > _MAX_ENTRY:
        return "is too large", None
    try:
        entry = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "is not JSON (corrupt or truncated)", None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return "has another format", None
    body = entry.get("template")
    if json.dumps(entry.get("key"), sort_keys=True, separators=(",", ":")) != key_text:
        return "belongs to another key", None
    check = hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    if entry.get("sha256") != check:
        return "fails its checksum", None
    return "", body


def discard(key: Any) -> None:
    folder = _entries_dir(create=False)
    if folder is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(folder / f"{digest(key)[1]}.json")


@_quiet(False)
def store(key: Any, template: Any) -> bool:
    """Write one entry atomically (a temporary file renamed into place)."""
    folder = _entries_dir(create=True)
    if folder is None:
        return False
    body = json.dumps(template, sort_keys=True, separators=(",", ":"))
    entry = {
        "format": FORMAT,
        "key": key,
        "sha256": hashlib.sha256(body.encode()).hexdigest(),
        "template": template,
    }
    data = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()
    bound = limit()
    # One that cannot fit would be evicted at once, and evict every other entry first.
    if len(data) > min(_MAX_ENTRY, bound):
        return False
    name = digest(key)[1]
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / f"{name}.json")
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    with _LOCK:
        _STATS["writes"] += 1
    _keep_bound(folder, len(data), bound)
    return True


def _files(folder: Path) -> Iterator[tuple[Path, os.stat_result]]:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        stem = name[:-5] if name.endswith(".json") else None
        if stem is None or not _HASH.match(stem):
            continue
        path = folder / name
        try:
            yield path, path.stat()
        except OSError:
            continue  # removed meanwhile by another process


def prune(max_bytes: int | None = None) -> int:
    """Remove the least recently used entries until the cache fits; returns how many."""
    folder = _entries_dir(create=False)
    if folder is None:
        return 0
    bound = limit() if max_bytes is None else max_bytes
    return _prune(folder, bound, bound)[0]


def _prune(folder: Path, bound: int, target: int) -> tuple[int, int]:
    """When the entries take more than ``bound`` bytes, remove the least recently used
    until they take at most ``target``. Returns how many were removed and the bytes
    left. One scan of the directory."""
    files = sorted(_files(folder), key=lambda f: f[1].st_mtime)
    total = sum(st.st_size for _, st in files)
    if total <= bound:
        return 0, total
    removed = 0
    for path, st in files:
        if total <= target:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
        total -= st.st_size
    return removed, total


# The directory's size at this process's last scan of it plus what it wrote there
# since: when that passes the bound, the next scan is due. Other processes' writes
# show at the next scan; each process keeps its own writes within the bound.
_KNOWN: dict[Path, int] = {}
# A prune goes this far below the bound, so that a full cache is scanned once per
# fifth of the bound written rather than at every write.
_LOW_WATER = 0.8


def _keep_bound(folder: Path, written: int, bound: int) -> None:
    with _LOCK:
        known = _KNOWN.pop(folder, None)
        if known is None and not written:
            return  # nothing written there by this process: nothing of its own to bound
        if known is not None and known + written <= bound:
            _KNOWN[folder] = known + written
            return
    left = _prune(folder, bound, int(bound * _LOW_WATER))[1]
    with _LOCK:
        _KNOWN.clear()  # one directory at a time is all a process uses
        _KNOWN[folder] = left


def _is_dir(path: Path) -> bool:
    # Path.is_dir raises for some errors (a name too long, no permission to search);
    # a link to a folder is not the entries folder.
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def info() -> dict[str, Any]:
    """Where the disk cache is, how big it is, and this process's use of it."""
    root = directory()
    folder = None if root is None else root / _SUBDIR
    entries = size = 0
    if folder is not None and _is_dir(folder):
        for _, st in _files(folder):
            entries += 1
            size += st.st_size
    with _LOCK:
        stats = dict(_STATS)
    return {
        "enabled": root is not None,
        "directory": None if root is None else str(root),
        "entries": entries,
        "bytes": size,
        "max_bytes": limit(),
        **stats,
    }


_TEMP = re.compile(r"^\.[0-9a-f]{64}\..+\.tmp$")


def clear() -> tuple[int, list[str]]:
    """Remove every entry this cache wrote (and its stray temporary files): files
    named as entries that are regular files of this user holding an entry that checks
    out. Nothing else is touched, and no symbolic link is followed: an entries folder
    that is a link is left as it is. Returns how many entries were removed and what
    was left, each with why."""
    root = directory()
    with _LOCK:
        _STATS.update(hits=0, misses=0, writes=0, rejected=0, bypassed=0)
    if root is None:
        return 0, []
    folder = root / _SUBDIR
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
    except FileNotFoundError:
        return 0, []
    except OSError as exc:
        why = "a symbolic link, not followed" if os.path.islink(folder) else exc.strerror
        return 0, [f"{folder} ({why})"]
    try:
        return _clear_in(fd)
    finally:
        os.close(fd)


def _clear_in(fd: int) -> tuple[int, list[str]]:
    removed = 0
    left: list[str] = []
    for name in sorted(os.listdir(fd)):
        why = _not_ours(fd, name)
        if why:
            left.append(f"{name!r} ({why})")
            continue
        try:
            os.unlink(name, dir_fd=fd)
        except OSError as exc:
            left.append(f"{name!r} ({exc.strerror})")
            continue
        removed += not name.startswith(".")
    return removed, left


def _not_ours(fd: int, name: str) -> str:
    """Why the file ``name`` of the entries folder is not one this cache wrote (empty:
    it is an entry, or a temporary file of one)."""
    is_entry = name.endswith(".json") and bool(_HASH.match(name[:-5]))
    if not (is_entry or _TEMP.match(name)):
        return "not named as an entry"
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError as exc:
        return str(exc.strerror)
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return "belongs to another user"
    if not is_entry:
        return ""
    try:
        entry_fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
        with os.fdopen(entry_fd, "rb") as f:
            raw = f.read(_MAX_ENTRY + 1)
        entry = json.loads(raw.decode("utf-8"))
        key_text = json.dumps(entry["key"], sort_keys=True, separators=(",", ":"))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "not an entry"
    if digest(entry["key"])[1] != name[:-5] or _parse(raw, key_text)[0]:
        return "not an entry"
    return ""


# --- templates as data -----------------------------------------------------------------

# Plain functions a template may call, by name. Each is pure arithmetic on sizes or
# indexing; anything else (builtins.getattr, operator.call, ...) is refused.
_OPERATOR_NAMES = frozenset(
    [
        "abs",
        "add",
        "and_",
        "eq",
        "floordiv",
        "ge",
        "getitem",
        "gt",
        "invert",
        "le",
        "lshift",
        "lt",
        "mod",
        "mul",
        "ne",
        "neg",
        "not_",
        "or_",
        "pos",
        "pow",
        "rshift",
        "sub",
        "truediv",
        "truth",
        "xor",
    ]
)
_MATH_NAMES = frozenset(
    [
        "ceil",
        "floor",
        "trunc",
        "sqrt",
        "exp",
        "log",
        "log2",
        "log10",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "tanh",
        "sinh",
        "cosh",
        "fabs",
        "isnan",
        "isinf",
        "isfinite",
    ]
)
_TORCH_SYM_NAMES = frozenset(
    ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OP_NAMESPACES = ("aten", "prims")


class Unrepresentable(Exception):
    """A template (or a table) that cannot be written as data; it stays in memory."""


def _function_name(target: Any) -> str:
    import math
    import operator

    import torch

    for module, names, label in (
        (operator, _OPERATOR_NAMES, "operator"),
        (math, _MATH_NAMES, "math"),
        (torch, _TORCH_SYM_NAMES, "torch"),
    ):
        name = getattr(target, "__name__", None)
        if name in names and getattr(module, name, None) is target:
            return f"{label}.{name}"
    raise Unrepresentable(f"call target {target!r}")


def _op_name(op: Any) -> str:
    import torch

    if not isinstance(op, torch._ops.OpOverload) or op.namespace not in _OP_NAMESPACES:
        raise Unrepresentable(f"operator {op!r}")
    name = str(op)  # "aten.add.Tensor"; resolve_op reads it back
    if name.count(".") != 2:
        raise Unrepresentable(f"operator {op!r}")
    return name


def resolve_op(name: Any) -> Any:
    """The ATen or prims operator ``ns.op.overload``, found by attribute lookup only."""
    import torch

    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or parts[0] not in _OP_NAMESPACES or not all(map(_NAME.match, parts)):
        raise ValueError(f"names no ATen operator ({name!r:.80})")
    packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
    op = getattr(packet, parts[2], None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload):
        raise ValueError(f"names an unknown operator {name!r:.80}")
    if op._schema.is_mutable:
        raise ValueError(f"names a mutating operator {name!r:.80}")
    if not op._schema.returns:
        # aten.save, aten._print, the assertions: called for their effect, never in a
        # template (a trace records no node for them)
        raise ValueError(f"names an operator without results {name!r:.80}")
    return op


def _resolve_target(name: Any) -> Any:
    import math
    import operator

    import torch

    if not isinstance(name, str):
        raise ValueError("has a call target that is not a name")
    label, _, attr = name.partition(".")
    allowed = {"operator": (operator, _OPERATOR_NAMES), "math": (math, _MATH_NAMES)}
    allowed["torch"] = (torch, _TORCH_SYM_NAMES)
    if label in allowed and attr in allowed[label][1] and hasattr(allowed[label][0], attr):
        return getattr(allowed[label][0], attr)
    return resolve_op(name)


_SCALARS = (bool, int, str, type(None))


def _encode_value(value: Any, index: dict[Any, int]) -> Any:
    import torch

    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is float:
        return {"float": value.hex()}
    if kind is list:
        return {"list": [_encode_value(v, index) for v in value]}
    if kind is tuple:
        return {"tuple": [_encode_value(v, index) for v in value]}
    if isinstance(value, torch.fx.Node):
        return {"ref": index[value]}
    if kind is torch.fx.immutable_collections.immutable_list:
        return {"list": [_encode_value(v, index) for v in value]}
    if kind is torch.dtype:
        return {"dtype": str(value).removeprefix("torch.")}
    if kind is torch.layout:
        return {"layout": str(value).removeprefix("torch.")}
    if kind is torch.memory_format:
        return {"memory_format": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {"device": str(value)}
    if kind is torch._ops.OpOverload:
        return {"op": _op_name(value)}
    raise Unrepresentable(f"a value of type {kind.__name__}")


def _decode_value(data: Any, nodes: list[Any], depth: int = 0) -> Any:
    import torch

    if depth > 32:
        raise ValueError("nests too deep")
    if data is None or type(data) in (bool, int, str):
        return data
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError("has a malformed value")
    ((tag, inner),) = data.items()
    if tag in ("list", "tuple") and isinstance(inner, list):
        items = [_decode_value(v, nodes, depth + 1) for v in inner]
        return items if tag == "list" else tuple(items)
    if tag == "ref" and type(inner) is int and 0 <= inner < len(nodes):
        return nodes[inner]
    if tag == "float" and isinstance(inner, str):
        return float.fromhex(inner)
    if tag in ("dtype", "layout", "memory_format") and isinstance(inner, str):
        value = getattr(torch, inner, None) if _NAME.match(inner) else None
        wanted = {"dtype": torch.dtype, "layout": torch.layout}
        wanted["memory_format"] = torch.memory_format
        if type(value) is not wanted[tag]:
            raise ValueError(f"names no {tag} {inner!r:.40}")
        return value
    if tag == "device" and isinstance(inner, str) and re.match(r"^[a-z]+(:\d+)?$", inner):
        return torch.device(inner)
    if tag == "op":
        return resolve_op(inner)
    raise ValueError(f"has a value tagged {tag!r:.40}")


def encode(graph: Any, inherited: Any, own: Any) -> dict[str, Any]:
    """A template graph as JSON data.

    Raises:
        Unrepresentable: for a target or value that data cannot name exactly.
    """
    import torch

    index: dict[Any, int] = {}
    inputs: list[str] = []
    nodes: list[dict[str, Any]] = []
    output: Any = None
    for node in graph.nodes:
        if node.op == "placeholder":
            index[node] = len(index)
            inputs.append(node.name)
        elif node.op == "output":
            output = _encode_value(node.args[0], index)
        elif node.op == "call_function":
            target = node.target
            name = (
                _op_name(target)
                if isinstance(target, torch._ops.OpOverload)
                else _function_name(target)
            )
            custom = node.meta.get("custom")
            nodes.append(
                {
                    "name": node.name,
                    "target": name,
                    "args": _encode_value(tuple(node.args), index),
                    # pairs: JSON objects are written with sorted keys, and the
                    # order of keyword arguments shows in the graph
                    "kwargs": [[k, _encode_value(v, index)] for k, v in node.kwargs.items()],
                    "inherited": list(inherited[node]),
                    "own": {k: _encode_value(v, index) for k, v in own[node].items()},
                    "custom": (
                        {k: _encode_value(v, index) for k, v in custom.items()} if custom else None
                    ),
                }
            )
            index[node] = len(index)
        else:
            raise Unrepresentable(f"a {node.op} node")
    return {"inputs": inputs, "nodes": nodes, "output": output}


def decode(
    body: Any, input_values: list[Any], fake_mode: Any, inherited_fields: tuple[str, ...]
) -> tuple[Any, dict[Any, tuple[str, ...]], dict[Any, dict[str, Any]]]:
    """The template graph ``body`` describes, its values recomputed from fresh fake
    inputs under ``fake_mode`` (the values of the program being rewritten).

    Raises:
        ValueError: for anything that is not a template this module wrote.
    """
    import torch

    if not isinstance(body, dict) or set(body) != {"inputs", "nodes", "output"}:
        raise ValueError("is not a template")
    names, entries = body["inputs"], body["nodes"]
    if not (isinstance(names, list) and isinstance(entries, list)):
        raise ValueError("is not a template")
    if len(names) != len(input_values):
        raise ValueError("has another number of inputs")
    graph = torch.fx.Graph()
    nodes: list[Any] = []
    for name, value in zip(names, input_values, strict=True):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError("has a malformed input name")
        ph = graph.placeholder(name)
        ph.meta["val"] = value
        nodes.append(ph)
    inherited: dict[Any, tuple[str, ...]] = {}
    own: dict[Any, dict[str, Any]] = {}
    fields = {"name", "target", "args", "kwargs", "inherited", "own", "custom"}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != fields:
            raise ValueError("has a malformed node")
        name = entry["name"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError("has a malformed node name")
        target = _resolve_target(entry["target"])
        args = _decode_value(entry["args"], nodes)
        pairs = entry["kwargs"]
        if not isinstance(args, tuple) or not isinstance(pairs, list):
            raise ValueError("has malformed arguments")
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise ValueError("has malformed keyword arguments")
        kwargs = {k: _decode_value(v, nodes) for k, v in pairs}
        taken = entry["inherited"]
        if not isinstance(taken, list) or not set(taken) <= set(inherited_fields):
            raise ValueError("has unknown inherited meta")
        own_data, custom = entry["own"], entry["custom"]
        if not isinstance(own_data, dict) or not set(own_data) <= set(inherited_fields):
            raise ValueError("has unknown meta")
        if custom is not None and not isinstance(custom, dict):
            raise ValueError("has malformed custom meta")
        node = graph.create_node("call_function", target, args, kwargs, name=name)
        if node.name != name:
            raise ValueError("has a repeated node name")
        # The values are recomputed here, from operators looked up above, on fake
        # tensors: the entry holds no values of its own.
        vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*vals[0], **vals[1])
        inherited[node] = tuple(taken)
        own[node] = {k: _decode_value(v, nodes) for k, v in own_data.items()}
        if custom:
            node.meta["custom"] = {str(k): _decode_value(v, nodes) for k, v in custom.items()}
        nodes.append(node)
    graph.output(_decode_value(body["output"], nodes))
    return graph, inherited, own


def count(stat: str) -> None:
    """Count one event of this process's use of the cache (``bypassed``: a template
    traced for a table that cannot be named, kept for its decomposition alone)."""
    with _LOCK:
        _STATS[stat] += 1


def reject(key: Any, reason: str) -> None:
    """Drop an entry that parsed but does not describe a template (one warning)."""
    _warn(f"entry {digest(key)[1]}.json {reason:.200}")
    discard(key)


@_quiet(None)
def prune_soon() -> None:
    """Prune when this process's writes could have taken the cache past its bound
    (read again: it may have been lowered since). :func:`store` checks at every
    write; neither scans the directory unless a prune may be due."""
    with _LOCK:
        folders = list(_KNOWN)
    for folder in folders:
        _keep_bound(folder, 0, limit())


def cache_info() -> dict[str, Any]:
    """Both template caches: ``memory`` (this process) and ``disk`` (shared by processes).

    Example::

        info = epass.cache_info()
        print(info["disk"]["directory"], info["disk"]["entries"])
    """
    decomp = sys.modules.get("epass._decomp")
    memory = decomp.cache_info() if decomp is not None else {"hits": 0, "misses": 0, "size": 0}
    return {"memory": memory, "disk": info()}


def clear_cache() -> dict[str, Any]:
    """Empty both template caches; returns how many disk entries were removed
    (``disk_entries``) and the files of the entries folder that were left, each with
    why (``left``: a file this cache did not write is never removed)."""
    decomp = sys.modules.get("epass._decomp")
    if decomp is not None:
        decomp.clear_cache()
    removed, left = clear()
    return {"disk_entries": removed, "left": left}

"""The on-disk decomposition-template cache: JSON entries in a private directory.

Stdlib only at import (``epass cache info`` starts without torch). An entry is data:
it is read with :func:`json.loads` and checked (format, key, checksum) before its
template is handed on, which :mod:`epass._decomp.encoding` reads field by field.

One concept: the cache's files (names, format, checks, eviction), apart from what a
template means (:mod:`epass._decomp.encoding`).
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
    "BAD_SIZES",
    "DIR_ENV",
    "FORMAT",
    "KNOWN",
    "SIZE_ENV",
    "WARNED",
    "clear",
    "count",
    "digest",
    "directory",
    "discard",
    "entry_files",
    "environment",
    "exists",
    "info",
    "limit",
    "load",
    "prune",
    "prune_soon",
    "reject",
    "save",
]

DIR_ENV = "EPASS_CACHE_DIR"
SIZE_ENV = "EPASS_CACHE_SIZE"
# 2: each node holds a description of its value, and symbolic templates are kept
# (their symbols by position, with what the shape environment knows of them).
FORMAT = 2
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
WARNED = False


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
BAD_SIZES: set[str] = set()


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
            first = text not in BAD_SIZES
            BAD_SIZES.add(text)
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
    global WARNED
    with _LOCK:
        _STATS["rejected"] += 1
        if WARNED:
            return
        WARNED = True
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
def save(key: Any, template: Any) -> bool:
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


def entry_files(folder: Path) -> Iterator[tuple[Path, os.stat_result]]:
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
    files = sorted(entry_files(folder), key=lambda f: f[1].st_mtime)
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
KNOWN: dict[Path, int] = {}
# A prune goes this far below the bound, so that a full cache is scanned once per
# fifth of the bound written rather than at every write.
_LOW_WATER = 0.8


def _keep_bound(folder: Path, written: int, bound: int) -> None:
    with _LOCK:
        known = KNOWN.pop(folder, None)
        if known is None and not written:
            return  # nothing written there by this process: nothing of its own to bound
        if known is not None and known + written <= bound:
            KNOWN[folder] = known + written
            return
    left = _prune(folder, bound, int(bound * _LOW_WATER))[1]
    with _LOCK:
        KNOWN.clear()  # one directory at a time is all a process uses
        KNOWN[folder] = left


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
        for _, st in entry_files(folder):
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
    (read again: it may have been lowered since). :func:`save` checks at every
    write; neither scans the directory unless a prune may be due."""
    with _LOCK:
        folders = list(KNOWN)
    for folder in folders:
        _keep_bound(folder, 0, limit())

"""Installed files: the distribution whose wheel installed a source file, as its
``RECORD`` lists it, and only while the file is the one that version installed.

A consumer library's code is named in cache keys by its distribution, version and
file, as torch's is by the torch build. That name holds only for a file whose bytes
are those the distribution's ``RECORD`` lists (its sha256): a file edited after
installing, a file of an editable install (its sources are not in ``RECORD``), or a
file no installed distribution lists has no name. Nothing of torch is imported.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

__all__ = ["Installed", "NotInstalled", "clear", "lookup"]


@attrs.frozen
class Installed:
    """A source file exactly as a distribution installed it.

    Attributes:
        distribution: the distribution's name (``executorch``).
        version: its installed version.
        path: the file's path in ``RECORD``, relative to the site directory.
        sha256: the file's hash as ``RECORD`` holds it (urlsafe base64).
    """

    distribution: str
    version: str
    path: str
    sha256: str

    def name(self) -> str:
        """The file's name in a cache key."""
        return f"{self.distribution}=={self.version}:{self.path}#{self.sha256}"


@attrs.frozen
class NotInstalled:
    """Why a file has no installed name."""

    reason: str


@attrs.frozen
class _Distribution:
    name: str
    version: str
    editable: bool
    record: Path


_LOCK = threading.Lock()
# Per file as code objects spell it: what installed it, and the file's stat when that
# was read (a file edited since, and perhaps reloaded, is read again).
_FILES: dict[str, tuple[Any, Installed | NotInstalled]] = {}
# Per site directory: its distributions' metadata folders.
_SITES: dict[str, list[Path]] = {}
# Per RECORD file: path -> sha256.
_RECORDS: dict[Path, dict[str, str]] = {}


def clear() -> None:
    """Forget every answer (files, site directories and RECORDs are read again)."""
    with _LOCK:
        _FILES.clear()
        _SITES.clear()
        _RECORDS.clear()


def lookup(filename: str) -> Installed | NotInstalled:
    """The distribution that installed ``filename`` (a code object's file), with the
    file's bytes checked against its ``RECORD``; or why there is none. Cached per
    file name while the file's size and modification time stay the same."""
    stamp = _stamp(filename)
    with _LOCK:
        known = _FILES.get(filename)
    if known is not None and known[0] == stamp:
        return known[1]
    try:
        found = _resolve(filename)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        found = NotInstalled(f"{filename} cannot be read ({type(exc).__name__}: {exc})")
    with _LOCK:
        _FILES[filename] = (stamp, found)
    return found


def _stamp(filename: str) -> Any:
    try:
        stat = os.stat(filename)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _resolve(filename: str) -> Installed | NotInstalled:
    real = os.path.realpath(filename)
    if not os.path.isfile(real):
        return NotInstalled(f"{filename} is not a file")
    for site in _site_dirs():
        if not real.startswith(site + os.sep):
            continue
        relative = Path(os.path.relpath(real, site)).as_posix()
        top = relative.split("/", 1)[0]
        for dist in _candidates(site, top):
            expected = _record(dist.record).get(relative)
            if expected is None:
                continue
            if dist.editable:
                return NotInstalled(f"{filename} belongs to an editable install of {dist.name}")
            if _sha256(real) != expected:
                return NotInstalled(
                    f"{filename} differs from the file {dist.name} {dist.version} installed"
                )
            return Installed(dist.name, dist.version, relative, expected)
    return NotInstalled(f"{filename} is no installed distribution's file")


def _site_dirs() -> list[str]:
    """The import path's directories, resolved, longest first (a nested one wins)."""
    found = {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)}
    return sorted(found, key=len, reverse=True)


def _candidates(site: str, top: str) -> Iterator[_Distribution]:
    """The site directory's wheel-installed distributions that may hold files under
    ``top``, likeliest first: a name like ``top`` (``apache_tvm`` for ``tvm``), then
    those whose ``top_level.txt`` lists it, then those without one. Reading every
    RECORD of a site directory takes a third of a second; the first guess is right
    for every consumer epass hands off to."""
    infos = _infos(site)
    name = _normal(top.removesuffix(".py"))
    named = [i for i in infos if name and name in _normal(i.name.split("-", 1)[0])]
    yield from filter(None, map(_distribution, named))
    unlisted = []
    for info in infos:
        if info in named:
            continue
        tops = _top_level(info)
        if tops is None:
            unlisted.append(info)
        elif top.removesuffix(".py") in tops:
            yield from filter(None, [_distribution(info)])
    yield from filter(None, map(_distribution, unlisted))


def _infos(site: str) -> list[Path]:
    with _LOCK:
        known = _SITES.get(site)
    if known is None:
        known = sorted(Path(site).glob("*.dist-info"))
        with _LOCK:
            _SITES[site] = known
    return known


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _top_level(info: Path) -> set[str] | None:
    try:
        return set((info / "top_level.txt").read_text(encoding="utf-8").split())
    except OSError:
        return None


_HEADER = re.compile(r"^(Name|Version):\s*(.+?)\s*$", re.MULTILINE)


def _distribution(info: Path) -> _Distribution | None:
    record = info / "RECORD"
    if not record.is_file():
        return None
    try:
        with open(info / "METADATA", encoding="utf-8", errors="replace") as file:
            head = file.read(8192).split("\n\n", 1)[0]
    except OSError:
        return None
    fields = {m.group(1): m.group(2) for m in _HEADER.finditer(head)}
    if "Name" not in fields or "Version" not in fields:
        return None
    return _Distribution(fields["Name"], fields["Version"], _editable(info), record)


def _editable(info: Path) -> bool:
    try:
        direct = json.loads((info / "direct_url.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(isinstance(direct, dict) and direct.get("dir_info", {}).get("editable"))


def _record(record: Path) -> dict[str, str]:
    """A RECORD's files: path -> sha256 (files it lists without a hash are left out)."""
    with _LOCK:
        known = _RECORDS.get(record)
    if known is not None:
        return known
    files: dict[str, str] = {}
    text = record.read_text(encoding="utf-8")
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[1].startswith("sha256="):
            files[row[0]] = row[1][len("sha256=") :]
    with _LOCK:
        _RECORDS[record] = files
    return files


def _sha256(path: str) -> str:
    with open(path, "rb") as file:
        digest = hashlib.sha256(file.read()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

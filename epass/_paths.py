"""Checks of the files a command names, made before anything is loaded (stdlib only,
so that a wrong path is reported before torch is imported)."""

from __future__ import annotations

import os
import stat
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from epass.errors import LoadError, SaveError

__all__ = ["check_exists", "check_input_path", "check_output_path", "directory_of"]


def directory_of(p: Path) -> Path:
    """The directory holding ``p``'s own entry, where a rename over it happens.

    Not the directory a symlink at ``p`` points into: the rename replaces the link
    (it never writes through it), and must not cross file systems.
    """
    return Path(os.path.abspath(p)).parent


def check_exists(p: Path) -> None:
    """Raise LoadError when the input path ``p`` names no file, or a directory."""
    if not p.exists():
        raise LoadError(f"{p}: no such file", path=str(p))
    if p.is_dir():
        raise LoadError(f"{p}: is a directory, not a .pt2 file", path=str(p))


def check_input_path(path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is a regular file holding a zip archive, as every ``.pt2``
    file does; what is in it is :func:`epass.io.load`'s to check.

    Raises:
        LoadError: missing, a directory, not a regular file, or not a zip archive.
    """
    p = Path(path)
    check_exists(p)
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):  # a FIFO is never opened here
            raise LoadError(f"{p}: not a regular file", path=str(p))
        archive = zipfile.is_zipfile(p)
    except OSError as exc:
        raise LoadError(f"{p}: cannot read ({exc.strerror or exc})", path=str(p)) from exc
    if not archive:
        raise LoadError(
            f"{p}: not a .pt2 archive (torch.export.save writes a zip file)", path=str(p)
        )
    return p


def check_output_path(path: str | os.PathLike[str], suffixes: Sequence[str]) -> Path:
    """Check, before any work is done, that ``path`` can be written.

    Raises:
        SaveError: wrong suffix, missing or unwritable directory, or a directory.
    """
    p = Path(path)
    if p.suffix.lower() not in suffixes:
        raise SaveError(f"{p}: the file must end in {' or '.join(suffixes)}")
    parent = directory_of(p)
    if not parent.is_dir():
        raise SaveError(f"{p}: directory {p.parent} does not exist")
    if p.is_dir():
        raise SaveError(f"{p}: is a directory")
    try:  # the one reliable test (permissions, read-only mounts, /proc) is to try
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{p.stem}.", suffix=".probe")
    except OSError as exc:
        raise SaveError(f"{p}: cannot write in {p.parent} ({exc.strerror or exc})") from exc
    os.close(fd)
    os.unlink(probe)
    return p

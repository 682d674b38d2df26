"""Checks of the files a command names, made before anything is loaded (stdlib only,
so that a wrong path is reported before torch is imported)."""

from __future__ import annotations

import os
import stat
import tempfile
import zipfile
from collections.abc import Collection, Sequence
from pathlib import Path

from epass.errors import LoadError, SaveError

__all__ = [
    "check_exists",
    "check_input_path",
    "check_output_directory",
    "check_output_path",
    "directory_of",
]


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


def check_output_directory(
    path: str | os.PathLike[str],
    *,
    replaceable: Collection[str],
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """Check, before any work is done, that the folder ``path`` can be written whole
    (a new folder renamed into place) without replacing anything but earlier output.

    Raises:
        SaveError: ``path`` is a symlink (dangling or not) or a file; it is or holds
            one of ``inputs``; it holds an entry not named in ``replaceable``; or
            neither it nor its nearest existing parent takes a new entry.
    """
    p = Path(path)
    if p.is_symlink():  # the rename would replace the link, or write where it points
        raise SaveError(f"{p}: is a symbolic link; give a folder of its own")
    here = Path(os.path.realpath(p))
    for given in inputs:
        # The file and the name given for it: a symlink to the input is the user's too.
        named = Path(os.path.realpath(directory_of(Path(given)))) / Path(given).name
        for source in (Path(os.path.realpath(given)), named):
            if source == here or here in source.parents:
                what = "is" if source == here else "holds"
                raise SaveError(f"{p}: {what} the input {given}; write the output elsewhere")
    if here == Path(os.getcwd()) or here in Path(os.getcwd()).parents:
        raise SaveError(f"{p}: holds the working folder, which a rename cannot replace")
    if p.exists() and not p.is_dir():
        raise SaveError(f"{p}: is a file; the output is a folder")
    if p.is_dir():
        try:
            others = sorted(e.name for e in p.iterdir() if e.name not in replaceable)
        except OSError as exc:
            raise SaveError(f"{p}: cannot read ({exc.strerror or exc})") from exc
        if others:
            more = f" and {len(others) - 3} more" if len(others) > 3 else ""
            raise SaveError(
                f"{p}: holds {', '.join(others[:3])}{more}, which an earlier output "
                "did not write; give a new or empty folder"
            )
    _probe_folder(p)
    return p


def _probe_folder(p: Path) -> None:
    """Raise SaveError unless a folder can be made beside ``p`` (where it is renamed
    into place), in ``p``'s nearest existing parent when its own does not exist."""
    parent = directory_of(p)
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise SaveError(f"{p}: cannot be created: {parent} is not a folder")
    try:  # the one reliable test (permissions, read-only mounts, /proc) is to try
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=f".{p.name}.", suffix=".probe"))
    except OSError as exc:
        raise SaveError(f"{p}: cannot be created in {parent} ({exc.strerror or exc})") from exc

"""The structure of a ``.pt2`` zip: the members it may hold (:data:`ALLOWLIST`), the
checks every zip entry passes, where a member's data lies, and the two readers agreeing."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from typing import IO

from epass import _pt2
from epass._screen.refusal import Refusal, first_line, unsafe_error
from epass.errors import EpassError, LoadError

__all__ = [
    "ALLOWLIST",
    "TRUST_ONLY",
    "check_program_archive",
    "check_zip_entries",
    "data_span",
    "disagreement",
    "member_kind",
    "private_copy",
    "readers_agree",
    "zip_size",
]

# (pattern, kind, why it is safe). Patterns match a member's name below the archive's
# root folder, case-insensitively, because torch's zip reader looks names up that way.
ALLOWLIST: tuple[tuple[str, str, str], ...] = (
    (
        r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id",
        "text",
        "a short UTF-8 tag torch compares with a constant",
    ),
    (
        r"models/model\.json",
        "program",
        "JSON walked with torch's schema: no field the schema lacks, and every string "
        "checked by the role of its field (identifier, operator, bounded shape "
        "expression, text): see ROLES",
    ),
    (
        r"data/weights/model_weights_config\.json|data/constants/model_constants_config\.json",
        "config",
        "JSON; each entry must name a weight_N / tensor_N member of this archive",
    ),
    (
        r"data/weights/weight_\d+|data/constants/tensor_\d+",
        "tensor",
        "raw tensor bytes, viewed with a dtype; a tensor the config marks as pickled must "
        "be a torch.save archive the weights-only unpickler accepts",
    ),
    (
        r"data/sample_inputs/model\.pt",
        "pickle",
        "a torch.save archive whose pickle holds only what the weights-only unpickler "
        "accepts (checked statically, then unpickled by that unpickler), and whose "
        "text holds no quotes or backslashes",
    ),
    (r"extra/[^/]+", "text", "extra files, read as strings and never interpreted"),
)

# Members torch.export.save writes that only run with trust: their loaders unpickle
# arbitrary objects (pickle.loads, TorchScript's unpickler).
TRUST_ONLY = (r"data/constants/opaque_obj_\d+", r"data/constants/custom_obj_\d+")


def member_kind(name: str) -> str | None:
    """The kind :data:`ALLOWLIST` gives a member's name below the root folder, or None."""
    low = name.lower()
    for pattern, kind, _ in ALLOWLIST:
        if re.fullmatch(pattern, low):
            return kind
    return None


def zip_size(file: IO[bytes], name: str) -> int:
    """The size of ``file``, rewound; LoadError when it is not a zip archive."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(0)
    if not zipfile.is_zipfile(file):
        raise LoadError(
            f"{name}: not a .pt2 archive (torch.export.save writes a zip file)", path=name
        )
    return size


def check_program_archive(infos: Sequence[zipfile.ZipInfo], name: str) -> None:
    """LoadError when the zip holds no program (a zip file, but not a .pt2)."""
    if not any(i.filename.lower().endswith("models/model.json") for i in infos):
        raise LoadError(
            f"{name}: a zip file, but not an exported program (no models/model.json inside)",
            path=name,
        )


def check_zip_entries(infos: Sequence[zipfile.ZipInfo], size: int, where: str) -> str:
    """Common checks on a zip's entries; returns the one root folder they share."""
    if not infos:
        raise Refusal(where, "the archive is empty")
    roots, folded, total = set(), set(), 0
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if (
            name.startswith("/")
            or "\\" in name
            or "\0" in name
            or any(p in ("", ".", "..") for p in parts)
            or re.match(r"[A-Za-z]:", name)
        ):
            raise Refusal(name, "unsafe member name (absolute path or '..')")
        if info.is_dir() or len(parts) < 2:
            raise Refusal(name, "a member outside the archive's root folder")
        if info.flag_bits & 0x1:
            raise Refusal(name, "an encrypted member")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise Refusal(name, "a compressed member (torch.export.save stores members as is)")
        if name.lower() in folded:
            raise Refusal(name, "two members whose names differ only in case")
        folded.add(name.lower())
        roots.add(parts[0])
        total += info.file_size
    if len(roots) != 1:
        raise Refusal(where, f"members under {len(roots)} root folders, expected one")
    if total > size:  # entries overlapping one another: a zip bomb
        raise Refusal(where, f"members add up to {total} bytes in a {size}-byte archive")
    return roots.pop()


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then name and extra lengths


def data_span(file: IO[bytes], info: zipfile.ZipInfo) -> tuple[int, int]:
    """Where Python's zip reader reads ``info``'s data: (offset, size), after the
    member's local header, as ``ZipFile.open`` finds it."""
    file.seek(info.header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(
        file.read(_LOCAL_HEADER.size).ljust(_LOCAL_HEADER.size, b"\0")
    )
    if signature != b"PK\x03\x04":
        raise Refusal(info.filename, "no local header where the central directory says")
    offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    return offset, info.file_size


def disagreement(file: IO[bytes], name: str) -> str | None:
    """The first member torch's zip reader and Python's find differently (a name only
    one finds, or data at another place or of another size), or None.

    Raises:
        LoadError: torch's reader cannot read the archive.
        Refusal: a member has no local header.
    """
    file.seek(0)
    try:
        theirs = _pt2.archive_records(file)
    except Exception as exc:
        raise LoadError(f"{name}: torch cannot read the archive ({first_line(exc)})") from exc
    finally:
        file.seek(0)
    with zipfile.ZipFile(file) as archive:
        ours = {i.filename.split("/", 1)[1]: data_span(file, i) for i in archive.infolist()}
    file.seek(0)
    odd = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    return odd[0] if odd else None


def readers_agree(file: IO[bytes]) -> bool:
    """Whether torch's zip reader and Python's find the same members at the same
    places in ``file``, whose members pass the checks all members must pass (so
    that torch's reader only ever parses an archive Python's reader accepted)."""
    try:
        size = zip_size(file, "<archive>")
        with zipfile.ZipFile(file) as archive:
            check_zip_entries(archive.infolist(), size, "<archive>")
        return disagreement(file, "<archive>") is None
    except (EpassError, Refusal, zipfile.BadZipFile, OSError, EOFError):
        return False
    finally:
        file.seek(0)


@contextlib.contextmanager
def private_copy(file: IO[bytes], name: str) -> Iterator[IO[bytes]]:
    """The archive rewritten by Python's zipfile, each member read once, into a
    temporary file that has no name (nothing to leave behind, nothing to swap).

    torch's zip reader and Python's can find different members in one file (a
    central directory stored elsewhere than its end record says: Python reads the
    one before the end record, torch the one at the stated offset), and a file can
    change on disk, or a network file system answer differently, between two
    reads. Screening and loading this copy makes what torch loads what was screened.
    """
    size = zip_size(file, name)
    with tempfile.TemporaryFile() as copy:
        try:
            with zipfile.ZipFile(file) as archive:
                infos = archive.infolist()
                check_program_archive(infos, name)
                check_zip_entries(infos, size, name)
                with zipfile.ZipFile(copy, "w") as out:
                    for info in infos:
                        entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                        entry.file_size = info.file_size  # zip64 when needed
                        with archive.open(info) as src, out.open(entry, "w") as dst:
                            shutil.copyfileobj(src, dst, 1 << 20)
        except Refusal as refused:
            raise unsafe_error(name, refused) from None
        except (zipfile.BadZipFile, EOFError) as exc:
            raise LoadError(f"{name}: not a .pt2 archive ({exc})", path=name) from exc
        copy.seek(0)
        yield copy

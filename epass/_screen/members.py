"""What each member of an archive may hold, checked by its kind (text tags, the
program, payload configs, pickles), and :func:`screen`, which checks a whole archive."""

from __future__ import annotations

import contextlib
import io
import json
import re
import zipfile
from typing import IO, Any

import torch

from epass._screen.archive import (
    TRUST_ONLY,
    check_program_archive,
    check_zip_entries,
    disagreement,
    member_kind,
    zip_size,
)
from epass._screen.read_once import ReadOnce
from epass._screen.refusal import Refusal, first_line, unsafe_error
from epass._screen.schema import screen_program
from epass._screen.text import TEXT_LIMIT, is_plain
from epass.errors import LoadError, UnsafeArchiveError

__all__ = ["screen"]


# The archive's own version tags: a version this torch does not write is refused.
# (torch.export.pt2_archive pulls in torch._dynamo, seconds of import: it is imported
# when an archive is screened, not with this module.)
def _archive_tags() -> dict[str, str]:
    from torch.export.pt2_archive import constants

    return {
        constants.ARCHIVE_FORMAT_PATH: constants.ARCHIVE_FORMAT_VALUE,
        constants.ARCHIVE_VERSION_PATH: constants.ARCHIVE_VERSION_VALUE,
    }


def screen(file: IO[bytes], *, name: str = "<archive>") -> None:
    """Check every member of a .pt2 archive against :data:`ALLOWLIST` without loading it.

    ``models/model.json`` is walked with torch's schema (:func:`screen_program`):
    every string is checked by the role of its field (:data:`ROLES`).

    This checks the members as Python's zip reader finds them, and that torch's
    reader finds the same ones in the same places. A file can change between two
    reads, so ``epass.load`` screens and loads one :class:`ReadOnce` view (or a
    private copy): screen a file only to report on it, and load it with ``load``.

    Args:
        file: the archive, open for reading in binary mode (seekable).
        name: the file's name, for messages.

    Raises:
        UnsafeArchiveError: a member that is not allowed, with one line naming it.
        LoadError: the file is not a zip archive or not a saved program.
    """
    size = zip_size(file, name)
    try:
        with zipfile.ZipFile(file) as archive:
            _screen_members(archive, size, name)
    except Refusal as refused:
        raise unsafe_error(name, refused) from None
    except zipfile.BadZipFile as exc:
        raise LoadError(f"{name}: not a .pt2 archive ({exc})", path=name) from exc
    # torch's own zip reader must find exactly the members screened above, each at
    # the place Python's reader found it: then every byte torch reads of a member is
    # a byte screened as that member.
    # Before torch 2.13 its reader reads a record whole to tell its size: a view
    # then keeps no tensor data (the members screened above are kept already).
    unkept = file.tensor_data_unkept() if isinstance(file, ReadOnce) else contextlib.nullcontext()
    try:
        with unkept:
            odd = disagreement(file, name)
    except Refusal as refused:
        raise unsafe_error(name, refused) from None
    if odd is not None:
        raise UnsafeArchiveError(
            f"{name}: refused member {odd!r}: torch's zip reader and Python's disagree",
            path=name,
            member=odd,
        )


def _screen_members(archive: zipfile.ZipFile, size: int, name: str) -> None:
    infos = archive.infolist()
    check_program_archive(infos, name)
    root = check_zip_entries(infos, size, name)
    names = {i.filename[len(root) + 1 :]: i.filename for i in infos}
    pickles: set[str] = set()
    for short, full in names.items():
        if any(re.fullmatch(p, short.lower()) for p in TRUST_ONLY):
            raise Refusal(full, "a pickled object that loading would execute")
        kind = member_kind(short)
        if kind is None:
            what = "a shared library" if re.search(r"\.(so|dll|dylib)$", short.lower()) else ""
            if short.lower().startswith("data/aotinductor/"):
                what = "an AOTInductor package"
            raise Refusal(full, (what or "a member") + " that torch.export.save does not write")
        if short != short.lower() and not short.startswith("extra/"):
            raise Refusal(full, "a member name in the wrong case")
        if kind == "text":
            if archive.getinfo(full).file_size > TEXT_LIMIT:
                raise Refusal(full, "a text member over 1 MiB")
            try:
                text = archive.read(full).decode()
            except UnicodeDecodeError as exc:
                raise Refusal(full, "a text member that is not UTF-8") from exc
            tags = _archive_tags()
            if short in tags and text != tags[short]:
                raise Refusal(
                    full,
                    f"{short} {text[:20]!r}, which torch {torch.__version__} does not read "
                    f"(it reads {tags[short]!r})",
                )
        elif kind == "program":
            screen_program(full, archive.read(full))
        elif kind == "config":
            folder = short.rsplit("/", 1)[0] + "/"
            _screen_config(full, archive.read(full), folder, names, pickles)
        elif kind == "pickle" and archive.getinfo(full).file_size:
            pickles.add(full)
    for full in sorted(pickles):
        _screen_pickle(full, archive.read(full))
        if member_kind(full[len(root) + 1 :]) == "pickle":
            _screen_sample_inputs(full, archive.read(full))


def _screen_sample_inputs(member: str, data: bytes) -> None:
    """Unpickle the sample inputs with the weights-only unpickler and check their text.

    torch retries sample inputs with ``weights_only=False`` when the weights-only
    unpickler fails on them, and ExportedProgram.module() pastes their dict keys
    into the source of its input checks, between quotes.
    """
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise Refusal(
            member, f"sample inputs the weights-only unpickler refuses ({first_line(exc)})"
        ) from exc
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, (str, bytes)):
            text = item if isinstance(item, str) else item.decode("latin-1")
            if not is_plain(text):
                raise Refusal(
                    member,
                    f"sample inputs holding the text {text[:60]!r}, with quotes, "
                    "backslashes or control characters",
                )


def _screen_pickle(member: str, data: bytes) -> None:
    """Refuse a torch.save archive whose pickle the weights-only unpickler would reject.

    ``torch.serialization.get_unsafe_globals_in_checkpoint`` disassembles the pickle
    with the weights-only unpickler's own opcode table, without executing it: an
    opcode that unpickler does not support raises, and every global it would not
    allow is listed.
    """
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        raise Refusal(member, "a pickle that is not a torch.save archive")
    try:
        with zipfile.ZipFile(buffer) as inner:
            infos = inner.infolist()
            check_zip_entries(infos, len(data), member)
            names = [i.filename.split("/", 1)[1] for i in infos]
    except zipfile.BadZipFile as exc:
        raise Refusal(member, f"a corrupt torch.save archive ({exc})") from exc
    if "data.pkl" not in names:
        raise Refusal(member, "a torch.save archive without data.pkl")
    for name in names:
        if not re.fullmatch(
            r"data\.pkl|data/\d+|version|\.data/version|byteorder|"
            r"\.data/serialization_id|\.format_version|\.storage_alignment",
            name,
        ):
            raise Refusal(member, f"a torch.save archive holding {name!r}")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as exc:  # an opcode the weights-only unpickler does not support
        raise Refusal(member, f"a pickle the weights-only unpickler refuses ({exc})") from exc
    if unsafe:
        listed = ", ".join(sorted(unsafe)[:3])
        raise Refusal(member, f"a pickle naming {listed}, which the weights-only unpickler refuses")


def _screen_config(
    member: str, data: bytes, folder: str, names: dict[str, str], pickles: set[str]
) -> None:
    try:
        config = json.loads(data).get("config")
    except (ValueError, AttributeError) as exc:
        raise Refusal(member, "not a payload config") from exc
    if not isinstance(config, dict):
        raise Refusal(member, "not a payload config")
    allowed = r"weight_\d+" if folder == "data/weights/" else r"tensor_\d+"
    for key, entry in config.items():
        path_name = entry.get("path_name") if isinstance(entry, dict) else None
        if not isinstance(path_name, str):
            raise Refusal(member, f"entry {key!r} has no path_name")
        target = folder + path_name
        if any(re.fullmatch(p, target.lower()) for p in TRUST_ONLY):
            # torch finds the member case-insensitively: name the one it would read.
            actual = next((v for k, v in names.items() if k.lower() == target.lower()), target)
            raise Refusal(actual, "a pickled object that loading would execute")
        if not re.fullmatch(allowed, path_name) or target not in names:
            raise Refusal(member, f"entry {key!r} points at {path_name!r}, not a tensor member")
        if entry.get("use_pickle"):
            pickles.add(names[target])

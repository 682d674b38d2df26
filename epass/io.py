"""Load, save, prune and inspect ``.pt2`` files; untrusted archives are screened first.

``load`` screens a private copy against :data:`ALLOWLIST` and loads that copy.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch.export import ExportedProgram

from epass import _program
from epass.errors import ArgumentTypeError, LoadError, SaveError, UnsafeArchiveError
from epass.records import op_histogram

__all__ = [
    "ALLOWLIST",
    "atomic_write",
    "check_output_path",
    "declared_imports",
    "import_modules",
    "inspect",
    "load",
    "prune",
    "save",
    "screen",
    "unreferenced",
]

# (pattern, kind, why it is safe). Patterns match a member's name below the archive's
# root folder, case-insensitively, because torch's zip reader looks names up that way.
ALLOWLIST: tuple[tuple[str, str, str], ...] = (
    (r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id",
     "text", "a short UTF-8 tag torch compares with a constant"),
    (r"models/model\.json", "program",
     "JSON parsed into torch's schema; its sympy expressions and guard code are "
     "parsed here and only arithmetic on shape symbols is allowed; text that "
     "module() pastes into source holds no quotes or backslashes"),
    (r"data/weights/model_weights_config\.json|data/constants/model_constants_config\.json",
     "config", "JSON; each entry must name a weight_N / tensor_N member of this archive"),
    (r"data/weights/weight_\d+|data/constants/tensor_\d+", "tensor",
     "raw tensor bytes, viewed with a dtype; a tensor the config marks as pickled must "
     "be a torch.save archive the weights-only unpickler accepts"),
    (r"data/sample_inputs/model\.pt", "pickle",
     "a torch.save archive whose pickle holds only what the weights-only unpickler "
     "accepts (checked statically, then unpickled by that unpickler), and whose "
     "text holds no quotes or backslashes"),
    (r"extra/[^/]+", "text", "extra files, read as strings and never interpreted"),
)  # fmt: skip

# Members torch.export.save writes that only run with trust: their loaders unpickle
# arbitrary objects (pickle.loads, TorchScript's unpickler).
TRUST_ONLY = (r"data/constants/opaque_obj_\d+", r"data/constants/custom_obj_\d+")

_TEXT_LIMIT = 1 << 20
_EXPR_LIMIT = 1 << 16
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_SYMBOL = re.compile(r"[a-z]{1,4}\d+")
# sympy's and torch's shape functions, as torch's deserializer names them.
_SYMPY_CALLS = frozenset(
    """
    Symbol Integer Float Rational Add Mul Pow Mod Max Min Abs LessThan StrictLessThan
    GreaterThan StrictGreaterThan Equality Unequality Eq Ne Lt Le Gt Ge And Or Not Xor
    Piecewise ExprCondPair ITE floor ceiling sqrt BooleanTrue BooleanFalse FloorDiv
    ModularIndexing Where PythonMod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift
    PowByNatural FloatPow FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator
    TruncToFloat TruncToInt RoundToInt RoundDecimal ToFloat Identity
    """.split()  # noqa: SIM905
)
_SYMPY_NAMES = frozenset(
    """
    oo zoo nan true false pi E S Half One Zero NegativeOne
    """.split()  # noqa: SIM905
)
_GUARD_CALLS = frozenset(["max", "min", "abs", "int", "float", "round"]) | _SYMPY_CALLS
_GUARD_METHODS = frozenset(["size", "stride", "storage_offset", "dim", "numel"])
_MATH = frozenset(["floor", "ceil", "trunc", "sqrt", "log", "exp", "pow", "isnan", "isinf"])
# Node targets torch's deserializer resolves: registered ops, and the builtins its
# verifier allows (operator, math and torch.sym_* functions); "#ns:op" for extensions.
_TARGET = re.compile(
    r"torch\.ops(\.\w+){2,3}|_operator\.\w+|math\.\w+|torch\._?sym_\w+|#\w+:[\w.]+"
)
_ARITHMETIC = (
    ast.Expression, ast.Load, ast.Constant, ast.UnaryOp, ast.BinOp, ast.Compare, ast.BoolOp,
    ast.Tuple, ast.USub, ast.UAdd, ast.Not, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv,
    ast.Mod, ast.Pow, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq, ast.And, ast.Or,
    ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor,
)  # fmt: skip


# --- screening ---------------------------------------------------------------------


class _Refuse(Exception):
    def __init__(self, member: str, why: str) -> None:
        super().__init__(why)
        self.member = member
        self.why = why


def _kind(name: str) -> str | None:
    low = name.lower()
    for pattern, kind, _ in ALLOWLIST:
        if re.fullmatch(pattern, low):
            return kind
    return None


def _check_zip_entries(infos: Sequence[zipfile.ZipInfo], size: int, where: str) -> str:
    """Common checks on a zip's entries; returns the one root folder they share."""
    if not infos:
        raise _Refuse(where, "the archive is empty")
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
            raise _Refuse(name, "unsafe member name (absolute path or '..')")
        if info.is_dir() or len(parts) < 2:
            raise _Refuse(name, "a member outside the archive's root folder")
        if info.flag_bits & 0x1:
            raise _Refuse(name, "an encrypted member")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise _Refuse(name, "a compressed member (torch.export.save stores members as is)")
        if name.lower() in folded:
            raise _Refuse(name, "two members whose names differ only in case")
        folded.add(name.lower())
        roots.add(parts[0])
        total += info.file_size
    if len(roots) != 1:
        raise _Refuse(where, f"members under {len(roots)} root folders, expected one")
    if total > size:  # entries overlapping one another: a zip bomb
        raise _Refuse(where, f"members add up to {total} bytes in a {size}-byte archive")
    return roots.pop()


def _screen_pickle(member: str, data: bytes) -> None:
    """Refuse a torch.save archive whose pickle the weights-only unpickler would reject.

    ``torch.serialization.get_unsafe_globals_in_checkpoint`` disassembles the pickle
    with the weights-only unpickler's own opcode table, without executing it: an
    opcode that unpickler does not support raises, and every global it would not
    allow is listed.
    """
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        raise _Refuse(member, "a pickle that is not a torch.save archive")
    try:
        with zipfile.ZipFile(buffer) as inner:
            infos = inner.infolist()
            _check_zip_entries(infos, len(data), member)
            names = [i.filename.split("/", 1)[1] for i in infos]
    except zipfile.BadZipFile as exc:
        raise _Refuse(member, f"a corrupt torch.save archive ({exc})") from exc
    if "data.pkl" not in names:
        raise _Refuse(member, "a torch.save archive without data.pkl")
    for name in names:
        if not re.fullmatch(
            r"data\.pkl|data/\d+|version|\.data/version|byteorder|"
            r"\.data/serialization_id|\.format_version|\.storage_alignment",
            name,
        ):
            raise _Refuse(member, f"a torch.save archive holding {name!r}")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as exc:  # an opcode the weights-only unpickler does not support
        raise _Refuse(member, f"a pickle the weights-only unpickler refuses ({exc})") from exc
    if unsafe:
        listed = ", ".join(sorted(unsafe)[:3])
        raise _Refuse(member, f"a pickle naming {listed}, which the weights-only unpickler refuses")


def _is_plain(text: str) -> bool:
    """Text torch may paste between quotes in generated code without escaping it."""
    return text.isprintable() and not any(c in text for c in "'\"\\")


def _check_ast(member: str, text: str, *, guard: bool) -> None:
    """Allow only arithmetic and comparisons on shape symbols (sympy text or guard code)."""
    if len(text) > _EXPR_LIMIT:
        raise _Refuse(member, "an expression longer than 64 KiB")
    # sympy strips newlines before it parses, and torch pastes guard code into the
    # source of a function: a backslash, comment or line break would let the text
    # they run differ from the text parsed here.
    if not text.isprintable() or "\\" in text or "#" in text:
        raise _Refuse(
            member, f"an expression with a backslash, comment or control character: {text[:60]!r}"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise _Refuse(member, f"an expression that does not parse: {text[:60]!r}") from exc
    calls = _GUARD_CALLS if guard else _SYMPY_CALLS
    call_args: dict[int, tuple[ast.AST, int]] = {}
    slices: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for i, arg in enumerate(node.args):
                call_args[id(arg)] = (node.func, i)
        if isinstance(node, ast.Subscript):
            slices.add(id(node.slice))
    for node in ast.walk(tree):
        ok = isinstance(node, _ARITHMETIC)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            func, position = call_args.get(id(node), (None, -1))
            ok = (guard and id(node) in slices and _is_plain(node.value)) or (
                not guard
                and isinstance(func, ast.Name)
                and func.id in ("Symbol", "Float")
                and position == 0
                and _NAME.fullmatch(node.value) is not None
            )
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (int, float, bool)) or node.value is None
        elif isinstance(node, ast.Name):
            ok = (
                node.id in calls
                or node.id in _SYMPY_NAMES
                or (guard and node.id in ("L", "math"))
                or _SYMBOL.fullmatch(node.id) is not None
            )
        elif isinstance(node, ast.Call):
            f = node.func
            ok = (isinstance(f, ast.Name) and f.id in calls) or (
                guard and isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS | _MATH
            )
        elif isinstance(node, ast.keyword):
            ok = (
                not guard
                and node.arg is not None
                and node.arg.isidentifier()
                and not node.arg.startswith("_")
            )
        elif isinstance(node, ast.Attribute):
            ok = guard and (
                node.attr in _GUARD_METHODS
                or (
                    (isinstance(node.value, ast.Name) and node.value.id == "math")
                    and node.attr in _MATH
                )
            )
        elif isinstance(node, ast.Subscript):
            ok = guard
        if not ok:
            shown = ast.unparse(node)[:60] if not isinstance(node, ast.keyword) else node.arg
            raise _Refuse(member, f"code in an expression: {shown!r}")


def _screen_program_json(member: str, data: bytes) -> None:
    try:
        program = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _Refuse(member, f"not valid JSON ({exc})") from exc
    if not isinstance(program, dict):
        raise _Refuse(member, "not a serialized program")
    for code in program.get("guards_code") or ():
        if not isinstance(code, str):
            raise _Refuse(member, "guard code that is not text")
        _check_ast(member, code, guard=True)
    stack: list[Any] = [program]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            target = value.get("target")
            if "inputs" in value and isinstance(target, str) and not _TARGET.fullmatch(target):
                raise _Refuse(member, f"a node calling {target[:60]!r}, which is not an operator")
            if isinstance(value.get("nodes"), list) and isinstance(value.get("inputs"), list):
                # A program's string inputs become guard code (``x == '<value>'``)
                # that ExportedProgram.module() compiles.
                for arg in value["inputs"]:
                    text = arg.get("as_string") if isinstance(arg, dict) else None
                    if text is not None and not (isinstance(text, str) and _is_plain(text)):
                        raise _Refuse(member, f"a string input {str(text)[:60]!r} with quotes, "
                                      "backslashes or control characters")  # fmt: skip
            names = value.get("forward_arg_names")
            if names is not None and not (
                isinstance(names, list)
                and all(isinstance(n, str) and n.isidentifier() for n in names)
            ):  # ExportedProgram.module() writes them into the source of forward()
                raise _Refuse(member, "forward argument names that are not identifiers")
            expr = value.get("expr_str")
            if expr is not None:
                if not isinstance(expr, str):
                    raise _Refuse(member, "an expression that is not text")
                _check_ast(member, expr, guard=False)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _screen_config(
    member: str, data: bytes, folder: str, names: dict[str, str], pickles: set[str]
) -> None:
    try:
        config = json.loads(data).get("config")
    except (ValueError, AttributeError) as exc:
        raise _Refuse(member, "not a payload config") from exc
    if not isinstance(config, dict):
        raise _Refuse(member, "not a payload config")
    allowed = r"weight_\d+" if folder == "data/weights/" else r"tensor_\d+"
    for key, entry in config.items():
        path_name = entry.get("path_name") if isinstance(entry, dict) else None
        if not isinstance(path_name, str):
            raise _Refuse(member, f"entry {key!r} has no path_name")
        target = folder + path_name
        if any(re.fullmatch(p, target.lower()) for p in TRUST_ONLY):
            # torch finds the member case-insensitively: name the one it would read.
            actual = next((v for k, v in names.items() if k.lower() == target.lower()), target)
            raise _Refuse(actual, "a pickled object that loading would execute")
        if not re.fullmatch(allowed, path_name) or target not in names:
            raise _Refuse(member, f"entry {key!r} points at {path_name!r}, not a tensor member")
        if entry.get("use_pickle"):
            pickles.add(names[target])


def _zip_size(file: IO[bytes], name: str) -> int:
    """The size of ``file``, rewound; LoadError when it is not a zip archive."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(0)
    if not zipfile.is_zipfile(file):
        raise LoadError(
            f"{name}: not a .pt2 archive (torch.export.save writes a zip file)", path=name
        )
    return size


def screen(file: IO[bytes], *, name: str = "<archive>") -> None:
    """Check every member of a .pt2 archive against :data:`ALLOWLIST` without loading it.

    This checks the members as Python's zip reader finds them; torch's reader can
    find others in the same file. :func:`load` therefore screens and loads one
    private copy: screen a file only to report on it, and load it with ``load``.

    Args:
        file: the archive, open for reading in binary mode (seekable).
        name: the file's name, for messages.

    Raises:
        UnsafeArchiveError: a member that is not allowed, with one line naming it.
        LoadError: the file is not a zip archive or not a saved program.
    """
    size = _zip_size(file, name)
    try:
        with zipfile.ZipFile(file) as archive:
            _screen_members(archive, size, name)
    except _Refuse as refused:
        raise _unsafe(name, refused) from None
    except zipfile.BadZipFile as exc:
        raise LoadError(f"{name}: not a .pt2 archive ({exc})", path=name) from exc
    # Imported here: torch.export.pt2_archive pulls in torch._dynamo (seconds).
    from torch.export.pt2_archive import PT2ArchiveReader

    file.seek(0)
    # torch's own zip reader must see exactly the members screened above.
    try:
        seen = set(PT2ArchiveReader(file).get_file_names())  # type: ignore[arg-type]
    except Exception as exc:
        raise LoadError(f"{name}: torch cannot read the archive ({_first_line(exc)})") from exc
    finally:
        file.seek(0)
    with zipfile.ZipFile(file) as archive:
        expected = {i.filename.split("/", 1)[1] for i in archive.infolist()}
    file.seek(0)
    if seen != expected:
        odd = sorted(seen ^ expected)[0]
        raise UnsafeArchiveError(
            f"{name}: refused member {odd!r}: torch's zip reader and Python's disagree",
            path=name,
            member=odd,
        )


def _check_program_archive(infos: Sequence[zipfile.ZipInfo], name: str) -> None:
    if not any(i.filename.lower().endswith("models/model.json") for i in infos):
        raise LoadError(
            f"{name}: a zip file, but not an exported program (no models/model.json inside)",
            path=name,
        )


@contextlib.contextmanager
def _private_copy(file: IO[bytes], name: str) -> Iterator[IO[bytes]]:
    """The archive rewritten by Python's zipfile, each member read once, into a
    temporary file that has no name (nothing to leave behind, nothing to swap).

    torch's zip reader and Python's can find different members in one file (a
    central directory stored elsewhere than its end record says: Python reads the
    one before the end record, torch the one at the stated offset), and a file can
    change on disk, or a network file system answer differently, between two
    reads. Screening and loading this copy makes what torch loads what was screened.
    """
    size = _zip_size(file, name)
    with tempfile.TemporaryFile() as copy:
        try:
            with zipfile.ZipFile(file) as archive:
                infos = archive.infolist()
                _check_program_archive(infos, name)
                _check_zip_entries(infos, size, name)
                with zipfile.ZipFile(copy, "w") as out:
                    for info in infos:
                        entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                        entry.file_size = info.file_size  # zip64 when needed
                        with archive.open(info) as src, out.open(entry, "w") as dst:
                            shutil.copyfileobj(src, dst, 1 << 20)
        except _Refuse as refused:
            raise _unsafe(name, refused) from None
        except (zipfile.BadZipFile, EOFError) as exc:
            raise LoadError(f"{name}: not a .pt2 archive ({exc})", path=name) from exc
        copy.seek(0)
        yield copy


def _unsafe(name: str, refused: _Refuse) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"{name}: refused member {refused.member!r}: {refused.why}; nothing was loaded "
        "(rerun with --trust only if you trust where the file came from)",
        path=name,
        member=refused.member,
    )


def _screen_members(archive: zipfile.ZipFile, size: int, name: str) -> None:
    infos = archive.infolist()
    _check_program_archive(infos, name)
    root = _check_zip_entries(infos, size, name)
    names = {i.filename[len(root) + 1 :]: i.filename for i in infos}
    pickles: set[str] = set()
    for short, full in names.items():
        if any(re.fullmatch(p, short.lower()) for p in TRUST_ONLY):
            raise _Refuse(full, "a pickled object that loading would execute")
        kind = _kind(short)
        if kind is None:
            what = "a shared library" if re.search(r"\.(so|dll|dylib)$", short.lower()) else ""
            if short.lower().startswith("data/aotinductor/"):
                what = "an AOTInductor package"
            raise _Refuse(full, (what or "a member") + " that torch.export.save does not write")
        if short != short.lower() and not short.startswith("extra/"):
            raise _Refuse(full, "a member name in the wrong case")
        if kind == "text":
            if archive.getinfo(full).file_size > _TEXT_LIMIT:
                raise _Refuse(full, "a text member over 1 MiB")
            try:
                archive.read(full).decode()
            except UnicodeDecodeError as exc:
                raise _Refuse(full, "a text member that is not UTF-8") from exc
        elif kind == "program":
            _screen_program_json(full, archive.read(full))
        elif kind == "config":
            folder = short.rsplit("/", 1)[0] + "/"
            _screen_config(full, archive.read(full), folder, names, pickles)
        elif kind == "pickle" and archive.getinfo(full).file_size:
            pickles.add(full)
    for full in sorted(pickles):
        _screen_pickle(full, archive.read(full))
        if _kind(full[len(root) + 1 :]) == "pickle":
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
        raise _Refuse(
            member, f"sample inputs the weights-only unpickler refuses ({_first_line(exc)})"
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
            if not _is_plain(text):
                raise _Refuse(
                    member,
                    f"sample inputs holding the text {text[:60]!r}, with quotes, "
                    "backslashes or control characters",
                )


# --- loading -----------------------------------------------------------------------


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an error, cut to its first sentence when long."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > limit and ". " in line:
        line = line[: line.index(". ") + 1]
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost error of a chain: torch wraps its real reason in summaries."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def import_modules(modules: Iterable[str]) -> None:
    """Import modules that register custom ops (``--import``), before a program loads.

    Raises:
        LoadError: a module does not import; the message names it.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise LoadError(f"--import {module}: {_first_line(exc)}") from exc


def declared_imports(passes: Iterable[Any]) -> list[str]:
    """The modules the passes of a pipeline (nested ones included) declare in ``imports``.

    A pass that works on programs holding custom ops names the modules registering
    them (``imports = ("torchao",)``); the ``epass`` command imports them before it
    loads the input, as if given with ``--import``.
    """
    found: list[str] = []
    stack = list(passes)
    while stack:
        p = stack.pop(0)
        found.extend(m for m in getattr(p, "imports", ()) or () if m not in found)
        stack.extend(getattr(p, "passes", ()) or ())
    return found


def load(
    path: str | os.PathLike[str], *, trust: bool = False, imports: Sequence[str] = ()
) -> ExportedProgram:
    """Load a program saved with ``torch.export.save``, refusing what could run code.

    Without ``trust`` the file is read once, its members copied into a temporary
    file that has no name, and that copy is screened (:func:`screen`) and loaded,
    so what torch reads is what was screened. Nothing process-global changes, so
    other threads' ``torch.load`` calls are unaffected; loads through epass in
    several threads are safe (torch's deserializer itself runs one at a time).
    With ``trust`` this is ``torch.export.load``.

    Args:
        path: the .pt2 file.
        trust: skip screening; for files you made yourself.
        imports: modules to import first (libraries that register custom ops).

    Raises:
        UnsafeArchiveError: a member is not allowed; nothing was executed.
        LoadError: missing file, not an archive, an import fails, or torch cannot
            load it (the message carries torch's reason in one line).
    """
    import_modules(imports)
    p = Path(path)
    if not p.exists():
        raise LoadError(f"{p}: no such file", path=str(p))
    if p.is_dir():
        raise LoadError(f"{p}: is a directory, not a .pt2 file", path=str(p))
    try:
        with open(p, "rb") as f:
            if trust:
                ep = _program.load_pt2(f, trust=True)
            else:
                with _private_copy(f, str(p)) as copy:
                    screen(copy, name=str(p))
                    ep = _program.load_pt2(copy)
    except LoadError:
        raise
    except OSError as exc:
        raise LoadError(f"{p}: cannot read ({exc.strerror or exc})", path=str(p)) from exc
    except Exception as exc:
        hint = "" if imports else "; if it uses custom ops, --import the module registering them"
        reason = _first_line(_root_cause(exc))
        raise LoadError(f"{p}: cannot load ({reason}){hint}", path=str(p)) from exc
    if not isinstance(ep, ExportedProgram):
        raise LoadError(f"{p}: did not hold an ExportedProgram", path=str(p))
    return ep


# --- saving ------------------------------------------------------------------------


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _directory(p: Path) -> Path:
    """The directory holding ``p``'s own entry, where the rename happens.

    Not the directory a symlink at ``p`` points into: the rename replaces the link
    (it never writes through it), and must not cross file systems.
    """
    return Path(os.path.abspath(p)).parent


def check_output_path(path: str | os.PathLike[str], suffixes: Sequence[str]) -> Path:
    """Check, before any work is done, that ``path`` can be written.

    Raises:
        SaveError: wrong suffix, missing or unwritable directory, or a directory.
    """
    p = Path(path)
    if p.suffix.lower() not in suffixes:
        raise SaveError(f"{p}: the file must end in {' or '.join(suffixes)}")
    parent = _directory(p)
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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` on success.

    On any error the temporary file is removed and ``path`` is as it was.

    Example::

        with atomic_write("r.json") as tmp:
            tmp.write_text("{}")
    """
    p = Path(path)
    try:
        fd, name = tempfile.mkstemp(
            dir=_directory(p), prefix=f".{p.stem}.", suffix=f".tmp{p.suffix}"
        )
    except OSError as exc:
        raise SaveError(f"{p}: cannot write ({exc.strerror or exc})") from exc
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(
    ep: ExportedProgram, path: str | os.PathLike[str], *, prune_state: bool = True
) -> list[str]:
    """Save with ``torch.export.save``, atomically; returns the pruned keys.

    With ``prune_state`` (the default), state entries the signature no longer
    references are dropped first (:func:`prune` with ``compact=True``).

    Raises:
        SaveError: the path is not writable or torch cannot write the program;
            ``path`` is left as it was.
    """
    p = check_output_path(path, (".pt2",))
    dropped = unreferenced(ep) if prune_state else []
    program = prune(ep, compact=True) if dropped else ep
    try:
        with atomic_write(p) as tmp:
            torch.export.save(program, tmp)
    except SaveError:
        raise
    except Exception as exc:
        raise SaveError(f"{p}: cannot write ({_first_line(exc)})") from exc
    return dropped


# --- pruning and inspecting --------------------------------------------------------


def _check_program(ep: Any, what: str) -> None:
    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(f"{what} takes an ExportedProgram, got {type(ep).__name__}")


def unreferenced(ep: ExportedProgram) -> list[str]:
    """Keys :func:`prune` would drop, as ``"state_dict:<key>"`` / ``"constants:<key>"``."""
    _check_program(ep, "unreferenced")
    targets = {s.target for s in ep.graph_signature.input_specs if s.target is not None}
    dropped = [f"state_dict:{k}" for k in ep.state_dict if k not in targets]
    return dropped + [f"constants:{k}" for k in ep.constants if k not in targets]


def prune(ep: ExportedProgram, *, compact: bool = False) -> ExportedProgram:
    """A program holding exactly the state entries its signature references.

    The result gets new dicts (same tensor objects), so it no longer shares the
    store: sharing ends here by choice. Use it before saving a program that has no
    user dict to share, such as one loaded from disk.

    With ``compact=True`` an entry that is a partial or strided view of memory no
    kept entry covers whole (the folded transpose of a weight that was pruned) is
    replaced by a contiguous copy, so that the program holds no bytes it cannot
    reach and ``torch.export.save`` writes each tensor whole.

    Example::

        lean = prune(out)
        assert set(lean.state_dict) <= set(out.state_dict)
    """
    _check_program(ep, "prune")
    targets = {s.target for s in ep.graph_signature.input_specs if s.target is not None}
    state_dict = {k: v for k, v in ep.state_dict.items() if k in targets}
    constants = {k: v for k, v in ep.constants.items() if k in targets}
    if compact:
        _compact(state_dict, constants)
    out = _program.shallow_clone(ep)
    _program.set_state(out, state_dict, constants)
    return out


def _whole(t: torch.Tensor) -> bool:
    return bool(
        t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
    )


def _compact(*dicts: dict[str, Any]) -> None:
    tensors = [v for d in dicts for v in d.values() if isinstance(v, torch.Tensor)]
    covered = {t.untyped_storage().data_ptr() for t in tensors if _whole(t)}
    copies: dict[int, torch.Tensor] = {}  # tied entries stay tied
    for d in dicts:
        for key, value in d.items():
            if not isinstance(value, torch.Tensor) or _whole(value):
                continue
            if value.untyped_storage().data_ptr() in covered:
                continue
            if id(value) not in copies:
                data = value.detach().clone(memory_format=torch.contiguous_format)
                if isinstance(value, torch.nn.Parameter):
                    data = torch.nn.Parameter(data, requires_grad=value.requires_grad)
                copies[id(value)] = data
            d[key] = copies[id(value)]


def _bytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def inspect(ep: ExportedProgram) -> dict[str, Any]:
    """What ``epass inspect`` shows, as JSON-ready data: dialect, nodes, ops, state, signature."""
    sig = ep.graph_signature
    by_dtype: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for d in (ep.state_dict, ep.constants):
        for value in d.values():
            if isinstance(value, torch.Tensor):
                entry = by_dtype[str(value.dtype).removeprefix("torch.")]
                entry[0] += 1
                entry[1] += _bytes(value)
    params = [ep.state_dict[k] for k in sig.parameters if k in ep.state_dict]
    buffers = [ep.state_dict.get(k, ep.constants.get(k)) for k in sig.buffers]
    constants = [ep.constants[k] for k in sig.lifted_tensor_constants if k in ep.constants]
    ops = op_histogram(ep)  # keyed like the pass records' op deltas
    return {
        "dialect": ep.dialect,
        "nodes": len(ep.graph.nodes),
        "ops": dict(ops.most_common()),
        "state": {
            "state_dict_entries": len(ep.state_dict),
            "constants_entries": len(ep.constants),
            "by_dtype": {k: {"entries": v[0], "bytes": v[1]} for k, v in sorted(by_dtype.items())},
            "parameters": {"count": len(params), "bytes": sum(map(_bytes, params))},
            "buffers": {"count": len(buffers), "bytes": sum(map(_bytes, buffers))},
            "constants": {
                "count": len(sig.lifted_tensor_constants) + len(sig.lifted_custom_objs),
                "bytes": sum(map(_bytes, constants)),
            },
        },
        "signature": {
            "user_inputs": list(sig.user_inputs),
            "user_outputs": [str(o) for o in sig.user_outputs],
            "input_kinds": dict(collections.Counter(s.kind.name.lower() for s in sig.input_specs)),
            "output_kinds": dict(
                collections.Counter(s.kind.name.lower() for s in sig.output_specs)
            ),
            "buffers_mutated": dict(sig.buffers_to_mutate),
        },
    }

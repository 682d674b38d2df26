"""Load, save, prune and inspect ``.pt2`` files; untrusted archives are screened first.

``load`` screens the file (``epass._screen``: members against :data:`ALLOWLIST`,
``models/model.json`` field by field against torch's schema) through a view in which
every byte read stays as it was read, and hands torch that same view.

One concept: a ``.pt2`` file's way in and out; load, save, prune and inspect share
the screen and the path checks.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import importlib
import os
import shutil
import stat
import sys
import tempfile
import threading
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch.export import ExportedProgram

from epass import _heap, _program, _pt2
from epass._paths import check_exists, check_output_path, directory_of
from epass._screen import ALLOWLIST, ReadOnce, readers_agree, screen
from epass._screen import first_line as _first_line
from epass._screen import private_copy as _private_copy
from epass.errors import ArgumentTypeError, LoadError, SaveError
from epass.protocol import PassModel, adapt
from epass.records import op_histogram

__all__ = [
    "ALLOWLIST",
    "ProgressCallback",
    "atomic_directory",
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


# --- loading -----------------------------------------------------------------------


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

    A module that is not on the import path but sits in the current folder
    (``mymodule.py`` or a package folder) is imported from there, as
    ``python -m epass`` would find it; the ``epass`` script does not put the
    current folder on the path by itself.

    Raises:
        LoadError: a module does not import; the message names it.
    """
    for module in modules:
        try:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                top = module.split(".")[0]
                here = os.getcwd()
                local = os.path.exists(os.path.join(here, top + ".py")) or os.path.isdir(
                    os.path.join(here, top)
                )
                if exc.name == top and not local:
                    raise LoadError(f"--import {module}: {_not_found(top, here)}") from exc
                if exc.name != top or here in sys.path:
                    raise
                sys.path.append(here)
                importlib.import_module(module)
        except LoadError:
            raise
        except Exception as exc:
            raise LoadError(f"--import {module}: {_first_line(exc)}") from exc


def _not_found(top: str, here: str) -> str:
    """Where a module was looked for, and what to set: the reproducer's hint."""
    path = os.environ.get("PYTHONPATH")
    where = f"PYTHONPATH={path}" if path else "PYTHONPATH is not set"
    return (
        f"no module named {top!r} in the current folder {here} nor on the import path "
        f"({where}); run from the folder that holds {top}.py, put that folder on "
        "PYTHONPATH, or install the package that provides it"
    )


def module_origin(module: str) -> str | None:
    """The folder to put on ``sys.path`` to import ``module`` as it was imported
    here, or None for a module without a file (built in, or not imported)."""
    found = sys.modules.get(module)
    file = getattr(found, "__file__", None)
    if not isinstance(file, str):
        return None
    path = Path(file).resolve()
    levels = module.count(".") + (1 if path.name == "__init__.py" else 0)
    return str(path.parents[levels])


def declared_imports(passes: Iterable[Any]) -> list[str]:
    """The modules the passes of a pipeline (nested ones included) declare in ``imports``.

    A pass that works on programs holding custom ops names the modules registering
    them (``imports = ("torchao",)``); the ``epass`` command imports them before it
    loads the input, as if given with ``--import``.
    """
    found: list[str] = []
    stack = [p if isinstance(p, PassModel) else adapt(p) for p in passes]
    while stack:
        model = stack.pop(0)
        found.extend(m for m in model.imports if m not in found)
        stack.extend(model.children)
    return found


ProgressCallback = Callable[[str], object]
"""A callable told, with a short text, when each phase of a load or save starts
(``"screening model.pt2 (77 MB)"``); ``epass.instruments.Spinner`` is one."""


def _size_text(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.0f} GB"  # pragma: no cover (the loop returns)


def load(
    path: str | os.PathLike[str],
    *,
    trust: bool = False,
    imports: Sequence[str] = (),
    progress: ProgressCallback | None = None,
) -> ExportedProgram:
    """Load a program saved with ``torch.export.save``, refusing what could run code.

    Without ``trust`` the file is screened (:func:`screen`) and loaded through one
    view of it in which a byte, once read, stays what it was (``ReadOnce``), so
    that a file rewritten on disk meanwhile cannot slip torch bytes the screen did
    not see. An archive in which torch's zip reader and Python's find different
    members is first rewritten by Python's zipfile into a temporary file that has
    no name, and that copy is screened and loaded instead. Other threads'
    ``torch.load`` calls are unaffected; loads through epass in several threads are
    safe (torch's deserializer itself runs one at a time). While torch deserializes,
    Python's cycle collector waits, as it does during a pass.
    With ``trust`` this is ``torch.export.load``.

    Args:
        path: the .pt2 file.
        trust: skip screening; for files you made yourself.
        imports: modules to import first (libraries that register custom ops).
        progress: called with ``"screening NAME (SIZE)"`` and ``"loading NAME (SIZE)"``
            as those phases start (see :data:`ProgressCallback`).

    Raises:
        UnsafeArchiveError: a member is not allowed; nothing was executed.
        LoadError: missing file, not an archive, an import fails, or torch cannot
            load it (the message carries torch's reason in one line).
    """
    import_modules(imports)
    p = Path(path)
    check_exists(p)
    try:
        # torch's deserializer makes about a million containers, nearly all of which
        # outlive it: the cycle collector would walk them a thousand times (0.8 s of
        # a 768 MiB Llama-shaped checkpoint's 2.5 s load). So it waits, as in a pass.
        with open(_open_regular(p), "rb") as f, _heap.collector_paused():
            say = _phases(progress, f"{p.name} ({_size_text(os.fstat(f.fileno()).st_size)})")
            if trust:
                say("loading")
                ep = _pt2.read_program(f, trust=True)
            else:
                ep = _load_screened(f, str(p), say)
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


def _open_regular(p: Path) -> int:
    """A descriptor of ``p``, open for reading; LoadError unless it is a regular file.

    Not waiting on a FIFO for a writer: a program is a regular file (its reader
    seeks, and the screen and torch must read the same bytes).
    """
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LoadError(f"{p}: not a regular file", path=str(p))
    return fd


def _phases(progress: ProgressCallback | None, what: str) -> Callable[[str], None]:
    def say(phase: str) -> None:
        if progress is not None:
            progress(f"{phase} {what}")

    return say


def _load_screened(f: Any, name: str, say: Callable[[str], None]) -> ExportedProgram:
    say("screening")
    view = ReadOnce(f, name) if ReadOnce.usable(f) else None
    if view is not None and _agree(view):
        screen(typing.cast(IO[bytes], view), name=name)
        view.seal()
        say("loading")
        return _pt2.read_program(view)
    with _private_copy(f, name) as copy:  # not a regular file, or the readers disagree
        screen(copy, name=name)
        say("loading")
        return _pt2.read_program(copy)


def _agree(view: ReadOnce) -> bool:
    """Whether torch's zip reader and Python's agree on ``view``; the tensor data that
    torch's reader may read whole to tell a record's size is not kept by the view."""
    with view.tensor_data_unkept():
        return readers_agree(typing.cast(IO[bytes], view))


# --- saving ------------------------------------------------------------------------


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` on success.

    On any error the temporary file is removed and ``path`` is as it was. The
    temporary file has ``path``'s own name, in a new folder beside it, so that what
    names itself after its file (``torch.export.save`` names the archive's root
    folder so) names itself as if written to ``path``.

    Example::

        with atomic_write("r.json") as tmp:
            tmp.write_text("{}")
    """
    p = Path(path)
    try:
        work = Path(tempfile.mkdtemp(dir=directory_of(p), prefix=f".{p.name}.", suffix=".tmp"))
    except OSError as exc:
        raise SaveError(f"{p}: cannot write ({exc.strerror or exc})") from exc
    tmp = work / p.name
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        old = _hold(p)
        try:
            _replace(tmp, p)
        finally:
            if old is not None:
                threading.Thread(
                    target=os.close, args=(old,), name="epass-release", daemon=True
                ).start()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# renameat2(2)'s flag that swaps two names atomically (linux/fs.h).
_RENAME_EXCHANGE = 2


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function: Callable[..., int] | None = getattr(libc, "renameat2", None)
    return function


def _replace(tmp: Path, p: Path) -> None:
    """Put ``tmp`` in place of ``p``, atomically: a reader finds the old file or the new.

    A regular file (or a link) at ``p`` is swapped with ``tmp`` (``renameat2`` with
    ``RENAME_EXCHANGE``), and the old file, now at ``tmp``, is removed. On ext4, a
    file renamed over another is flushed to disk at the rename (``auto_da_alloc``):
    for an 800 MB program that took a second of system time, which a swap does not
    cost. Elsewhere, or where the swap is refused, this is ``os.replace``.
    """
    exchange = _renameat2()
    try:
        kind = os.lstat(p).st_mode
    except OSError:
        kind = 0
    if exchange is not None and (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
        at = -100  # AT_FDCWD
        if exchange(at, os.fsencode(tmp), at, os.fsencode(p), _RENAME_EXCHANGE) == 0:
            if stat.S_ISDIR(os.lstat(tmp).st_mode):  # a folder took the file's place
                exchange(at, os.fsencode(tmp), at, os.fsencode(p), _RENAME_EXCHANGE)
            else:
                return  # the old file, at tmp, goes with the temporary folder
    os.replace(tmp, p)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a new empty folder beside ``path``; on success rename it to ``path``.

    A folder already at ``path`` (an earlier output) is moved aside first and removed
    once the new one is in place: ``path`` holds the old files or the new ones, never
    a mix. On any error the new folder is removed and ``path`` is as it was. The
    caller decides what ``path`` may replace (:func:`epass._paths.check_output_directory`).

    Example::

        with atomic_directory("repro") as tmp:
            (tmp / "a.txt").write_text("a")
    """
    p = Path(os.path.abspath(path))
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp"))
    except OSError as exc:
        raise SaveError(f"{path}: cannot write ({exc.strerror or exc})") from exc
    try:
        yield work
        os.chmod(work, 0o777 & ~_umask())  # mkdtemp's folder is the owner's alone
        _rename_into_place(work, p, path)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _rename_into_place(work: Path, p: Path, given: str | os.PathLike[str]) -> None:
    old = None
    try:
        if p.is_dir() and not p.is_symlink():
            old = Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".old"))
            os.replace(p, old)  # over the empty folder just made: the name stays ours
        try:
            os.rename(work, p)
        except BaseException:
            if old is not None:
                os.rename(old, p)
                old = None
            raise
    except OSError as exc:
        raise SaveError(f"{given}: cannot write ({exc.strerror or exc})") from exc
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _hold(p: Path) -> int | None:
    """A descriptor of the regular file the rename will replace, or None.

    Freeing a replaced file's blocks takes the rename a tenth of a second per
    200 MB (ext4); holding it open moves that work to the last close, which a
    thread makes once the new file is in place.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(p, flags)  # a symlink is not followed: the rename replaces the link
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode) and os.fstat(fd).st_size >= 1 << 24:
        return fd
    os.close(fd)
    return None


def save(
    ep: ExportedProgram,
    path: str | os.PathLike[str],
    *,
    prune_state: bool = True,
    progress: ProgressCallback | None = None,
) -> list[str]:
    """Save with ``torch.export.save``, atomically; returns the pruned keys.

    With ``prune_state`` (the default), state entries the signature no longer
    references are dropped first (:func:`prune` with ``compact=True``).
    ``progress`` is called with ``"saving NAME (SIZE)"`` as the write starts, SIZE
    being the bytes of state to write (see :data:`ProgressCallback`).

    Raises:
        SaveError: the path is not writable or torch cannot write the program;
            ``path`` is left as it was.
    """
    p = check_output_path(path, (".pt2",))
    dropped = unreferenced(ep) if prune_state else []
    program = prune(ep, compact=True) if dropped else ep
    if progress is not None:
        storages = (t.untyped_storage() for t in _tensors(program))
        state = {s.data_ptr(): s.nbytes() for s in storages}  # tied entries once
        progress(f"saving {p.name} ({_size_text(sum(state.values()))})")
    try:
        with atomic_write(p) as tmp, _heap.collector_paused():  # as in load()
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


def _tensors(ep: ExportedProgram) -> Iterator[torch.Tensor]:
    for d in (ep.state_dict, ep.constants):
        yield from (v for v in d.values() if isinstance(v, torch.Tensor))


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
            "inputs": _inputs(ep),
            "dims": {
                str(symbol): [_bound(r.lower), _bound(r.upper)]
                for symbol, r in ep.range_constraints.items()
            },
        },
    }


# How `epass inspect` names each kind of graph input.
_INPUT_KINDS = {
    "USER_INPUT": "user input",
    "PARAMETER": "parameter",
    "BUFFER": "buffer",
    "CONSTANT_TENSOR": "constant",
    "CUSTOM_OBJ": "custom object",
    "TOKEN": "token",
}


def _inputs(ep: ExportedProgram) -> list[dict[str, Any]]:
    """Each graph input in order: its name, kind, the state entry it binds (None for a
    user input), shape (ints, and symbols such as ``s0`` for dynamic dimensions) and
    dtype (a type name for an input that is not a tensor)."""
    values = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in ep.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        value = values.get(name) if isinstance(name, str) else getattr(spec.arg, "value", None)
        shape = dtype = None
        if isinstance(value, torch.Tensor):
            shape = [d if isinstance(d, int) else str(d) for d in value.shape]
            dtype = str(value.dtype).removeprefix("torch.")
        elif value is not None:
            dtype = type(value).__name__
        out.append(
            {
                "name": name if isinstance(name, str) else str(value),
                "kind": _INPUT_KINDS.get(spec.kind.name, spec.kind.name.lower()),
                "target": spec.target,
                "shape": shape,
                "dtype": dtype,
            }
        )
    return out


def _bound(value: Any) -> int | None:
    """A range bound as an int; None when it is unbounded."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None

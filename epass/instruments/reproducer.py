"""``Reproducer``: when a pass fails, write what someone else needs to make it fail again."""

from __future__ import annotations

import json
import logging
import operator
import pickle
import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import registry
from epass._text import escape_char, printable_lines
from epass.errors import InstrumentError
from epass.instrumentation import Instrument
from epass.io import atomic_directory, module_origin
from epass.manager import to_text
from epass.protocol import adapt
from epass.records import PassInfo

__all__ = [
    "GRAPH_FILE",
    "Reproducer",
    "docstring_text",
    "graph_listing",
    "listing_differences",
    "load_program",
    "pipeline_text",
    "qualified_name",
    "save_program",
    "script",
    "write_pipeline",
]

logger = logging.getLogger("epass")

QUALIFIED_HEADER = "# epass pipeline, one pass per line as module:qualname"
# The nodes of the saved program, graph by graph, to load it back node for node.
GRAPH_FILE = "graph.json"


def graph_listing(program: ExportedProgram) -> dict[str, list[list[str]]]:
    """Every node of every graph of ``program`` (nested ``cond`` branches and loop
    bodies by module path): name, op, target, arguments and keyword arguments, as text."""
    return {
        path or "<root>": [
            [n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs)] for n in module.graph.nodes
        ]
        for path, module in program.graph_module.named_modules()
        if isinstance(module, torch.fx.GraphModule)
    }


def save_program(program: ExportedProgram, where: Path) -> None:
    """Write ``program.pt2`` (``torch.export.save``) and its node listing into ``where``."""
    torch.export.save(program, where / "program.pt2")
    (where / GRAPH_FILE).write_text(json.dumps(graph_listing(program), indent=1) + "\n")


def _as_tuples(value: Any) -> Any:
    """``value`` with every list in it (nested) made a tuple."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_tuples(v) for k, v in value.items()}
    return value


def _restore(program: ExportedProgram, listing: Mapping[str, Any]) -> None:
    """Undo what torch's deserializer changes, where the saved listing says so: the
    ``getitem`` nodes without users it makes for every output of a multi-output op
    (``native_layer_norm_unused_1``) are removed, and operands it reads back as a
    list where the program had a tuple (``cond``'s) are a tuple again."""
    for path, module in program.graph_module.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        saved = {row[0]: row for row in listing.get(path or "<root>", ())}
        added = [
            n
            for n in module.graph.nodes
            if n.target is operator.getitem and not n.users and n.name not in saved
        ]
        for node in reversed(added):
            module.graph.erase_node(node)
        for node in module.graph.nodes:
            row = saved.get(node.name)
            if row is not None and repr(node.args) != row[3]:
                args = _as_tuples(node.args)
                if repr(args) == row[3]:
                    node.args = args
        module.recompile()


def listing_differences(
    expected: Mapping[str, Sequence[Sequence[str]]], actual: Mapping[str, Sequence[Sequence[str]]]
) -> list[str]:
    """What differs between two node listings, one line per difference (at most 10)."""
    out = []
    for path in sorted(set(expected) | set(actual)):
        want = [tuple(r) for r in expected.get(path, ())]
        have = [tuple(r) for r in actual.get(path, ())]
        if want == have:
            continue
        out.append(f"graph {path}: {len(want)} nodes saved, {len(have)} loaded")
        for i, (a, b) in enumerate(zip(want, have, strict=False)):
            if a != b:
                out.append(f"  node {i}: saved {' '.join(a[:3])}, loaded {' '.join(b[:3])}")
                break
    return out[:10]


def load_program(where: str | Path) -> tuple[ExportedProgram, list[str]]:
    """The program a reproducer saved in ``where``, node for node as it failed.

    ``torch.export.load`` gives back a ``getitem`` node for every output of a
    multi-output op, used or not (184 nodes for a 176-node program); those the
    saved program did not have are removed. Returns the program and what still
    differs from the saved node listing (empty when it is the same node for node,
    or when no listing was saved).
    """
    where = Path(where)
    program = torch.export.load(where / "program.pt2")
    listing_file = where / GRAPH_FILE
    if not listing_file.exists():
        return program, []
    listing = json.loads(listing_file.read_text())
    _restore(program, listing)
    return program, listing_differences(listing, graph_listing(program))


def qualified_name(p: Any) -> str:
    """``module:qualname`` of a pass's function or class (``FxPass`` names its function)."""
    target = getattr(p, "fn", None) if type(p).__name__ == "FxPass" else None
    if target is None:
        target = p
    # Instances (a torch.fx PassBase, a callable object) are named by their class.
    if not isinstance(target, type) and not hasattr(target, "__qualname__"):
        target = type(target)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}:{getattr(target, '__qualname__', type(target).__qualname__)}"


def _not_importable(name: str) -> str:
    """Why ``module:qualname`` cannot be imported again, or "" when it can."""
    module, _, qualname = name.partition(":")
    if "<locals>" in qualname or "<lambda>" in qualname:
        return "it is defined inside a function"
    if module in ("__main__", "?"):
        return "it is defined in a script, not an importable module"
    return ""


def pipeline_text(passes: Sequence[Any]) -> tuple[str, str]:
    """The pipeline as registry text when every pass is registered, otherwise one
    qualified name per line. Returns ``(format, text)`` with format ``"text"`` or
    ``"qualified"``."""
    try:
        return "text", to_text(list(passes)) + "\n"
    except Exception:  # a pass the registry cannot name
        pass
    lines = [QUALIFIED_HEADER, *(qualified_name(p) for p in passes)]
    return "qualified", "\n".join(lines) + "\n"


def _qualified_lines(passes: Sequence[Any]) -> str:
    try:
        return pipeline_text(passes)[1]
    except Exception as exc:  # the reproducer must still be written
        return f"{QUALIFIED_HEADER}\n# the passes could not be named: {exc!r}\n"


_REPRO = '''\
"""Reproduce an epass pass failure.

{summary}
{unimportable}
Run: python repro.py    (exits with the failure; 0 means it did not reproduce)
"""

import importlib
import pickle
import pkgutil
import sys
from pathlib import Path

import torch

import epass

HERE = Path(__file__).resolve().parent
VERIFY = {verify}
# None: the pipeline must raise; else the tolerances under which a pass must drift.
NUMERICS = {numerics}
# Modules that define or register the passes, and the folder each was imported from.
IMPORTS = {imports}


def import_modules():
    for module, folder in IMPORTS:
        if folder is not None and folder not in sys.path:
            sys.path.append(folder)
        try:
            importlib.import_module(module)
        except Exception as exc:
            where = f"the folder {{folder}}" if folder else "its folder"
            sys.exit(
                f"cannot import {{module}} ({{exc!r}}), which the passes need; "
                f"put {{where}} on PYTHONPATH or install the package that provides it"
            )


def load_passes():
    pickled = HERE / "passes.pkl"
    if pickled.exists():
        try:
            return pickle.loads(pickled.read_bytes())
        except Exception as exc:
            print(f"passes.pkl did not load ({{exc!r}}); using pipeline.txt", file=sys.stderr)
    text = (HERE / "pipeline.txt").read_text()
    if not text.startswith("{header}"):
        return epass.PassManager.from_text(text.strip()).passes
    passes = []
    for line in text.splitlines()[1:]:
        if line.startswith("#"):
            sys.exit(f"cannot rebuild the passes: {{line[1:].strip()}}")
        try:
            obj = pkgutil.resolve_name(line.strip())
        except Exception as exc:
            sys.exit(f"cannot re-import pass {{line.strip()}}: {{exc!r}}")
        # Classes are rebuilt with their default options; functions are used as they are.
        passes.append(obj() if isinstance(obj, type) else obj)
    return passes


def load_program():
    try:
        from epass.instruments.reproducer import load_program as load_exact
    except ImportError:  # an epass without it: the program as torch loads it
        return torch.export.load(HERE / "program.pt2")
    program, differences = load_exact(HERE)
    for line in differences:
        print(f"the loaded program differs from the one saved: {{line}}", file=sys.stderr)
    return program


def main():
    import_modules()
    program = load_program()
    passes = load_passes()
    print("running", [epass.protocol.pass_name(p) for p in passes], file=sys.stderr)
    if NUMERICS is None:
        epass.PassManager(passes, verify=VERIFY).run(program)
        print("the pipeline ran without error: the failure did not reproduce", file=sys.stderr)
        return
    check = epass.NumericsCheck(**NUMERICS)
    epass.PassManager(passes, verify=VERIFY, instruments=[check]).run(program)
    print(check.report(), file=sys.stderr)
    if check.first_drift is not None:
        sys.exit(f"numerics drift: {{check.first_drift}}")
    print("no pass drifted: the failure did not reproduce", file=sys.stderr)


if __name__ == "__main__":
    main()
'''


class Reproducer(Instrument):
    """On a pass failure, write a directory that reproduces it.

    Each failure gets a new ``<directory>/<NNN>-<pass>/`` with:

    * ``program.pt2``: the failing pass's input program (``torch.export.save``);
    * ``pipeline.txt``: the pipeline from the failing pass on, as registry text
      when the passes can be printed that way, otherwise by qualified names;
    * ``passes.pkl``: the same passes pickled with their options, when they pickle;
    * ``error.txt``: the original error;
    * ``repro.py``: reloads the program, rebuilds the passes and runs them.

    The path is appended to the ``PassError`` message; ``written`` lists the
    directories written, ``write_errors`` why a reproducer could not be written.
    The modules that define the passes must be importable where ``repro.py`` runs;
    where a pass cannot be re-imported, ``repro.py`` says why. A reproducer is
    written into a hidden folder and renamed, so it is there whole or not at all.
    Writing never raises: if it fails, the error message says so instead. Failures
    raised by instruments (``InstrumentError``) get no reproducer, since the passes
    alone would not fail.

    Example::

        PassManager(passes, instruments=[Reproducer("repros")]).run(ep)
        # epass.PassError: pass 'my-pass' (position 3, step 0) failed: ...
        #   reproducer: repros/000-my-pass/repro.py
    """

    def __init__(self, directory: str | Path, *, imports: Sequence[str] = ()) -> None:
        self.directory = Path(directory)
        self.imports = tuple(imports)
        self.written: list[Path] = []
        self.write_errors: list[str] = []

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        manager = info.manager
        path = info.path
        if isinstance(error, InstrumentError):
            return  # an instrument stopped the pipeline; rerunning the passes would not
        note = getattr(error, "add_note_line", None)
        try:
            where = self.write(info, path, program, manager, error)
        except Exception as exc:
            logger.info("reproducer for %s could not be written: %r", path, exc)
            self.write_errors.append(f"{type(exc).__name__}: {exc}")
            if note is not None:
                note(f"reproducer could not be written: {type(exc).__name__}: {exc}")
            return
        if note is not None:
            note(f"reproducer: {where / 'repro.py'}")

    def write(
        self,
        info: PassInfo,
        path: str,
        program: ExportedProgram,
        manager: Any,
        error: BaseException,
    ) -> Path:
        """Write the reproducer for one failure and return its directory."""
        passes = list(manager.passes[info.index :]) if manager is not None else [info.pass_]
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", path)
        number = len(self.written)
        while self.directory.is_dir() and any(self.directory.glob(f"{number:03d}-*")):
            number += 1  # keep reproducers from earlier runs
        where = self.directory / f"{number:03d}-{safe}"
        # Written into a hidden folder and renamed: a reproducer is there whole or not at all.
        with atomic_directory(where) as work:
            self._fill(work, passes, program, manager, error)
        self.written.append(where)
        logger.info("reproducer for %s written to %s", path, where)
        return where

    def _fill(
        self,
        where: Path,
        passes: Sequence[Any],
        program: ExportedProgram,
        manager: Any,
        error: BaseException,
    ) -> None:
        message = str(error)
        # A message may hold any character (a node name from the program, lone
        # surrogates): error.txt keeps its lines and escapes everything unprintable.
        (where / "error.txt").write_text(printable_lines(message) + "\n", "utf-8")
        save_program(program, where)
        verify = bool(getattr(manager, "verify", True))
        write_pipeline(where, passes, message, verify=verify, imports=self.imports)


def write_pipeline(
    where: Path,
    passes: Sequence[Any],
    message: str,
    *,
    verify: bool = True,
    imports: Sequence[str] = (),
    numerics: Mapping[str, float] | None = None,
) -> None:
    """Write ``pipeline.txt``, ``passes.pkl`` (when the passes pickle) and a
    ``repro.py`` that loads ``program.pt2`` (:func:`load_program`) and runs the
    passes: it fails with the pass's error, or with ``numerics`` (``rtol`` and
    ``atol``) when a pass's outputs drift. ``message`` heads its docstring."""
    text = _qualified_lines(passes)
    (where / "pipeline.txt").write_text(text)
    try:
        (where / "passes.pkl").write_bytes(pickle.dumps(list(passes)))
    except Exception as exc:  # lambdas, local classes: pipeline.txt has to do
        logger.debug("passes do not pickle: %r", exc)
    reasons = []
    if text.startswith(QUALIFIED_HEADER) and not (where / "passes.pkl").exists():
        for line in text.splitlines()[1:]:
            why = "" if line.startswith("#") else _not_importable(line)
            if why:
                reasons.append(f"{line} cannot be re-imported: {why}.")
    unimportable = "\n".join(reasons) + ("\n" if reasons else "")
    modules = [(m, module_origin(m)) for m in _modules(passes, imports)]
    (where / "repro.py").write_text(
        script(message, unimportable, verify=verify, imports=modules, numerics=numerics),
        "utf-8",
    )


def _modules(passes: Sequence[Any], imports: Sequence[str]) -> list[str]:
    """The modules to import before the passes are rebuilt: those given as
    ``imports`` (``--import``), then those defining the passes' classes and
    functions and the factories that registered them, nested pipelines included
    (epass's and torch's own left out)."""
    found = list(imports)
    stack = [adapt(p) for p in passes]
    while stack:
        model = stack.pop(0)
        stack.extend(model.children)
        for module in (model.module, _factory_module(model.origin)):
            if (
                isinstance(module, str)
                and module.split(".")[0] not in ("epass", "torch", "builtins", "__main__")
                and module not in found
            ):
                found.append(module)
    return found


def _factory_module(origin: Any) -> str | None:
    """The module of the factory registered under a pass's registry name: the one
    that registers it, which pipeline text needs imported."""
    if origin is None:
        return None
    try:
        factory = registry.get_factory(origin[0])
    except Exception:  # no longer registered: its own module has to do
        return None
    module = getattr(factory, "__module__", None)
    return module if isinstance(module, str) else None


def docstring_text(text: str) -> str:
    """``text`` as the body of a triple-quoted string literal that reads back as ``text``.

    Printable characters, newlines and tabs stay as they are; quotes, backslashes and
    every other character (NUL, terminal escapes, line separators, lone surrogates)
    become escape sequences, so no error message can end the literal or break the file.
    """
    out = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch in "\n\t" or ch.isprintable():
            out.append(ch)
        else:
            out.append(escape_char(ch))
    return "".join(out)


def script(
    message: str,
    unimportable: str = "",
    *,
    verify: bool = True,
    imports: Sequence[tuple[str, str | None]] = (),
    numerics: Mapping[str, float] | None = None,
) -> str:
    """The text of ``repro.py`` for a failure whose error reads ``message``; it
    imports ``imports`` (module, folder to put on ``sys.path``) first. With
    ``numerics`` (``rtol``, ``atol``) the failure it checks for is a drift."""
    tolerances = None if numerics is None else {k: float(v) for k, v in numerics.items()}
    return _REPRO.format(
        summary=textwrap.indent(docstring_text(message), "    "),
        unimportable=docstring_text(unimportable),
        verify=verify,
        numerics=repr(tolerances),
        imports=repr([(str(m), None if f is None else str(f)) for m, f in imports]),
        header=QUALIFIED_HEADER,
    )

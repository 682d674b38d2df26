"""``epass.fast_decompositions()``: every ``ExportedProgram.run_decompositions`` call
in a block served by epass's ``Decompose``; and ``python -m epass.fast_decompositions
script.py args...``: every such call of a whole script, in all its threads.

The first form is a context manager for code one can edit; the second, for code one
cannot (a training framework's export step, a backend's command line), runs a
script as ``python -m cProfile script.py`` does and prints one line at exit saying
what it served.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import importlib.util
import io
import os
import runpy
import sys
import types
from typing import Any

from epass._served import HOW, DecompositionLog, ServedDecomposition
from epass._switch import fast_decompositions, process_log, process_wide

__all__ = [
    "HOW",
    "DecompositionLog",
    "ServedDecomposition",
    "fast_decompositions",
    "main",
    "process_log",
]

_PROG = "python -m epass.fast_decompositions"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        usage=f"{_PROG} [--check] [-m module | script.py] [args ...]",
        description=(
            "Run a Python script (or, with -m, a module) with every "
            "ExportedProgram.run_decompositions call served by epass's Decompose: the "
            "program torch's method returns, holding the caller's tensors in dicts of "
            "its own, usually much faster; what epass cannot take exactly goes to "
            "torch's own method. The switch is process-wide: it covers every thread "
            "of the process, unlike the context manager epass.fast_decompositions(), "
            "which covers the context that enters it. At exit, one line on stderr "
            "says what was served."
        ),
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also run torch's retrace for every call and fail where the programs differ",
    )
    parser.add_argument(
        "-m", dest="module", action="store_true", help="run a module by name, as python -m does"
    )
    parser.add_argument("target", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the script or module named in ``argv`` (default: ``sys.argv[1:]``) under
    the process-wide switch; its ``SystemExit`` and exceptions pass through."""
    head, rest = _split(sys.argv[1:] if argv is None else argv)
    options = _parser().parse_args(head)
    if not options.module and not os.path.exists(options.target):
        print(
            f"{_PROG}: can't open file {options.target!r}: [Errno 2] No such file or directory",
            file=sys.stderr,
        )
        sys.exit(2)
    stop = process_wide(check=True if options.check else None)
    log = process_log()
    # After every non-daemon thread has ended: exit handlers run after the
    # interpreter joins them.
    atexit.register(_at_exit, stop, log)
    sys.argv[:] = [options.target, *rest]
    if options.module:
        spec = importlib.util.find_spec(options.target)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{options.target}.__main__")
        if spec is None or spec.loader is None:
            runpy.run_module(options.target, run_name="__main__", alter_sys=True)  # its error
            return
        sys.argv[0] = spec.origin or options.target
        _run_as_main(spec.loader.get_code(spec.name), spec.origin, spec)  # type: ignore[attr-defined]
    elif os.path.isfile(options.target):
        # As python runs a script: its folder first on the path, symbolic links
        # resolved; __file__ absolute.
        sys.path[0] = os.path.dirname(os.path.realpath(options.target))
        path = os.path.abspath(options.target)
        with io.open_code(path) as source:
            code = compile(source.read(), path, "exec")
        _run_as_main(code, path, None)
    else:  # a folder or an archive holding __main__.py
        sys.path[0] = os.path.dirname(os.path.abspath(options.target))
        runpy.run_path(options.target, run_name="__main__")


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """This command's options and the target, and the target's arguments, verbatim
    (a ``--`` or an option after the target is the target's, as python passes it)."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return argv[i + 1 : i + 2], argv[i + 2 :]
        if arg not in ("--check", "-m", "-h", "--help"):
            return argv[: i + 1], argv[i + 1 :]
    return argv, []


def _run_as_main(code: types.CodeType, path: str | None, spec: Any) -> None:
    """Run ``code`` as the module ``__main__``, which stays in ``sys.modules`` after it
    returns (threads still running and exit handlers find what it defined, as under
    ``python script.py``)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __builtins__=builtins,
        __spec__=spec,
        __loader__=None if spec is None else spec.loader,
        __package__=None if spec is None else spec.parent,
        __cached__=None,
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _at_exit(stop: object, log: DecompositionLog | None) -> None:
    if log is not None:
        print(f"epass.fast_decompositions: {log.summary()}", file=sys.stderr, flush=True)
    if callable(stop):
        stop()


if __name__ == "__main__":
    main()

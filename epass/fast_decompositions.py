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
import os
import runpy
import sys

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
    options = _parser().parse_args(argv)
    stop = process_wide(check=True if options.check else None)
    log = process_log()
    # After every non-daemon thread has ended: exit handlers run after the
    # interpreter joins them.
    atexit.register(_at_exit, stop, log)
    sys.argv[:] = [options.target, *options.args]
    if options.module:
        runpy.run_module(options.target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(options.target))
        runpy.run_path(options.target, run_name="__main__")


def _at_exit(stop: object, log: DecompositionLog | None) -> None:
    if log is not None:
        print(f"epass.fast_decompositions: {log.summary()}", file=sys.stderr, flush=True)
    if callable(stop):
        stop()


if __name__ == "__main__":
    main()

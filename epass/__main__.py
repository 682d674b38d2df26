"""``python -m epass`` and the ``epass`` script: the command, then the process's exit."""

import atexit
import contextlib
import os
import sys
from typing import NoReturn

try:
    from epass.cli import EXIT_INTERRUPTED, EXIT_TERMINATED, main
except KeyboardInterrupt:  # Ctrl-C while the command itself is imported
    print("epass: interrupted", file=sys.stderr)
    sys.exit(130)  # epass.cli.EXIT_INTERRUPTED, which did not finish importing


def console() -> NoReturn:
    """The ``epass`` script and ``python -m epass``: :func:`main`, then exit with its code.

    After Ctrl-C or SIGTERM the process ends at once. The command has cleaned up by
    then (no temporary file is left, the report is written), and the interpreter's
    own teardown, which frees every object torch and the program made one by one,
    takes seconds. Exit handlers still run and output is flushed.
    """
    code = main()
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # what sys.exit would run first (logging, temp folders)
    os._exit(code)


if __name__ == "__main__":
    console()

"""``python -m epass`` and the ``epass`` script: the command, then the process's exit."""

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

try:
    from epass.cli import EXIT_INTERRUPTED, EXIT_TERMINATED, main
except KeyboardInterrupt:  # Ctrl-C while the command itself is imported
    print("epass: interrupted", file=sys.stderr)
    sys.exit(130)  # epass.cli.EXIT_INTERRUPTED, which did not finish importing


def console() -> NoReturn:
    """The ``epass`` script and ``python -m epass``: :func:`main`, then exit with its code.

    Once the command returns, the process ends at once: every file it writes is
    written and closed by then (no temporary file is left, the report is written),
    and the interpreter's own teardown, which frees every object torch and the
    program made one by one, takes seconds (a second after lowering a 768 MiB
    Llama-shaped checkpoint). Exit handlers still run and output is flushed. A
    thread that is not a daemon, which a ``--import`` module may have started, is
    waited for as Python would: the process then exits the ordinary way (after
    Ctrl-C or SIGTERM it does not wait).
    """
    code = main()
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED) or _only_thread():
        _exit_now(code)
    sys.exit(code)


def _only_thread() -> bool:
    """Whether no thread but this one would keep the interpreter from exiting."""
    main_thread = threading.main_thread()
    return all(t is main_thread or t.daemon or not t.is_alive() for t in threading.enumerate())


def _exit_now(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # what sys.exit would run first (logging, temp folders)
    os._exit(code)


if __name__ == "__main__":
    console()

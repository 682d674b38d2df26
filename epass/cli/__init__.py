"""The ``epass`` command: run pipelines on .pt2 files, list passes, inspect programs.

One module a command (run, inspect, reduce, cache, demo, passes), each with
``add_parser(sub)`` and ``run(args, out)``, between the entry and a shared part::

    entry     the parser, assembled from the commands, and main: exit codes, errors
    run       epass run: check, build, load, run, show, write (program and report)
    _verdicts what epass run concludes: numerics, a drift, a failed pass, a reproducer
    inspect   epass inspect: describe a .pt2 file
    reduce    epass reduce: shrink a program on which a pipeline fails or drifts
    cache     epass cache: the decomposition-template cache on disk
    demo      epass demo: export a small transformer, lower it, show what happened
    passes    epass passes: the registered passes
    _shared   exit codes, SIGTERM, and what several commands use

Argument parsing and rendering only: loading, saving, numerics and reproducers are
library pieces (:mod:`epass.io`, :mod:`epass.instruments`). Every failure exits
non-zero with one line ``epass: error: <reason>`` on stderr (plus a caret line for
pipeline syntax errors); ``--debug`` shows the traceback. Exit codes: 0, 1 (a pass
or a check failed), 2 (bad arguments, files or pipeline text), 130 (interrupted,
SIGINT), 143 (terminated, SIGTERM); both signals clean up as any failure does.

Each command imports torch and the library inside the function that runs it, after
everything that can be checked without them, so ``epass --help``, ``epass passes``
and argument errors (bad files and pipeline text included) answer at once.
"""

from epass._text import printable
from epass.cli._shared import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_USAGE
from epass.cli.entry import build_parser, main

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "build_parser",
    "main",
    "printable",
]

"""A lock, across the test workers of one machine, around the example plugin's
install: while a test has it installed into the environment, a `python -m epass`
subprocess of another worker would load it (and the torch it imports)."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

_LOCK = Path(tempfile.gettempdir()) / "epass-tests-installed-plugins.lock"


@contextlib.contextmanager
def held(exclusive: bool) -> Iterator[None]:
    """Hold the lock: exclusively to install a plugin, shared to run without one."""
    with _LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

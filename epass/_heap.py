"""Python's cyclic garbage collector during a pipeline: the objects that exist when
the outermost pipeline starts are left out of its collections until it ends."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["old_objects_frozen"]

_LOCK = threading.Lock()
_depth = 0
_froze = False


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Leave every object that exists now out of the cyclic collector
    (``gc.freeze``) until the outermost such block, in any thread, ends
    (``gc.unfreeze``).

    A program's graphs and fake values are cycles, so every collection of the
    oldest generation walks the whole heap: a Llama-7B-shaped program holds half a
    million such objects, two or three collections fire during a lowering, and each
    costs as much as a pass, more the larger the program; and no signal handler runs
    until a collection ends, so Ctrl-C waited a second or more for one in the middle
    of ``Decompose``. The objects a pipeline
    creates are collected as before. Nothing happens when the collector is off or
    the caller has frozen objects of its own (``unfreeze`` would thaw those too).
    """
    global _depth, _froze
    with _LOCK:
        if _depth == 0:
            _froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _froze:
                _froze = False
                gc.unfreeze()

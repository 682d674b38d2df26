"""Python's cyclic garbage collector during a pipeline: the objects that exist when
the outermost pipeline starts are left out of its collections until it ends, and so
are those a block that pauses the collector made."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused", "old_objects_frozen"]

_LOCK = threading.Lock()
_depth = 0
_froze = False

_PAUSE_LOCK = threading.Lock()
_pauses = 0  # blocks inside collector_paused(), in every thread
_was_enabled = False


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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (reference counting still frees what
    it can), then turn it back on if it was on when the first of the blocks running
    in any thread began.

    An incremental decomposition makes thousands of graph nodes and values that
    outlive it; each allocation counts towards a full collection, which walks every
    object of the process, the exported model's included. On a Llama-7B-shaped
    program one such collection took a third of the decomposition's time.

    Inside a pipeline that froze its old objects (:func:`old_objects_frozen`), the
    last block to end collects the youngest generation once (what the blocks made,
    which no collection has seen, and its cyclic garbage) and freezes what survives:
    the program just built would otherwise be walked by each of the collections its
    allocations set off, full ones included, in whatever pass runs next (at 128
    Llama layers, two full collections of 30 ms each).
    """
    global _pauses, _was_enabled
    with _PAUSE_LOCK:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        if _froze:
            gc.collect(0)  # outside the locks: a finalizer may start a pipeline
        with _PAUSE_LOCK:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                with _LOCK:
                    if _froze:
                        gc.freeze()
                gc.enable()

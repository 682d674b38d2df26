"""Running one candidate where the search can stop waiting for it: a worker thread,
abandoned when the time limit passes or on Ctrl-C, so that a pass that hangs cannot
hold the reduction (or the smallest program found so far) with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

__all__ = ["Abandoned", "within"]

T = TypeVar("T")

# How often the waiting thread wakes: a signal handler (Ctrl-C) runs at the latest then,
# even where waiting on a lock is not interrupted.
_TICK = 0.25


class Abandoned(Exception):
    """The work did not finish in its time; its thread was left running."""


class _Box(Generic[T]):
    """What the worker hands back: its value, or what it raised."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


def within(seconds: float | None, work: Callable[[], T], *, name: str = "epass-reduce") -> T:
    """``work()`` run in a daemon thread; its value, or what it raised, in this one.

    Raises:
        Abandoned: ``seconds`` passed first (None: no limit). The thread goes on
            until ``work`` returns: it must own everything it writes, since nobody
            waits for it any more.
        KeyboardInterrupt: Ctrl-C while waiting; the thread is abandoned the same way.
    """
    box: _Box[T] = _Box()
    grad = torch.is_grad_enabled()  # thread-local: the worker runs as the caller would

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad):
                box.value = work()
        except BaseException as exc:  # handed to the waiting thread, raised there
            box.error = exc
        finally:
            box.done.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    deadline = None if seconds is None else time.monotonic() + seconds
    thread.start()
    while not box.done.is_set():
        left = _TICK if deadline is None else min(_TICK, deadline - time.monotonic())
        if left <= 0:
            raise Abandoned(f"{name} did not finish within {seconds:g} s")
        box.done.wait(left)
    if box.error is not None:
        raise box.error
    return box.value  # type: ignore[return-value]

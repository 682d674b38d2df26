"""Running one candidate where the search can stop it: a forked child process, killed
when the time limit passes or on Ctrl-C (a worker thread, abandoned then, where fork
cannot be used), so that a pass that hangs cannot hold the reduction (or the smallest
program found so far) with it."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Abandoned", "Died", "within"]

T = TypeVar("T")

# How often the waiting thread wakes: a signal handler (Ctrl-C) runs at the latest then,
# even where waiting on a lock is not interrupted.
_TICK = 0.25


class Abandoned(Exception):
    """The work did not finish in its time; its thread was left running."""


class Died(Exception):
    """The child process ended without an answer (killed, crashed, or ``os._exit``)."""


class _Box(Generic[T]):
    """What the worker hands back: its value, or what it raised."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


def within(seconds: float | None, work: Callable[[], T], *, name: str = "epass-reduce") -> T:
    """``work()`` run in a child process (a thread where fork cannot be used); its
    value, or what it raised, in this one. ``work`` must return a value that pickles.

    A child is killed at the limit or on Ctrl-C, whatever it does, even in C code
    that holds the GIL; nothing it writes reaches this process.

    Raises:
        Abandoned: ``seconds`` passed first (None: no limit).
        Died: the child ended without an answer.
        KeyboardInterrupt: Ctrl-C while waiting (the child is killed).
    """
    if _forkable():
        return _in_child(seconds, work, name)
    return _in_thread(seconds, work, name)


def _forkable() -> bool:
    """Fork where it is safe: Linux, and no CUDA context (a child cannot use it)."""
    return (
        hasattr(os, "fork") and sys.platform.startswith("linux") and not torch.cuda.is_initialized()
    )


def _in_child(seconds: float | None, work: Callable[[], T], name: str) -> T:
    deadline = None if seconds is None else time.monotonic() + seconds
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)  # what is buffered here would be written twice
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child ends in _child
        os.close(read)
        _child(work, write)
    os.close(write)
    answered = False
    try:
        data = _receive(read, deadline, seconds, name)
        answered = bool(data)
    finally:
        os.close(read)
        if not answered:
            _kill(pid)
        _, status = os.waitpid(pid, 0)
    if not data:
        raise Died(f"{name}: the process running it ended ({_status(status)}) without an answer")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _child(work: Callable[[], Any], fd: int) -> None:  # pragma: no cover - runs in a child
    """Run ``work`` and write ``(ok, value or error)`` into ``fd``; never returns."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to act on
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        torch.set_num_threads(1)  # the parent's OpenMP workers do not exist here
        try:
            payload: tuple[bool, Any] = (True, work())
        except BaseException as exc:
            payload = (False, exc)
        try:
            data = pickle.dumps(payload)
            pickle.loads(data)
        except Exception:
            text = f"{type(payload[1]).__name__}: {payload[1]}"
            data = pickle.dumps((False, RuntimeError(f"the answer did not pickle ({text})")))
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def _receive(fd: int, deadline: float | None, seconds: float | None, name: str) -> bytes:
    """All that the child writes into ``fd`` until it closes it."""
    chunks: list[bytes] = []
    while True:
        left = _TICK if deadline is None else min(_TICK, deadline - time.monotonic())
        if left <= 0:
            raise Abandoned(f"{name} did not finish within {seconds:g} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"signal {number}, {signal.Signals(number).name}"
        except ValueError:
            return f"signal {number}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _flush(stream: Any) -> None:
    with contextlib.suppress(Exception):
        stream.flush()


def _in_thread(seconds: float | None, work: Callable[[], T], name: str) -> T:
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

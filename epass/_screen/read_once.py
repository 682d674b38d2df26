"""A read-only view of an open file in which each byte, once read, stays what it was:
the screen and torch's loader read one such view, so torch reads what was screened."""

from __future__ import annotations

import bisect
import contextlib
import errno
import io
import os
import stat
import typing
import zipfile
from collections.abc import Iterator
from typing import IO, Any

from epass._screen.archive import data_span, member_kind
from epass._screen.refusal import Refusal

__all__ = ["ReadOnce"]


class ReadOnce(io.RawIOBase):
    """A read-only view of an open regular file in which each byte, once read, stays
    what it was: a later read of it returns the bytes already read, whatever the file
    holds by then.

    Screening a view and then loading the same view gives torch a file the screen
    accepted, without a copy: the screen's verdict rests only on the bytes it read
    (the zip directories, local headers, and every member but raw tensor data), and
    torch's reads of those bytes return what the screen read. After :meth:`seal`,
    bytes no read has touched yet inside the data of a raw tensor member
    (``weight_N`` / ``tensor_N``) are read straight into torch's buffer and not kept:
    torch views them as numbers with a dtype, whatever they hold. Every other byte
    read is kept, so the view costs the memory of what was screened, not of the file.
    """

    def __init__(self, file: IO[bytes], name: str = "<archive>") -> None:
        super().__init__()
        self._file = file  # holds the descriptor open
        self._fd = file.fileno()
        self._size = os.fstat(self._fd).st_size
        self._pos = 0
        self._starts: list[int] = []  # kept bytes: sorted, disjoint chunks
        self._chunks: list[bytes] = []
        self._raw: list[tuple[int, int]] = []  # sorted (start, end) of raw tensor data
        self.name = name  # for messages

    @staticmethod
    def usable(file: IO[bytes]) -> bool:
        """Whether ``file`` is a regular file that positioned reads work on."""
        try:
            return hasattr(os, "preadv") and stat.S_ISREG(os.fstat(file.fileno()).st_mode)
        except (OSError, AttributeError, io.UnsupportedOperation):
            return False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:  # as a file says it (zipfile probes with such seeks)
            raise OSError(errno.EINVAL, f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readall(self) -> bytes:
        return self.read(max(0, self._size - self._pos))

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self._size - self._pos))
        self._fill(self._pos, out[:n])
        self._pos += n
        return n

    def seal(self) -> None:
        """Mark the screen done: raw tensor data is read straight through from now on."""
        self._raw = self._tensor_data()
        self.seek(0)

    @contextlib.contextmanager
    def tensor_data_unkept(self) -> Iterator[None]:
        """Within the block, reads inside raw tensor data (as Python's zip reader finds
        it in the bytes kept so far) are not kept; afterwards they are again, until
        :meth:`seal`.

        For a look at the archive's structure that reads whole members, such as
        torch's zip reader telling a record's size before torch 2.13 (it reads the
        record): the view would otherwise keep every tensor's bytes, a second copy
        of the weights in memory. A block on an archive Python cannot read keeps
        everything, as outside it.
        """
        try:
            self._raw = self._tensor_data()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, Refusal):
            self._raw = []
        try:
            yield
        finally:
            self._raw = []
            self.seek(0)

    def _tensor_data(self) -> list[tuple[int, int]]:
        raw = []
        file = typing.cast(IO[bytes], self)
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if member_kind(info.filename.partition("/")[2]) == "tensor" and info.file_size:
                    start, size = data_span(file, info)
                    raw.append((start, start + size))
        return sorted(raw)

    def _is_raw(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._raw, (start, float("inf"))) - 1
        return i >= 0 and self._raw[i][0] <= start and end <= self._raw[i][1]

    def _fill(self, start: int, out: memoryview) -> None:
        end = start + len(out)
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        pos, kept = start, []
        while pos < end:
            if i < len(self._starts) and self._starts[i] + len(self._chunks[i]) <= pos:
                i += 1  # a chunk wholly before pos
                continue
            if i < len(self._starts) and self._starts[i] <= pos:
                chunk, first = self._chunks[i], self._starts[i]
                stop = min(end, first + len(chunk))
                out[pos - start : stop - start] = chunk[pos - first : stop - first]
                pos, i = stop, i + 1
                continue
            stop = min(end, self._starts[i]) if i < len(self._starts) else end
            self._pread(pos, out[pos - start : stop - start])
            if not self._is_raw(pos, stop):
                kept.append((pos, bytes(out[pos - start : stop - start])))
            pos = stop
        for first, chunk in kept:
            at = bisect.bisect_left(self._starts, first)
            self._starts.insert(at, first)
            self._chunks.insert(at, chunk)

    def _pread(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n == 0:
                raise OSError(f"the file got shorter while it was read ({self.name})")
            done += n

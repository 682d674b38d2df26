"""``epass._screen.read_once``: a byte of the view, once read, stays what it was read as."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epass._screen import ReadOnce


def test_read_once_view_returns_a_byte_as_first_read(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"abcdefgh")
    with open(path, "rb") as f:
        view = ReadOnce(f)
        assert view.read(3) == b"abc"
        view.seek(5)
        assert view.read(2) == b"fg"
        path.write_bytes(b"ABCDEFGH")  # in place
        view.seek(0)
        assert view.read() == b"abcDEfgH"  # kept bytes, and the rest as now on disk
        view.seek(0)
        assert view.read() == b"abcDEfgH"
        assert view.seek(-2, os.SEEK_END) == 6
        with pytest.raises(OSError):
            view.seek(-9, os.SEEK_END)


def test_read_once_view_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    read, write = os.pipe()
    with os.fdopen(read, "rb") as r, os.fdopen(write, "wb"):
        assert not ReadOnce.usable(r)
    with open(tmp_path / "f.bin", "wb") as f:
        assert ReadOnce.usable(f)

"""``epass._screen.members``: each member is checked by its kind; here the text tags
(more hostile members, end to end through ``epass.load``, are in tests/test_io.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import screen_helpers as h

import epass
from epass.errors import UnsafeArchiveError


def test_unknown_archive_version_is_refused(small: dict[str, bytes], tmp_path: Path) -> None:
    members = {
        name: b"1" if name.endswith("/archive_version") else data for name, data in small.items()
    }
    with pytest.raises(UnsafeArchiveError, match=r"archive_version '1'.*does not read"):
        epass.load(h.write(members, tmp_path / "v1.pt2"))

"""The decomposition engine's tests: a disk cache of a test's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from epass._decomp import disk, templates


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty disk cache of this test's own, the memory cache emptied around it and
    the disk cache's one warning not yet given."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("EPASS_CACHE_DIR", str(folder))
    monkeypatch.setattr(disk, "WARNED", False)
    templates.clear_memory()
    yield folder
    templates.clear_memory()

"""What the decomposition engine's tests share: the checkout's root, the disk cache's
entry files, and a decomposition checked against torch's retrace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epass import Decompose
from epass.passes.decompose import DecomposeResult

# The checkout: subprocesses run there, with it on their path.
ROOT = Path(__file__).resolve().parents[2]


def entry_paths(folder: Path) -> list[Path]:
    """The entry files of the disk cache in ``folder``."""
    return sorted((folder / "templates-v1").glob("*.json"))


def assert_same_as_torch(ep: Any, **options: Any) -> DecomposeResult:
    """Decompose(check=True) runs both paths and raises on the first difference."""
    result = Decompose(check=True, **options)(ep)
    assert isinstance(result, DecomposeResult)
    return result

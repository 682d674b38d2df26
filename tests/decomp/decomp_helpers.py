"""What the decomposition engine's tests share: the checkout's root, the disk cache's
entry files, and a decomposition checked against torch's retrace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epass import Decompose
from epass._decomp import disk
from epass.passes.decompose import DecomposeResult

# The checkout: subprocesses run there, with it on their path.
ROOT = Path(__file__).resolve().parents[2]


def entry_paths(folder: Path) -> list[Path]:
    """The entry files of the disk cache in ``folder``."""
    return sorted((folder / f"templates-v{disk.FORMAT}").glob("*.json"))


def run_script(script: str, cache: Path, *args: str, env: Mapping[str, str] = {}) -> Any:
    """Run ``script`` with ``args`` in a new Python process in the checkout, its disk
    cache in ``cache`` (and ``env`` set); the last line it prints, read as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**os.environ, **env, "EPASS_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same_as_torch(ep: Any, **options: Any) -> DecomposeResult:
    """Decompose(check=True) runs both paths and raises on the first difference."""
    result = Decompose(check=True, **options)(ep)
    assert isinstance(result, DecomposeResult)
    return result

"""What the decomposition engine's tests share: the checkout's root, the disk cache's
entry files, and a decomposition checked against torch's retrace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from fast_path import incremental_path_errors

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


Expect = Literal["incremental", "retrace", "either"]


def assert_same_as_torch(
    ep: Any, *, expect: Expect = "incremental", because: str | None = None, **options: Any
) -> DecomposeResult:
    """``Decompose(check=True, **options)`` on ``ep``, asserting which path gave it.

    ``expect="incremental"``: the incremental path ran and check mode found its
    program node for node torch's (it raises on the first difference). ``"retrace"``:
    the incremental path declined the program, for a reason that contains
    ``because``, and torch's retrace is the result. ``"either"`` (random programs):
    one of the two. In every case the incremental path never raised: torch's retrace
    in place of a crash is a fault the result would otherwise hide.
    """
    with incremental_path_errors() as raised:
        result = Decompose(check=True, **options)(ep)
    assert isinstance(result, DecomposeResult)
    assert not raised, f"the incremental path raised {raised[0]!r}; Decompose retraced"
    if result.method == "incremental":
        assert expect != "retrace", f"expected a retrace ({because}); the incremental path ran"
        assert result.checked, "check mode did not compare the incremental path with torch's"
    else:
        assert expect != "incremental", f"expected the incremental path; {result.fallback}"
        assert result.fallback, "a retrace in check mode that names no reason"
        if because is not None:
            assert because in result.fallback, result.fallback
    return result

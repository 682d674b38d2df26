"""``benchmarks/bench_handoff.py`` in its smoke form: one consumer on one small
program, each path in a fresh process, its table read back."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_handoff.py"


@pytest.mark.slow
def test_quick_run_prints_a_finite_ratio_and_the_same_numbers() -> None:
    for module in ("onnxscript", "onnxruntime", "transformers"):
        pytest.importorskip(module)
    argv = [sys.executable, str(SCRIPT), "--quick", "--models", "gpt2", "--consumers", "onnx"]
    # The script gives its children this checkout's epass and a cache of its own.
    done = subprocess.run(
        [*argv, "--static"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        fields[3]: fields
        for fields in (line.split() for line in done.stdout.splitlines())
        if fields[:3] == ["onnx", "gpt2", "static"]
    }
    assert set(rows) == {"switch", "handoff"}, done.stdout
    for path, fields in rows.items():
        plain, served, ratio = (float(x) for x in fields[4:7])
        assert all(math.isfinite(x) and x > 0 for x in (plain, served, ratio)), fields
        assert fields[-3] == "1/0", f"{path}: the exporter's call was not served: {fields}"
        assert float(fields[-2]) <= 1e-5, f"{path}: outputs differ: {fields}"
        assert fields[-1] == "yes/yes", f"{path}: the user's dicts changed: {fields}"

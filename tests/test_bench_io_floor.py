"""``benchmarks/bench_io_floor.py`` runs end to end on a small checkpoint."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_io_floor_benchmark_measures_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_io_floor.py"
    bench = runpy.run_path(str(script), run_name="bench_io_floor")
    rows = bench["main"](["--repeats", "1", "--layers", "1", "--hidden", "128"])
    (wall, peak, cpu, phases) = rows
    assert math.isfinite(wall[1]) and wall[1] > 0 and "Llama-shaped, 1 layers" in wall[0]
    assert 0.5 < peak[1] < 2.0
    assert "epass" in cpu[3] and "floor" in cpu[3]
    for phase in ("import", "screening", "loading", "passes", "saving", "exit"):
        assert f"{phase} " in phases[3].split("; floor:")[0]
    assert "fresh processes" in capsys.readouterr().out

"""TVM's import of the lowered tiny Llama through ``epass.tvm`` (TVM's second
decomposition skipped) against TVM alone on the same program (which decomposes it
again), and against TVM alone on the user's raw program.

Run from the repository root: ``python benchmarks/bench_tvm.py [--repeats N]``
(needs apache-tvm and transformers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import hf_models  # noqa: E402
from bench_core import interleaved  # noqa: E402
from tvm.relax.frontend.torch import from_exported_program  # noqa: E402

import epass.tvm  # noqa: E402
from epass.passes import presets  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    _, ep, _ = hf_models.export("llama")
    lowered = presets.lower().run(ep)
    times = interleaved(
        {
            "epass.tvm (lowered)": lambda: epass.tvm.from_exported_program(lowered),
            "TVM alone (lowered)": lambda: from_exported_program(lowered),
            "TVM alone (raw)": lambda: from_exported_program(ep),
        },
        repeats,
    )
    median = {k: statistics.median(v) for k, v in times.items()}
    base = median["epass.tvm (lowered)"]
    print(f"{'import of the tiny Llama':<32} {'CPU s':>8} {'/ epass.tvm':>12}")
    for key, seconds in median.items():
        print(f"{key:<32} {seconds:>8.3f} {seconds / base:>12.1f}")


if __name__ == "__main__":
    main()

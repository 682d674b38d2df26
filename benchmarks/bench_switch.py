"""A consumer's own call (``torch.onnx.export(ep, dynamo=True)``, ExecuTorch's
``to_edge(ep)``) under ``epass.fast_decompositions()`` against the same call without
it, each in a fresh process (ABAB), with the template cache filled by one earlier
process of each, as for a user who exports more than once.

Run from the repository root: ``python benchmarks/bench_switch.py [--repeats N]
[--models gpt2,llama] [--consumers onnx,to_edge]`` (needs transformers, and onnxscript
or executorch for their rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import epass
import hf_models, models

consumer, name, served = {consumer!r}, {name!r}, {served!r}
if name in hf_models.ZOO:
    _, ep, args = hf_models.export(name)
else:
    _, ep, args = models.export(name)
if consumer == "onnx":
    call = lambda: torch.onnx.export(ep, args, dynamo=True, verbose=False)
else:
    from executorch.exir import to_edge
    call = lambda: to_edge(ep)
began = time.perf_counter()
if served:
    with epass.fast_decompositions() as log:
        call()
    counts = log.counts
else:
    call()
    counts = None
print(json.dumps({{"seconds": time.perf_counter() - began, "counts": counts}}))
"""


def _run(consumer: str, name: str, served: bool, env: dict[str, str]) -> dict[str, object]:
    code = _CHILD.format(
        root=str(ROOT), tests=str(ROOT / "tests"), consumer=consumer, name=name, served=served
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--consumers", default="onnx,to_edge")
    options = parser.parse_args()
    print(f"{'consumer':<10} {'model':<12} {'plain s':>8} {'switch s':>9} {'ratio':>6}  served")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "EPASS_CACHE_DIR": cache}
        for consumer in options.consumers.split(","):
            for name in options.models.split(","):
                _run(consumer, name, True, env)  # fills the template cache
                plain, switched, counts = [], [], None
                for _ in range(options.repeats):
                    plain.append(_run(consumer, name, False, env)["seconds"])
                    result = _run(consumer, name, True, env)
                    switched.append(result["seconds"])
                    counts = result["counts"]
                a, b = statistics.median(plain), statistics.median(switched)  # type: ignore[type-var]
                print(
                    f"{consumer:<10} {name:<12} {a:>8.2f} {b:>9.2f} {b / a:>6.2f}  {counts}",
                    flush=True,
                )


if __name__ == "__main__":
    began = time.perf_counter()
    main()
    print(f"({time.perf_counter() - began:.0f} s)")

"""Scale figures: the Llama-7B-shaped decoder of ``bench_llama7b.py`` at several layer
counts (and a 70B-shaped one: 80 layers, hidden 8192), weights on the meta device,
with a static and with a dynamic sequence length, each step in a fresh process.

Per program: the wall clock of ``presets.lower()``, the seconds of each of its passes
(from the records) and of the manager around them (verification and linking: the
wall less the passes), ``Decompose()`` alone, the peak RSS of the process, and at 32
layers ``run_decompositions()``. Then the time per doubling of layers of each pass
(goal <= 2.1x), ``lower() / Decompose`` (goal <= 1.5) and ``lower() /
run_decompositions`` (goal <= 0.1). For reference, the time per doubling of a bare
walk over the lowered program's nodes: the machine's own cost per node grows with
the graph (caches), and a pass that reads every node doubles about as that walk
does. The template cache is a directory of this run's own, filled by one untimed
process per width and sequence kind first.

Run from the repository root::

    python benchmarks/bench_scale.py             # 8, 16, 32 layers (about 8 minutes on 2 cores)
    python benchmarks/bench_scale.py --full      # 32, 64, 128 layers and the 70B-shaped program
    python benchmarks/bench_scale.py --layers 4,8 --no-retrace
    python benchmarks/bench_scale.py --layers 32,128 --no-retrace --collector-off

``--collector-off`` turns Python's cyclic garbage collector off in each process once
the program is exported: what the passes cost per node without its collections.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import bench_llama7b  # noqa: E402
from bench_core import Row, print_table  # noqa: E402

WIDTHS: dict[str, dict[str, int]] = {"7B": {}, "70B": bench_llama7b.SHAPE_70B}
RETRACE_LAYERS = 32  # run_decompositions() is timed at this size only: it is slow
COLLECTOR_OFF = "EPASS_BENCH_COLLECTOR_OFF"
PASSES = ("decompose", "remove-asserts", "fold-constants", "cse", "dce")
WALK = "a bare walk over the nodes (reference)"


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _walk_seconds(ep: Any) -> float:
    """The median of five bare walks over ``ep``'s nodes that read what every pass
    reads of a node (op, target, inputs, users, value): what one walk costs on this
    machine at this size, which grows with the graph."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for node in ep.graph.nodes:
            _ = (
                node.op,
                node.target,
                node.args,
                node.kwargs,
                node.meta.get("val"),
                len(node.users),
            )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(step: str, dynamic: bool, layers: int, width: str) -> None:
    from epass import Decompose
    from epass.passes import presets

    ep = bench_llama7b._export(layers, dynamic, **WIDTHS[width])
    out: dict[str, Any] = {"nodes": len(ep.graph.nodes), "rss_export": _peak_rss_mb()}
    if os.environ.get(COLLECTOR_OFF):
        gc.disable()
    began = time.perf_counter()
    if step == "retrace":
        ep.run_decompositions()
    elif step in ("decompose", "fill"):
        out["method"] = Decompose()(ep).notes["method"]
    else:
        result = presets.lower()(ep)
        out["method"] = result.records[0].notes["method"]
        out["passes"] = {r.name: r.seconds for r in result.records}
    out["seconds"] = time.perf_counter() - began
    out["rss_peak"] = _peak_rss_mb()
    if step == "lower":
        out["walk"] = _walk_seconds(result.program)
    print(json.dumps(out))


def _run(step: str, dynamic: bool, layers: int, width: str, env: dict[str, str]) -> Any:
    argv = [sys.executable, __file__, "--child", step, str(int(dynamic)), str(layers), width]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.splitlines()[-1])


def _median_run(repeat: int, *args: Any) -> Any:
    """``repeat`` fresh processes, each figure the median of its values: the wall,
    the peak RSS and, for a lower() run, each pass and the manager (the wall less
    the passes, per run). A pass of a few milliseconds varies by a fifth from one
    process to the next; one run's per-pass times would carry that into the
    doubling ratios."""
    runs = [_run(*args) for _ in range(repeat)]
    for run in runs:
        if "passes" in run:
            run["passes"]["manager"] = run["seconds"] - sum(run["passes"].values())
    out = dict(runs[0])
    for key in ("seconds", "rss_peak", "walk"):
        if key in out:
            out[key] = statistics.median(r[key] for r in runs)
    if "passes" in out:
        out["passes"] = {
            name: statistics.median(r["passes"][name] for r in runs) for name in out["passes"]
        }
    return out


def measure(
    sizes: list[tuple[str, int]], dynamic: bool, retrace: bool, repeat: int, env: dict[str, str]
) -> list[dict[str, Any]]:
    """One entry per size: the lower() run, Decompose alone and (at 32 layers) the retrace."""
    for width in dict.fromkeys(w for w, _ in sizes):
        smallest = min(n for w, n in sizes if w == width)
        _run("fill", dynamic, smallest, width, env)  # fills the template cache
    out = []
    for width, layers in sizes:
        lower = _median_run(repeat, "lower", dynamic, layers, width, env)
        alone = _median_run(repeat, "decompose", dynamic, layers, width, env)
        entry = {"width": width, "layers": layers, "dynamic": dynamic, "lower": lower}
        entry["decompose"] = alone
        if retrace and width == "7B" and layers == RETRACE_LAYERS:
            entry["retrace"] = _run("retrace", dynamic, layers, width, env)
        print(_line(entry), flush=True)
        out.append(entry)
    return out


def _line(entry: dict[str, Any]) -> str:
    lower, passes = entry["lower"], entry["lower"]["passes"]
    kind = "dynamic" if entry["dynamic"] else "static"
    cells = " ".join(f"{passes.get(name, 0.0):>8.3f}" for name in (*PASSES, "manager"))
    retrace = entry.get("retrace", {}).get("seconds")
    return (
        f"{entry['width']:>3} {entry['layers']:>4} {kind:<8} {lower['nodes']:>6} "
        f"{lower['seconds']:>7.2f} {entry['decompose']['seconds']:>7.2f} {cells} "
        f"{lower['rss_peak']:>7.0f} {'' if retrace is None else f'{retrace:.1f}'}"
    )


def _header() -> str:
    names = " ".join(f"{name[:8]:>8}" for name in (*PASSES, "manager"))
    return (
        f"{'':>3} {'lay':>4} {'sequence':<8} {'nodes':>6} {'lower':>7} {'decomp':>7} "
        f"{names} {'RSS MB':>7} retrace"
    )


def doubling_rows(entries: list[dict[str, Any]]) -> list[Row]:
    """Per pass (and the whole lower()), the largest time ratio between a size and
    the size of half its layers, over the runs measured."""
    rows: list[Row] = []
    for dynamic in (False, True):
        runs = {e["layers"]: e for e in entries if e["width"] == "7B" and e["dynamic"] == dynamic}
        pairs = [(n, 2 * n) for n in sorted(runs) if 2 * n in runs]
        if not pairs:
            continue
        kind = "dynamic sequence" if dynamic else "static"
        for name in ("lower()", *PASSES, "manager", WALK):
            ratios = []
            for small, big in pairs:
                a, b = (_seconds(runs[n], name) for n in (small, big))
                ratios.append((b / a if a > 0 else float("inf"), small, big, a, b))
            worst = max(ratios)
            digits = 3 if worst[3] >= 0.01 else 5
            note = ", ".join(
                f"{s}->{b} layers {x:.{digits}f}->{y:.{digits}f} s" for _, s, b, x, y in ratios
            )
            tiny = " (under 20 ms: noise)" if worst[3] < 0.02 and name != WALK else ""
            rows.append((f"{kind}: {name} time per doubling of layers", worst[0], 2.1, note + tiny))
    return rows


def _seconds(entry: dict[str, Any], name: str) -> float:
    lower = entry["lower"]
    if name == WALK:
        return float(lower["walk"])
    return float(lower["seconds"] if name == "lower()" else lower["passes"].get(name, 0.0))


def ratio_rows(entries: list[dict[str, Any]]) -> list[Row]:
    rows: list[Row] = []
    for e in entries:
        kind = "dynamic sequence" if e["dynamic"] else "static"
        label = f"{e['width']}-shaped, {e['layers']} layers, {kind}"
        lower, alone = e["lower"]["seconds"], e["decompose"]["seconds"]
        note = f"{lower:.2f} s vs {alone:.2f} s, Decompose {e['decompose']['method']}"
        rows.append((f"{label}: lower() / Decompose", lower / alone, 1.5, note))
        if "retrace" in e:
            retrace = e["retrace"]["seconds"]
            note = f"{lower:.2f} s vs {retrace:.2f} s"
            rows.append((f"{label}: lower() / run_decompositions", lower / retrace, 0.1, note))
        if e["width"] == "70B" and e["dynamic"]:
            rows.append((f"{label}: lower() wall (s)", lower, 30.0, "on this machine"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="8,16,32", help="layer counts, comma-separated")
    parser.add_argument("--full", action="store_true", help="32, 64, 128 layers and 70B")
    parser.add_argument("--with-70b", action="store_true", help="add the 70B-shaped program")
    parser.add_argument("--no-retrace", action="store_true", help="skip run_decompositions()")
    parser.add_argument("--repeat", type=int, default=1, help="fresh processes per figure")
    parser.add_argument(
        "--collector-off", action="store_true", help="no cyclic garbage collection after export"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, dynamic, layers, width = args.child
        child(step, bool(int(dynamic)), int(layers), width)
        return
    layers = [32, 64, 128] if args.full else [int(n) for n in args.layers.split(",")]
    sizes = [("7B", n) for n in layers]
    if args.full or args.with_70b:
        sizes.append(("70B", 80))
    env = {**os.environ, "EPASS_CACHE_DIR": tempfile.mkdtemp(prefix="epass-bench-cache-")}
    if args.collector_off:
        env[COLLECTOR_OFF] = "1"
    print("each step in a fresh process, wall clock seconds; per pass from lower()'s records")
    print(_header())
    began = time.perf_counter()
    entries = [
        e
        for dynamic in (False, True)
        for e in measure(sizes, dynamic, not args.no_retrace, args.repeat, env)
    ]
    print(f"({time.perf_counter() - began:.0f} s)\n")
    print_table(ratio_rows(entries) + doubling_rows(entries))


if __name__ == "__main__":
    main()

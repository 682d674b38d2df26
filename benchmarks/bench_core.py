"""Core figures: Decompose through the PassManager against a bare run_decompositions
call, and the StateLinker's cost per state entry.

Run from the repository root: ``python benchmarks/bench_core.py [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from epass import Decompose, PassManager, StateLinker, _program  # noqa: E402

CLOCK = time.process_time
Row = tuple[str, float, float, str]  # figure, value, target, unit/explanation


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, alternating between them (ABAB...), so
    that drift in machine load hits all of them alike.

    The clock is this process's CPU time: on a shared machine, other processes
    stretch wall time far more than they stretch our own CPU time. As in ``timeit``,
    the cyclic garbage collector is run before and kept off during each call, so
    that one side does not pay for collecting the other side's garbage.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: first calls pay for imports and caches
        fn()
    for _ in range(repeats):
        for key, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                start = CLOCK()
                fn()
                times[key].append(CLOCK() - start)
            finally:
                gc.enable()
    return times


def encoder(layers: int = 12, d_model: int = 256) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(
        d_model, 8, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
    )
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()


def bench_decompose_vs_bare(repeats: int, layers: int = 12) -> list[Row]:
    torch.manual_seed(0)
    model = encoder(layers)
    ep = torch.export.export(model, (torch.randn(2, 16, 256),))
    # The same retrace on both sides: this row measures the manager's overhead.
    manager = PassManager([Decompose(method="retrace")])

    def nested(frames: int) -> Any:
        # The same bare call, made from ``frames`` more Python frames.
        return ep.run_decompositions() if frames == 0 else nested(frames - 1)

    times = interleaved(
        {
            "bare": lambda: ep.run_decompositions(),
            "epass": lambda: manager.run(ep),
            "nested": lambda: nested(20),
        },
        repeats,
    )
    bare, ours = statistics.median(times["bare"]), statistics.median(times["epass"])
    deep = statistics.median(times["nested"])
    return [
        (
            f"PassManager([Decompose(method='retrace')]) / run_decompositions ({layers}-layer"
            " encoder)",
            ours / bare,
            1.02,
            f"median of {repeats}: {ours:.3f}s vs {bare:.3f}s",
        ),
        (
            "  bare run_decompositions from 20 more stack frames / bare",
            deep / bare,
            float("inf"),
            f"{deep:.3f}s; torch symbolizes the stack for each new node",
        ),
    ]


def _linker_programs(n: int, nbytes: int, relinked: bool) -> tuple[Any, Any]:
    """Two programs over a store of ``n`` tensors of ``nbytes`` each; the second
    holds the same objects, or new tensor objects over the same memory."""
    base = torch.export.export(torch.nn.Identity(), (torch.randn(1),))
    numel = nbytes // 4
    # One storage, n distinct windows of nbytes each: big tensors without n * nbytes of RAM.
    storage = torch.zeros(numel + n)
    store = {f"w{i}": storage[i : i + numel] for i in range(n)}
    new = {k: v.detach() for k, v in store.items()} if relinked else dict(store)
    original = _program.shallow_clone(base)
    result = _program.shallow_clone(base)
    _program.set_state(original, store, {})
    _program.set_state(result, new, {})
    return original, result


def _time_links(linker: StateLinker, original: Any, result: Any, repeats: int) -> list[float]:
    fresh = dict(result.state_dict)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        _program.set_state(result, dict(fresh), {})
        start = CLOCK()
        linker.link(original, result)
        times.append(CLOCK() - start)
    return times[1:]


def bench_linker(repeats: int, n: int = 10_000) -> list[Row]:
    rows: list[Row] = []
    linker = StateLinker()
    for nbytes, size in ((1024, "1 KB"), (4 << 20, "4 MB")):
        for relinked in (False, True):
            original, result = _linker_programs(n, nbytes, relinked)
            times = _time_links(linker, original, result, repeats)
            assert result.state_dict is original.state_dict
            per_entry = statistics.median(times) / n * 1e6
            kind = "relinked same-storage" if relinked else "identical objects"
            rows.append(
                (f"StateLinker.link per entry, {size}, {kind} (us)", per_entry, 1.0, f"n={n}")
            )
    return rows


def core_rows(quick: bool = False) -> list[Row]:
    rows = bench_linker(repeats=5 if quick else 21)
    rows += bench_decompose_vs_bare(repeats=3 if quick else 7, layers=2 if quick else 12)
    return rows


def print_table(rows: list[Row]) -> None:
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'value':>9}  {'target':>7}  ok  note")
    for figure, value, target, note in rows:
        ok = "yes" if value <= target else "NO"
        print(f"{figure:<{width}}  {value:>9.4f}  {target:>7.3g}  {ok:<3} {note}")


def main() -> None:
    torch.set_num_threads(1)  # tracing is Python-bound; idle OpenMP threads only add noise
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller model")
    print_table(core_rows(parser.parse_args().quick))


if __name__ == "__main__":
    main()

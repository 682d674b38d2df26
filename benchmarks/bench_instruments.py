"""Overhead of instrumentation, as ratios measured side by side in one run.

Two pipelines, each run with no instruments (twice, as two configurations, to
show the noise floor), an empty instrument list, and the full built-in set
(Timing, OpCounts, MemoryAccounting, NumericsCheck, PrintIR, Progress,
Reproducer), interleaved round by round. Times are process CPU seconds (all
threads), and the best round of each configuration is reported: on a shared
machine, wall time mostly measures the neighbours.

* ``decompose``: Decompose + three fx passes on an ``nn.TransformerEncoder``
  (12 layers, d_model=256 by default), the case users run.
* ``cheap``: 20 trivial fx passes on a small MLP, where the manager's own
  per-pass cost dominates, so any cost of an empty instrument list would show.

Then it prints the Timing and OpCounts tables of Decompose on the encoder.

Run: python benchmarks/bench_instruments.py [--layers 12] [--d-model 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import io
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from epass import (
    Decompose,
    FxPass,
    MemoryAccounting,
    NumericsCheck,
    OpCounts,
    PassManager,
    PrintIR,
    Progress,
    Reproducer,
    Timing,
)

aten = torch.ops.aten


def encoder(layers: int, d_model: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model, max(d_model // 64, 1), dim_feedforward=4 * d_model, dropout=0.0,
        batch_first=True,
    )  # fmt: skip
    module = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    return module, (torch.randn(2, 16, d_model),)


def relu_to_clamp(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.target is aten.relu.default:
            node.target = aten.clamp_min.default
            node.args = (node.args[0], 0.0)
    return gm


def clone_output(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    out = gm.graph.output_node()
    value = out.args[0][0]
    with gm.graph.inserting_before(out):
        node = gm.graph.call_function(aten.clone.default, (value,))
    node.meta["val"] = value.meta["val"]
    out.args = ((node, *out.args[0][1:]),)
    return gm


def untouched(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return gm


def full_set(directory: str) -> list[Any]:
    from rich.console import Console

    quiet = Console(file=io.StringIO(), force_terminal=False)
    return [
        Timing(),
        OpCounts(),
        MemoryAccounting(),
        NumericsCheck(),
        PrintIR(stream=io.StringIO()),
        Progress(quiet),
        Reproducer(directory),
    ]


def measure(
    ep: torch.export.ExportedProgram,
    passes: Callable[[], list[Any]],
    rounds: int,
    repeat: int,
    directory: str,
    each: bool = False,
) -> dict[str, float]:
    configs: dict[str, Callable[[], PassManager]] = {
        "none": lambda: PassManager(passes()),
        # The same configuration again: the ratio of the two is the noise floor.
        "none again": lambda: PassManager(passes()),
        "empty": lambda: PassManager(passes(), instruments=[]),
        "full": lambda: PassManager(passes(), instruments=full_set(directory)),
    }
    if each:
        for i, instrument in enumerate(full_set(directory)):
            configs[type(instrument).__name__] = lambda i=i: PassManager(
                passes(), instruments=[full_set(directory)[i]]
            )
    samples: dict[str, list[float]] = {k: [] for k in configs}
    for k in configs:  # warm-up: first-call costs (imports, dispatcher caches)
        configs[k]().run(ep)
    for _ in range(rounds):
        for k, make in configs.items():
            managers = [make() for _ in range(repeat)]
            gc.collect()
            start = time.process_time()
            for pm in managers:
                pm.run(ep)
            samples[k].append((time.process_time() - start) / repeat)
    return {k: min(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cheap-repeat", type=int, default=20)
    parser.add_argument("--each", action="store_true", help="also each instrument alone")
    args = parser.parse_args(argv)

    module, inputs = encoder(args.layers, args.d_model)
    big = torch.export.export(module, inputs)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    small = torch.export.export(mlp, (torch.randn(3, 8),))

    def decompose_pipeline() -> list[Any]:
        return [
            Decompose(),
            FxPass(relu_to_clamp, name="relu-to-clamp"),
            FxPass(clone_output, name="clone-output"),
            FxPass(untouched, name="untouched"),
        ]

    def cheap_pipeline() -> list[Any]:
        return [FxPass(untouched, name=f"untouched-{i}") for i in range(20)]

    with tempfile.TemporaryDirectory() as directory:
        rows = [
            (
                f"decompose ({args.layers}-layer encoder, d_model={args.d_model})",
                measure(big, decompose_pipeline, args.rounds, 1, directory, args.each),
            ),
            (
                "cheap (20 no-op fx passes, MLP)",
                measure(
                    small, cheap_pipeline, args.rounds, args.cheap_repeat, directory, args.each
                ),
            ),
        ]
    print(f"{'pipeline':<46} {'none cpu s':>10} {'noise':>7} {'empty/none':>11} {'full/none':>10}")
    for name, t in rows:
        print(
            f"{name:<46} {t['none']:>10.4f} {t['none again'] / t['none']:>7.3f} "
            f"{t['empty'] / t['none']:>11.3f} {t['full'] / t['none']:>10.3f}"
        )
    print("(noise: a second, identical no-instrument configuration over the first)")
    if args.each:
        names = [k for k in rows[0][1] if k not in ("none", "none again", "empty", "full")]
        print()
        print(f"{'each instrument alone, over none':<46} " + " ".join(f"{n:>8.8}" for n in names))
        for name, t in rows:
            print(f"{name:<46} " + " ".join(f"{t[n] / t['none']:>8.3f}" for n in names))

    timing, counts = Timing(), OpCounts()
    PassManager([Decompose()], instruments=[timing, counts]).run(big)
    print()
    print(timing.table())
    print()
    print(counts.table())


if __name__ == "__main__":
    main()

"""Every performance figure in one table: start-up of the command and the import, the
core figures (bench_core.py), the no-op skip, coalescing, pipeline overhead on the
zoo, and peak memory on a ~1 GB model.

Run from the repository root: ``python benchmarks/bench_speed.py [--quick]``.
All values are ratios (or microseconds, where marked) measured side by side in one run.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import bench_core  # noqa: E402
from bench_core import Row, interleaved, print_table  # noqa: E402

from epass import Decompose, PassManager  # noqa: E402

aten = torch.ops.aten


def lower_pipeline() -> tuple[str, Callable[[], PassManager]]:
    """The default lowering pipeline the memory and overhead rows measure."""
    from epass.passes import presets

    return "presets.lower()", presets.lower


class Wide(torch.nn.Module):
    """An MLP of square fp32 layers: ``layers * (width**2 + width) * 4`` bytes."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = torch.relu(layer(x))
        return x


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def bench_skip(repeats: int) -> list[Row]:
    rows: list[Row] = []
    torch.manual_seed(0)
    models = {
        "128 MB MLP": (Wide(8, 2048), torch.randn(4, 2048)),
        "12-layer encoder": (bench_core.encoder(12), torch.randn(2, 16, 256)),
    }
    for label, (model, x) in models.items():
        ep = torch.export.export(model.eval(), (x,)).run_decompositions()
        manager = PassManager([Decompose()])
        assert manager(ep).records[0].skipped
        fns: dict[str, Callable[[], Any]] = {
            "bare": lambda ep=ep: ep.run_decompositions(),
            "skip": lambda ep=ep, m=manager: m.run(ep),
        }
        times = interleaved(fns, repeats)
        bare, skip = statistics.median(times["bare"]), statistics.median(times["skip"])
        rows.append(
            (
                f"skipped Decompose / run_decompositions on ATen ({label})",
                skip / bare,
                0.02,
                f"{skip * 1e3:.2f} ms vs {bare:.3f} s",
            )
        )
    return rows


def bench_coalesce(repeats: int, layers: int) -> list[Row]:
    torch.manual_seed(0)
    ep = torch.export.export(bench_core.encoder(layers), (torch.randn(2, 16, 256),))
    chain = [
        Decompose(keep=[aten.linear.default, aten.layer_norm.default], method="retrace"),
        Decompose(keep=[aten.linear.default], method="retrace"),
        Decompose(method="retrace"),
        Decompose(method="retrace"),
    ]
    k = len(chain)
    coalesced = PassManager(chain)
    assert len(coalesced.passes) == 1
    apart = PassManager([PassManager([p]) for p in chain])  # nested: never merged
    one = PassManager([Decompose(method="retrace")])
    times = interleaved(
        {
            "one": lambda: one.run(ep),
            "merged": lambda: coalesced.run(ep),
            "apart": lambda: apart.run(ep),
        },
        repeats,
    )
    t1, merged, separate = (statistics.median(times[k]) for k in ("one", "merged", "apart"))
    return [
        (
            f"{k} adjacent Decompose (coalesced) / 1 retrace ({layers}-layer encoder)",
            merged / t1,
            1.05,
            f"{merged:.3f}s vs {t1:.3f}s",
        ),
        (
            f"{k} Decompose run apart (no coalescing, skip on) / 1 retrace",
            separate / t1,
            float(k),
            f"{separate:.3f}s; for comparison",
        ),
    ]


def _speedup_row(label: str, fast: list[float], bare: list[float], target: float) -> Row:
    f, b = statistics.median(fast), statistics.median(bare)
    return (label, f / b, 1 / target, f"{b / f:.1f}x faster: {f:.3f}s vs {b:.3f}s (>= {target}x)")


def bench_incremental(repeats: int, quick: bool) -> list[Row]:
    """The incremental Decompose against a bare ``ep.run_decompositions()`` on the same
    program, interleaved. The template cache is warm (it lives for the process), as
    for any program after the first of its kind; one row measures it cold."""
    import hf_models
    from torch.export import Dim

    from epass import _decomp
    from epass.passes import presets
    from epass.passes.constant_fold import ConstantFold
    from epass.passes.cse import CSE
    from epass.passes.dce import DeadCodeElimination
    from epass.passes.remove_assertions import RemoveAssertions

    rows: list[Row] = []
    layers, deep = (2, 4) if quick else (12, 24)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 256)
    batch = ({0: Dim("batch", min=1, max=64)},)
    cases = [
        (f"{layers}-layer encoder, static", bench_core.encoder(layers), x, None, 5.0),
        (f"{layers}-layer encoder, dynamic batch", bench_core.encoder(layers), x, batch, 5.0),
        (f"{deep}-layer encoder, dynamic batch", bench_core.encoder(deep), x, batch, 6.0),
    ]
    decompose = Decompose()
    for label, model, arg, shapes, target in cases:
        ep = torch.export.export(model, (arg,), dynamic_shapes=shapes)
        assert decompose(ep).notes["method"] == "incremental"
        times = interleaved(
            {"bare": lambda ep=ep: ep.run_decompositions(), "fast": lambda ep=ep: decompose(ep)},
            repeats,
        )
        rows.append(
            _speedup_row(
                f"Decompose / run_decompositions ({label})", times["fast"], times["bare"], target
            )
        )
        if shapes is None:

            def cold(ep: Any = ep) -> Any:
                _decomp.clear_cache()
                return decompose(ep)

            times = interleaved(
                {"bare": lambda ep=ep: ep.run_decompositions(), "cold": cold}, max(2, repeats // 2)
            )
            rows.append(
                (
                    *_speedup_row(
                        "  the same, template cache cleared before each call",
                        times["cold"],
                        times["bare"],
                        1.0,
                    )[:2],
                    float("inf"),
                    "for comparison: every template traced again",
                )
            )
            # "Few ops left": everything decomposed except aten.linear.
            few = Decompose(keep=[aten.linear.default])(ep).program
            assert decompose(few).notes["method"] == "incremental"
            times = interleaved(
                {
                    "bare": lambda few=few: few.run_decompositions(),
                    "fast": lambda few=few: decompose(few),
                },
                repeats,
            )
            rows.append(
                _speedup_row(
                    "  few ops left (all but aten.linear decomposed)",
                    times["fast"],
                    times["bare"],
                    8.0,
                )
            )

    if importlib.util.find_spec("transformers") is not None:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2 if quick else 8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=128,
            use_cache=False,
            attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        llama = hf_models.HFWrapper(transformers.LlamaForCausalLM(config), "logits").eval()
        ids = torch.randint(0, 256, (2, 32))
        ep = torch.export.export(llama, (ids,))
        assert decompose(ep).notes["method"] == "incremental"
        times = interleaved(
            {"bare": lambda: ep.run_decompositions(), "fast": lambda: decompose(ep)}, repeats
        )
        rows.append(
            _speedup_row(
                f"Decompose / run_decompositions (Llama, {config.num_hidden_layers} layers)",
                times["fast"],
                times["bare"],
                5.0,
            )
        )

    # The whole zoo through the lowering preset, against the same preset retracing.
    programs = []
    for name, case in hf_models.ZOO.items():
        if case.transformers and importlib.util.find_spec("transformers") is None:
            continue
        for dynamic in (False, True):
            programs.append(hf_models.export(name, dynamic=dynamic)[1])
    fast_lower = presets.lower()
    slow_lower = PassManager(
        [
            Decompose(method="retrace"),
            RemoveAssertions(),
            ConstantFold(),
            CSE(),
            DeadCodeElimination(),
        ],
        name="lower",
    )
    methods = [fast_lower(ep).records[0].notes.get("method") for ep in programs]
    times = interleaved(
        {
            "bare": lambda: [slow_lower(ep) for ep in programs],
            "fast": lambda: [fast_lower(ep) for ep in programs],
        },
        max(2, repeats // 2),
    )
    label = (
        f"presets.lower() / with Decompose(method='retrace') (zoo, {len(programs)} "
        f"programs, {methods.count('incremental')} incremental)"
    )
    rows.append(_speedup_row(label, times["fast"], times["bare"], 2.0))
    return rows


def bench_overhead(repeats: int) -> list[Row]:
    import hf_models
    import models as small

    label, make = lower_pipeline()
    zoo: dict[str, Callable[[], torch.export.ExportedProgram]] = {}
    for name in hf_models.ZOO:
        zoo[name] = lambda name=name: hf_models.export(name)[1]
    for name in small.CASES:
        zoo[name] = lambda name=name: small.export(name)[1]
    pipeline_total = bare_total = 0.0
    rows: list[Row] = []
    for name, export in zoo.items():
        ep = export()
        manager = make()
        b, e = _overhead_times(ep, manager, repeats)
        pipeline_total, bare_total = pipeline_total + e, bare_total + b
        rows.append((f"  {label} overhead on {name}", e / b, 1.02, f"{e:.3f}s vs {b:.3f}s bare"))
    rows.insert(
        0,
        (
            f"{label} via PassManager / sum of bare pass calls (whole zoo)",
            pipeline_total / bare_total,
            1.02,
            f"{pipeline_total:.2f}s vs {bare_total:.2f}s over {len(zoo)} models",
        ),
    )
    torch.manual_seed(0)
    ep = torch.export.export(bench_core.encoder(12), (torch.randn(2, 16, 256),))
    b, e = _overhead_times(ep, make(), repeats)
    rows.append(
        (f"{label} via PassManager / bare (12-layer encoder)", e / b, 1.02, f"{e:.3f}s vs {b:.3f}s")
    )
    return rows


def _overhead_times(ep: Any, manager: PassManager, repeats: int) -> tuple[float, float]:
    """Median seconds of ``manager.run(ep)`` and of its passes called bare, in turn."""

    def bare() -> None:
        current = ep
        for p in manager.passes:
            out = p(current)
            current = getattr(out, "program", out)

    times = interleaved({"bare": bare, "epass": lambda: manager.run(ep)}, repeats)
    return statistics.median(times["bare"]), statistics.median(times["epass"])


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def rss_child(layers: int, width: int) -> None:
    """Runs in a fresh process: prints peak RSS figures as JSON."""
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = Wide(layers, width).eval()
    size = _param_bytes(model)
    ep = torch.export.export(model, (torch.randn(2, width),))
    label, make = lower_pipeline()
    manager = make()
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    out = manager.run(ep)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    assert out.state_dict is ep.state_dict or all(
        out.state_dict[k] is v for k, v in ep.state_dict.items() if k in out.state_dict
    )
    del out
    _reset_peak()
    before_copy = _status("VmRSS")
    start = time.perf_counter()
    clone = copy.deepcopy(ep)
    copy_seconds = time.perf_counter() - start
    copy_peak = _status("VmHWM")
    del clone
    print(
        json.dumps(
            {
                "pipeline": label,
                "passes": len(manager.passes),
                "model_bytes": size,
                "base_rss": base,
                "rss_before": before,
                "peak": peak,
                "seconds": seconds,
                "copy_extra": copy_peak - before_copy,
                "copy_seconds": copy_seconds,
            }
        )
    )


def bench_memory(layers: int, width: int) -> list[Row]:
    proc = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(layers), str(width)],
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    gb = r["model_bytes"] / 1e9
    extra = (r["peak"] - r["rss_before"]) / r["model_bytes"]
    passes = max(r["passes"], 1)
    return [
        (
            f"peak RSS during {r['pipeline']} / (process before it), {gb:.2f} GB model",
            r["peak"] / r["rss_before"],
            1.05,
            f"peak {r['peak'] / 1e9:.2f} GB; torch alone {r['base_rss'] / 1e9:.2f} GB",
        ),
        (
            f"  extra peak RSS during {r['pipeline']} / model size",
            extra,
            0.05,
            f"+{(r['peak'] - r['rss_before']) / 1e6:.0f} MB in {r['seconds']:.2f}s",
        ),
        (
            f"  naive copy.deepcopy(ep) per pass: extra RSS / model size ({passes} pass(es))",
            passes * r["copy_extra"] / r["model_bytes"],
            float("inf"),
            f"one copy +{r['copy_extra'] / 1e6:.0f} MB in {r['copy_seconds']:.2f}s; for comparison",
        ),
    ]


def bench_start(repeats: int) -> list[Row]:
    """Start-up in fresh processes: wall-clock medians, alternating A B C D A B C D..."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = {
        "torch": ["-c", "import torch"],
        "help": ["-m", "epass", "--help"],
        "api": ["-c", "from epass import *"],
        "epass": ["-c", "import epass"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for round_ in range(repeats + 1):  # the first round warms the page cache
        for key, argv in commands.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            if round_:
                times[key].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    torch_s = median["torch"]
    return [
        ("epass --help / python -c 'import torch' (wall, fresh processes)",
         median["help"] / torch_s, 0.35, f"{median['help']:.2f}s / {torch_s:.2f}s"),
        ("from epass import * / import torch (wall, fresh processes)",
         median["api"] / torch_s, 1.10, f"{median['api']:.2f}s; the whole public API"),
        ("import epass / import torch (wall, fresh processes)",
         median["epass"] / torch_s, 1.10, f"{median['epass']:.2f}s; names load on first use"),
    ]  # fmt: skip


def bench_guards(repeats: int) -> list[Row]:
    """What the edge guarantees cost: the before-pass snapshot that tells whether a
    pass edited its view in place, the nested node-meta copy in every graph copy,
    and the store lock taken by each link."""
    import hf_models

    import epass.linker
    from epass import StateLinker, _graph, _program

    _, ep, _ = hf_models.export("llama")
    label, make = lower_pipeline()
    manager = make()
    view = _program.private_view(ep, copy_graph=True)
    snapshot = _graph.ProgramSnapshot(view)
    out = manager.run(ep)
    linker = StateLinker()
    lock = epass.linker.STORE_LOCK

    def guard() -> None:
        _graph.ProgramSnapshot(view).changed(view)

    def meta() -> None:
        for node in ep.graph.nodes:
            _program.copy_meta(node.meta)

    def locks() -> None:
        for _ in range(100):
            with lock:
                pass

    times = interleaved(
        {
            "pipeline": lambda: manager.run(ep),
            "guard": guard,
            "copy": lambda: _program.copy_graph_module(ep.graph_module),
            "meta": meta,
            "link": lambda: linker.link(ep, _program.shallow_clone(out)),
            "locks": locks,
        },
        repeats,
    )
    best = {k: min(v) for k, v in times.items()}
    passes = len(manager.passes)
    assert not snapshot.changed(view)
    return [
        (
            f"view snapshot + compare x {passes} passes / {label} on llama",
            passes * best["guard"] / best["pipeline"],
            0.02,
            f"{best['guard'] * 1e3:.2f} ms per pass, {len(ep.graph.nodes)} nodes",
        ),
        (
            "  nested node-meta copy / whole graph copy (llama)",
            best["meta"] / best["copy"],
            0.2,
            f"{best['meta'] * 1e3:.2f} ms of {best['copy'] * 1e3:.2f} ms",
        ),
        (
            "  store lock / one link (llama, single thread)",
            best["locks"] / 100 / best["link"],
            0.05,
            f"{best['locks'] / 100 * 1e9:.0f} ns of {best['link'] * 1e6:.1f} us",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller models")
    parser.add_argument("--rss-child", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=["overhead"], help="print only these rows")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tracing is Python-bound; idle OpenMP threads only add noise
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    quick = args.quick
    if args.only == "overhead":
        print_table(bench_overhead(repeats=2 if quick else 5))
        return
    rows = bench_start(repeats=3 if quick else 7)
    rows += bench_core.core_rows(quick)
    rows += bench_skip(repeats=3 if quick else 7)
    rows += bench_coalesce(repeats=2 if quick else 5, layers=2 if quick else 6)
    rows += bench_incremental(repeats=3 if quick else 7, quick=quick)
    rows += bench_overhead(repeats=2 if quick else 5)
    rows += bench_guards(repeats=5 if quick else 20)
    rows += bench_memory(layers=4 if quick else 16, width=4096)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU-time medians")
    print_table(rows)


if __name__ == "__main__":
    main()

"""Every performance figure in one table: start-up of the command and the import, the
core figures (bench_core.py), the no-op skip, coalescing, the zoo's fallback rate (which
programs ``Decompose()`` could not take incrementally, and why), the vision corpus's
median and worst program, pipeline overhead on the zoo, peak memory on a ~1 GB model,
load and save of a 200 MB file, and ``epass run`` end to end against the same work in a
torch script; then the per-pass table of the scale run (bench_scale.py).

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

    from epass._decomp import templates
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
            {
                "bare": lambda ep=ep: ep.run_decompositions(),
                "fast": lambda ep=ep, d=decompose: d(ep),
            },
            repeats,
        )
        rows.append(
            _speedup_row(
                f"Decompose / run_decompositions ({label})", times["fast"], times["bare"], target
            )
        )
        if shapes is None:

            def cold(ep: Any = ep) -> Any:
                templates.clear_memory()
                saved = os.environ.get("EPASS_CACHE_DIR")
                os.environ["EPASS_CACHE_DIR"] = ""  # the disk cache off: every trace
                try:
                    return decompose(ep)
                finally:
                    if saved is None:
                        del os.environ["EPASS_CACHE_DIR"]
                    else:
                        os.environ["EPASS_CACHE_DIR"] = saved

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
        import hf_models  # makes torchvision, which transformers imports, load
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

        rows.append(_zoo_transformers_row(decompose, repeats))

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


def _zoo_transformers_row(decompose: Decompose, repeats: int) -> Row:
    """Warm ``Decompose`` / ``run_decompositions`` over the transformers of
    ``tests/hf_models.py``, static and dynamic: the median speed-up and the worst."""
    import hf_models

    speedups: dict[str, float] = {}
    for name, case in hf_models.ZOO.items():
        if not case.transformers:
            continue
        for dynamic in (False, True):
            ep = hf_models.export(name, dynamic=dynamic)[1]
            assert decompose(ep).notes["method"] == "incremental"
            times = interleaved(
                {
                    "bare": lambda ep=ep: ep.run_decompositions(),
                    "fast": lambda ep=ep: decompose(ep),
                },
                repeats,
            )
            label = f"{name}{', dynamic' if dynamic else ''}"
            speedups[label] = statistics.median(times["bare"]) / statistics.median(times["fast"])
    median = statistics.median(speedups.values())
    each = ", ".join(f"{k} {v:.1f}x" for k, v in speedups.items())
    return (
        f"warm Decompose / run_decompositions, the zoo's transformers ({len(speedups)} "
        "programs, median)",
        1 / median,
        1 / 20.0,
        f"{median:.1f}x faster (>= 20x): {each}",
    )


def _zoo(quick: bool) -> dict[str, Callable[[], Any]]:
    """The test zoos (tests/models.py, tests/hf_models.py), static and dynamic."""
    import hf_models
    import models

    programs: dict[str, Callable[[], Any]] = {}
    for name, case in models.CASES.items():
        for dynamic in (False, True) if case.dynamic_batch and not quick else (False,):
            label = f"{name}{', dynamic' if dynamic else ''}"
            programs[label] = lambda name=name, d=dynamic: models.export(name, dynamic=d)[1]
    for name, zoo_case in hf_models.ZOO.items():
        if zoo_case.transformers and importlib.util.find_spec("transformers") is None:
            continue
        for dynamic in (False,) if quick else (False, True):
            label = f"zoo {name}{', dynamic' if dynamic else ''}"
            programs[label] = lambda name=name, d=dynamic: hf_models.export(name, dynamic=d)[1]
    return programs


def bench_fallbacks(quick: bool) -> list[Row]:
    """How many of the zoo's programs ``Decompose()`` took incrementally, read from the
    pass records' notices as every view reads them; one row per fallback, its reason.
    Where auto chose the retrace as the cheaper path, that is counted apart: it is no
    fallback. The goal is none: torch decomposes every program of the zoo."""
    fell_back: dict[str, str] = {}
    chose: list[str] = []
    programs = _zoo(quick)
    for label, make in programs.items():
        torch.manual_seed(0)
        (record,) = PassManager([Decompose()])(make()).records
        fallbacks = [n.text for n in record.notices if n.fallback]
        if fallbacks:
            fell_back[label] = "; ".join(fallbacks)
        elif record.notes.get("method") != "incremental":
            chose.append(label)
    total = len(programs)
    taken = total - len(fell_back) - len(chose)
    rows: list[Row] = [
        (f"Decompose() fell back on {len(fell_back)} of {total} zoo programs (fallback rate)",
         len(fell_back) / total, 0.0,
         f"{taken} taken incrementally, {len(chose)} retraced by auto's choice"
         + (f" ({', '.join(chose)})" if chose else "")),
    ]  # fmt: skip
    rows += [(f"  fell back: {label}", 1.0, 0.0, why) for label, why in fell_back.items()]
    return rows


def bench_vision(repeats: int, quick: bool) -> list[Row]:
    """The coverage test's corpus (tests/vision_models.py: torchvision and timm
    architectures, random weights): which programs ``Decompose()`` takes incrementally,
    and the warm ``Decompose`` against ``run_decompositions`` on each program it
    takes, static and dynamic batch, interleaved (the median and the worst ratio of
    each kind over the corpus)."""
    import vision_models

    names = [n for n in vision_models.CORPUS if vision_models.available(n)]
    if quick:
        names = names[:4]
    if not names:
        return [("vision corpus: torchvision and timm are not installed", 0.0, 0.0, "skipped")]
    decompose = Decompose()
    taken, fell_back = 0, {}
    speedups: dict[bool, dict[str, float]] = {False: {}, True: {}}
    chose: list[str] = []
    cases = [(n, d) for n in names for d in (False, True)]
    for name, dynamic in cases:
        ep = vision_models.export(name, dynamic=dynamic)[1]
        (record,) = PassManager([decompose])(ep).records
        fallbacks = [n.text for n in record.notices if n.fallback]
        if record.notes.get("method") == "incremental":
            taken += 1
        elif fallbacks:
            fell_back[vision_models.label(name, dynamic)] = "; ".join(fallbacks)
        else:
            chose.append(vision_models.label(name, dynamic))
        if record.notes.get("method") != "incremental":
            continue
        times = interleaved(
            {
                "bare": lambda ep=ep: ep.run_decompositions(),
                "fast": lambda ep=ep, d=decompose: d(ep),
            },
            repeats,
        )
        speedup = statistics.median(times["bare"]) / statistics.median(times["fast"])
        speedups[dynamic][name] = speedup
    rows: list[Row] = [
        (f"vision corpus: Decompose() took {taken} of {len(cases)} programs incrementally",
         (len(cases) - taken) / len(cases), 0.0,
         f"{len(fell_back)} fell back, {len(chose)} retraced by auto's choice"
         + (f" ({', '.join(chose)})" if chose else "") + "; static and dynamic batch"),
    ]  # fmt: skip
    rows += [(f"  fell back: {label}", 1.0, 0.0, why) for label, why in fell_back.items()]
    for dynamic, ratios in speedups.items():
        if not ratios:
            continue
        kind = "dynamic batch" if dynamic else "static"
        median = statistics.median(ratios.values())
        worst = min(ratios, key=ratios.__getitem__)
        rows.append(
            (f"warm Decompose / run_decompositions, vision corpus {kind} (median)",
             1 / median, 1 / 10.0, f"{median:.1f}x faster over {len(ratios)} programs (>= 10x)")
        )  # fmt: skip
        rows.append(
            ("  the worst program", 1 / ratios[worst], 1 / 10.0,
             f"{ratios[worst]:.1f}x faster: {worst} (>= 10x)")
        )  # fmt: skip
        rows += [
            (f"  {name}", 1 / ratio, float("inf"), f"{ratio:.1f}x faster")
            for name, ratio in sorted(ratios.items(), key=lambda kv: kv[1])
        ]
    return rows + bench_vision_hw(repeats)


# Corpus architectures also exported with Dim.AUTO batch, height and width: sizes
# nested through every strided layer (GoogLeNet), and convolutions on permuted inputs
# (ConvNeXt's blocks).
HW_PROGRAMS = ("tv_googlenet", "tv_convnext_tiny")


def bench_vision_hw(repeats: int) -> list[Row]:
    """Warm ``Decompose`` against ``run_decompositions`` on :data:`HW_PROGRAMS` with
    dynamic batch, height and width, interleaved; the path ``Decompose()`` took on its
    first run (empty cache) is noted."""
    import vision_models
    from torch.export import Dim

    rows: list[Row] = []
    for name in HW_PROGRAMS:
        if not vision_models.available(name):
            continue
        module = vision_models.build(name)
        (x,) = vision_models.inputs(name)
        auto = {0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO}
        with torch.no_grad():
            ep = torch.export.export(module, (x,), dynamic_shapes=(auto,))
        decompose = Decompose()
        method = decompose(ep).notes["method"]
        times = interleaved(
            {
                "bare": lambda ep=ep: ep.run_decompositions(),
                "fast": lambda ep=ep, d=decompose: d(ep),
            },
            repeats,
        )
        ratio = statistics.median(times["bare"]) / statistics.median(times["fast"])
        rows.append(
            (f"warm Decompose / run_decompositions, {name}, dynamic height and width",
             1 / ratio, 1 / 10.0, f"{ratio:.1f}x faster (>= 10x); first run: {method}")
        )  # fmt: skip
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


def _wall_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, before: Callable[[], Any] = lambda: None
) -> dict[str, list[float]]:
    """Wall-clock times, alternating A B B A A B: loads and saves wait on the disk,
    which this process's CPU time does not see, and the order alternates so that
    neither side always runs while the other's writes are still being flushed.
    ``before`` runs, untimed, before each call."""
    for fn in fns.values():
        fn()  # warm-up: page cache, imports
    times: dict[str, list[float]] = {k: [] for k in fns}
    for round_ in range(repeats):
        order = list(fns.items())
        for key, fn in order if round_ % 2 == 0 else order[::-1]:
            before()
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return times


def bench_io(repeats: int, layers: int) -> list[Row]:
    """``epass.load`` (screened) and ``epass.save`` (atomic) against torch's, on an MLP
    of ``layers`` 2048-wide fp32 layers (12: a 200 MB file). Saves write a new file,
    then over a file already on disk, synced first either way: the old file's blocks
    are freed in the second, by torch's truncation or by the rename over it."""
    import tempfile

    import epass

    torch.manual_seed(0)
    model = Wide(layers, 2048)
    ep = torch.export.export(model, (torch.randn(2, 2048),))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "wide.pt2"
        torch.export.save(ep, path)
        mb = path.stat().st_size / 1e6
        loads = _wall_interleaved(
            {"torch": lambda: torch.export.load(path), "epass": lambda: epass.load(path)},
            repeats,
        )
        targets = {"torch": Path(tmp) / "t.pt2", "epass": Path(tmp) / "e.pt2"}
        savers = {
            "torch": lambda: torch.export.save(ep, targets["torch"]),
            "epass": lambda: epass.save(ep, targets["epass"]),
        }

        def remove() -> None:
            for target in targets.values():
                target.unlink(missing_ok=True)
            os.sync()  # the last save's writes and the freed blocks, off the clock

        fresh = _wall_interleaved(savers, repeats, before=remove)
        over = _wall_interleaved(savers, repeats, before=os.sync)
    load = {k: statistics.median(v) for k, v in loads.items()}
    save = {k: statistics.median(v) for k, v in fresh.items()}
    over_s = {k: statistics.median(v) for k, v in over.items()}
    return [
        (f"epass.load / torch.export.load, {mb:.0f} MB (wall)", load["epass"] / load["torch"],
         1.5, f"{load['epass']:.3f}s / {load['torch']:.3f}s; screened, read once"),
        (f"epass.save / torch.export.save, {mb:.0f} MB, new file (wall)",
         save["epass"] / save["torch"], 1.1,
         f"{save['epass']:.3f}s / {save['torch']:.3f}s; atomic: a temporary file, renamed"),
        (f"epass.save / torch.export.save, {mb:.0f} MB, over a file on disk (wall)",
         over_s["epass"] / over_s["torch"], 1.1,
         f"{over_s['epass']:.3f}s / {over_s['torch']:.3f}s"),
    ]  # fmt: skip


_TORCH_SCRIPT = """\
import sys, torch
ep = torch.export.load(sys.argv[1])
ep = ep.run_decompositions()
torch.export.save(ep, sys.argv[2])
"""

# What `epass run -p lower -o` does, phase by phase, timed through the progress hook.
_PHASES_SCRIPT = """\
import json, sys, time
marks = [("import", time.perf_counter())]
import epass
from epass.passes import presets
def mark(text):
    marks.append((text.split()[0], time.perf_counter()))
ep = epass.load(sys.argv[1], progress=mark)
mark("passes")
out = presets.lower().run(ep)
epass.save(out, sys.argv[2], progress=mark)
mark("end")
print(json.dumps({a: b - t for (a, t), (_, b) in zip(marks, marks[1:])}))
"""

_TORCH_PHASES_SCRIPT = """\
import json, sys, time
marks = [("import", time.perf_counter())]
import torch
marks.append(("load", time.perf_counter()))
ep = torch.export.load(sys.argv[1])
marks.append(("run_decompositions", time.perf_counter()))
ep = ep.run_decompositions()
marks.append(("save", time.perf_counter()))
torch.export.save(ep, sys.argv[2])
marks.append(("end", time.perf_counter()))
print(json.dumps({a: b - t for (a, t), (_, b) in zip(marks, marks[1:])}))
"""


def bench_end_to_end(repeats: int, layers: int) -> list[Row]:
    """``epass run -p lower -o`` against a torch script doing load, run_decompositions,
    save: fresh processes, wall clock, each epass run with an empty decomposition
    cache (``EPASS_CACHE_DIR`` a new empty folder); a separate run times the phases."""
    import shutil
    import tempfile

    torch.manual_seed(0)
    ep = torch.export.export(bench_core.encoder(layers), (torch.randn(2, 16, 256),))
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "enc.pt2", Path(tmp) / "out.pt2"
        torch.export.save(ep, src)
        script = Path(tmp) / "lower.py"
        script.write_text(_TORCH_SCRIPT)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "EPASS_PLAIN": "1"}
        times: dict[str, list[float]] = {"torch": [], "epass": []}

        cache = Path(tmp) / "cache"

        def run(argv: list[str]) -> float:
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir()  # empty for every run
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], env={**env, "EPASS_CACHE_DIR": str(cache)},
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
            return time.perf_counter() - start

        argv = {
            "torch": [str(script), str(src), str(out)],
            "epass": ["-m", "epass", "run", str(src), "-p", "lower", "-o", str(out)],
        }
        for round_ in range(repeats + 1):  # the first round warms the page cache
            for key, command in argv.items():
                seconds = run(command)
                if round_:
                    times[key].append(seconds)
        notes = {}
        for key, text in (("epass", _PHASES_SCRIPT), ("torch", _TORCH_PHASES_SCRIPT)):
            shutil.rmtree(cache)
            cache.mkdir()
            phases_script = Path(tmp) / f"phases_{key}.py"
            phases_script.write_text(text)
            done = subprocess.run(
                [sys.executable, str(phases_script), str(src), str(out)],
                env={**env, "EPASS_CACHE_DIR": str(cache)}, cwd=ROOT, check=True,
                capture_output=True, text=True,
            )  # fmt: skip
            phases = json.loads(done.stdout.strip().splitlines()[-1])
            notes[key] = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
    median = {k: statistics.median(v) for k, v in times.items()}
    return [
        (f"epass run -p lower -o / torch load+run_decompositions+save ({layers}-layer encoder, "
         "cold, empty cache)", median["epass"] / median["torch"], 1.0,
         f"{median['epass']:.2f}s / {median['torch']:.2f}s"),
        ("  phases (s), one cold process each", 0.0, 1.0,
         f"epass: {notes['epass']}; torch: {notes['torch']}"),
    ]  # fmt: skip


def first_child(mode: str, path: str) -> None:
    """One fresh process: load the program, time the first decomposition (CPU time)."""
    ep = torch.export.load(path)
    if mode == "naming":  # what the first decomposition spends naming torch's table
        from epass._decomp import identity, table

        tables = table.split_table(None)
        start = time.process_time()
        identity.cache_name(tables)
        print(time.process_time() - start)
        return
    start = time.process_time()
    if mode == "retrace":
        ep.run_decompositions()
    elif mode == "auto":
        result = Decompose()(ep)  # either path: auto chooses
        notes = result.notes
        chose_retrace = notes.get("decision", "").startswith("retrace")
        print("fallback" if notes["fallback"] and not chose_retrace else notes["method"])
    else:
        result = Decompose()(ep)
        assert result.notes["method"] == "incremental", result.notes
    print(time.process_time() - start)


def bench_first_run(repeats: int, quick: bool) -> list[Row]:
    """The first Decompose() of a process against its first run_decompositions(), in
    fresh processes, alternating: with an empty template cache, and with the cache an
    earlier process filled."""
    import tempfile

    import models

    from epass.cli.demo import demo_program

    torch.manual_seed(0)
    programs = {
        "demo model": demo_program,
        # Symbolic templates on disk: a dynamic batch, and a dynamic batch and sequence.
        "CNN, dynamic batch": lambda: models.export_dynamic("cnn")[1],
        "decoder, dynamic batch and sequence": lambda: models.export_dynamic("decoder")[1],
    }
    if not quick:
        programs["12-layer encoder"] = lambda: torch.export.export(
            bench_core.encoder(12).eval(), (torch.randn(2, 16, 256),)
        )
        if importlib.util.find_spec("torchvision") is not None:
            import vision_models

            programs["torchvision ResNet-18, dynamic batch"] = lambda: vision_models.export(
                "tv_resnet18", dynamic=True
            )[1]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, make in programs.items():
            path = os.path.join(tmp, "program.pt2")
            torch.export.save(make(), path)
            filled = os.path.join(tmp, "filled")

            def child(mode: str, cache: str, path: str = path) -> float:
                env = {**os.environ, "PYTHONPATH": str(ROOT), "EPASS_CACHE_DIR": cache}
                done = subprocess.run(
                    [sys.executable, __file__, "--first-child", mode, path],
                    env=env, cwd=ROOT, check=True, capture_output=True, text=True,
                )  # fmt: skip
                return float(done.stdout.strip().splitlines()[-1])

            child("incremental", filled)  # the earlier process that fills the cache
            times: dict[str, list[float]] = {"retrace": [], "cold": [], "filled": [], "naming": []}
            for round_ in range(repeats):
                empty = os.path.join(tmp, f"empty-{round_}")
                times["retrace"].append(child("retrace", empty))
                times["cold"].append(child("incremental", empty))
                times["filled"].append(child("incremental", filled))
                times["naming"].append(child("naming", filled))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows += [
                (f"first Decompose(), empty cache / first run_decompositions() ({label})",
                 med["cold"] / med["retrace"], 1.00,
                 f"{med['cold']:.2f}s / {med['retrace']:.2f}s, fresh processes"),
                (f"first Decompose(), cache filled earlier / first run_decompositions() ({label})",
                 med["filled"] / med["retrace"], 0.25,
                 f"{med['filled']:.2f}s / {med['retrace']:.2f}s, fresh processes; naming "
                 f"torch's table for the keys alone {med['naming'] * 1000:.0f} ms"),
            ]  # fmt: skip
    return rows


def _auto_programs(quick: bool) -> dict[str, Callable[[], Any]]:
    """Programs of many distinct ops and few nodes, where tracing weighs the most."""
    import models

    from epass.cli.demo import demo_program

    programs: dict[str, Callable[[], Any]] = {
        name: (lambda name=name: models.export(name)[1]) for name in models.CASES
    }
    programs["demo model"] = demo_program
    if quick:
        return programs
    if importlib.util.find_spec("transformers") is not None:
        import hf_models

        for name in hf_models.ZOO:
            programs[f"zoo {name}"] = lambda name=name: hf_models.export(name)[1]
    programs["12-layer encoder"] = lambda: torch.export.export(
        bench_core.encoder(12).eval(), (torch.randn(2, 16, 256),)
    )
    return programs


def bench_auto_first_run(repeats: int, quick: bool) -> list[Row]:
    """``method="auto"``'s first Decompose() of a fresh process, empty template cache,
    against the first run_decompositions() of a fresh process, on every program of
    `_auto_programs`: alternating, medians per program, the worst ratio printed; and
    the same for a process that finds the cache the first one filled."""
    import tempfile

    ratios: dict[str, tuple[float, float, str]] = {}
    spread: dict[str, str] = {}  # how far one program's cold processes vary
    with tempfile.TemporaryDirectory() as tmp:
        for label, make in _auto_programs(quick).items():
            torch.manual_seed(0)
            path = os.path.join(tmp, "program.pt2")
            torch.export.save(make(), path)

            def child(mode: str, cache: str, path: str = path) -> tuple[float, str]:
                env = {**os.environ, "PYTHONPATH": str(ROOT), "EPASS_CACHE_DIR": cache}
                done = subprocess.run(
                    [sys.executable, __file__, "--first-child", mode, path],
                    env=env, cwd=ROOT, check=True, capture_output=True, text=True,
                )  # fmt: skip
                lines = done.stdout.strip().splitlines()
                return float(lines[-1]), lines[-2] if len(lines) > 1 else ""

            times: dict[str, list[float]] = {"retrace": [], "cold": [], "filled": []}
            methods = set()
            for round_ in range(repeats):
                cache = os.path.join(tmp, f"{len(ratios)}-{round_}")
                times["retrace"].append(child("retrace", cache + "-unused")[0])
                cold, method = child("auto", cache)
                times["cold"].append(cold)
                methods.add(method)
                times["filled"].append(child("auto", cache)[0])  # finds what cold left
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios[label] = (
                med["cold"] / med["retrace"],
                med["filled"] / med["retrace"],
                "/".join(sorted(methods)),
            )
            spread[label] = (
                f"its retraces took {min(times['retrace']):.2f}-{max(times['retrace']):.2f} s, "
                f"auto {min(times['cold']):.2f}-{max(times['cold']):.2f} s"
            )
    worst = max(ratios, key=lambda k: ratios[k][0])
    # A program the incremental path cannot take retraces whatever the cache holds.
    takes = [k for k in ratios if ratios[k][2] != "fallback"]
    worst_filled = max(takes, key=lambda k: ratios[k][1])
    each = ", ".join(f"{k} {v[0]:.2f} ({v[2]})" for k, v in ratios.items())
    return [
        (f"auto's first Decompose(), empty cache / first run_decompositions(), worst of "
         f"{len(ratios)} programs ({worst})", ratios[worst][0], 1.00,
         f"fresh processes, alternating; {spread[worst]}; {each}"),
        (f"  the same, cache filled by that first run, worst of the {len(takes)} programs "
         f"the incremental path takes ({worst_filled})", ratios[worst_filled][1], 0.25,
         "fresh processes, alternating; "
         + ", ".join(f"{k} {ratios[k][1]:.2f}" for k in takes)),
    ]  # fmt: skip


def bench_patchable_walk(repeats: int) -> list[Row]:
    """The walk epass makes before each retrace (the operators whose kernels it puts
    back) against torch's own ``_collect_all_valid_cia_ops``, which visits the same
    operators, in this process."""
    from torch._export.utils import _collect_all_valid_cia_ops

    from epass._decomp import state

    times = interleaved(
        {"epass": state.patchable_ops, "torch": _collect_all_valid_cia_ops}, repeats
    )
    e, t = statistics.median(times["epass"]), statistics.median(times["torch"])
    return [
        ("  the walk before each retrace / torch's _collect_all_valid_cia_ops (same set)",
         e / t, 1.0, f"{e * 1e3:.1f} ms / {t * 1e3:.1f} ms, warm"),
        *bench_consumer_tables(repeats),
    ]  # fmt: skip


def bench_consumer_tables(repeats: int) -> list[Row]:
    """What a served call spends on a consumer's table before any decomposition:
    reading a ``default_decompositions()`` table (ExecuTorch and OpenVINO pass one; the
    read materializes it) and splitting the table read, epass's against torch's, each
    on a table of its own made beforehand."""
    from epass._decomp import table
    from epass._torch import operators

    def fresh() -> Any:
        made = torch.export.default_decompositions()
        made.pop(torch.ops.aten.linear.default)
        return made

    unread = [fresh() for _ in range(2 * repeats + 2)]
    read = {"epass": lambda: table.as_dict(unread.pop()), "torch": lambda: dict(unread.pop())}
    reading = interleaved(read, repeats)
    whole = dict(fresh())
    split = {
        "epass": lambda: table._split_explicit(dict(whole)),
        "torch": lambda: operators.split_decomp_table(dict(whole)),
    }
    splitting = interleaved(split, repeats)
    rows = []
    for label, times in (("reading", reading), ("splitting", splitting)):
        e, t = statistics.median(times["epass"]), statistics.median(times["torch"])
        rows.append(
            (f"  {label} a default_decompositions() table, epass / torch (the same entries)",
             e / t, 1.0, f"{e * 1e3:.1f} ms / {t * 1e3:.1f} ms, warm")
        )  # fmt: skip
    return rows


def bench_guards(repeats: int) -> list[Row]:
    """What the edge guarantees cost: the before-pass snapshot that tells whether a
    pass edited its view in place, the nested node-meta copy in every graph copy,
    and the store lock taken by each link."""
    import hf_models

    import epass.linker
    from epass import StateLinker, _program, _snapshot

    _, ep, _ = hf_models.export("llama")
    label, make = lower_pipeline()
    manager = make()
    view = _program.private_view(ep, copy_graph=True)
    snapshot = _snapshot.ProgramSnapshot(view)
    out = manager.run(ep)
    linker = StateLinker()
    lock = epass.linker.STORE_LOCK

    def guard() -> None:
        _snapshot.ProgramSnapshot(view).changed(view)

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


def bench_scale(quick: bool) -> None:
    """The scale run of ``bench_scale.py`` (the Llama-7B-shaped decoder at 8, 16 and 32
    layers, static and dynamic sequence, each step in a fresh process), printed as it
    prints it: one line per program with ``presets.lower()``'s wall, each pass and the
    manager's own seconds, then its ratios and the time per doubling of layers."""
    script = Path(__file__).with_name("bench_scale.py")
    layers = "4,8" if quick else "8,16,32"
    subprocess.run([sys.executable, str(script), "--layers", layers], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller models")
    parser.add_argument("--rss-child", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--only",
        choices=[
            "first-run",
            "auto",
            "incremental",
            "fallbacks",
            "vision",
            "vision-hw",
            "io",
            "overhead",
            "scale",
        ],
        help="one group: first-run, auto (auto's first run on many programs), incremental, "
        "fallbacks (the zoo's fallback rate), vision (the torchvision and timm corpus: "
        "fallbacks, warm speed-ups and the worst program), vision-hw (two of its programs "
        "with dynamic height and width), io (load, save, end to end), "
        "overhead or scale (bench_scale.py's per-pass table at 8, 16 and 32 layers)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # tracing is Python-bound; idle OpenMP threads only add noise
    if args.rss_child:
        rss_child(*args.rss_child)
        return
    if args.first_child:
        first_child(*args.first_child)
        return
    import tempfile

    # The figures are measured against a template cache of their own, never the user's.
    os.environ.setdefault("EPASS_CACHE_DIR", tempfile.mkdtemp(prefix="epass-bench-cache-"))
    if args.only == "first-run":
        print_table(bench_first_run(repeats=3 if args.quick else 5, quick=args.quick))
        return
    if args.only == "auto":
        print_table(bench_auto_first_run(repeats=3, quick=args.quick) + bench_patchable_walk(9))
        return
    if args.only == "incremental":
        print_table(bench_incremental(repeats=3 if args.quick else 7, quick=args.quick))
        return
    if args.only == "fallbacks":
        print_table(bench_fallbacks(quick=args.quick))
        return
    if args.only == "vision-hw":
        print_table(bench_vision_hw(repeats=3 if args.quick else 5))
        return
    if args.only == "vision":
        print_table(bench_vision(repeats=3 if args.quick else 5, quick=args.quick))
        return
    quick = args.quick
    if args.only == "io":
        rows = bench_io(repeats=3 if quick else 11, layers=4 if quick else 12)
        rows += bench_end_to_end(repeats=2 if quick else 5, layers=2 if quick else 12)
        print_table(rows)
        return
    if args.only == "overhead":
        print_table(bench_overhead(repeats=2 if quick else 5))
        return
    if args.only == "scale":
        bench_scale(quick)
        return
    rows = bench_start(repeats=3 if quick else 7)
    rows += bench_core.core_rows(quick)
    rows += bench_skip(repeats=3 if quick else 7)
    rows += bench_coalesce(repeats=2 if quick else 5, layers=2 if quick else 6)
    rows += bench_first_run(repeats=3 if quick else 5, quick=quick)
    rows += bench_auto_first_run(repeats=3, quick=quick)
    rows += bench_patchable_walk(repeats=9)
    rows += bench_incremental(repeats=3 if quick else 7, quick=quick)
    rows += bench_fallbacks(quick=quick)
    rows += bench_vision(repeats=3 if quick else 5, quick=quick)
    rows += bench_overhead(repeats=2 if quick else 5)
    rows += bench_guards(repeats=5 if quick else 20)
    rows += bench_memory(layers=4 if quick else 16, width=4096)
    rows += bench_io(repeats=3 if quick else 11, layers=4 if quick else 12)
    rows += bench_end_to_end(repeats=2 if quick else 5, layers=2 if quick else 12)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU-time medians")
    print_table(rows)
    print("\nThe whole lowering at scale (bench_scale.py):")
    bench_scale(quick)


if __name__ == "__main__":
    main()

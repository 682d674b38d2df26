"""Each consumer's own path from an ExportedProgram to a runnable model, plain and
under epass: ONNX (``torch.onnx.export(ep, dynamo=True)``, run with onnxruntime),
ExecuTorch (``to_edge(ep).to_executorch()``, run with its portable runtime), TVM
(``from_exported_program``, built and run on llvm) and OpenVINO (``convert_model``,
compiled on CPU), on GPT-2, Llama and torchvision's ResNet-18 (random weights),
static and with a dynamic sequence (batch, for the CNN).

epass takes part in two ways: the switch (``with epass.fast_decompositions():``
around the consumer's own calls) and, where epass has one, the hand-off
(``epass.onnx.export``, ``epass.executorch.to_edge``, ``epass.tvm``, each with
``pipeline=presets.lower()``). A path's time runs from the program to a model
ready to run: ``torch.onnx.export`` and the onnxruntime session, ``to_edge`` and
``to_executorch``, TVM's import and ``tvm.compile``, ``convert_model`` and
``compile_model``; the ``convert`` column is the ratio of the converting call alone
(the one that decomposes). Every measurement is a fresh process that loads the
program from a ``.pt2`` file (``--fresh-export``: that exports it itself, as a
script calling ``torch.export.export`` would), with the consumer's modules imported
before the clock starts. The paths alternate (ABAB, the order reversed every other
round) and each figure is the median of the repeats. The template cache is a
directory of this run's own (``EPASS_CACHE_DIR``), filled by one earlier process per
program, as for a user who exports more than once.

Per path the child also reports the share of the path's time spent in
``run_decompositions``, how epass served those calls, whether the user's
``state_dict`` and ``constants`` kept exactly their keys and tensor objects, and
the outputs of the compiled model, which the parent compares between the plain path
and each epass path (on the example inputs, and on inputs of another size for the
dynamic programs).

Run from the repository root: ``python benchmarks/bench_handoff.py [--repeats N]
[--models gpt2,llama,resnet18] [--consumers onnx,executorch,tvm,openvino]
[--static | --dynamic] [--layers N] [--fresh-export] [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from consumer_paths import CONSUMERS, Made, explicit_cumsum_dtype  # noqa: E402

# What each consumer needs installed, and its paths: "plain" is the consumer alone.
NEEDS = {
    "onnx": ("onnxscript", "onnxruntime"),
    "executorch": ("executorch",),
    "tvm": ("tvm",),
    "openvino": ("openvino",),
}
PATHS = {
    "onnx": ("plain", "switch", "handoff"),
    "executorch": ("plain", "switch", "handoff"),
    "tvm": ("plain", "switch", "handoff"),
    "openvino": ("plain", "switch"),
}
MODELS = ("gpt2", "llama", "resnet18")
CHILD_TIMEOUT_S = 900
# What a user's script imports at its top: imported before the clock starts.
IMPORTS = {
    "onnx": ("onnxscript", "onnxruntime"),
    "executorch": ("executorch.exir", "executorch.runtime"),
    "tvm": ("tvm", "tvm.relax.frontend.torch"),
    "openvino": ("openvino",),
}

# --- the programs (parent) ----------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """The decoders' size: layers, hidden width and vocabulary."""

    layers: int
    hidden: int
    vocab: int


def _decoder(name: str, size: Size) -> Any:
    """GPT-2 (eager attention: torch's default table cannot retrace transformers'
    sdpa GPT-2, whose attention reshapes a transposed view) or Llama (sdpa,
    grouped-query attention), random weights."""
    import hf_models
    import transformers

    if name == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=size.vocab,
            n_embd=size.hidden,
            n_layer=size.layers,
            n_head=4,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
            attn_implementation="eager",
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=size.vocab,
            hidden_size=size.hidden,
            intermediate_size=2 * size.hidden,
            num_hidden_layers=size.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            use_cache=False,
            attn_implementation="sdpa",
        )
        model = transformers.LlamaForCausalLM(config)
    return hf_models.HFWrapper(model, "logits").eval()


def _model(name: str, size: Size) -> tuple[Any, list[tuple[Any, ...]], Any]:
    """The module, its inputs (the example first, then one of another size for a
    dynamic program) and its dynamic shapes."""
    import torch
    import vision_models
    from torch.export import Dim

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    if name == "resnet18":
        module = vision_models.build("tv_resnet18")
        inputs = [(torch.randn(n, 3, 64, 64, generator=generator),) for n in (2, 3)]
        return module, inputs, ({0: vision_models.BATCH_DIM},)
    ids = [(torch.randint(0, size.vocab, (2, n), generator=generator),) for n in (32, 17)]
    return _decoder(name, size), ids, ({1: Dim("seq", min=2, max=128)},)


def export_program(name: str, dynamic: bool, size: Size, folder: Path) -> tuple[Path, Path]:
    """Export one program into ``folder``: the ``.pt2`` file and its inputs' file."""
    import torch

    module, inputs, shapes = _model(name, size)
    ep = torch.export.export(module, inputs[0], dynamic_shapes=shapes if dynamic else None)
    stem = folder / f"{name}-{'dynamic' if dynamic else 'static'}"
    torch.export.save(ep, f"{stem}.pt2")
    torch.save(inputs if dynamic else inputs[:1], f"{stem}.inputs.pt")
    return Path(f"{stem}.pt2"), Path(f"{stem}.inputs.pt")


# --- timing run_decompositions (child) ----------------------------------------------------


class DecompositionClock:
    """Wall time of the ``run_decompositions`` calls torch's method takes outside the
    switch.

    The clock is a wrapper put on torch's class before anything else runs. The switch,
    entered later, captures it as torch's method and puts its own above it: a served
    call never reaches the clock (the switch's log times it), and what does reach it
    while the switch is on is a call made from inside a served one (a retrace, or a
    call handed to torch), already inside the log's time. So the clock counts a call
    only while it is itself the class's attribute; the log adds the rest. The switch
    puts the clock back when its block ends, which :meth:`uninstall` checks.
    """

    NAME = "run_decompositions"

    def __init__(self) -> None:
        from torch.export import ExportedProgram

        self.cls = ExportedProgram
        self.torch = ExportedProgram.__dict__[self.NAME]
        self.seconds = 0.0
        self.calls = 0
        self.depth = 0

        @functools.wraps(self.torch)
        def timed(ep: Any, *args: Any, **kwargs: Any) -> Any:
            if self.depth or self.cls.__dict__.get(self.NAME) is not timed:
                return self.torch(ep, *args, **kwargs)
            self.depth += 1
            began = time.perf_counter()
            try:
                return self.torch(ep, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began
                self.calls += 1
                self.depth -= 1

        self.timed = timed

    def install(self) -> None:
        setattr(self.cls, self.NAME, self.timed)

    def uninstall(self) -> bool:
        """Put torch's method back; True when the clock was still the attribute."""
        mine = self.cls.__dict__.get(self.NAME) is self.timed
        setattr(self.cls, self.NAME, self.torch)
        return mine


# --- one measurement (child) ---------------------------------------------------------------

MARK = "bench_handoff: "
_FIELDS = ("state_dict", "constants")


def _entries(ep: Any) -> dict[str, tuple[Any, dict[str, Any]]]:
    return {f: (getattr(ep, f), dict(getattr(ep, f))) for f in _FIELDS}


def _unchanged(ep: Any, before: dict[str, tuple[Any, dict[str, Any]]]) -> bool:
    """The user's dicts are the same objects, with the same keys, holding the same
    tensor objects."""
    for name, (store, entries) in before.items():
        now = getattr(ep, name)
        if now is not store or now.keys() != entries.keys():
            return False
        if any(now[key] is not value for key, value in entries.items()):
            return False
    return True


def prepare(consumer: str, spec: dict[str, Any]) -> tuple[Any, list[tuple[Any, ...]]]:
    """Import what the consumer's paths need, and the program and its inputs: the
    ``.pt2`` file, or with ``fresh`` an export of the model in this process."""
    import importlib

    import torch

    import epass.executorch
    import epass.onnx
    import epass.tvm  # noqa: F401

    for module in IMPORTS[consumer]:
        importlib.import_module(module)
    inputs = torch.load(spec["inputs"])
    if spec.get("fresh"):
        sys.path[:0] = [str(ROOT / "tests")]
        module, _, shapes = _model(spec["model"], Size(**spec["size"]))
        ep = torch.export.export(
            module, inputs[0], dynamic_shapes=shapes if spec["dynamic"] else None
        )
    else:
        ep = torch.export.load(spec["program"])
    if consumer == "tvm":
        explicit_cumsum_dtype(ep)
    return ep, inputs


def _take(consumer: str, path: str, ep: Any, args: tuple[Any, ...], build: bool) -> Made:
    """Run one path; the switch's block covers the whole path, build included."""
    import epass

    make = CONSUMERS[consumer]
    if path != "switch":
        return make(ep, args, path, build)
    with epass.fast_decompositions() as log:
        made = make(ep, args, "plain", build)
    made.log = log
    return made


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One path in this process: its seconds, what it spent in ``run_decompositions``,
    how epass served those calls, whether the user's dicts are untouched; the
    compiled model's outputs go to ``spec["out"]``."""
    import torch

    ep, inputs = prepare(spec["consumer"], spec)
    before = _entries(ep)
    clock = DecompositionClock()
    clock.install()
    try:
        began = time.perf_counter()
        made = _take(spec["consumer"], spec["path"], ep, inputs[0], True)
        seconds = time.perf_counter() - began
    finally:
        clock_kept = clock.uninstall()
    log = made.log
    report = {
        "seconds": seconds,
        "convert": made.convert_s,
        "decomp": clock.seconds + (log.seconds if log is not None else 0.0),
        "calls": clock.calls + (len(log.served) if log is not None else 0),
        "counts": None if log is None else log.counts,
        "reasons": None if log is None else log.reasons,
        "pipeline": made.pipeline_s,
        "dicts_ok": _unchanged(ep, before),
        "clock_kept": clock_kept,
    }
    with torch.no_grad():
        torch.save([torch.as_tensor(made.run(x)) for x in inputs], spec["out"])
    return report


def fill(spec: dict[str, Any]) -> dict[str, Any]:
    """Fill the template cache: every consumer's epass paths convert the program once,
    nothing is built; returns what failed (the measurements report it). The program
    is always loaded: a template depends on the ops and their inputs, not on whether
    the program was exported in this process."""
    failed = {}
    for consumer, path in spec["fill"]:
        try:
            ep, inputs = prepare(consumer, spec | {"fresh": False})
            _take(consumer, path, ep, inputs[0], False)
        except Exception as exc:
            failed[f"{consumer} {path}"] = failure(exc)
    return failed


def failure(exc: BaseException) -> str:
    """The exception's type and first line, skipping the location lines OpenVINO
    stacks before its message (``Exception from src/...:117:``)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    said = next((line for line in lines if not line.endswith(":")), lines[0] if lines else "")
    return f"{type(exc).__name__}: {said}"[:160]


def child(text: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    spec = json.loads(text)
    try:
        report = fill(spec) if spec.get("fill") else measure(spec)
    except Exception as exc:
        report = {"error": failure(exc)}
    print(MARK + json.dumps(report), flush=True)


def _spawn(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        done = subprocess.run(
            argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])  # type: ignore[no-any-return]
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {done.returncode}: {tail}"[:160]}


# --- the run (parent) ----------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """One exported program: the model, static or dynamic, and its files."""

    model: str
    dynamic: bool
    size: Size
    files: tuple[Path, Path]  # the .pt2 file and the inputs' file

    @property
    def shape(self) -> str:
        return "dynamic" if self.dynamic else "static"

    def spec(self, fresh: bool) -> dict[str, Any]:
        """What a child needs to find the program (or export it afresh)."""
        return {
            "program": str(self.files[0]),
            "inputs": str(self.files[1]),
            "fresh": fresh,
            "model": self.model,
            "dynamic": self.dynamic,
            "size": vars(self.size),
        }


@dataclass
class Cell:
    """One consumer on one program: every path's runs, in the order they ran."""

    consumer: str
    program: Program
    runs: dict[str, list[dict[str, Any]]]
    outputs: dict[str, Path]


def run_cell(
    consumer: str, program: Program, repeats: int, env: dict[str, str], fresh: bool
) -> Cell:
    """Alternate the paths, one fresh process each, the order reversed every other
    round. A path that failed is not run again, nor is any once the plain path or
    every epass path failed (no ratio is left to measure)."""
    paths = PATHS[consumer]
    stem = program.files[0].with_suffix("")
    outputs = {path: Path(f"{stem}.{consumer}.{path}.out.pt") for path in paths}
    runs: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    for turn in range(repeats):
        failed = {path for path in paths if runs[path] and "error" in runs[path][-1]}
        if "plain" in failed or failed.issuperset(paths[1:]):
            break
        for path in paths if turn % 2 == 0 else paths[::-1]:
            if path in failed:
                continue
            spec = program.spec(fresh) | {
                "consumer": consumer,
                "path": path,
                "out": str(outputs[path]),
            }
            runs[path].append(_spawn(spec, env))
    return Cell(consumer, program, runs, outputs)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def max_abs_diff(a: Path, b: Path) -> float | str:
    """The largest difference between two paths' outputs, over every input."""
    import torch

    worst = 0.0
    for x, y in zip(torch.load(a), torch.load(b), strict=True):
        if x.shape != y.shape:
            return f"shapes {tuple(x.shape)} vs {tuple(y.shape)}"
        worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _served(counts: dict[str, int] | None) -> str:
    """``served/to torch``, and how many of the served were retraced (``r1``)."""
    if counts is None:
        return "-"
    served = counts["incremental"] + counts["no-op"] + counts["retrace"]
    retraced = f"(r{counts['retrace']})" if counts["retrace"] else ""
    return f"{served}/{counts['torch']}{retraced}"


def _share(runs: list[dict[str, Any]]) -> float | None:
    shares = [r["decomp"] / r["seconds"] for r in runs if "seconds" in r]
    return statistics.median(shares) if shares else None


def _ok(runs: list[dict[str, Any]]) -> str:
    return "yes" if all(r["dicts_ok"] for r in runs) else "NO"


def _failed(cell: Cell, path: str) -> str | None:
    """The row's failure: the plain path's, else the epass path's."""
    plain, runs = cell.runs["plain"][-1], cell.runs[path][-1]
    if "error" in plain:
        also = "fails too" if "error" in runs else f"runs ({runs['seconds']:.2f} s)"
        return f"plain failed: {plain['error']} [{path} {also}]"
    if "error" in runs:
        return f"{path} failed: {runs['error']}"
    return None


def rows(cell: Cell) -> Iterator[dict[str, Any]]:
    """One row per epass path of the cell, beside the plain path."""
    plain = cell.runs["plain"]
    for path in PATHS[cell.consumer][1:]:
        runs = cell.runs[path]
        row: dict[str, Any] = {
            "consumer": cell.consumer,
            "model": cell.program.model,
            "shape": cell.program.shape,
            "path": path,
        }
        failed = _failed(cell, path)
        if failed:
            yield row | {"error": failed}
            continue
        a, b = _median(plain, "seconds"), _median(runs, "seconds")
        ca, cb = _median(plain, "convert"), _median(runs, "convert")
        assert a is not None and b is not None and ca is not None and cb is not None
        yield row | {
            "plain": a,
            "epass": b,
            "ratio": b / a,
            "convert": cb / ca,
            "share": (_share(plain), _share(runs)),
            "pipeline": _median(runs, "pipeline"),
            "served": _served(runs[-1]["counts"]),
            "reasons": runs[-1]["reasons"] or {},
            "diff": max_abs_diff(cell.outputs["plain"], cell.outputs[path]),
            "dicts": f"{_ok(plain)}/{_ok(runs)}",
            "clock": all(r["clock_kept"] for r in (*plain, *runs)),
        }


HEADER = (
    f"{'consumer':<10} {'model':<8} {'shape':<7} {'path':<7} {'plain s':>7} {'epass s':>7} "
    f"{'ratio':>5} {'convert':>7} {'decomp share':>12} {'lower s':>7} {'served/torch':>12} "
    f"{'max|diff|':>9} {'dicts':>7}"
)


def render(row: dict[str, Any]) -> str:
    head = f"{row['consumer']:<10} {row['model']:<8} {row['shape']:<7} {row['path']:<7}"
    if "error" in row:
        return f"{head} {row['error']}"
    share = "/".join("-" if s is None else f"{100 * s:.0f}%" for s in row["share"])
    pipeline = "-" if row["pipeline"] is None else f"{row['pipeline']:.2f}"
    diff = row["diff"] if isinstance(row["diff"], str) else f"{row['diff']:.1e}"
    return (
        f"{head} {row['plain']:>7.2f} {row['epass']:>7.2f} {row['ratio']:>5.2f} "
        f"{row['convert']:>7.2f} {share:>12} {pipeline:>7} {row['served']:>12} "
        f"{diff:>9} {row['dicts']:>7}"
    )


def print_table(table: list[dict[str, Any]]) -> None:
    print(HEADER)
    print("-" * len(HEADER))
    for row in table:
        print(render(row))
    for row in table:
        for why, n in row.get("reasons", {}).items():
            print(f"  {row['consumer']} {row['model']} {row['shape']} {row['path']}: {n}x {why}")
    if not all(row.get("clock", True) for row in table):
        print("  the switch did not put the timing wrapper back: the shares are not reliable")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, help="fresh processes per path (default 3)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--consumers", default=",".join(NEEDS))
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--static", action="store_true", help="static programs only")
    shapes.add_argument("--dynamic", action="store_true", help="dynamic programs only")
    parser.add_argument(
        "--layers", type=int, default=4, help="GPT-2 and Llama layers, hidden 256 (default 4)"
    )
    parser.add_argument(
        "--fresh-export",
        action="store_true",
        help="each process exports the model itself instead of loading the .pt2 file",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1-layer decoders of hidden 64, 1 repeat"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def _installed(consumers: list[str]) -> list[str]:
    ready = []
    for consumer in consumers:
        missing = [m for m in NEEDS[consumer] if importlib.util.find_spec(m) is None]
        if missing:
            print(f"skipped {consumer}: {', '.join(missing)} not installed", flush=True)
        else:
            ready.append(consumer)
    return ready


def _environment(folder: Path) -> dict[str, str]:
    """The children's: this checkout's epass, and a template cache of this run's own."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "EPASS_CACHE_DIR": str(folder / "cache"), "PYTHONPATH": path}


def _fill(program: Program, consumers: list[str], env: dict[str, str], fresh: bool) -> None:
    """One untimed process converts the program along every epass path of every
    consumer, filling the template cache for the measured ones."""
    done = [[c, path] for c in consumers for path in PATHS[c] if path != "plain"]
    _spawn(program.spec(fresh) | {"fill": done}, env)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print its table, and return the table's rows."""
    options = _parser().parse_args(argv)
    if options.child:
        child(options.child)
        return []
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    size = Size(1, 64, 128) if options.quick else Size(options.layers, 256, 512)
    repeats = options.repeats or (1 if options.quick else 3)
    dynamics = [False] if options.static else [True] if options.dynamic else [False, True]
    consumers = _installed(options.consumers.split(","))
    print(f"decoders: {size.layers} layers, hidden {size.hidden}; repeats: {repeats}", flush=True)
    table: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="epass-bench-handoff-") as folder:
        env = _environment(Path(folder))
        for model in options.models.split(","):
            for dynamic in dynamics:
                files = export_program(model, dynamic, size, Path(folder))
                program = Program(model, dynamic, size, files)
                _fill(program, consumers, env, options.fresh_export)
                for consumer in consumers:
                    began = time.perf_counter()
                    cell = run_cell(consumer, program, repeats, env, options.fresh_export)
                    table.extend(rows(cell))
                    took = time.perf_counter() - began
                    print(f"  {consumer} on {model} {program.shape}: {took:.0f} s", flush=True)
        print_table(table)
    return table


if __name__ == "__main__":
    began = time.perf_counter()
    main()
    print(f"({time.perf_counter() - began:.0f} s)")

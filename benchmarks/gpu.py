"""GPU programs, on a machine with a GPU: the GPU tests (``tests/test_gpu.py``, marked
``gpu``) and a coverage corpus of torchvision, timm and transformers programs with CUDA
tensors, one line per program and one summary line at the end.

Run from the repository root::

    python benchmarks/gpu.py                           # on a GPU machine, under 10 minutes
    python benchmarks/gpu.py --device cpu --quick      # a dry run anywhere (about 2 minutes)

For each program (random weights, nothing downloaded): ``torch.export.export``, then
``ep.run_decompositions()`` (torch's program), ``Decompose()`` (auto, then warm) and
``Decompose(check=True)`` (raises where the incremental path's program is not
torch's), each timed; whether the output is torch's graph, the method each run took,
the largest absolute difference of its outputs from torch's program and from eager,
whether every output shares the user's ``state_dict`` and whether the user's program
is unchanged. The tests run beside the corpus in a process of their own. The corpus
is spread over worker processes; a program that fails, hangs past ``--timeout`` or
kills its worker is recorded as such, and the run goes on. Programs not started
when ``--budget`` runs out are listed as not run. Results go to ``--out`` as JSON
(default ``$OUT/gpu.json`` where ``OUT`` is set), the tests' log beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# One program: (label, source, name, dynamic, dtype); plain data, sent to a worker.
Spec = tuple[str, str, str, bool, str]

# The torchvision architectures first, then transformers decoders and encoders,
# each static and with a dynamic sequence, then the rest of tests/vision_models.py.
VISION_FIRST = [
    "tv_resnet18",
    "tv_mobilenet_v3_small",
    "tv_efficientnet_b0",
    "tv_vit_b_16",
    "tv_convnext_tiny",
    "tv_swin_t",
]
TRANSFORMERS = ["bert", "gpt2", "llama", "qwen2"]


def _vit() -> torch.nn.Module:
    import vision_models

    tv = vision_models.torchvision()
    return tv.models.get_model("vit_b_16", weights=None, image_size=64)  # type: ignore[no-any-return]


def _qwen2() -> torch.nn.Module:
    import hf_models
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=hf_models.VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return hf_models.HFWrapper(transformers.Qwen2ForCausalLM(config), "logits")


# Architectures the test corpora do not hold, built the same way.
EXTRA: dict[str, Callable[[], torch.nn.Module]] = {"tv_vit_b_16": _vit, "qwen2": _qwen2}


def corpus(quick: bool) -> list[Spec]:
    """The programs, in the order they are started."""
    import vision_models

    def vision(name: str, dynamic: bool = False) -> Spec:
        return (vision_models.label(name, dynamic), "vision", name, dynamic, "float32")

    def text(name: str, dynamic: bool, dtype: str = "float32") -> Spec:
        label = f"{name}-{'dynamic' if dynamic else 'static'}"
        return (label if dtype == "float32" else f"{label}-{dtype}", "hf", name, dynamic, dtype)

    has = {lib: importlib.util.find_spec(lib) is not None for lib in ("transformers", "timm")}
    if quick:
        specs = [vision("tv_resnet18"), vision("tv_mobilenet_v3_small")]
        return specs + ([text("bert", False), text("llama", True)] if has["transformers"] else [])
    specs = [vision(n) for n in VISION_FIRST]
    if has["transformers"]:
        specs += [text(n, d) for n in TRANSFORMERS for d in (False, True)]
        specs.append(text("llama", False, "bfloat16"))
    specs += [vision("tv_resnet18", True), vision("tv_mobilenet_v3_small", True)]
    specs += [
        vision(n)
        for n, case in vision_models.CORPUS.items()
        if n not in VISION_FIRST and not case.warm and vision_models.available(n)
    ]
    return specs


# ---------------------------------------------------------------------------------
# One program, in a worker


def _model(spec: Spec, device: str) -> tuple[torch.nn.Module, tuple[Any, ...], Any]:
    """The eager module on the device, its inputs and its dynamic shapes."""
    import hf_models
    import vision_models

    _, source, name, dynamic, dtype = spec
    torch.manual_seed(0)
    if source == "vision":
        module = EXTRA[name]().eval() if name in EXTRA else vision_models.build(name)
        args: tuple[Any, ...] = (torch.randn(vision_models.BATCH, 3, 64, 64),)
        if name in vision_models.CORPUS:
            args = vision_models.inputs(name)
        shapes = ({0: vision_models.BATCH_DIM},) if dynamic else None
    else:
        module = EXTRA[name]().eval() if name in EXTRA else hf_models.build(name)
        case = hf_models.ZOO["llama" if name in EXTRA else name]
        args = case.inputs()
        shapes = case.dynamic() if dynamic and case.dynamic is not None else None
    kind = getattr(torch, dtype)
    args = tuple(a.to(device, kind) if a.is_floating_point() else a.to(device) for a in args)
    return module.to(device, kind), args, shapes


def _leaves(value: Any) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _max_diff(got: Any, want: Any) -> float:
    a, b = _leaves(got), _leaves(want)
    if len(a) != len(b):
        return math.inf
    diffs = [
        (x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True) if x.numel()
    ]
    return max(diffs, default=0.0)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    began = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:400]


def _decompose_runs(ep: Any, ref: Any, row: dict[str, Any]) -> Any:
    """Decompose() (auto), Decompose(check=True) and a warm Decompose() on ``ep``,
    each compared with torch's program ``ref``; returns the last output taken."""
    from epass import Decompose, PassManager
    from epass._decomp.check import first_difference

    auto, row["decompose_s"] = _timed(lambda: PassManager([Decompose()])(ep))
    notes = auto.records[0].notes
    row["method"], row["fallback"] = notes.get("method"), notes.get("fallback")
    outputs = [auto.program]
    try:
        checked, row["check_s"] = _timed(lambda: PassManager([Decompose(check=True)])(ep))
        row["check"] = "ok"
        row["method_check"] = checked.records[0].notes.get("method")
        row["fallback_check"] = checked.records[0].notes.get("fallback")
        outputs.append(checked.program)
    except Exception as exc:
        row["check"] = _error(exc)
    warm, row["decompose_warm_s"] = _timed(lambda: PassManager([Decompose()])(ep))
    row["method_warm"] = warm.records[0].notes.get("method")
    outputs.append(warm.program)
    differences = [first_difference(out, ref) for out in outputs]
    row["torch_graph"] = all(d is None for d in differences)
    row["difference"] = next((d for d in differences if d is not None), None)
    row["shared"] = all(out.state_dict is ep.state_dict for out in outputs)
    return outputs[-1]


def measure(spec: Spec, device: str) -> dict[str, Any]:
    """Everything the corpus records for one program; failures are recorded, not raised."""
    from fingerprint import fingerprint

    label, source, name, dynamic, dtype = spec
    row: dict[str, Any] = {"label": label, "source": source, "name": name}
    row.update(dynamic=dynamic, dtype=dtype, status="error", stage="build")
    began = time.perf_counter()
    try:
        module, args, shapes = _model(spec, device)
        with torch.no_grad():
            expected = module(*args)
        row["stage"] = "export"
        ep, row["export_s"] = _timed(
            lambda: torch.export.export(module, args, dynamic_shapes=shapes)
        )
        before = fingerprint(ep)
        row["stage"] = "torch"
        ref, row["torch_s"] = _timed(ep.run_decompositions)
        row["stage"] = "epass"
        out = _decompose_runs(ep, ref, row)
        row["stage"] = "numerics"
        with torch.no_grad():
            got = out.module()(*args)
            row["diff_torch"] = _max_diff(got, ref.module()(*args))
            row["diff_eager"] = _max_diff(got, expected)
        row["unchanged"] = fingerprint(ep) == before
        row["status"], row["stage"] = "ok", None
    except Exception as exc:
        row["error"] = _error(exc)
        row["traceback"] = traceback.format_exc()[-3000:]
    row["seconds"] = time.perf_counter() - began
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def worker(conn: Any, device: str, threads: int) -> None:
    """A worker process: measures each program it is sent until it is sent None."""
    import vision_models

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_num_threads(threads)
    vision_models.make_torchvision_importable()
    conn.send(("ready", None))
    while True:
        spec = conn.recv()
        if spec is None:
            return
        conn.send(("done", measure(tuple(spec), device)))


# ---------------------------------------------------------------------------------
# The pool: one pipe a worker, so that a worker killed for its time takes nothing
# of the others with it


class Pool:
    def __init__(self, size: int, device: str, threads: int) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.device, self.threads = device, threads
        self.slots: list[dict[str, Any]] = [self._start() for _ in range(size)]
        self.failed_starts = 0  # workers that died before they were ready

    def _start(self) -> dict[str, Any]:
        parent, child = self.context.Pipe()
        process = self.context.Process(
            target=worker, args=(child, self.device, self.threads), daemon=True
        )
        process.start()
        child.close()
        return {"process": process, "conn": parent, "spec": None, "since": 0.0, "ready": False}

    def replace(self, slot: dict[str, Any]) -> None:
        slot["process"].kill()
        slot["process"].join(5)
        slot.update(self._start())

    def close(self) -> None:
        """Idle workers are told to end; a busy one (out of time) is killed."""
        for slot in self.slots:
            if slot["spec"] is None and slot["process"].is_alive():
                with contextlib.suppress(OSError):
                    slot["conn"].send(None)
        for slot in self.slots:
            slot["process"].join(10)
            if slot["process"].is_alive():
                slot["process"].kill()
                slot["process"].join(5)


def _failed(spec: Spec, status: str, error: str) -> dict[str, Any]:
    label, source, name, dynamic, dtype = spec
    row = {"label": label, "source": source, "name": name, "dynamic": dynamic}
    return row | {"dtype": dtype, "status": status, "error": error}


def _receive(pool: Pool, slot: dict[str, Any]) -> dict[str, Any] | None:
    """What ``slot``'s worker sent: a result, or None (it said it is ready)."""
    try:
        kind, row = slot["conn"].recv()
    except (EOFError, OSError):
        code = slot["process"].exitcode
        spec = slot["spec"]
        pool.replace(slot)
        if spec is None:
            pool.failed_starts += 1
            return None
        return _failed(spec, "died", f"the worker process died (exit code {code})")
    if kind == "ready":
        slot["ready"] = True
        return None
    slot["spec"] = None
    return row  # type: ignore[no-any-return]


def run_corpus(
    specs: list[Spec], args: argparse.Namespace, deadline: float, report: Callable[..., None]
) -> list[dict[str, Any]]:
    """Measure every program over the pool; ``report`` is called with each result."""
    pending = deque(specs)
    rows: list[dict[str, Any]] = []
    pool = Pool(min(args.workers, max(len(specs), 1)), args.device, args.threads)
    try:
        while pending or any(s["spec"] is not None for s in pool.slots):
            now = time.monotonic()
            for slot in pool.slots:
                if slot["ready"] and slot["spec"] is None and pending and now < deadline:
                    slot["spec"], slot["since"] = pending.popleft(), now
                    slot["conn"].send(slot["spec"])
            busy = any(s["spec"] is not None for s in pool.slots)
            if not busy and (now >= deadline or pool.failed_starts > 2 * len(pool.slots)):
                break
            conns = [s["conn"] for s in pool.slots]
            for conn in multiprocessing.connection.wait(conns, timeout=1.0):
                slot = next(s for s in pool.slots if s["conn"] is conn)
                row = _receive(pool, slot)
                if row is not None:
                    rows.append(row)
                    report(row)
            now = time.monotonic()
            for slot in pool.slots:
                spec = slot["spec"]
                if spec is not None and (now - slot["since"] > args.timeout or now >= deadline):
                    why = "out of time" if now >= deadline else f"over {args.timeout:.0f} s"
                    pool.replace(slot)
                    rows.append(_failed(spec, "timeout", f"stopped: {why}"))
                    report(rows[-1])
    finally:
        pool.close()
    rows += [_failed(spec, "not run", "not started: out of time") for spec in pending]
    return rows


# ---------------------------------------------------------------------------------
# The GPU tests, in a process of their own beside the corpus


def start_tests(args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``pytest -m gpu tests/test_gpu.py``, its log and JUnit report in ``folder``."""
    report = folder / "gpu-tests.xml"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q"]
    command += ["-p", "no:cacheprovider", "-p", "no:benchmark", f"--junitxml={report}"]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(args.test_workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", "300"]  # a test that hangs fails alone
    if args.quick:
        command += ["-k", "mlp or template"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["EPASS_TEST_DEVICE"] = "cpu"  # the same tests on the CPU (a dry run)
    log = open(folder / "gpu-tests.log", "wb")  # noqa: SIM115 (the process holds it)
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return process, report


def finish_tests(process: subprocess.Popen[bytes], report: Path, deadline: float) -> dict[str, Any]:
    """Wait for the tests until ``deadline``; their counts and the failed tests."""
    try:
        code = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return {"status": "timeout", "exit_code": None}
    result: dict[str, Any] = {"status": "ran", "exit_code": code, "failed_tests": []}
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError) as exc:
        return result | {"status": f"no report ({_error(exc)})"}
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            message = " ".join((bad.get("message") or "").split())[:300]
            result["failed_tests"].append(f"{case.get('name')}: {message}")
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    return result | {"passed": passed, "failed": failed, "skipped": counts["skipped"]}


# ---------------------------------------------------------------------------------
# Lines


def _seconds(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.1f}s" if isinstance(row.get(key), float) else "-"


def line(row: dict[str, Any]) -> str:
    """One program's line."""
    if row["status"] != "ok":
        where = f"at {row['stage']}: " if row.get("stage") else ""
        return f"  {row['status'].upper():8} {row['label']:32} {where}{row['error']}"
    graph = "torch's graph" if row["torch_graph"] else f"NOT torch's graph ({row['difference']})"
    check = "check ok" if row["check"] == "ok" else f"check raised ({row['check']})"
    methods = f"{row['method']}/{row.get('method_check', '-')}/{row['method_warm']}"
    return (
        f"  {'ok':8} {row['label']:32} {methods:30} {graph}, {check}, "
        f"{'shares' if row['shared'] else 'DOES NOT share'} state_dict, "
        f"{'unchanged' if row['unchanged'] else 'USER PROGRAM CHANGED'}, "
        f"diff {row['diff_torch']:.3g} vs torch / {row['diff_eager']:.3g} vs eager; "
        f"export {_seconds(row, 'export_s')} run_decompositions {_seconds(row, 'torch_s')} "
        f"Decompose {_seconds(row, 'decompose_s')} warm {_seconds(row, 'decompose_warm_s')}"
    )


def _tests_text(tests: dict[str, Any]) -> str:
    if "passed" not in tests:
        return f"gpu tests {tests['status']}"
    text = f"gpu tests {tests['passed']} passed"
    text += f", {tests['failed']} failed" if tests["failed"] else ""
    return text + (f", {tests['skipped']} skipped" if tests["skipped"] else "")


def summary(device: str, tests: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The one line the run ends with."""
    ok = [r for r in rows if r["status"] == "ok"]
    n = len(ok)
    count = {
        "graph": sum(r["torch_graph"] for r in ok),
        "incremental": sum(r.get("method_check") == "incremental" for r in ok),
        "auto": sum(r["method"] == "incremental" for r in ok),
        "check": sum(r["check"] == "ok" for r in ok),
        "shared": sum(r["shared"] for r in ok),
        "unchanged": sum(r["unchanged"] for r in ok),
    }
    diff_torch = max((r["diff_torch"] for r in ok), default=0.0)
    diff_eager = max((r["diff_eager"] for r in ok), default=0.0)
    others = {}
    for r in rows:
        if r["status"] != "ok":
            stage = r.get("stage")
            kind = {"build": "not built", "export": "torch failed", "torch": "torch failed"}.get(
                stage or "", r["status"] if r["status"] != "error" else f"failed at {stage}"
            )
            others[kind] = others.get(kind, 0) + 1
    rest = "".join(f", {v} {k}" for k, v in others.items())
    return (
        f"epass gpu: torch {torch.__version__}, {device}: {_tests_text(tests)}; "
        f"corpus {count['graph']}/{n} torch's graph, {count['incremental']} incremental "
        f"({count['auto']} on auto's first run), check mode raised on {n - count['check']}, "
        f"{count['shared']} share state_dict, {count['unchanged']} unchanged, "
        f"max abs diff {diff_torch:.3g} vs torch's program, {diff_eager:.3g} vs eager{rest}"
    )


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, for a dry run")
    parser.add_argument("--quick", action="store_true", help="four programs and a few tests")
    parser.add_argument("--workers", type=int, default=8, help="corpus worker processes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a worker")
    parser.add_argument("--test-workers", type=int, default=4, help="pytest-xdist workers")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a program")
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for the run")
    parser.add_argument("--no-tests", action="store_true", help="the corpus only")
    parser.add_argument("--only", default=None, help="programs whose label holds this text")
    parser.add_argument("--out", default=None, help="results JSON ($OUT/gpu.json)")
    return parser.parse_args()


def _out_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return Path(args.out)
    return Path(os.environ.get("OUT") or tempfile.gettempdir()) / "gpu.json"


def main() -> None:
    args = parse()
    began = time.monotonic()
    deadline = began + args.budget
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu.py: torch.cuda.is_available() is False here; --device cpu for a dry run")
    out = _out_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The corpus's own template cache, empty: the workers share it, as processes do.
    os.environ["EPASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="epass-gpu-cache-")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    name = device_name(args.device)
    print(f"epass gpu: torch {torch.__version__} on {name}", flush=True)
    tests = None if args.no_tests else start_tests(args, out.parent)
    specs = [s for s in corpus(args.quick) if args.only is None or args.only in s[0]]
    print(f"corpus: {len(specs)} programs over {args.workers} workers", flush=True)
    print("  methods: Decompose() first run / Decompose(check=True) / warm run", flush=True)

    def report(row: dict[str, Any]) -> None:
        print(line(row), flush=True)

    rows = run_corpus(specs, args, deadline - 20.0, report)
    for row in rows:
        if row["status"] == "not run":
            report(row)
    tested: dict[str, Any] = {"status": "not run"}
    if tests is not None:
        tested = finish_tests(*tests, deadline)
        for failed in tested.get("failed_tests", []):
            print(f"  FAILED test {failed}", flush=True)
    text = summary(name, tested, rows)
    results = {
        "summary": text,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device": name,
        "seconds": round(time.monotonic() - began, 1),
        "tests": tested,
        "programs": rows,
    }
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {out}", flush=True)
    print(text, flush=True)


if __name__ == "__main__":
    main()

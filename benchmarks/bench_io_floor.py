"""``epass run model.pt2 -p lower -o out.pt2`` against the I/O floor: a script that
only does ``torch.export.load`` and ``torch.export.save`` on the same file.

The checkpoint is Llama-shaped (12 layers, hidden 1024, intermediate 2816, 16 heads,
4 key-value heads, vocabulary 32000: 768 MiB of random fp32 weights), saved with
``torch.export.save``. Each command runs in a fresh process, alternating (ABBA...),
with the file in the page cache and the template cache filled by one earlier,
untimed ``epass run``, as for a user who lowers more than once; each writes over its
output of the round before. The figures are medians of wall time and of peak memory
(the child's ``ru_maxrss``); system time is shown beside them. One more process of
each times its phases (``docs/io.md`` quotes them).

Run from the repository root: ``python benchmarks/bench_io_floor.py [--repeats N]
[--layers N] [--hidden N]`` (needs transformers; about 3 minutes on 2 cores).
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
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_core import Row, print_table  # noqa: E402

_MAKE = """
import sys
sys.path[:0] = [{tests!r}]
import hf_models  # makes torchvision, which transformers imports, load
import torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=32000, hidden_size={hidden}, intermediate_size={intermediate},
    num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=4,
    max_position_embeddings=256, use_cache=False, attn_implementation="sdpa",
)
model = hf_models.HFWrapper(transformers.LlamaForCausalLM(config), "logits").eval()
ep = torch.export.export(model, (torch.zeros(1, 16, dtype=torch.long),))
torch.export.save(ep, {path!r})
"""

FLOOR = """\
import sys, torch
ep = torch.export.load(sys.argv[1])
torch.export.save(ep, sys.argv[2])
"""

# Each phase's wall time; the last, "exit", runs from the end of the work to the
# process's end as the parent sees it (interpreter teardown included).
_EPASS_PHASES = """\
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
print(json.dumps({a: b - t for (a, t), (_, b) in zip(marks, marks[1:])}), time.time())
"""

_FLOOR_PHASES = """\
import json, sys, time
marks = [("import", time.perf_counter())]
import torch
marks.append(("loading", time.perf_counter()))
ep = torch.export.load(sys.argv[1])
marks.append(("saving", time.perf_counter()))
torch.export.save(ep, sys.argv[2])
marks.append(("end", time.perf_counter()))
print(json.dumps({a: b - t for (a, t), (_, b) in zip(marks, marks[1:])}), time.time())
"""


def _child(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run one fresh process; its wall time, peak memory (MiB) and CPU times."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    ended = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    return {
        "wall": wall,
        "peak": usage.ru_maxrss / 1024,
        "sys": usage.ru_stime,
        "user": usage.ru_utime,
        "ended": ended,
        "out": out,  # type: ignore[dict-item]
    }


def _phases(script: str, src: Path, dst: Path, env: dict[str, str]) -> dict[str, float]:
    result = _child(["-c", script, str(src), str(dst)], env)
    line = str(result["out"]).strip().splitlines()[-1]
    text, finished = line.rsplit(" ", 1)
    phases: dict[str, float] = json.loads(text)
    phases["exit"] = result["ended"] - float(finished)
    return phases


def measure(repeats: int, layers: int, hidden: int) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="epass-io-floor-") as tmp:
        work = Path(tmp)
        src = work / "llama.pt2"
        make = _MAKE.format(
            tests=str(ROOT / "tests"),
            hidden=hidden,
            intermediate=hidden * 11 // 4,
            layers=layers,
            path=str(src),
        )
        subprocess.run([sys.executable, "-c", make], check=True, cwd=ROOT, capture_output=True)
        mib = src.stat().st_size / 2**20
        (work / "floor.py").write_text(FLOOR)
        env = {**os.environ, "EPASS_CACHE_DIR": str(work / "cache"), "EPASS_PLAIN": "1"}
        commands = {
            "floor": [str(work / "floor.py"), str(src), str(work / "floor.pt2")],
            "epass": ["-m", "epass", "run", str(src), "-p", "lower", "-o", str(work / "out.pt2")],
        }
        for argv in commands.values():  # the template cache, the page cache, both outputs
            _child(argv, env)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in commands}
        for round_ in range(repeats):
            order = list(commands) if round_ % 2 == 0 else list(commands)[::-1]
            for key in order:
                runs[key].append(_child(commands[key], env))
        phases = {
            "epass": _phases(_EPASS_PHASES, src, work / "out.pt2", env),
            "floor": _phases(_FLOOR_PHASES, src, work / "floor.pt2", env),
        }

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    wall = {k: median(k, "wall") for k in runs}
    peak = {k: median(k, "peak") for k in runs}
    cpu = {k: (median(k, "user"), median(k, "sys")) for k in runs}
    label = f"Llama-shaped, {layers} layers, hidden {hidden}, {mib:.0f} MiB"

    def phase_text(key: str) -> str:
        return ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases[key].items())

    return [
        (
            f"epass run -p lower -o / torch.export.load + save, {label} (wall)",
            wall["epass"] / wall["floor"],
            1.15,
            f"{wall['epass']:.2f} s / {wall['floor']:.2f} s; screened, filled template cache",
        ),
        (
            "  peak memory, the same runs",
            peak["epass"] / peak["floor"],
            1.05,
            f"{peak['epass']:.0f} MiB / {peak['floor']:.0f} MiB",
        ),
        (
            "  CPU time (user, system), the same runs",
            0.0,
            0.0,
            f"epass {cpu['epass'][0]:.2f} s, {cpu['epass'][1]:.2f} s; "
            f"floor {cpu['floor'][0]:.2f} s, {cpu['floor'][1]:.2f} s",
        ),
        (
            "  phases (s), one process each",
            0.0,
            0.0,
            f"epass: {phase_text('epass')}; floor: {phase_text('floor')}",
        ),
    ]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args(argv)
    rows = measure(args.repeats, args.layers, args.hidden)
    print(f"fresh processes, {args.repeats} rounds alternating, medians")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()

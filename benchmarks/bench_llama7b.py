"""A Llama-7B-shaped decoder (32 layers, hidden 4096, 32 heads, 8 key-value heads,
intermediate 11008, weights on the meta device), each step in a fresh process:
export, then one of ``run_decompositions()``, ``Decompose()`` and ``presets.lower()``,
timed by the wall clock, with a static and with a dynamic sequence length.

The template cache is a directory of this run's own, filled by one untimed process
first (as the first lowering of a model does for every later one).

Run from the repository root: ``python benchmarks/bench_llama7b.py [--layers N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_core import Row, print_table  # noqa: E402

STEPS = ("retrace", "decompose", "lower")


# Llama-2-70B's widths, for _export's ``shape``.
SHAPE_70B = {"hidden": 8192, "intermediate": 28672, "heads": 64, "kv_heads": 8}


def _export(  # type: ignore[no-untyped-def]
    layers: int,
    dynamic: bool,
    *,
    hidden: int = 4096,
    intermediate: int = 11008,
    heads: int = 32,
    kv_heads: int = 8,
):
    """The decoder with ``layers`` layers, exported on meta weights; the widths are
    Llama-7B's unless given (``SHAPE_70B``)."""
    import hf_models  # makes torchvision, which transformers imports, load
    import torch
    import transformers
    from torch.export import Dim

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = hf_models.HFWrapper(transformers.LlamaForCausalLM(config), "logits").eval()
        ids = torch.zeros(1, 64, dtype=torch.long)
    shapes = ({1: Dim("seq", min=2, max=1024)},) if dynamic else None
    return torch.export.export(model, (ids,), dynamic_shapes=shapes)


def child(step: str, dynamic: bool, layers: int) -> None:
    from epass import Decompose
    from epass.passes import presets

    began = time.perf_counter()
    ep = _export(layers, dynamic)
    exported = time.perf_counter()
    method = ""
    if step == "retrace":
        ep.run_decompositions()
    elif step == "decompose":
        method = Decompose()(ep).notes["method"]
    else:
        method = presets.lower()(ep).records[0].notes["method"]
    done = time.perf_counter()
    print(json.dumps({"export": exported - began, "step": done - exported, "method": method}))


def _run(step: str, dynamic: bool, layers: int, env: dict[str, str]) -> dict[str, float | str]:
    argv = [sys.executable, __file__, "--child", step, str(int(dynamic)), "--layers", str(layers)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], bool(int(args.child[1])), args.layers)
        return
    env = {**os.environ, "EPASS_CACHE_DIR": tempfile.mkdtemp(prefix="epass-bench-cache-")}
    rows: list[Row] = []
    for dynamic in (False, True):
        kind = "dynamic sequence" if dynamic else "static"
        _run("decompose", dynamic, args.layers, env)  # fills the template cache
        times = {step: _run(step, dynamic, args.layers, env) for step in STEPS}
        retrace, fast, lower = (float(times[s]["step"]) for s in STEPS)
        label = f"Llama-7B-shaped, {args.layers} layers, {kind}"
        rows.append(
            (f"{label}: presets.lower() wall (s)", lower, 10.0,
             f"lower() {lower:.1f} s, its Decompose {times['lower']['method']}; "
             f"export {float(times['lower']['export']):.1f} s, not counted")
        )  # fmt: skip
        rows.append(
            (f"{label}: Decompose / run_decompositions", fast / retrace, 0.1,
             f"{retrace / fast:.1f}x faster: {fast:.1f} s vs {retrace:.1f} s (>= 10x), "
             f"{times['decompose']['method']}")
        )  # fmt: skip
    print("each step in a fresh process, wall clock")
    print_table(rows)


if __name__ == "__main__":
    main()

"""``epass inspect``: describe a .pt2 file (ops, state, signature, inputs), as tables
or JSON; the description itself is :func:`epass.io.inspect`."""

from __future__ import annotations

import argparse
from typing import Any

from epass import _paths
from epass._terminal import Out, inputs_table
from epass._text import json_text
from epass.cli._shared import add_load_arguments, spinner

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``inspect`` to the subcommands ``sub``; returns its parser."""
    parser: argparse.ArgumentParser = sub.add_parser("inspect", help="describe a .pt2 file")
    parser.add_argument("input")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--all-ops", action="store_true", help="show every op and input")
    add_load_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def run(args: argparse.Namespace, out: Out) -> int:
    """Load (screened unless ``--trust``), then print the description."""
    _paths.check_input_path(args.input)  # before torch
    from epass import io

    with spinner(args) as progress:
        ep = io.load(args.input, trust=args.trust, imports=args.imports, progress=progress)
    info = io.inspect(ep)
    if args.json:
        print(json_text(info))
        return 0
    out.line(f"{args.input}: dialect {info['dialect']}, {info['nodes']} nodes")
    _ops(out, info["ops"], args.all_ops)
    _state(out, info["state"])
    _signature(out, info["signature"])
    inputs_table(out, info["signature"], args.all_ops)
    return 0


def _ops(out: Out, histogram: dict[str, int], everything: bool) -> None:
    ops = list(histogram.items())
    shown = ops if everything else ops[:20]
    rows = [[op, str(n)] for op, n in shown]
    if len(ops) > len(shown):
        rows.append([f"... {len(ops) - len(shown)} more (--all-ops)", ""])
    out.line()
    out.table("op histogram", ["op", "count"], rows)


def _state(out: Out, state: dict[str, Any]) -> None:
    out.line()
    out.table(
        "state",
        ["kind", "entries", "bytes"],
        [
            [kind, str(state[kind]["count"]), _human(state[kind]["bytes"])]
            for kind in ("parameters", "buffers", "constants")
        ]
        + [
            [f"dtype {k}", str(v["entries"]), _human(v["bytes"])]
            for k, v in state["by_dtype"].items()
        ],
    )


def _signature(out: Out, sig: dict[str, Any]) -> None:
    out.line()
    out.line(f"inputs:  {', '.join(sig['user_inputs']) or '-'}")
    out.line(f"outputs: {', '.join(sig['user_outputs']) or '-'}")
    kinds = ", ".join(f"{k} {v}" for k, v in sig["input_kinds"].items())
    out.line(f"input specs:  {kinds}")
    kinds = ", ".join(f"{k} {v}" for k, v in sig["output_kinds"].items())
    out.line(f"output specs: {kinds}")
    if sig["buffers_mutated"]:
        out.line(f"mutated buffers: {', '.join(sorted(set(sig['buffers_mutated'].values())))}")

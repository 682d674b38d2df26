"""The ``epass`` command."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

__all__ = ["main"]


def _demo_program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return torch.export.export(model, (torch.randn(2, 5, 32),))


def _cmd_demo(args: argparse.Namespace) -> int:
    from epass.manager import PassManager
    from epass.passes import Decompose

    start = time.perf_counter()
    ep = _demo_program()
    print(f"exported a 2-layer TransformerEncoder in {time.perf_counter() - start:.2f}s")
    result = PassManager([Decompose()])(ep)
    print(result.summary())
    out = result.program
    print(f"state_dict shared: {out.state_dict is ep.state_dict}")
    print(f"constants shared:  {out.constants is ep.constants}")
    same = all(out.state_dict[k] is v for k, v in ep.state_dict.items())
    print(f"every tensor is the user's object: {same}")
    x = torch.randn(2, 5, 32)
    diff = (out.module()(x) - ep.module()(x)).abs().max().item()
    print(f"max abs difference against the exported program: {diff:.2e}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="export a small model, lower it, and show what happened")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

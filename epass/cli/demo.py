"""``epass demo``: export a small transformer, lower it, and show what happened (state
shared, outputs compared); optionally save the program and write a report."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from epass import _paths
from epass._terminal import Out, notices, pass_table
from epass.cli._shared import REPORT_SUFFIXES, spinner
from epass.errors import RegistryError

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["DEMO_FILE", "add_parser", "demo_program", "run"]

DEMO_FILE = "demo.pt2"  # where `epass demo --save` writes when given no name


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to the subcommands ``sub``; returns its parser."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "demo", help="export a small transformer, lower it, show what happened"
    )
    parser.add_argument("--report", help="write a report (.html or .json)")
    parser.add_argument(
        "--save",
        metavar="PATH",
        nargs="?",
        const=DEMO_FILE,
        help=f"write the exported program (.pt2) to PATH ({DEMO_FILE})",
    )
    parser.set_defaults(func=run)
    return parser


def demo_program() -> ExportedProgram:
    """The program the demo lowers: a 2-layer TransformerEncoder, exported."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return torch.export.export(model, (torch.randn(2, 5, 32),))


def _demo_pipeline() -> tuple[Any, str]:
    """The ``lower`` preset when it is installed, else ``decompose``."""
    from epass.manager import PassManager, create_pass

    try:
        create_pass("lower")
        return PassManager.from_text("lower"), "lower"
    except RegistryError:
        return PassManager.from_text("decompose"), "decompose"


def run(args: argparse.Namespace, out: Out) -> int:
    """export -> save (--save) -> lower -> show -> report (--report) -> what next."""
    if args.report:  # before torch
        _paths.check_output_path(args.report, REPORT_SUFFIXES)
    if args.save:
        _paths.check_output_path(args.save, (".pt2",))
    from epass import io
    from epass.report import PipelineRun, write_report

    start = time.perf_counter()
    ep = demo_program()
    out.line(f"exported a 2-layer TransformerEncoder in {time.perf_counter() - start:.2f}s")
    if args.save:
        with spinner(args) as progress:
            io.save(ep, args.save, progress=progress)
        out.line(f"wrote {args.save} (the exported program, before any pass)")
    pm, text = _demo_pipeline()
    if text != "lower":
        out.line("the 'lower' preset is not available here; running 'decompose'")
    out.line(f"pipeline: {text}")
    result = pm(ep)
    pass_table(out, result)
    notices(out, result.records)
    _show_sharing(out, ep, result.program)
    if args.report:
        write_report(args.report, PipelineRun(result, manager=pm, pipeline=text))
        out.line(f"wrote {args.report}")
    out.line()
    if args.save:
        out.line(f"next: epass run {args.save} -p lower -o lowered.pt2 --report report.html")
    else:
        then = f"epass run {DEMO_FILE} -p lower --report report.html"
        out.line(f"next: epass demo --save (writes {DEMO_FILE}), then {then}")
    return 0


def _show_sharing(out: Out, ep: ExportedProgram, prog: ExportedProgram) -> None:
    """Whether the lowered program holds the user's dicts and tensors, and how far its
    outputs are from the exported program's."""
    import torch

    out.line()
    out.line(f"state_dict shared: {prog.state_dict is ep.state_dict}")
    out.line(f"constants shared:  {prog.constants is ep.constants}")
    same = all(prog.state_dict[k] is v for k, v in ep.state_dict.items() if k in prog.state_dict)
    out.line(f"every tensor is the user's object: {same}")
    x = torch.randn(2, 5, 32)
    diff = (prog.module()(x) - ep.module()(x)).abs().max().item()
    out.line(f"max abs difference against the exported program: {diff:.2e}")

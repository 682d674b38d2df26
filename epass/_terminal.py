"""What the ``epass`` command prints through: terminal-safe text, and tables drawn
with rich or as plain text."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from epass._text import printable

__all__ = ["LEGEND", "Out", "inputs_table", "notices", "pass_table"]

# The line under every pass table.
LEGEND = (
    "ops: op calls added + removed; state: whose dicts the output holds (user's: yours; own: new)"
)


class Out:
    """Tables and progress with rich, or plain text when rich is missing or --plain.

    Every string is passed through :func:`printable`, and rich reads none as markup.
    """

    def __init__(self, plain: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.rich: Any = None
        if not plain and not os.environ.get("EPASS_PLAIN"):
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                terminal = self.stream.isatty()
                self.rich = Console(
                    file=self.stream,
                    width=None if terminal else 120,
                    highlight=False,
                    emoji=False,
                    soft_wrap=False,
                )

    def line(self, text: str = "") -> None:
        text = printable(text)
        if self.rich is not None:
            self.rich.print(text, markup=False)
        else:
            print(text, file=self.stream)

    def table(
        self, title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]]
    ) -> None:
        right = {"step", "seconds", "nodes", "count", "bytes", "entries", "ops"}
        rows = [[printable(cell) for cell in row] for row in rows]
        if self.rich is not None:
            from rich.table import Table
            from rich.text import Text

            table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
            for c in columns:
                table.add_column(c, justify="right" if c in right else "left", overflow="fold")
            for row in rows:
                table.add_row(*(Text(cell) for cell in row))  # Text: no markup
            self.rich.print(table)
            return
        if title:
            print(title, file=self.stream)
        widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

        def fmt(cells: Sequence[str]) -> str:
            return "  ".join(
                cell.rjust(w) if col in right else cell.ljust(w)
                for cell, w, col in zip(cells, widths, columns, strict=True)
            ).rstrip()

        print(fmt(columns), file=self.stream)
        print("  ".join("-" * w for w in widths), file=self.stream)
        for row in rows:
            print(fmt(row), file=self.stream)


def inputs_table(out: Out, sig: dict[str, Any], everything: bool) -> None:
    """Every user input, and the first state inputs (all with --all-ops): kind, shape
    with its symbolic dimensions, dtype; then the range of each symbol."""
    inputs = sig["inputs"]
    users = [i for i in inputs if i["kind"] == "user input"]
    others = [i for i in inputs if i["kind"] != "user input"]
    shown = [*users, *(others if everything else others[:20])]
    rows = []
    for i in shown:
        shape = "" if i["shape"] is None else f"({', '.join(map(str, i['shape']))})"
        bound = f" ({i['target']})" if i["target"] and i["target"] != i["name"] else ""
        rows.append([i["name"] + bound, i["kind"], shape, i["dtype"] or ""])
    if len(shown) < len(inputs):
        rows.append([f"... {len(inputs) - len(shown)} more (--all-ops)", "", "", ""])
    out.line()
    out.table("inputs", ["input", "kind", "shape", "dtype"], rows)
    if sig["dims"]:
        ranges = ", ".join(
            f"{s} in [{lo}, {'inf' if hi is None else hi}]" for s, (lo, hi) in sig["dims"].items()
        )
        out.line(f"symbolic dims: {ranges}")


def pass_table(out: Out, result: Any) -> None:
    """One row per pass run (nested passes indented), then the :data:`LEGEND`."""
    from epass.records import flatten, state_text

    rows = []
    for r in flatten(result.records):
        ops = sum(abs(v) for v in r.op_delta.values())
        rows.append(
            [
                "  " * r.depth + r.name,
                str(r.step),
                f"{r.seconds:.4f}",
                f"{r.nodes_before} -> {r.nodes_after}",
                str(ops) if ops else "",
                state_text(r.skipped, r.skip_reason, None if r.link is None else r.link.summary()),
            ]
        )
    out.table(None, ["pass", "step", "seconds", "nodes", "ops", "state"], rows)
    out.line(LEGEND)


def notices(out: Out, records: Sequence[Any]) -> None:
    """A run's notices, when it has any: the count (``1 of 3 passes fell back``), then
    one line ``<pass>: <text>`` each (:func:`epass.records.notice_lines`)."""
    from epass.records import notice_lines

    for line in notice_lines(records):
        out.line(line)

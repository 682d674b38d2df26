"""What the ``epass`` command prints through: terminal-safe text, and tables drawn
with rich or as plain text."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from epass._text import printable

__all__ = ["Out", "printable"]


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

"""What the ``epass`` command prints through: terminal-safe text, and tables drawn
with rich or as plain text."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["Out", "printable"]


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: every non-printable character escaped.

    Names in a .pt2 file are whatever its author wrote. ESC, BEL, CSI, OSC or C1
    sequences printed raw would set the window title, clear the screen or rewrite
    what was shown; a newline would forge an output line. Everything the command
    prints goes through here.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _ESCAPES.get(c) or _escape(ord(c)) for c in text)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


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

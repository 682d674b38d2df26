"""The one escaping rule for text a program brings into what epass shows or writes.

Node names, meta, error messages and file names hold whatever a file's author wrote.
ESC, BEL, CSI, OSC or C1 sequences shown raw would set a terminal's title, clear it
or rewrite what was shown; a newline would forge a line; U+202E would reverse text.
Every view (the terminal, the HTML and JSON reports, the reproducer) goes through
here, and so does a file path a report shows (:func:`shown_path`). Standard library
only.
"""

from __future__ import annotations

import html
import json
import os
import sys
from typing import Any

__all__ = [
    "escape_char",
    "html_text",
    "json_text",
    "printable",
    "printable_lines",
    "shown_path",
]

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_char(ch: str) -> str:
    """One character as an escape sequence: ``\\n``, ``\\x1b``, ``\\u202e``, ``\\U0001f600``."""
    named = _ESCAPES.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (newlines and tabs too):
    what ``str.isprintable()`` accepts is left as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else escape_char(c) for c in text)


def printable_lines(text: str) -> str:
    """:func:`printable` line by line: the line breaks stay, nothing else unprintable."""
    return "\n".join(printable(line) for line in text.split("\n"))


def json_text(value: Any, *, indent: int | None = 2) -> str:
    """``value`` as JSON holding exact strings and no raw control character: JSON's
    own escapes (``\\u001b``), for DEL too, which ``json.dumps`` leaves raw."""
    return json.dumps(value, indent=indent, ensure_ascii=True).replace("\x7f", "\\u007f")


def html_text(value: Any) -> str:
    """``value`` for an HTML page: every unprintable character escaped (:func:`printable`,
    as on the terminal), then HTML's own escaping, quotes included."""
    return html.escape(printable(str(value)), quote=True)


def shown_path(filename: str) -> str:
    """``filename`` as a report shows it: relative to the working folder or to the
    import-path entry it lies under (``torch/_ops.py``, ``epass/manager.py``,
    ``my_passes.py``), whichever is shorter, else its name alone; a report names
    no folder of the machine that wrote it, so it can be shared."""
    if not os.path.isabs(filename):
        return filename
    path = os.path.normpath(filename)
    best = os.path.basename(path)
    for root in {os.getcwd(), *(entry for entry in sys.path if os.path.isabs(entry))}:
        root = os.path.normpath(root)
        if path.startswith(root.rstrip(os.sep) + os.sep):
            relative = os.path.relpath(path, root)
            if best == os.path.basename(path) or len(relative) < len(best):
                best = relative
    return best.replace(os.sep, "/")

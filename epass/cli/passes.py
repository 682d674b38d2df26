"""``epass passes``: the registered passes, their sources, descriptions and options,
read from the registry's table without importing torch."""

from __future__ import annotations

import argparse
import re
from typing import Any

from epass._terminal import Out
from epass._text import json_text
from epass.registry import pass_table

__all__ = ["add_parser", "plain_text", "run"]

_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``passes`` to the subcommands ``sub``; returns its parser."""
    parser: argparse.ArgumentParser = sub.add_parser("passes", help="list registered passes")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)
    return parser


def plain_text(text: str) -> str:
    """A docstring line without reST markup: roles and double backquotes removed."""
    text = _ROLE.sub(
        lambda m: m.group(1).rsplit(".", 1)[-1] if "." in m.group(1) else m.group(1), text
    )
    return text.replace("``", "")


def run(args: argparse.Namespace, out: Out) -> int:
    entries = pass_table()
    if args.json:
        print(json_text(entries))
        return 0
    rows = []
    for e in entries:
        description = f"ERROR: {e['error']}" if e["error"] else plain_text(e["description"])
        options = ", ".join(
            o["name"] if o["required"] else f"{o['name']}={o['default']}" for o in e["options"]
        )
        rows.append([e["name"], e["source"], description, options])
    out.table(None, ["pass", "source", "description", "options"], rows)
    return 0

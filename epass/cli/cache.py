"""``epass cache``: the decomposition-template cache on disk, shown or emptied.

The disk cache (:mod:`epass._decomp.disk`) is stdlib-only at import: this command
starts without torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from epass._terminal import Out
from epass._text import json_text

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``cache`` to the subcommands ``sub``; returns its parser."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "cache", help="the decomposition-template cache on disk"
    )
    parser.add_argument("action", choices=("info", "clear"), help="show it, or empty it")
    parser.add_argument("--json", action="store_true", help="print JSON (info)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, out: Out) -> int:
    from epass._decomp import disk

    if args.action == "clear":
        removed, left = disk.clear()
        where = disk.directory()
        out.line(f"removed {removed} entries from {where}" if where else "the cache is off")
        if left:
            out.line(f"left {len(left)} that this cache did not write: {', '.join(left[:10])}")
        return 0
    info = disk.info()
    if args.json:
        print(json_text(info))
        return 0
    if not info["enabled"]:
        out.line(f"the template cache is off ({disk.DIR_ENV} is empty)")
        return 0
    mib = 1024 * 1024
    out.line(f"directory: {info['directory']}")
    out.line(f"entries: {info['entries']} ({info['bytes'] / mib:.1f} MiB)")
    out.line(f"limit: {info['max_bytes'] / mib:.1f} MiB ({disk.SIZE_ENV})")
    return 0

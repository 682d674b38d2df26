"""The built-in passes as the registry reads them before torch loads: each one's
``module:attribute``, its line in ``epass passes`` and the options it takes.

Generated, never edited: ``python -m epass.passes`` writes ``_catalog.json`` beside
this module from :data:`epass.passes.BUILTINS`, the one place a built-in is registered,
and from what each pass declares (its docstring and its options);
tests/test_layers.py fails while the file is stale. An option is ``(name, type,
default in pipeline text, required)``, the type being the option model's text
(``epass.options.OptionType.text``); the command line checks built-in options
against it before torch is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN_CATALOG", "BUILTIN_TARGETS", "FILE"]

FILE = Path(__file__).with_name("_catalog.json")

# Absent only until ``python -m epass.passes`` first writes it (it imports the registry).
_ENTRIES: dict[str, dict[str, Any]] = (
    json.loads(FILE.read_text(encoding="utf-8")) if FILE.is_file() else {}
)

BUILTIN_TARGETS: dict[str, str] = {name: entry["target"] for name, entry in _ENTRIES.items()}
"""Registry name -> ``module:attribute`` of each built-in."""

BUILTIN_CATALOG: dict[str, tuple[str, tuple[tuple[str, str, str | None, bool], ...]]] = {
    name: (
        entry["description"],
        tuple((o["name"], o["type"], o["default"], o["required"]) for o in entry["options"]),
    )
    for name, entry in _ENTRIES.items()
}
"""Registry name -> ``(description, options)`` of each built-in."""

"""``python -m epass.passes`` writes ``epass/_catalog.json``: what the registry reads of
each built-in before torch loads, taken from :data:`epass.passes.BUILTINS` and the passes.

Run it after adding a built-in or changing one's docstring or options;
tests/test_layers.py fails while the file is stale.
"""

from __future__ import annotations

import json

from epass import _catalog, registry
from epass.passes import BUILTINS

__all__ = ["catalog_text", "main"]


def catalog_text() -> str:
    """The text of ``epass/_catalog.json`` for the built-ins as they are now: one
    line a field, one line an option."""
    entries = []
    for name, factory in BUILTINS.items():
        target = f"{factory.__module__}:{factory.__qualname__}"
        options = [f"\n      {_json(o.as_dict())}" for o in registry.option_infos(factory)]
        end = "\n    ]" if options else "]"
        entries.append(
            f"  {_json(name)}: {{\n"
            f'    "target": {_json(target)},\n'
            f'    "description": {_json(registry.description_of(factory))},\n'
            f'    "options": [{",".join(options)}{end}\n'
            "  }"
        )
    return "{\n" + ",\n".join(entries) + "\n}\n"


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def main() -> None:
    """Write the catalog."""
    _catalog.FILE.write_text(catalog_text(), encoding="utf-8")
    print(f"wrote {_catalog.FILE}")


if __name__ == "__main__":
    main()

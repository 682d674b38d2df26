"""epass uses no torch internal it does not list: every private torch name in its
source is covered by ``_decomp.INTERNALS`` or ``_program.INTERNALS`` (which the tests
of those modules pin, and ``_torch.absent`` checks when something fails), and is
used in the core layer only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from epass import _decomp, _program, _torch

PACKAGE = Path(_program.__file__).resolve().parent
LISTED = (*_decomp.INTERNALS, *_program.INTERNALS)
# The rooms that may touch torch internals (ARCHITECTURE.md: the core layer).
CORE = ("_program.py", "_torch.py", "_decomp/")


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split(".")[1:])


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_torch_names(source: str) -> set[str]:
    """Every private torch name ``source`` reaches: imported from torch, or read as an
    attribute chain from ``torch`` or a name imported from it. Operators
    (``torch.ops.aten._to_copy``) are not internals."""
    tree = ast.parse(source)
    names: dict[str, str] = {}  # local name -> the torch path it stands for
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if _private(f"{node.module}.{alias.name}"):
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
    for node in ast.walk(tree):
        path = _dotted(node) if isinstance(node, (ast.Attribute, ast.Name)) else None
        if path is None:
            continue
        head, _, rest = path.partition(".")
        if head not in names:
            continue
        full = names[head] + (f".{rest}" if rest else "")
        if _private(full) and not full.startswith("torch.ops."):
            found.add(full)
    return found


def _covered(name: str) -> bool:
    # A listed internal, something read from one (a method of a listed dict), or a
    # module a listed internal lives in.
    return any(
        name == entry or name.startswith(f"{entry}.") or entry.startswith(f"{name}.")
        for entry in LISTED
    )


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_private_torch_name_is_listed_and_used_in_the_core(path):
    names = private_torch_names(path.read_text())
    relative = path.relative_to(PACKAGE).as_posix()
    if names:
        assert relative.startswith(CORE), f"{relative} uses torch internals {sorted(names)}"
    unlisted = sorted(name for name in names if not _covered(name))
    assert not unlisted, f"{relative} uses torch internals no INTERNALS lists: {unlisted}"


def test_the_scan_finds_what_it_must():
    # The scan is what makes the test above fail: it must see each way of reaching one.
    source = (
        "import torch\n"
        "from torch._export.utils import _is_cia_op\n"
        "from torch.export import exported_program as ep_module\n"
        "def f():\n"
        "    torch._C._get_tracing_state()\n"
        "    ep_module._secret(1)\n"
        "    torch.ops.aten._to_copy.default\n"
    )
    assert private_torch_names(source) == {
        "torch._export.utils._is_cia_op",
        "torch._C",
        "torch._C._get_tracing_state",
        "torch.export.exported_program._secret",
    }
    assert not _covered("torch._C._get_tracing_state")
    assert _covered("torch._export.utils._is_cia_op")


@pytest.mark.parametrize("path", _program.INTERNALS)
def test_every_internal_of_the_program_module_exists(path):
    assert _torch.absent([path]) is None

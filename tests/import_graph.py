"""The import graph of a package, read from its source without importing it.

Edges are every static import (module level, inside functions, under
``TYPE_CHECKING``) and every by-name load whose name is fixed in the source
(``importlib.import_module("pkg.x")``, ``__import__("pkg.x")``,
``pkgutil.resolve_name("pkg.x:Y")``). A by-name load whose name is not a literal is
allowed only at the call sites a test names, where the name is data (plugins, a
user's ``--import`` modules, built-ins by module path).

``tests/test_layers.py`` checks epass with it, and checks that it catches planted code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import attrs

# Calls that load a module by name: (module the function lives in, function name).
LOADERS = {
    ("importlib", "import_module"),
    ("builtins", "__import__"),
    ("pkgutil", "resolve_name"),
}


@attrs.frozen
class Edge:
    """``source`` imports ``target`` at ``line``; ``by_name`` for a by-name load."""

    source: str
    target: str
    line: int
    by_name: bool = False


@attrs.frozen
class Load:
    """A by-name load in ``module`` at ``line``, inside ``function`` (dotted path of
    the enclosing defs, "" at module level); ``name`` is its literal name, or None."""

    module: str
    function: str
    line: int
    name: str | None


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package rooted at ``root`` (a folder with ``__init__.py``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _literal(node: ast.expr) -> str | None:
    """A string fixed in the source: a constant, or an f-string / sum whose leading
    part is constant (``f"epass.{x}"`` is a load of some epass module)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value + "*"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _literal(node.left)
        return None if left is None else left.rstrip("*") + "*"
    return None


class _Walker(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.imports: list[tuple[str, int, tuple[str, ...]]] = []  # (module, line, names)
        self.loads: list[Load] = []
        self.scope: list[str] = []
        # local name -> (module, attribute) for names bound by imports
        self.aliases: dict[str, tuple[str, str | None]] = {"__import__": ("builtins", "__import__")}

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append((alias.name, node.lineno, ()))
            local = alias.asname or alias.name.split(".")[0]
            self.aliases[local] = (alias.name if alias.asname else local, None)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        self.imports.append((base, node.lineno, tuple(a.name for a in node.names)))
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = (base, alias.name)

    def _callee(self, func: ast.expr) -> tuple[str, str] | None:
        if isinstance(func, ast.Name) and func.id in self.aliases:
            module, attr = self.aliases[func.id]
            return (module, attr) if attr is not None else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            bound = self.aliases.get(func.value.id)
            if bound is not None and bound[1] is None:
                return bound[0], func.attr
        return None

    def visit_Call(self, node: ast.Call) -> None:
        callee = self._callee(node.func)
        if callee in LOADERS and node.args:
            self.loads.append(
                Load(self.module, ".".join(self.scope), node.lineno, _literal(node.args[0]))
            )
        self.generic_visit(node)


def _walk(module: str, path: Path) -> _Walker:
    walker = _Walker(module, path.name == "__init__.py")
    walker.visit(ast.parse(path.read_text(), str(path)))
    return walker


def by_name_loads(mods: Mapping[str, Path]) -> list[Load]:
    """Every by-name load in these modules."""
    return [load for name, path in mods.items() for load in _walk(name, path).loads]


def _resolve(name: str, known: Iterable[str]) -> str | None:
    """The module of ``known`` that a dotted name (or ``module:attr``) refers to:
    the longest known prefix."""
    name = name.split(":")[0].rstrip("*").rstrip(".")
    best = None
    for candidate in known:
        inside = name == candidate or name.startswith(candidate + ".")
        if inside and (best is None or len(candidate) > len(best)):
            best = candidate
    return best


def edges(mods: Mapping[str, Path]) -> list[Edge]:
    """Every import between modules of ``mods``, by-name loads of fixed names included."""
    out: list[Edge] = []
    known = set(mods)
    for name, path in mods.items():
        walker = _walk(name, path)
        for target, line, names in walker.imports:
            # ``from pkg import sub`` imports the submodule; other names, the package.
            hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            rest = [n for n in names if f"{target}.{n}" not in known]
            if rest or not names:
                resolved = _resolve(target, known)
                if resolved is not None:
                    hits.append(resolved)
            out += [Edge(name, hit, line) for hit in hits if hit != name]
        for load in walker.loads:
            if load.name is None:
                continue
            resolved = _resolve(load.name, known)
            if resolved is not None and resolved != name:
                out.append(Edge(name, resolved, load.line, by_name=True))
    return out


def cycles(graph: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for e in graph:
        succ.setdefault(e.source, set()).add(e.target)
        succ.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def layers(pyproject: Path, contract: str) -> list[list[str]]:
    """The layers of the named import-linter ``layers`` contract, top first, each a
    list of its (independent) sibling modules."""
    import tomllib  # Python 3.11+: the tests using it skip on 3.10

    config = tomllib.loads(pyproject.read_text())
    for c in config["tool"]["importlinter"]["contracts"]:
        if c["name"] == contract:
            return [[m.strip() for m in layer.split("|")] for layer in c["layers"]]
    raise KeyError(contract)


def layer_of(module: str, order: Sequence[Sequence[str]]) -> tuple[int, str] | None:
    """(layer index, sibling) holding ``module``, or None when it is in no layer."""
    for i, siblings in enumerate(order):
        for sibling in siblings:
            if module == sibling or module.startswith(sibling + "."):
                return i, sibling
    return None


def against_layers(
    graph: Iterable[Edge], order: Sequence[Sequence[str]], top: str
) -> Iterator[Edge]:
    """Imports that run up the layer order, or across to an independent sibling.
    ``top`` (the root package, which re-exports) sits above every layer."""
    for e in graph:
        if e.target == top:
            if e.source != top:
                yield e
            continue
        if e.source == top:
            continue
        src, dst = layer_of(e.source, order), layer_of(e.target, order)
        if src is None or dst is None:
            continue
        if dst[0] < src[0] or (dst[0] == src[0] and dst[1] != src[1]):
            yield e


def container_layers(pyproject: Path) -> dict[str, list[list[str]]]:
    """Each package that a ``layers`` contract orders from inside (its ``containers``),
    with the layers of its modules, top first."""
    import tomllib

    config = tomllib.loads(pyproject.read_text())
    out: dict[str, list[list[str]]] = {}
    for c in config["tool"]["importlinter"]["contracts"]:
        for container in c.get("containers", ()):
            out[container] = [[m.strip() for m in layer.split("|")] for layer in c["layers"]]
    return out


def unnamed_modules(root: Path, package: str, pyproject: Path, contract: str) -> list[str]:
    """Modules that no contract names: a module of the root package must be in a layer
    of ``contract``; a module inside a subpackage must be a layer of the contract whose
    container is that subpackage (a subpackage without one leaves its modules unnamed)."""
    top = {m for layer in layers(pyproject, contract) for m in layer}
    inside = container_layers(pyproject)
    problems = []
    for name in modules(root, package):
        parts = name.split(".")
        if len(parts) == 1:
            continue
        if len(parts) == 2 or name in top:
            if name not in top:
                problems.append(f"{name} is in no layer of {contract!r}")
            continue
        container, leaf = ".".join(parts[:-1]), parts[-1]
        named = {m for layer in inside.get(container, ()) for m in layer}
        if leaf not in named:
            problems.append(f"{name} is in no layer of a contract over {container}")
    return problems

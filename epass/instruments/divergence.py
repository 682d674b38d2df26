"""The first diverging node: run a program before and after a pass on the same inputs
and name the first node whose values part, with its source line and what it became."""

from __future__ import annotations

import operator
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _program
from epass.instruments.values import (
    NodeDrift,
    check_untouched,
    clone,
    compare_outputs,
    private_copy,
    state_versions,
    state_view,
)
from epass.manager import PassManager

__all__ = [
    "HANDLE",
    "NodeDrift",
    "first_divergence",
    "node_values",
    "rerun_tagged",
    "source_line",
    "tagged",
]

# The key under ``node.meta["custom"]`` that carries a node's debug handle (its
# name in the program before the pass). torch's retrace and epass's incremental
# decomposition copy ``custom`` onto every node a node becomes, and graph copies
# keep it, so the nodes of a pass's output say which node they came from.
HANDLE = "epass_node"
# At most this many of the nodes a node became are listed.
BECAME_CAP = 8


def _op_text(node: torch.fx.Node) -> str:
    target = node.target
    if node.op != "call_function":
        return str(node.op)
    name = str(target)
    return str(getattr(target, "__qualname__", name)) if name.startswith("<") else name


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<fn>.*)')


def _short(path: str) -> str:
    """A module's path from the folder on ``sys.path`` it was imported from
    (``torch/nn/modules/linear.py``), or from the working folder."""
    roots = [os.getcwd(), *(p for p in sys.path if p)]
    inside = [root for root in roots if path.startswith(root.rstrip(os.sep) + os.sep)]
    found = [os.path.relpath(path, root) for root in inside]
    return min(found, key=len) if found else path


def source_line(node: torch.fx.Node) -> str:
    """The model line a node was traced from, ``file:line in fn: code``: the last
    frame of its ``stack_trace`` outside torch's own modules (``nn.Linear``'s
    ``forward`` is torch's; the line calling it is the model's), or ""."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in str(trace).strip().splitlines() if line.strip()]
    frames = [
        (match, lines[i + 1] if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else "")
        for i, line in enumerate(lines)
        if (match := _FRAME.match(line))
    ]
    if not frames:
        return lines[-1] if lines else ""
    mine = [f for f in frames if not f[0]["file"].startswith(_TORCH_DIR)]
    match, code = (mine or frames)[-1]
    where = f"{_short(match['file'])}:{match['line']} in {match['fn']}"
    return f"{where}: {code}" if code else where


def tagged(program: ExportedProgram) -> ExportedProgram:
    """A private copy of ``program`` (own graph and dicts, the same tensors) whose
    top-level nodes carry their names as debug handles (:data:`HANDLE`)."""
    return _tag(_program.private_view(program, copy_graph=True))


def _tag(view: ExportedProgram) -> ExportedProgram:
    for node in view.graph.nodes:
        custom = node.meta.get("custom")
        node.meta["custom"] = {**(custom if isinstance(custom, Mapping) else {}), HANDLE: node.name}
    return view


def rerun_tagged(pass_: Any, before: ExportedProgram) -> tuple[ExportedProgram, ExportedProgram]:
    """Run ``pass_`` again on a tagged copy of ``before``: returns the tagged input
    and the pass's output, whose nodes say which input node they came from.

    The copy owns its state tensors (:func:`~epass.instruments.values.private_copy`):
    the pass already ran once in the pipeline, and running it again must not give
    it a second chance to write into the user's weights."""
    start = _tag(private_copy(before))
    return start, PassManager([pass_], verify=False).run(start)


class _Recorder(torch.fx.Interpreter):  # type: ignore[misc]
    """Runs a graph and keeps a copy of each node's value, taken when it is made
    (a later in-place op cannot change it)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output":
            self.values[n.name] = clone(out)
        return out


def node_values(
    program: ExportedProgram,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    clone_state: str = "auto",
) -> dict[str, Any]:
    """The value of every top-level node of ``program`` run on the inputs, by node
    name (tensors copied as they were made). The program's state is not written
    (see :func:`~epass.instruments.values.run_program`)."""
    view = state_view(program, clone_state)
    before = state_versions(program)
    flat = _program.flat_inputs(view, clone(tuple(args)), clone(dict(kwargs or {})))
    recorder = _Recorder(view.graph_module)
    with torch.no_grad():
        recorder.run(*flat)
    check_untouched(program, before)
    return recorder.values


def _source_names(sources: Any) -> Iterator[str]:
    """The node names in a ``from_node`` provenance chain, nearest first."""
    from torch.fx.traceback import NodeSource

    for source in sources if isinstance(sources, list) else ():
        if isinstance(source, NodeSource):
            yield source.name
            yield from _source_names(source.from_node)


def _origin(node: torch.fx.Node, names: set[str], by_name: bool) -> str | None:
    """The node of the pass's input that ``node`` of its output came from."""
    custom = node.meta.get("custom")
    handle = custom.get(HANDLE) if isinstance(custom, Mapping) else None
    if handle in names:
        return str(handle)
    for name in _source_names(node.meta.get("from_node")):
        if name in names:
            return name
    return node.name if by_name and node.name in names else None


class _Provenance:
    """Which nodes of a pass's output came from which node of its input."""

    def __init__(self, before: torch.fx.Graph, after: torch.fx.Graph) -> None:
        names = {n.name for n in before.nodes}
        tags = any(
            isinstance(n.meta.get("custom"), Mapping) and HANDLE in n.meta["custom"]
            for n in after.nodes
        )
        self.origin = {n: _origin(n, names, not tags) for n in after.nodes}
        # The outputs are each other's, whatever meta a pass gave the new one.
        self.origin[after.output_node()] = before.output_node().name
        self.became: dict[str, list[torch.fx.Node]] = {}
        for n in after.nodes:
            name = self.origin[n]
            if name is not None:
                self.became.setdefault(name, []).append(n)

    def group(self, b: torch.fx.Node) -> list[torch.fx.Node]:
        group = self.became.get(b.name, [])
        if not group and b.target is operator.getitem and isinstance(b.args[0], torch.fx.Node):
            group = self.became.get(b.args[0].name, [])  # an item of a decomposed op
        return group

    def counterpart(self, b: torch.fx.Node, fits: Any) -> torch.fx.Node | None:
        """The node of the output holding ``b``'s value: one that came from ``b``,
        fits its value, and feeds a node that came from one of ``b``'s users."""
        group = [a for a in self.group(b) if fits(a)]
        consumers = {u.name for u in b.users}
        exits = [a for a in group if any(self.origin.get(u) in consumers for u in a.users)]
        if exits:
            return exits[-1]
        same = [a for a in group if a.name == b.name]
        return same[-1] if same else None


def _same_kind(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


def first_divergence(
    before: ExportedProgram,
    after: ExportedProgram,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    clone_state: str = "auto",
) -> NodeDrift | None:
    """The first node of ``before`` (in graph order) whose value differs, beyond
    ``atol + rtol * |value|``, from that of the node of ``after`` holding it.

    Nodes of ``after`` are traced back to ``before`` through their debug handle
    (:func:`tagged`), torch's ``from_node`` provenance, or, when no node of
    ``after`` carries a handle, their name. A node with no counterpart in
    ``after`` (its value is not computed there) is not compared. None when every
    compared node agrees.
    """
    vb = node_values(before, args, kwargs, clone_state=clone_state)
    va = node_values(after, args, kwargs, clone_state=clone_state)
    provenance = _Provenance(before.graph, after.graph)
    for b in before.graph.nodes:
        value = vb.get(b.name)
        if b.op == "output" or not isinstance(value, torch.Tensor):
            continue
        a = provenance.counterpart(b, lambda n, v=value: _same_kind(va.get(n.name), v))
        if a is None:
            continue
        drift = compare_outputs(va[a.name], value, rtol=rtol, atol=atol)
        if drift.ok:
            continue
        return _report(b, a, drift.max_abs, drift.max_rel, provenance.group(b))
    return None


def _report(
    b: torch.fx.Node, a: torch.fx.Node, max_abs: float, max_rel: float, group: list[torch.fx.Node]
) -> NodeDrift:
    """The NodeDrift of ``b`` (an item of a multi-output op named by that op)."""
    item = None
    source = b
    if b.target is operator.getitem and isinstance(b.args[0], torch.fx.Node):
        source, item = b.args[0], int(b.args[1])  # type: ignore[arg-type]
    became = [f"{n.name} ({_op_text(n)})" for n in group]
    if len(became) > BECAME_CAP:
        became = [*became[:BECAME_CAP], f"... {len(became) - BECAME_CAP} more"]
    return NodeDrift(
        node=source.name,
        op=_op_text(source),
        source=source_line(source),
        max_abs=max_abs,
        max_rel=max_rel,
        compared=a.name,
        became=tuple(became),
        item=item,
    )

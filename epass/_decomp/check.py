"""Check mode: the first way an incremental decomposition differs from torch's."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _torch
from epass._decomp import keys

__all__ = ["COMPARED_META", "first_difference"]


# Node meta compared by the check: what a user reads, prints or saves with the
# program (docs/compat.md, "What check mode compares"). ``from_node`` and ``seq_nr``
# are left out on purpose: the retrace records its own trace history there, which a
# rewrite cannot reproduce. An empty value counts as none: an empty ``custom`` dict
# annotates nothing, and releases differ in which of the two they leave.
COMPARED_META = ("stack_trace", "nn_module_stack", "original_aten", "custom")
_SUFFIX = re.compile(r"_\d+$")


# fx names the file of each GraphModule's generated code by a process-wide counter;
# the retrace runs copies of a region's body, so two retraces of one program record
# two numbers in the stack traces of the body's nodes.
_CODE_FILE = re.compile(r"<eval_with_key>\.\d+")


def _code_file(stack_trace: Any) -> Any:
    if isinstance(stack_trace, str):
        return _CODE_FILE.sub("<eval_with_key>", stack_trace)
    return stack_trace


def _plain_name(name: str) -> str:
    return _SUFFIX.sub("", name)


def _spec_text(spec: Any) -> str:
    arg = spec.arg
    name = getattr(arg, "name", None)
    value = _plain_name(name) if isinstance(name, str) else repr(getattr(arg, "value", None))
    return f"{spec.kind.name}:{value}:{spec.target}"


def first_difference(fast: ExportedProgram, ref: ExportedProgram) -> str | None:
    """The first way ``fast`` differs from torch's ``ref`` (None: equivalent).

    Compares the op sequence and arguments (node references by position), each
    node's value shape, strides and dtype, the meta in ``COMPARED_META``, the
    signature modulo numeric name suffixes, range constraints, the guards torch
    carries (``_guards_code``) and the module call graph's structure.
    """
    a_nodes, b_nodes = list(fast.graph.nodes), list(ref.graph.nodes)
    a_pos = {n: i for i, n in enumerate(a_nodes)}
    b_pos = {n: i for i, n in enumerate(b_nodes)}

    def args_of(n: torch.fx.Node, pos: dict[torch.fx.Node, int]) -> Any:
        return torch.fx.node.map_arg((n.args, n.kwargs), lambda x: f"%{pos[x]}")

    for i, (a, b) in enumerate(zip(a_nodes, b_nodes, strict=False)):
        where = f"node {i} ({a.name} / torch: {b.name})"
        if (a.op, str(a.target)) != (b.op, str(b.target)):
            return f"{where}: {a.op} {a.target} / torch: {b.op} {b.target}"
        if repr(args_of(a, a_pos)) != repr(args_of(b, b_pos)):
            return f"{where}: arguments {args_of(a, a_pos)} / torch: {args_of(b, b_pos)}"
        if a.op != "output":
            va, vb = keys.describe_val(a.meta.get("val")), keys.describe_val(b.meta.get("val"))
            if va != vb:
                return f"{where}: value {va} / torch: {vb}"
        if a.op == "call_function":
            for key in COMPARED_META:
                ma, mb = a.meta.get(key) or None, b.meta.get(key) or None
                if key == "original_aten":
                    ma, mb = str(ma) if ma else None, str(mb) if mb else None
                elif key == "stack_trace":
                    ma, mb = _code_file(ma), _code_file(mb)
                if ma != mb:
                    return f"{where}: meta {key!r} {ma!r:.200} / torch: {mb!r:.200}"
    if len(a_nodes) != len(b_nodes):
        return f"{len(a_nodes)} nodes / torch: {len(b_nodes)} nodes"
    sa, sb = fast.graph_signature, ref.graph_signature
    for kind, xs, ys in (
        ("input", sa.input_specs, sb.input_specs),
        ("output", sa.output_specs, sb.output_specs),
    ):
        ta, tb = [_spec_text(s) for s in xs], [_spec_text(s) for s in ys]
        if ta != tb:
            return f"signature {kind}s {ta} / torch: {tb}"
    ra = {str(k): str(v) for k, v in fast.range_constraints.items()}
    rb = {str(k): str(v) for k, v in ref.range_constraints.items()}
    if ra != rb:
        return f"range constraints {ra} / torch: {rb}"
    # The guards of the shape environment when each program was made (a guard added
    # to it outside a trace shows here, in every program made after it).
    guards, theirs = _torch.guards_code(fast), _torch.guards_code(ref)
    if guards != theirs:
        return f"guards {guards} / torch: {theirs}"
    ca = [e.fqn for e in fast.module_call_graph]
    cb = [e.fqn for e in ref.module_call_graph]
    if ca != cb:
        return f"module call graph {ca} / torch: {cb}"
    if fast.dialect != ref.dialect:
        return f"dialect {fast.dialect} / torch: {ref.dialect}"
    return None

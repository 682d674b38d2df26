"""Check mode: the first way an incremental decomposition differs from torch's."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _tensors
from epass._decomp import keys
from epass._torch import programs

__all__ = ["COMPARED_META", "example_difference", "first_difference", "numeric_difference"]


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


def _meta_difference(a: torch.fx.Node, b: torch.fx.Node) -> str | None:
    """How node ``a``'s value and compared meta differ from torch's node ``b``'s."""
    if a.op != "output":
        va, vb = keys.describe_val(a.meta.get("val")), keys.describe_val(b.meta.get("val"))
        if va != vb:
            return f"value {va} / torch: {vb}"
        ta = _tensor_meta_text(a.meta.get("tensor_meta"))
        tb = _tensor_meta_text(b.meta.get("tensor_meta"))
        if ta != tb:
            return f"meta 'tensor_meta' {ta} / torch: {tb}"
    if a.op == "call_function":
        for key in COMPARED_META:
            ma, mb = a.meta.get(key) or None, b.meta.get(key) or None
            if key == "original_aten":
                ma, mb = str(ma) if ma else None, str(mb) if mb else None
            elif key == "stack_trace":
                ma, mb = _code_file(ma), _code_file(mb)
            if ma != mb:
                return f"meta {key!r} {ma!r:.200} / torch: {mb!r:.200}"
    return None


def _tensor_meta_text(meta: Any) -> str | None:
    """A node's ``tensor_meta`` as text (its shape's symbols by name), None if it has none."""
    return None if meta is None else repr(meta)


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
    node's value shape, strides and dtype, its ``tensor_meta``, the meta in
    ``COMPARED_META``, the signature modulo numeric name suffixes, range
    constraints, the guards torch carries (``_guards_code``) and the module call
    graph's structure.
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
        difference = _meta_difference(a, b)
        if difference is not None:
            return f"{where}: {difference}"
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
    guards, theirs = programs.guards_code(fast), programs.guards_code(ref)
    if guards != theirs:
        return f"guards {guards} / torch: {theirs}"
    ca = [e.fqn for e in fast.module_call_graph]
    cb = [e.fqn for e in ref.module_call_graph]
    if ca != cb:
        return f"module call graph {ca} / torch: {cb}"
    if fast.dialect != ref.dialect:
        return f"dialect {fast.dialect} / torch: {ref.dialect}"
    return None


# The tolerance of ``numeric_difference`` by dtype: torch.testing's defaults (rtol,
# atol), with atol relative to the output's largest magnitude when that exceeds one.
_TOLERANCE = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def numeric_difference(got: Any, want: Any, where: str) -> str | None:
    """How output ``got`` of the incremental program differs from torch's ``want``
    on the same inputs (None: the same within float rounding). ``where`` names it.

    The two programs run the same graph, so what tells them apart is a wrong value
    (a constant, a state tensor), never rounding. Rounding still differs between
    two calls: a CPU matrix product's summation order can change with the threads
    it gets and the alignment of its buffers, and a logit that sums to near zero
    then differs far beyond ``torch.allclose``'s default ``atol=1e-8``. So floating
    values are compared with torch.testing's tolerance for their dtype, its atol
    scaled by the output's largest magnitude; NaNs must sit in the same places;
    anything else must be equal.
    """
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return None if got == want else f"{where} is {got!r} / torch: {want!r}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return (
            f"{where} is {got.dtype} {tuple(got.shape)} / torch: {want.dtype} {tuple(want.shape)}"
        )
    a, b = got.detach(), want.detach()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():
        if torch.equal(a, b):
            return None
        mismatched = int((a != b).sum())
        return f"{where} differs in {mismatched} of {a.numel()} elements"
    rtol, atol = _TOLERANCE.get(a.dtype, (1.3e-6, 1e-5))
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    nan_a, nan_b = a64.isnan(), b64.isnan()
    if not torch.equal(nan_a, nan_b):
        return f"{where} has NaN in other places than torch's"
    a64, b64 = a64.masked_fill(nan_a, 0.0), b64.masked_fill(nan_b, 0.0)
    infinite = b64.isinf() | a64.isinf()
    if not torch.equal(a64[infinite], b64[infinite]):
        return f"{where} has infinities in other places than torch's"
    a64, b64 = a64.masked_fill(infinite, 0.0), b64.masked_fill(infinite, 0.0)
    if not a64.numel():
        return None
    scale = max(1.0, float(b64.abs().max()))
    excess = (a64 - b64).abs() - (atol * scale + rtol * b64.abs())
    if float(excess.max()) <= 0:
        return None
    i = int(excess.argmax())
    index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), a64.shape))
    return (
        f"{where} differs by {float((a64 - b64).abs().flatten()[i]):.3g} at {index} "
        f"({float(a64.flatten()[i]):.6g} / torch: {float(b64.flatten()[i]):.6g}; "
        f"the tolerance there is {atol * scale + rtol * float(b64.abs().flatten()[i]):.3g})"
    )


def example_difference(fast: ExportedProgram, ref: ExportedProgram) -> str | None:
    """Whether both programs compute the same outputs on the example inputs (within
    float rounding: ``numeric_difference``)."""
    if fast.example_inputs is None:
        return None
    args, kwargs = fast.example_inputs
    got = _tensors.tree_leaves(fast.module()(*args, **kwargs))
    want = _tensors.tree_leaves(ref.module()(*args, **kwargs))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        difference = numeric_difference(a, b, f"output {i}")
        if difference is not None:
            return f"{difference} on the example inputs"
    return None

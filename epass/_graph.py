"""The graph toolkit: copy a graph, rebuild a program from a graph (the one rule),
lift tensor attributes to constants, and the helpers the built-in passes share.
Which nodes write in place into which tensors is :mod:`epass._writes`'s walk; who may
edit a graph in place is :mod:`epass._lease`'s.

One concept: a program's graph taken apart and put back together; every helper here
serves a copy, a rebuild or the placeholders and specs they carry.
"""

from __future__ import annotations

import copy
import operator
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    CustomObjArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    TensorArgument,
)

from epass import _lease, _program, _snapshot
from epass._torch import tracing
from epass.errors import ArgumentTypeError, ProgramError

__all__ = [
    "FAKE_LOCK",
    "STATE_KINDS",
    "InputKind",
    "InputKinds",
    "build_program",
    "copy_graph",
    "editable_graph",
    "original_name",
    "constant_spec",
    "fake_mode",
    "fake_value",
    "fill_meta",
    "input_kinds",
    "lift_tensor_attributes",
    "run_graph_pass",
    "tensor_attributes",
    "leaves",
    "new_state_placeholder",
    "parameter_spec",
    "placeholders",
    "placeholders_of",
    "reads_attributes",
    "adopt_graph",
    "attribute",
    "remove_unused_state_placeholders",
    "specs_by_name",
    "state_values",
    "unique_key",
]

STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
# A program's fake mode is one object shared by every copy of its graph, and torch's
# FakeTensorMode is not thread-safe: passes running in several threads on one
# program take this lock whenever they make fake values.
FAKE_LOCK = threading.RLock()
# meta key under which copy_graph records each placeholder's input spec
_SPEC = "epass_input_spec"


def placeholders(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    return placeholders_of(gm.graph)


def placeholders_of(graph: torch.fx.Graph) -> Iterator[torch.fx.Node]:
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        yield node


def specs_by_name(sig: ExportGraphSignature) -> dict[str, InputSpec]:
    return {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}


def state_values(ep: ExportedProgram) -> dict[str, Any]:
    """Placeholder name -> the tensor (or object) the program feeds it, for state inputs."""
    out: dict[str, Any] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.target is None or not hasattr(spec.arg, "name"):
            continue
        if spec.kind == InputKind.PARAMETER or (spec.kind == InputKind.BUFFER and spec.persistent):
            out[spec.arg.name] = ep.state_dict[spec.target]
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            out[spec.arg.name] = ep.constants[spec.target]
    return out


def unique_key(base: str, *taken: Collection[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever is in none of ``taken``
    (dicts or sets, so each check is O(1))."""

    def used(key: str) -> bool:
        return any(key in t for t in taken)

    if not used(base):
        return base
    i = 1
    while used(f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def fake_value(gm: torch.fx.GraphModule, tensor: torch.Tensor) -> Any:
    """A fake tensor for ``tensor`` in the fake mode of ``gm``'s placeholders (static
    shapes), or None when the graph carries no fake values."""
    for node in placeholders(gm):
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            with FAKE_LOCK:
                return mode.from_tensor(tensor, static_shapes=True)
    return None


class InputKinds(dict[str, InputKind]):
    """Placeholder name -> input kind, and where new state inputs go (found once,
    so inserting many placeholders stays O(nodes))."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.anchors: dict[bool, torch.fx.Node] = {}


def input_kinds(ep: ExportedProgram) -> InputKinds:
    """Placeholder name -> input kind, from ``ep``'s signature."""
    return InputKinds({name: spec.kind for name, spec in specs_by_name(ep.graph_signature).items()})


def _anchor(gm: torch.fx.GraphModule, kinds: InputKinds, parameter: bool) -> torch.fx.Node:
    anchor = kinds.anchors.get(parameter)
    if anchor is not None:
        return anchor
    for node in gm.graph.nodes:
        existing = kinds.get(node.name)
        if (
            node.op != "placeholder"
            or (parameter and existing != InputKind.PARAMETER)
            or existing not in (*STATE_KINDS, InputKind.CUSTOM_OBJ)
        ):
            kinds.anchors[parameter] = node
            return node
    raise ProgramError("graph has no output node")


def new_state_placeholder(
    gm: torch.fx.GraphModule,
    kinds: InputKinds,
    name: str,
    value: torch.Tensor,
    kind: InputKind,
) -> torch.fx.Node:
    """Insert a placeholder for a new state input where torch.export puts one:
    parameters after the last parameter, other state before the first user input.

    ``kinds`` (from :func:`input_kinds`) maps placeholder names to their kinds; the
    new one is added. Inserting before the remembered anchor keeps it valid.
    """
    with gm.graph.inserting_before(_anchor(gm, kinds, kind == InputKind.PARAMETER)):
        node = gm.graph.placeholder(name)
    kinds[node.name] = kind
    val = fake_value(gm, value)
    if val is not None:
        node.meta["val"] = val
    return node


def remove_unused_state_placeholders(
    gm: torch.fx.GraphModule, sig: ExportGraphSignature, only: Iterable[str] | None = None
) -> list[str]:
    """Erase parameter, buffer, constant and custom-object placeholders without users
    (restricted to the names in ``only``, current or original, when given). Returns
    the erased names."""
    by_name = specs_by_name(sig)
    allowed = None if only is None else set(only)
    kinds = (*STATE_KINDS, InputKind.CUSTOM_OBJ)
    removed = []
    for node in list(placeholders(gm)):
        spec = node.meta.get(_SPEC) or by_name.get(node.name)
        if node.users or spec is None or spec.kind not in kinds:
            continue
        if allowed is not None and not {node.name, original_name(node)} & allowed:
            continue
        gm.graph.erase_node(node)
        removed.append(node.name)
    return removed


def editable_graph(ep: ExportedProgram) -> torch.fx.GraphModule:
    """The graph module a built-in pass edits to make its output from ``ep``:
    :func:`epass._lease.take_lease`, else :func:`copy_graph`."""
    leased = _lease.take_lease(ep)
    return copy_graph(ep) if leased is None else leased


def copy_graph(ep: ExportedProgram) -> torch.fx.GraphModule:
    """A private copy of ``ep``'s graph (tensors shared) whose placeholders remember
    their input specs.

    Copying a graph can rename nodes (``input`` becomes ``input_1``, because the
    new graph's namespace avoids Python builtins), so :func:`build_program` finds
    the spec of an existing input through this tag rather than by name.
    """
    gm = _copy_module(ep.graph_module)
    specs = ep.graph_signature.input_specs
    nodes = list(placeholders(gm))
    if len(nodes) != len(specs):
        raise ProgramError(f"{len(nodes)} placeholders but {len(specs)} input specs")
    for node, spec in zip(nodes, specs, strict=True):
        node.meta[_SPEC] = spec
    _lease.note_built(gm.graph)
    return gm


def reads_attributes(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm``'s graph reads an attribute or calls a submodule (nested graphs
    of ``torch.cond`` and ``while_loop`` are read this way)."""
    return any(node.op in ("get_attr", "call_module") for node in gm.graph.nodes)


def adopt_graph(ep: ExportedProgram, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A module over ``graph``, which a pass built with ``Graph.node_copy`` from
    ``ep``'s graph, made what :func:`copy_graph` gives: each node's ``meta``
    containers copied (``node_copy`` shares them with ``ep``'s), the placeholders
    remembering their input specs, Python code generated only when read.

    ``graph`` must keep every placeholder of ``ep``'s, in order, and read no
    attribute (:func:`reads_attributes`).
    """
    nodes = list(placeholders_of(graph))
    specs = ep.graph_signature.input_specs
    if len(nodes) != len(specs):
        raise ProgramError(f"{len(nodes)} placeholders but {len(specs)} input specs")
    for node in graph.nodes:
        node.meta = _program.copy_meta(node.meta)
    for node, spec in zip(nodes, specs, strict=True):
        node.meta[_SPEC] = spec
    out = _program.graph_module_without_code(graph)
    out.meta.update(_program.copy_meta(ep.graph_module.meta))
    _lease.note_built(graph)
    return out


def _copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """:func:`epass._program.copy_graph_module`, for a graph that reads no attribute,
    in a module that generates its Python code only when it is read or called.

    The copy goes into a program whose constructor makes a module of its own, so
    the code of this one is never read there; generating it costs more than the
    copy itself, and each pass that edits a copy would pay it once per program.
    """
    if reads_attributes(gm):
        return _program.copy_graph_module(gm)  # attributes and nested graphs to copy
    graph = copy.deepcopy(gm.graph)
    for old, node in zip(gm.graph.nodes, graph.nodes, strict=True):
        if node.name != old.name:  # fx renames names that shadow Python builtins
            _program.keep_node_name(graph, node, old.name)
        node.meta = _program.copy_meta(node.meta)
    out = _program.graph_module_without_code(graph)
    out.meta.update(_program.copy_meta(gm.meta))
    return out


def original_name(node: torch.fx.Node) -> str:
    """The name a placeholder of :func:`copy_graph` had in the original program."""
    spec = node.meta.get(_SPEC)
    return str(spec.arg.name) if spec is not None and hasattr(spec.arg, "name") else node.name


def build_program(
    ep: ExportedProgram,
    gm: torch.fx.GraphModule,
    *,
    new_specs: Mapping[str, InputSpec] | None = None,
    state_dict: Mapping[str, Any] | None = None,
    constants: Mapping[str, Any] | None = None,
    erased_only: bool = False,
    repointed: Iterable[torch.fx.Node] = (),
) -> ExportedProgram:
    """A new, validated program from ``ep`` with graph ``gm``: the one rule by which
    every epass pass and adapter turns a rewritten graph into a program.

    Each placeholder of ``gm`` gets its input spec from, in order: the tag that
    :func:`copy_graph` left on it; ``new_specs`` (placeholders a pass added on
    purpose); ``ep``'s spec of that name; or ``ep``'s spec at the same position, for
    a placeholder renamed in place when the count is unchanged. A placeholder
    matching none is an error: a graph rewrite may remove inputs but cannot add
    them. The number of user inputs and of outputs must stay the same; outputs keep
    ``ep``'s output specs, renamed after ``gm``'s output nodes. State entries whose
    inputs are gone leave the new program's dicts.

    ``erased_only``: the pass only erased nodes of ``gm`` and pointed the inputs of
    the nodes ``repointed`` at nodes it already had. When ``gm`` is ``ep``'s own
    module (a lease), the program is then made without validating every node again
    (:func:`epass._program.after_erasure`).
    """
    old_specs = ep.graph_signature.input_specs
    inputs = _input_specs(old_specs, list(placeholders(gm)), dict(new_specs or {}))
    user_before = sum(s.kind == InputKind.USER_INPUT for s in old_specs)
    user_after = sum(s.kind == InputKind.USER_INPUT for s in inputs)
    if user_before != user_after:
        raise ProgramError(
            f"the pass changed the number of user inputs from {user_before} to "
            f"{user_after}; the calling convention must stay the same"
        )
    # No code is generated for gm: the program's constructor makes its own module
    # over gm's graph, whose code is generated when first read.
    outputs = _output_specs(ep.graph_signature.output_specs, gm)
    signature = ExportGraphSignature(input_specs=inputs, output_specs=outputs)
    sd = dict(ep.state_dict if state_dict is None else state_dict)
    consts = dict(ep.constants if constants is None else constants)
    referenced = {s.target for s in inputs if s.target is not None}
    for spec in old_specs:
        if spec.target is not None and spec.target not in referenced:
            sd.pop(spec.target, None)
            consts.pop(spec.target, None)
    if erased_only and gm is ep.graph_module:
        out = _program.after_erasure(ep, signature, sd, consts, repointed)
        if out is not None:
            return out
    return _program.new_program(ep, gm, signature, sd, consts)


def _input_specs(
    old_specs: Sequence[InputSpec], nodes: list[torch.fx.Node], added: Mapping[str, InputSpec]
) -> list[InputSpec]:
    """Each placeholder's input spec, by :func:`build_program`'s rule, renamed after it."""
    by_name = {s.arg.name: s for s in old_specs if hasattr(s.arg, "name")}
    current = {node.name for node in nodes}
    positional = len(nodes) == len(old_specs)
    inputs = []
    for i, node in enumerate(nodes):
        spec = node.meta.pop(_SPEC, None) or added.get(node.name) or by_name.get(node.name)
        if spec is None and positional and getattr(old_specs[i].arg, "name", None) not in current:
            spec = old_specs[i]
        if spec is None:
            known = [name for name in by_name if name]
            raise ProgramError(
                f"the graph has a new placeholder {node.name!r} that matches no input "
                f"spec (known: {known}); a graph pass may remove inputs but cannot add them"
            )
        arg_name = getattr(spec.arg, "name", None)
        if arg_name not in (None, node.name) and not isinstance(spec.arg, _UNNAMED):
            spec = InputSpec(
                spec.kind, type(spec.arg)(name=node.name), spec.target, spec.persistent
            )
        inputs.append(spec)
    return inputs


def _output_specs(old_specs: Sequence[OutputSpec], gm: torch.fx.GraphModule) -> list[OutputSpec]:
    """``old_specs``, renamed after ``gm``'s output nodes; their number must not change."""
    outs = leaves(gm.graph.output_node().args[0])
    if len(outs) != len(old_specs):
        raise ProgramError(
            f"the pass changed the number of outputs from {len(old_specs)} to {len(outs)}; "
            "the calling convention must stay the same"
        )
    outputs = []
    for spec, node in zip(old_specs, outs, strict=True):
        arg = spec.arg
        if isinstance(node, torch.fx.Node) and not isinstance(arg, _UNNAMED):
            arg = type(arg)(name=node.name)
        outputs.append(OutputSpec(spec.kind, arg, spec.target))
    return outputs


# Arguments that carry no node name (a constant, a custom object).
_UNNAMED = (ConstantArgument, CustomObjArgument)


def tensor_attributes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``get_attr`` nodes of ``gm``'s top-level graph that read a tensor."""
    return [
        node
        for node in gm.graph.nodes
        if node.op == "get_attr" and isinstance(attribute(gm, str(node.target)), torch.Tensor)
    ]


def attribute(gm: torch.nn.Module, target: str) -> Any:
    try:
        return operator.attrgetter(target)(gm)
    except AttributeError:
        return None


def lift_tensor_attributes(ep: ExportedProgram, gm: torch.fx.GraphModule) -> ExportedProgram:
    """Build a program from ``ep`` with graph ``gm`` (a copy of ``ep``'s graph, or its
    own under a lease, rewritten), lifting every tensor ``get_attr`` of ``gm`` to a
    ``CONSTANT_TENSOR`` input.

    torch.export's verifier rejects tensor attributes, so this is how a rewrite that
    registers a tensor becomes a program. ``gm`` is edited in place. Each attribute
    becomes one new key of ``constants`` holding the very tensor object (no copy),
    named after the attribute (suffixed when the name is taken).
    """
    kinds = input_kinds(ep)
    constants = dict(ep.constants)
    new_specs: dict[str, InputSpec] = {}
    lifted: dict[str, torch.fx.Node] = {}
    for node in tensor_attributes(gm):
        target = str(node.target)
        placeholder = lifted.get(target)
        if placeholder is None:
            value = attribute(gm, target)
            key = unique_key(target.replace(".", "_"), ep.state_dict, constants)
            placeholder = new_state_placeholder(
                gm, kinds, "c_" + key, value, InputKind.CONSTANT_TENSOR
            )
            if "val" not in placeholder.meta and "val" in node.meta:
                placeholder.meta["val"] = node.meta["val"]
            constants[key] = value
            new_specs[placeholder.name] = constant_spec(placeholder.name, key)
            lifted[target] = placeholder
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
    fill_meta(gm)
    for target in lifted:
        owner, _, attr = target.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        delattr(module, attr)
    return build_program(ep, gm, new_specs=new_specs, constants=constants)


def run_graph_pass(
    ep: ExportedProgram, fn: Callable[[torch.fx.GraphModule], Any], name: str
) -> tuple[ExportedProgram, bool, bool]:
    """Run a torch.fx pass (``GraphModule -> PassResult | GraphModule | None``) on a
    copy of ``ep``'s graph and return ``(program, modified)``.

    ``modified`` is whether the graph code or any node's ``meta`` changed (an
    annotation-only pass keeps its edits), or the fx ``PassResult``'s flag says so: a
    pass that edited its graph and said ``modified=False`` still modified it. Tensors
    the pass registered and reads through ``get_attr`` are lifted to constants. The
    input program is never touched. The third value says the pass's flag was False
    over an edit.
    """
    gm = copy_graph(ep)
    before = _snapshot.graph_code(gm)
    # gm is a fresh copy: ep's own node meta is the snapshot to compare with.
    metas = [
        node.meta for _, m in _program.graph_modules(ep.graph_module) for node in m.graph.nodes
    ]
    out = fn(gm)
    flag: bool | None
    if out is None:
        new_gm, flag = gm, None
    elif isinstance(out, torch.fx.GraphModule):
        new_gm, flag = out, None
    elif hasattr(out, "graph_module") and hasattr(out, "modified"):
        new_gm, flag = out.graph_module, bool(out.modified)
    else:
        raise ArgumentTypeError(
            f"fx pass {name!r} returned {type(out).__name__}; expected a "
            "torch.fx PassResult, a GraphModule or None"
        )
    if not isinstance(new_gm, torch.fx.GraphModule):
        raise ArgumentTypeError(
            f"fx pass {name!r} returned a result whose graph_module is "
            f"{type(new_gm).__name__}, not a GraphModule"
        )
    code = _snapshot.graph_code(new_gm)  # recompiles every graph
    # Its flag is not believed: an edit it reported as none is kept.
    changed = code != before or _snapshot.meta_changed(new_gm, metas, ignore=_SPEC)
    modified = bool(flag) or changed
    unreported = flag is False and changed
    if not modified:
        return ep, False, False
    if tensor_attributes(new_gm):
        return lift_tensor_attributes(ep, new_gm), True, unreported
    return build_program(ep, new_gm), True, unreported


def constant_spec(name: str, key: str) -> InputSpec:
    return InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=name), key)


def parameter_spec(name: str, key: str) -> InputSpec:
    return InputSpec(InputKind.PARAMETER, TensorArgument(name=name), key)


def leaves(value: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts of node arguments."""
    out: list[Any] = []
    torch.fx.node.map_aggregate(value, out.append)
    return out


def fake_mode(gm: torch.fx.GraphModule) -> Any:
    """The fake mode of ``gm``'s placeholder values, or None."""
    for node in gm.graph.nodes:
        mode = getattr(node.meta.get("val"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def fill_meta(gm: torch.fx.GraphModule, *, force: bool = False) -> None:
    """Compute ``meta["val"]`` (a fake value) for call_function nodes that lack one,
    or for every call_function node when ``force`` is set, by running each operator
    on its inputs' fake values. Placeholders keep theirs.

    The export verifier wants a value on every node; rewrites that insert nodes
    use this instead of re-running FakeTensorProp over the unchanged graph.
    """
    mode = fake_mode(gm)
    if mode is None:
        return

    def val(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg

    # Under the Python dispatcher, as export's tracer runs them: a composite operator
    # then keeps sizes symbolic (torch 2.12's C++ aten.linear reads a dynamic size
    # as an int, which specializes it in the program's shape environment).
    with FAKE_LOCK, mode, tracing.python_dispatcher():
        for node in gm.graph.nodes:
            if node.op != "call_function" or (not force and "val" in node.meta):
                continue
            args = torch.fx.node.map_aggregate(node.args, val)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
            node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]

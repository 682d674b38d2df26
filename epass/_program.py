"""Programs as epass builds and reads them: the one place that calls the
ExportedProgram constructor or sets a program's fields without it, and the reads of
operators, graph modules and archives that building and loading need.

One concept: the ExportedProgram object (its construction, fields, operators and
archive), whichever pass or loader asks. The torch internals it leans on are reached
through :mod:`epass._torch`; ``tests/test_program.py`` fails loudly when torch changes
what they do.
"""

from __future__ import annotations

import collections
import copy
import functools
import operator
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

from epass._torch import archives, operators, programs, quiet
from epass._torch.programs import pytree

__all__ = [
    "archive_records",
    "copy_call_graph",
    "copy_graph_module",
    "export_schema",
    "flat_call_graph",
    "flat_inputs",
    "is_higher_order",
    "is_mutable_op",
    "is_op_overload",
    "is_op_packet",
    "is_view_op",
    "is_operator",
    "keep_node_name",
    "load_pt2",
    "forget_validated",
    "mark_validated",
    "new_program",
    "private_view",
    "prune_range_constraints",
    "pytree_type_names",
    "serialized_builtin_targets",
    "copy_meta",
    "set_signature",
    "set_state",
    "shallow_clone",
    "still_validated",
    "tensor_marks",
    "tree_leaves",
]


def set_state(
    ep: ExportedProgram,
    state_dict: dict[str, Any] | None = None,
    constants: dict[str, Any] | None = None,
) -> None:
    """Point ``ep`` at the given dict objects without copying or re-validating."""
    if state_dict is not None:
        programs.set_fields(ep, state_dict=state_dict)
    if constants is not None:
        programs.set_fields(ep, constants=constants)


def set_signature(ep: ExportedProgram, signature: ExportGraphSignature) -> None:
    """Point ``ep`` at ``signature`` without re-validating."""
    programs.set_fields(ep, graph_signature=signature)


def shallow_clone(ep: ExportedProgram) -> ExportedProgram:
    """A new ExportedProgram object sharing every field (graph and dicts) with ``ep``."""
    clone = copy.copy(ep)
    state = _VALIDATED.get(ep)
    if state is not None:  # compared with the clone's own fields when it is verified
        _VALIDATED[clone] = state
    return clone


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Copy a GraphModule's graph (and those of nested GraphModules), sharing tensors.

    Node ``meta`` containers are copied at every level (:func:`copy_meta`), so no
    edit through the copy reaches ``gm``; fake values and other leaves are shared.
    """
    new_graph = copy.deepcopy(gm.graph)
    _keep_node_names(gm.graph, new_graph)
    for node in new_graph.nodes:
        node.meta = copy_meta(node.meta)
    root: dict[str, Any] = {}
    for node in new_graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        value = operator.attrgetter(target)(gm)
        if isinstance(value, torch.fx.GraphModule):
            value = copy_graph_module(value)
        root[target] = value
    new_gm = torch.fx.GraphModule(root, new_graph, gm.__class__.__name__)
    new_gm.meta.update(copy_meta(gm.meta))
    return new_gm


_CONTAINERS = (dict, list, tuple, set, collections.OrderedDict, collections.defaultdict)


def copy_meta(value: Any) -> Any:
    """``value`` with every nested dict, list, tuple and set copied; leaves (fake
    tensors, strings, types, other objects) are shared.

    ``node.meta`` holds containers that passes edit in place (``nn_module_stack``,
    ``source_fn_stack``, custom annotations); a graph copy with this meta shares
    none of them with the original.
    """
    kind = type(value)
    if kind not in _CONTAINERS:
        return value
    if kind is tuple:
        # Most tuples in meta hold strings and types only (nn_module_stack entries).
        if not any(type(v) in _CONTAINERS for v in value):
            return value
        return tuple(copy_meta(v) for v in value)
    if kind is list:
        return [copy_meta(v) for v in value]
    if kind is set:
        return set(value)
    out = copy.copy(value)  # keeps a defaultdict's factory
    for key, item in value.items():
        out[key] = copy_meta(item)
    return out


def _keep_node_names(old: torch.fx.Graph, new: torch.fx.Graph) -> None:
    """Give copied nodes their original names.

    fx's namespace renames nodes whose names shadow Python builtins (``input`` becomes
    ``input_1``) when a graph is copied, although torch.export created them with those
    names; the signature refers to nodes by name, so the copy must keep them.
    """
    for a, b in zip(old.nodes, new.nodes, strict=True):
        if a.name != b.name:
            keep_node_name(new, b, a.name)


def keep_node_name(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> None:
    """Name ``node`` of ``graph`` exactly ``name``, which fx's namespace would rename
    (``input`` becomes ``input_1``), and reserve the name in the namespace."""
    programs.reserve_name(graph, node, name)


def private_view(
    ep: ExportedProgram, *, copy_graph: bool, copy_state: bool = True
) -> ExportedProgram:
    """A program a pass may own: private dict copies (same tensors) unless
    ``copy_state`` is False, and a private graph and signature when ``copy_graph``
    is set."""
    view = shallow_clone(ep)
    if copy_state:
        programs.set_fields(view, state_dict=dict(ep.state_dict), constants=dict(ep.constants))
    # Small containers a pass may edit in place (the kwargs dict of the example
    # inputs, the verifier list): copied, so no edit reaches ``ep``.
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        programs.set_fields(view, example_inputs=(args, dict(kwargs)))
    programs.set_fields(view, verifiers=list(ep.verifiers))
    if copy_graph:
        programs.set_fields(
            view,
            graph_module=copy_graph_module(ep.graph_module),
            graph_signature=copy.deepcopy(ep.graph_signature),
            module_call_graph=copy_call_graph(ep.module_call_graph),
            range_constraints=dict(ep.range_constraints),
        )
    return view


def copy_call_graph(call_graph: list[Any]) -> list[Any]:
    """``copy.deepcopy(call_graph)`` that shares the leaf treespecs of its signatures.

    torch deprecated ``LeafSpec`` (2.13) and warns (``FutureWarning``, located in
    ``copyreg.py``) whenever one is constructed, as a deep copy does for every leaf;
    the user did nothing to cause it. A leaf spec is immutable, so the copy shares it.
    """
    memo: dict[int, Any] = {}
    for entry in call_graph:
        signature = getattr(entry, "signature", None)
        specs = [getattr(signature, "in_spec", None), getattr(signature, "out_spec", None)]
        while specs:
            spec = specs.pop()
            if not isinstance(spec, pytree.TreeSpec):
                continue
            if spec.is_leaf():
                memo[id(spec)] = spec
            else:
                specs.extend(programs.spec_children(spec))
    return copy.deepcopy(call_graph, memo)


def graph_module_without_code(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A ``GraphModule`` over ``graph`` (with an empty root, so ``graph`` names no
    attribute) that generates its Python code only when something reads or calls
    it: torch's ``_LazyGraphModule``. For a graph that goes into a program, whose
    constructor makes its own module and code, generating the code twice costs a
    tenth of the incremental decomposition of a large program."""
    return programs.lazy_graph_module(torch.nn.Module(), graph)


def new_program(
    ep: ExportedProgram,
    gm: torch.fx.GraphModule,
    signature: ExportGraphSignature,
    state_dict: dict[str, Any],
    constants: dict[str, Any],
    *,
    module_call_graph: Any = None,
    keep_dialect: bool = True,
) -> ExportedProgram:
    """A new, validated program with ``ep``'s other fields and ``gm`` as its graph:
    the one place epass calls the ``ExportedProgram`` constructor.

    Range constraints are recomputed for ``gm``. ``module_call_graph`` replaces
    ``ep``'s (copied either way). ``keep_dialect=False`` gives the program torch's
    default verifier (the ATEN dialect), as ``run_decompositions`` does. Callers
    derive the signature and dicts with ``epass._graph.build_program`` or, for a
    decomposed graph, as the retrace does.
    """
    # The constructor makes the graph module without its code
    # (programs.construct_without_code): that code generation is a fifth of an incremental
    # decomposition, and the next pass usually rebuilds the graph before anyone reads it.
    out = programs.construct_without_code(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=state_dict,
        range_constraints=programs.updated_range_constraints(gm, ep.range_constraints),
        module_call_graph=copy_call_graph(
            ep.module_call_graph if module_call_graph is None else module_call_graph
        ),
        example_inputs=ep.example_inputs,
        constants=constants,
        verifiers=ep.verifiers if keep_dialect else None,
    )
    mark_validated(out)  # the constructor's last step was validate()
    return out


def after_erasure(
    ep: ExportedProgram,
    signature: ExportGraphSignature,
    state_dict: dict[str, Any],
    constants: dict[str, Any],
    repointed: Iterable[torch.fx.Node] = (),
) -> ExportedProgram | None:
    """The program :func:`new_program` makes from ``ep``'s own graph module after a
    pass only erased nodes of it (with ``Graph.erase_node``, which refuses a node
    that still has users) and pointed the inputs of the nodes ``repointed`` at
    nodes it already had, made without the constructor; None where that cannot be
    shown to be the same.

    The constructor validates every node again and the graph's lint walks them all
    (tens of milliseconds a pass at a few thousand nodes). That adds nothing here:
    ``ep`` passed validation (:func:`mark_validated`, or its constructor), and every
    node left was one of its nodes, unchanged but for the inputs of ``repointed``.
    So what is checked again is what the edit could break: that each input of a
    repointed node is in the graph before it (the lint's order check, for those
    nodes), and what reads more than one node (the signature against the graph's
    inputs and outputs, the module call graph). Range constraints and guards are
    recomputed as the constructor computes them. Any other field is ``ep``'s, as the
    constructor would take it; the module call graph is ``ep``'s own list, as its
    graph module is (``ep`` was consumed: its graph is the one the pass edited).
    A graph with submodules (``cond`` branches: a ``get_attr`` left to a deleted one
    only the verifier's walk finds) or repeated items is left to the constructor.
    """
    gm = ep.graph_module
    if ep not in _VALIDATED or next(gm.children(), None) is not None:
        return None
    repointed = tuple(repointed)
    _check_order(gm.graph, repointed)
    if _repeats_an_item(repointed):
        return None
    values = programs.one_value_module(gm)
    out = copy.copy(ep)
    programs.set_fields(
        out,
        graph_signature=signature,
        state_dict=state_dict,
        constants=constants,
        range_constraints=programs.updated_range_constraints(values, ep.range_constraints),
        guards_code=programs.graph_guards_code(values),
    )
    programs.verify_beyond_nodes(out)
    mark_validated(out)
    return out


def _check_order(graph: torch.fx.Graph, nodes: Iterable[torch.fx.Node]) -> None:
    """``graph.lint()``'s checks of the inputs of ``nodes``: each is a node of
    ``graph``, still in it, that comes before the node using it. (An erased node
    has no inputs left: ``erase_node`` clears them.)"""
    for node in nodes:
        for arg in node.all_input_nodes:
            # An erased node is out of the list: its successor no longer points back.
            if arg.graph is not graph or arg.next.prev is not arg or not arg < node:
                raise RuntimeError(
                    f"argument {arg.name!r} of node {node.name!r} is not a node of the "
                    "graph defined before it; a pass that only erases nodes must point "
                    "uses at earlier ones"
                )


def _repeats_an_item(nodes: Iterable[torch.fx.Node]) -> bool:
    """Whether one of ``nodes`` takes an item another takes too (constructor: one)."""
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args[0], node.args[1]
            users = source.users if isinstance(source, torch.fx.Node) else ()
            if any(
                o.target is operator.getitem and o.args[1] == index for o in users if o is not node
            ):
                return True
    return False


def flat_inputs(ep: ExportedProgram, args: Any, kwargs: Any) -> list[Any]:
    """What ``ep.graph_module`` takes for the call ``ep.module()(*args, **kwargs)``:
    the state placeholders' values, then the user inputs flattened by the program's
    input spec (``ExportedProgram._graph_module_flat_inputs``)."""
    return programs.graph_module_flat_inputs(ep, args, kwargs)


def prune_range_constraints(ep: ExportedProgram) -> None:
    """Drop the range constraints of symbols no value of ``ep``'s graph mentions (a
    program cut out of a bigger one keeps the shape environment's ranges for every
    symbol it ever had; a program with static sizes then has none)."""
    used: set[Any] = set()
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        values = val if isinstance(val, (list, tuple)) else (val,)
        for v in values:
            dims = list(v.shape) if isinstance(v, torch.Tensor) else [v]
            for d in dims:
                if isinstance(d, torch.SymInt):
                    used |= d.node.expr.free_symbols
    programs.set_fields(
        ep, range_constraints={k: v for k, v in ep.range_constraints.items() if k in used}
    )


def flat_call_graph(inputs: int, outputs: int) -> list[Any]:
    """A module call graph for a program taking ``inputs`` positional tensors and
    returning a tuple of ``outputs``: its one root entry, with no submodule entries
    (``unflatten`` then gives one flat module)."""
    from torch.export import ModuleCallEntry, ModuleCallSignature

    in_spec = pytree.tree_flatten((tuple(range(inputs)), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(outputs)))[1]
    signature = ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec)
    return [ModuleCallEntry(fqn="", signature=signature)]


# Programs new_program built, with what torch's verifier read of them right after
# the constructor validated them: verify_program need not run validate() again
# while none of it has changed (weak keys: a freed program leaves no entry).
_VALIDATED: weakref.WeakKeyDictionary[ExportedProgram, list[Any]] = weakref.WeakKeyDictionary()


# The Verifier methods that read a program; a subclass that keeps them (torch's
# TrainingIRVerifier sets only its dialect) reads what the base one reads.
_VERIFIER_READS = ("check", "_check_graph_module", "check_valid_op", "check_additional")


def _verified_state(ep: ExportedProgram) -> list[Any] | None:
    """Everything torch's base ``Verifier`` reads of ``ep``: its verifiers (their
    dialect), every module and graph, each node's name, op, target, arguments and
    ``meta["val"]`` / ``meta["torch_fn"]``, the objects ``get_attr`` nodes name, the
    signature, the dicts' entries and the module call graph's argument names. None
    when one of ``ep``'s verifiers checks more than the base one (ExecuTorch's
    dialects do), since it may read anything. One flat list, with no tuple per node
    (fewer objects for the collector to walk): each node's entries start with the
    node and its op, and a list value's items follow their count, so two lists are
    equal exactly when every fact in them is."""
    verifier = programs.base_verifier()
    for v in ep.verifiers:
        if any(getattr(v, m) is not getattr(verifier, m) for m in _VERIFIER_READS):
            return None
    gm = ep.graph_module
    sig = ep.graph_signature
    state: list[Any] = [
        gm,
        sig,
        list(ep.verifiers),  # the dialect: an ATEN program may hold no in-place call
        [(s.kind, repr(s.arg), s.target, s.persistent) for s in sig.input_specs],
        [(s.kind, repr(s.arg), s.target) for s in sig.output_specs],
        list(ep.state_dict.items()),
        list(ep.constants.items()),
        [
            (e.fqn, None if e.signature is None else repr(e.signature.inputs + e.signature.outputs))
            for e in ep.module_call_graph
        ],
    ]
    add, extend = state.append, state.extend
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            extend((module, list(vars(module).items())))
            continue
        buffers = list(programs.module_buffers(module).items())
        extend((module, module.graph, list(vars(module).items()), buffers))
        for node in module.graph.nodes:
            meta = node.meta
            val = meta.get("val")
            extend((node, node.op, node.name, node.target, node.args, node.kwargs, val,
                    meta.get("torch_fn")))  # fmt: skip
            if type(val) in (list, tuple):  # its items, after their count
                add(len(val))
                extend(val)
            else:
                add(None)
            if node.op == "get_attr":
                try:
                    add(operator.attrgetter(str(node.target))(module))
                except AttributeError:
                    add(None)
    return state


def mark_validated(ep: ExportedProgram) -> None:
    """Record that ``ep`` has just passed ``validate()`` (its constructor ran it)."""
    state = _verified_state(ep)
    if state is not None:
        _VALIDATED[ep] = state


def forget_validated(ep: ExportedProgram) -> None:
    """Drop ``ep``'s record of passing ``validate()`` (:func:`mark_validated`): a pass
    epass does not vouch for may have edited its graph, and no check has run since."""
    _VALIDATED.pop(ep, None)


def still_validated(ep: ExportedProgram) -> bool:
    """Whether ``ep`` passed ``validate()`` (:func:`mark_validated`) and nothing the
    verifier reads has changed since, so that running it again would pass."""
    before = _VALIDATED.get(ep)
    if before is None:
        return False
    try:
        # Lists and tuples compare identical items by identity first: fake values
        # are never compared element-wise; an odd __eq__ counts as a change.
        return bool(_verified_state(ep) == before)
    except Exception:
        return False


def tree_leaves(value: Any) -> list[Any]:
    """The leaves of a nested structure of outputs (``torch.utils._pytree``, the
    flattening torch.export itself uses for program inputs and outputs)."""
    return list(pytree.tree_leaves(value))


def tensor_version(value: Any) -> int | None:
    """The in-place write counter of a tensor, or None for other values."""
    if isinstance(value, torch.Tensor):
        try:
            return programs.version_counter(value)
        except (RuntimeError, AttributeError):  # inference tensors and some subclasses
            return None
    return None


def tensor_marks(values: list[torch.Tensor]) -> list[tuple[int | None, bool]]:
    """What an in-place change of each tensor changes: its write counter (as
    :func:`tensor_version`) and its ``requires_grad`` flag, read in one loop (the
    manager reads them for every store entry around every pass)."""
    marks: list[tuple[int | None, bool]] = []
    for t in values:
        try:
            version: int | None = programs.version_counter(t)
        except (RuntimeError, AttributeError):  # inference tensors and some subclasses
            version = None
        marks.append((version, t.requires_grad))
    return marks


def same_view(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are the same object, or tensors viewing the same memory
    with the same dtype, shape, strides, offset, device, Parameter-ness and lazy
    conjugate/negative bits.

    No tensor bytes are read. The linker calls this once per state entry, so the
    common case is one dispatcher call (``is_set_to`` compares storage, offset,
    sizes and strides at once).
    """
    if a is b:
        return True
    if type(a) is not type(b):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if isinstance(a, torch.nn.Parameter) is not isinstance(b, torch.nn.Parameter):
            return False
    elif not isinstance(a, torch.Tensor):
        return False
    if a.dtype is not b.dtype:  # is_set_to compares geometry in elements, not bytes
        return False
    try:
        # is_set_to is False whenever either side is a lazy conjugate/negative view
        # (it resolves them into copies), so True also means equal conj/neg bits.
        if a.is_set_to(b):  # raises for sparse and other storage-less layouts
            return True
        if a.is_conj() or a.is_neg() or b.is_conj() or b.is_neg():
            # Such views share memory with their base but read other values.
            return bool(
                a.is_conj() == b.is_conj()
                and a.is_neg() == b.is_neg()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.device == b.device
                and a.shape == b.shape
                and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset()
            )
        # Empty tensors may have no storage to compare; equal geometry is enough.
        return bool(
            a.numel() == 0
            and a.device == b.device
            and a.device.type != "meta"
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
        )
    except (RuntimeError, NotImplementedError):  # meta, fake and storage-less subclasses
        return False


# --- operator schemas (used by the built-in passes) ---------------------------------


def op_schema(target: Any) -> torch.FunctionSchema | None:
    """The schema of an ATen operator overload (``OpOverload._schema``), or None for
    other call targets (Python functions, higher-order operators, packets)."""
    if not isinstance(target, OpOverload):
        return None
    return operators.function_schema(target)


def is_op_overload(value: Any) -> bool:
    """True for an ATen-style operator overload (``torch._ops.OpOverload``), such as
    ``torch.ops.aten.relu.default``."""
    return isinstance(value, OpOverload)


def is_op_packet(value: Any) -> bool:
    """True for an operator packet (``torch._ops.OpOverloadPacket``), such as
    ``torch.ops.aten.relu``."""
    return isinstance(value, operators.OpOverloadPacket)


# The type of an operator overload, for annotations such as a pass option's.
OpOverload = operators.OpOverload


def overload_of(value: Any) -> Any:
    """``value`` as an operator overload: an overload itself, a packet's ``default``
    overload (``aten.relu`` -> ``aten.relu.default``), or None."""
    if isinstance(value, OpOverload):
        return value
    if isinstance(value, operators.OpOverloadPacket) and "default" in operators.op_overloads(
        value, names=True
    ):
        return value.default
    return None


def is_higher_order(value: Any) -> bool:
    """True for a higher-order operator (``torch._ops.HigherOrderOperator``), such as
    ``torch.ops.higher_order.cond``."""
    return isinstance(value, operators.HigherOrderOperator)


def is_operator(value: Any) -> bool:
    """True for any torch operator object (``torch._ops.OperatorBase``): ATen
    overloads and higher-order operators, the keys of a decomposition table."""
    return isinstance(value, operators.OperatorBase)


def is_view_op(target: Any) -> bool:
    """Whether ``target`` is a view operator: an operator overload that writes nothing
    and returns an alias of an argument (``view``, ``t``, ``split``...)."""
    schema = op_schema(target)
    return (
        schema is not None
        and not schema.is_mutable
        and any(r.alias_info is not None for r in schema.returns)
    )


def is_mutable_op(op: Any) -> bool:
    """Whether the operator's schema writes into one of its arguments."""
    return bool(operators.function_schema(op).is_mutable)


# --- graph sharing (used by the manager to decide when a pass needs a graph copy) ---


def _graph_objects(gm: torch.nn.Module) -> set[int]:
    """Ids of every GraphModule in ``gm``'s module tree and of their Graphs."""
    ids: set[int] = set()
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            ids.add(id(module))
            ids.add(id(module.graph))
    return ids


def shares_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """Whether mutating ``a``'s graphs in place could change ``b``'s: they are the same
    module, or share a Graph or a nested GraphModule (a ``torch.cond`` branch)."""
    if a is b:
        return True
    return not _graph_objects(a).isdisjoint(_graph_objects(b))


def graph_code(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """The recompiled code of ``gm`` and of every GraphModule nested in it (``torch.cond``
    branches), so that a pass that edits only a branch counts as a change."""
    out = []
    for name, module in gm.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()
            out.append((name, module.code))
    return out


# torch's deserializer marks the one running in a module global
# (serde.serialize._CURRENT_DESERIALIZER) and fails when two overlap: loads run
# one at a time. Loads outside epass (a bare torch.export.load) are not covered.
_DESERIALIZING = threading.Lock()


def load_pt2(f: Any, *, trust: bool = False) -> ExportedProgram:
    """The ``"model"`` program of a .pt2 archive, through torch's archive loader.

    ``torch.export.load`` wraps the same loader but hides its error behind a log
    record and falls back to a legacy reader that unpickles without restriction;
    calling the loader directly gives torch's own exception and no fallback.
    ``trust=True`` calls ``torch.export.load`` itself, under the same lock.
    """
    with _DESERIALIZING, quiet.loader():
        if trust:
            return torch.export.load(f)
        contents = archives.load_pt2_contents(f)
    programs = contents.exported_programs
    if "model" not in programs:
        raise ValueError(f"the archive holds no 'model' program (found {sorted(programs)})")
    return programs["model"]


def archive_records(f: Any) -> dict[str, tuple[int, int]]:
    """Every member torch's zip reader finds in an archive, below its root folder:
    name -> (offset of its data in the file, size), as torch's loader will read it.

    The offset comes from the member's local header, read as torch reads it before
    the data (``get_record_offset``); the public ``PT2ArchiveReader`` gives names only.
    """
    reader = archives.zip_reader(f)
    return {
        name: (reader.get_record_offset(name), archives.record_size(reader, name))
        for name in reader.get_all_records()
    }


# --- the serialization schema (used by the typed screen of untrusted archives) ------


def export_schema() -> tuple[type, tuple[int, int], type]:
    """torch's serialization schema behind ``models/model.json``: the root dataclass
    (``torch._export.serde.schema.ExportedProgram``), the schema version this torch
    writes, and the base class of its tagged unions (one key per JSON object)."""
    schema, union = archives.serialization_schema()
    return schema.ExportedProgram, tuple(schema.SCHEMA_VERSION), union  # type: ignore[return-value]


@functools.cache
def serialized_builtin_targets() -> frozenset[str]:
    """Node targets that are not ``torch.ops`` operators, as torch's serializer writes
    them (``_operator.getitem``, ``torch.sym_max``): the symbolic-shape functions it
    serializes and the builtins its verifier allows."""
    ops = set(archives.serialized_sym_ops()) | set(programs.base_verifier()().allowed_builtin_ops())
    return frozenset(f"{op.__module__}.{op.__name__}" for op in ops)


def pytree_type_names() -> frozenset[str]:
    """The type names a serialized pytree spec may name (``builtins.tuple``...): the
    node types registered with torch's pytree in this process."""
    return frozenset(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)

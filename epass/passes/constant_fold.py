"""ConstantFold: evaluate subgraphs that depend only on state and lift the results."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputSpec

from epass import _dce, _graph, _operators, _writes
from epass.options import checked
from epass.protocol import PassResult, RewriteCounter

__all__ = ["ConstantFold", "ConstantFoldResult"]

logger = logging.getLogger("epass")

# Operators whose result is not a function of their inputs' values.
_UNINITIALIZED = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
# Folding these straight off a state input only duplicates it (or relabels it).
_TRIVIAL = frozenset(
    {
        "aten::clone",
        "aten::lift_fresh_copy",
        "aten::detach",
        "aten::alias",
        "aten::contiguous",
        "aten::view",
        "aten::reshape",
        "aten::_unsafe_view",
        "aten::flatten",
        "aten::squeeze",
        "aten::unsqueeze",
    }
)
# Ops that only re-view their input. A chain of them off a state input saves no
# compute when folded; it turns a parameter into a constant that backends no longer
# recognize as the weight of a module call (fold with ``fold_views=True``).
_VIEWS = frozenset(
    {
        "aten::permute",
        "aten::transpose",
        "aten::t",
        "aten::numpy_T",
        "aten::mT",
        "aten::expand",
        "aten::expand_as",
        "aten::view_as",
        "aten::slice",
        "aten::select",
        "aten::narrow",
        "aten::as_strided",
        "aten::diagonal",
        "aten::movedim",
        "aten::unflatten",
        "aten::split",
        "aten::split_with_sizes",
        "aten::unbind",
        "aten::chunk",
        "aten::unfold",
        "aten::view_as_real",
        "aten::view_as_complex",
    }
)
# Node meta naming the source call a node was traced from; a folded node's call is
# split after folding, so its remaining nodes no longer form that call.
_SOURCE_KEYS = ("source_fn_stack", "torch_fn")


@attrs.frozen
class ConstantFoldResult(PassResult):
    """A :class:`PassResult` that also says what was folded.

    Attributes:
        folded: names of the nodes replaced by constants.
        added: the new ``constants`` keys, one per folded node.
        bytes_added: memory the new constants allocate (views into existing state
            count zero).
        notes: the rewrite count (:class:`~epass.protocol.RewriteCounter`): one
            rewrite per folded node.
    """

    folded: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    bytes_added: int = 0
    notes: dict[str, Any] = attrs.field(factory=dict)


def _foldable_op(node: torch.fx.Node, impure: Callable[[torch.fx.Node], bool]) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = _operators.op_schema(node.target)
    if schema is None or schema.is_mutable or schema.name in _UNINITIALIZED:
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags:  # type: ignore[union-attr]
        return False
    return not impure(node)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


@attrs.define
class _Evaluated:
    """What :meth:`ConstantFold._evaluate` found: each node's value, the nodes in
    evaluation order, those that only relabel a state input, each node's first
    identical computation, and the bytes of state each value is computed from
    (shared inputs counted per path)."""

    values: dict[torch.fx.Node, Any] = attrs.field(factory=dict)
    order: list[torch.fx.Node] = attrs.field(factory=list)
    trivial: set[torch.fx.Node] = attrs.field(factory=set)
    canon: dict[torch.fx.Node, torch.fx.Node] = attrs.field(factory=dict)
    source: dict[torch.fx.Node, int] = attrs.field(factory=dict)


@checked
@attrs.define(eq=False)
class ConstantFold:
    """Evaluate every subgraph whose inputs are only parameters, buffers or constants
    and replace it with a new lifted constant.

    A node folds when it is a functional ATen call (not in place, not random, no
    side effects, not ``empty``) and all its inputs fold; parameters, buffers and
    constants fold unless the program mutates them. The values are computed once
    on the real tensors (under ``no_grad``); only the *boundary* values (those a
    non-folded node or the output reads) are kept: a view into a state tensor (the
    ``permute`` of a weight) stays a view and costs no memory; any other value is a
    tensor that owns exactly its memory. Then the folded nodes are removed, and state inputs that
    lost their last user are dropped from the signature.

    torch's ``torch._export.passes.constant_folding`` is not used (it needs
    torchao on torch 2.13); evaluation runs the ATen overloads directly, in
    topological order, O(nodes).

    Not folded, to keep the program small: a boundary value larger than
    ``max_growth`` times the state it is computed from (an ``expand``, also
    behind a ``view``, or an outer product; the smaller values feeding it are
    folded instead), and a reshape or copy applied directly to a state input
    (it would only duplicate the entry). A chain that only re-views a state input
    (``permute``, ``transpose``, ``t``, ``view``, ``expand``, ``slice``, ...) is not
    folded either unless ``fold_views`` is set: it costs nothing at run time, and
    folding it turns a parameter into a constant that backends no longer recognize
    as a module's weight.

    When part of a traced call is folded (the ``permute`` of ``F.linear``), the
    nodes left of that call drop the call's name from their meta
    (``source_fn_stack``, ``torch_fn``, and the innermost ``nn_module_stack``
    scope), so that pattern matchers do not rebuild the call from them.

    Graph: folded nodes become ``CONSTANT_TENSOR`` placeholders. State: **adds**
    one ``constants`` entry per boundary value (keys ``folded_<node>``); the
    entries of inputs that became unused leave the output's dicts (the user's
    dicts keep them; the link report lists them as removed). No existing entry
    changes: the output shares the user's ``state_dict``, and holds a
    ``constants`` dict of its own (the user's tensor objects plus the folded
    values) when it folded anything.
    Works on training-IR and decomposed programs alike.

    Args:
        max_growth: the largest ratio of a folded value's bytes to the bytes of the
            parameters, buffers and constants it is computed from.
        fold_views: also fold chains that only re-view a state input (pre-transposed
            weights, for backends that want them); the folded value is a view of
            the state tensor and costs no memory.

    Returns a :class:`ConstantFoldResult` with the folded nodes, new keys and
    ``bytes_added``. Each folded node is one rewrite
    (:class:`~epass.protocol.RewriteCounter`): ``max_rewrites`` folds only the
    first N, in graph order.

    Example::

        out = PassManager([Decompose(), ConstantFold(fold_views=True)]).run(ep)
        # every "permute(p_weight)" is now a pre-transposed constant
    """

    name: ClassVar[str] = "fold-constants"
    changes_input: ClassVar[bool] = False
    _takes_lease: ClassVar[bool] = True

    max_growth: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    fold_views: bool = False
    max_rewrites: int | None = None

    def with_max_rewrites(self, limit: int | None) -> ConstantFold:
        """This pass, folding only the first ``limit`` nodes it would fold."""
        return attrs.evolve(self, max_rewrites=limit)

    def __call__(self, ep: ExportedProgram) -> ConstantFoldResult:
        counter = RewriteCounter(self.max_rewrites)
        plan, evaluated = self._plan(ep)
        plan = {  # in graph order, as far as the counter allows
            n.name: plan[n.name]
            for n in ep.graph.nodes
            if n.name in plan and counter.allow(n.target, n.name)
        }
        if not plan:
            return ConstantFoldResult(ep, False, notes=counter.notes)
        return self._apply(ep, plan, evaluated, counter.notes)

    def _plan(self, ep: ExportedProgram) -> tuple[dict[str, tuple[str, torch.Tensor]], set[str]]:
        """Boundary node name -> (name of the node whose value it shares, the value),
        and the names of all the nodes evaluated."""
        state = _graph.state_values(ep)
        ev = self._evaluate(ep, state)
        # Walk backwards so each node knows whether its users were folded.
        rejected: set[torch.fx.Node] = set()
        boundary: dict[str, tuple[str, torch.Tensor]] = {}
        owned: dict[torch.fx.Node, torch.Tensor] = {}
        state_ptrs = {_storage_key(v) for v in state.values() if isinstance(v, torch.Tensor)}
        for node in reversed(ev.order):
            needed = any(u not in ev.values or u in rejected for u in node.users)
            if not needed:
                continue
            value = ev.values[node]
            if not isinstance(value, torch.Tensor) or node in ev.trivial:
                rejected.add(node)
                continue
            if value.nbytes > self.max_growth * ev.source[node]:
                rejected.add(node)
                continue
            first = ev.canon[node]
            if first not in owned:
                with torch.no_grad():
                    owned[first] = _owned(value.detach(), state_ptrs)
            boundary[node.name] = (first.name, owned[first])
        return boundary, {n.name for n in ev.order}

    def _evaluate(self, ep: ExportedProgram, state: dict[str, Any]) -> _Evaluated:
        """Evaluate every node computed from state alone, in graph order."""
        mutated = _writes.mutated_nodes(ep.graph_module, ep.graph_signature)
        ev = _Evaluated()
        seen: dict[Any, torch.fx.Node] = {}
        impure = _dce.impure_test()
        with torch.no_grad():
            for node in ep.graph_module.graph.nodes:
                if node in mutated:
                    continue
                if node.op == "placeholder":
                    value = state.get(node.name)
                    if isinstance(value, torch.Tensor):
                        ev.values[node] = value
                        ev.source[node] = value.nbytes
                        ev.trivial.add(node)
                    continue
                inputs = node.all_input_nodes
                if not all(i in ev.values for i in inputs) or not _foldable_op(node, impure):
                    continue
                # Identical computations (tied weights) share one evaluation and
                # one constant.
                key = _structure(node, ev.canon)
                first = seen.setdefault(key, node)
                ev.canon[node] = ev.canon.get(first, first)
                if first is node:
                    args = torch.fx.node.map_arg(node.args, ev.values.__getitem__)
                    kwargs = torch.fx.node.map_arg(node.kwargs, ev.values.__getitem__)
                    ev.values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
                else:
                    ev.values[node] = ev.values[first]
                ev.order.append(node)
                ev.source[node] = sum(ev.source[i] for i in inputs)
                if len(inputs) == 1 and inputs[0] in ev.trivial and self._relabels(node):
                    ev.trivial.add(node)
        return ev

    def _relabels(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` only copies, relabels or (unless ``fold_views``) re-views
        its single input."""
        if node.target is operator.getitem:
            return True
        schema = _operators.op_schema(node.target)
        if schema is None:
            return False
        return schema.name in _TRIVIAL or (not self.fold_views and schema.name in _VIEWS)

    def _apply(
        self,
        ep: ExportedProgram,
        plan: dict[str, tuple[str, torch.Tensor]],
        evaluated: set[str],
        notes: dict[str, Any],
    ) -> ConstantFoldResult:
        gm = _graph.editable_graph(ep)
        kinds = _graph.input_kinds(ep)
        constants = dict(ep.constants)
        state_ptrs = {
            _storage_key(v) for v in _graph.state_values(ep).values() if isinstance(v, torch.Tensor)
        }
        new_specs: dict[str, InputSpec] = {}
        used_before = {n.name for n in _graph.placeholders(gm) if n.users}
        folded: list[torch.fx.Node] = []
        lifted: dict[str, torch.fx.Node] = {}
        nbytes = 0
        for node in list(gm.graph.nodes):
            entry = plan.get(node.name)
            if entry is None or node.op != "call_function":
                continue
            first, value = entry
            placeholder = lifted.get(first)
            if placeholder is None:
                key = _graph.unique_key(f"folded_{first}", ep.state_dict, constants)
                placeholder = _graph.new_state_placeholder(
                    gm, kinds, f"c_{key}", value, _graph.InputKind.CONSTANT_TENSOR
                )
                if "val" not in placeholder.meta and "val" in node.meta:
                    placeholder.meta["val"] = node.meta["val"]
                constants[key] = value
                new_specs[placeholder.name] = _graph.constant_spec(placeholder.name, key)
                lifted[first] = placeholder
                if _storage_key(value) not in state_ptrs:
                    nbytes += value.nbytes
            node.replace_all_uses_with(placeholder)
            folded.append(node)
        _drop_split_sources(gm, folded)
        # Erase the folded subgraphs (their nodes are now dead), newest first; other
        # dead code is DeadCodeElimination's business.
        for node in reversed(list(gm.graph.nodes)):
            if node.name in evaluated and not node.users:
                gm.graph.erase_node(node)
        now_unused = used_before - {n.name for n in _graph.placeholders(gm) if n.users}
        _graph.remove_unused_state_placeholders(gm, ep.graph_signature, only=now_unused)
        program = _graph.build_program(ep, gm, new_specs=new_specs, constants=constants)
        added = tuple(new_specs[p].target or "" for p in new_specs)
        logger.info("fold-constants: %d nodes folded, %d bytes added", len(folded), nbytes)
        return ConstantFoldResult(
            program,
            True,
            folded=tuple(n.name for n in folded),
            added=added,
            bytes_added=nbytes,
            notes=notes,
        )


def _source_keys(node: torch.fx.Node) -> set[Any]:
    keys: set[Any] = set()
    stack = node.meta.get("source_fn_stack")
    if stack:
        keys.add(("source_fn_stack", stack[-1][0]))
    torch_fn = node.meta.get("torch_fn")
    if torch_fn:
        keys.add(("torch_fn", torch_fn[0]))
    return keys


def _drop_split_sources(gm: torch.fx.GraphModule, folded: list[torch.fx.Node]) -> None:
    """Keep the remaining nodes of a partly folded source call from claiming it.

    The nodes traced from one call (``F.linear``) carry its name in their meta; tools
    such as ``get_source_partitions`` rebuild the call from them (XNNPACK turns
    ``addmm(b, x, permute(w))`` labelled ``linear`` back into ``linear(x, w, b)``).
    Once part of the call is a constant, the rest no longer computes that call from
    its inputs, so the nodes left lose the call's name (``source_fn_stack``,
    ``torch_fn``) and the innermost module scope they shared with the folded node
    (matchers fall back to ``nn_module_stack``).
    """
    keys: set[Any] = set()
    scopes: set[str] = set()
    for node in folded:
        node_keys = _source_keys(node)
        if node_keys:
            keys |= node_keys
            stack = node.meta.get("nn_module_stack")
            if stack:
                scopes.add(next(reversed(stack)))
    if not keys:
        return
    gone = set(folded)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in gone or not (_source_keys(node) & keys):
            continue
        for key in _SOURCE_KEYS:
            node.meta.pop(key, None)
        stack = node.meta.get("nn_module_stack")
        if stack and next(reversed(stack)) in scopes:
            node.meta["nn_module_stack"] = dict(list(stack.items())[:-1])


def _structure(node: torch.fx.Node, canon: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    """A hashable description of the computation at ``node``, inputs canonicalized."""

    def freeze(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("node", canon.get(value, value).name)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *(freeze(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *sorted((k, freeze(v)) for k, v in value.items()))
        if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return (type(value).__name__, value)
        return ("id", id(value))

    return (node.target, freeze(node.args), freeze(node.kwargs))


def _owned(value: torch.Tensor, state_ptrs: set[int | None]) -> torch.Tensor:
    """The tensor to keep for a folded value, never holding more memory than needed.

    A view into a state tensor (the ``permute`` of a weight) is kept as that view:
    it costs no memory, since the store keeps the weight anyway, and reads what the
    original graph computed. A contiguous value that owns its storage is kept as
    it is; anything else (a view into a larger intermediate) is copied.
    """
    key = _storage_key(value)
    if key is not None and key in state_ptrs:
        return value
    if (
        value.is_contiguous()
        and value.untyped_storage().nbytes() == value.nbytes
        and value.storage_offset() == 0
    ):
        return value
    return value.clone(memory_format=torch.contiguous_format)

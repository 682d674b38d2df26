"""What the incremental path can take: the walk that says why not, and what the
retrace sees of the program's state.

One concept: whether the incremental path can take a program, and why not; one walk
answers for every reason.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from epass import _operators, _tensors
from epass._decomp import table
from epass._torch import internals

__all__ = [
    "THROUGH",
    "Fallback",
    "Plan",
    "View",
    "argument",
    "check",
    "exact_here",
    "is_plain_call",
    "retrace_grads",
    "returns_a_view_of_an_input",
    "returns_its_input",
    "state_tensors",
    "unsafe_reason",
    "written_argument",
]


def exact_here(what: str) -> None:
    """Raise :class:`Fallback` for ``what`` on a torch release other than the one the
    engine emulates it on (``internals.EXACT_RELEASE``)."""
    reason = internals.inexact(what)
    if reason is not None:
        raise Fallback(reason)


class Fallback(Exception):
    """The incremental path cannot promise torch's result; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_SYM_FUNCTIONS = frozenset(
    getattr(torch, name)
    for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
    if hasattr(torch, name)
)


def _returns_nothing(target: Any) -> bool:
    """An operator that returns nothing (``_assert_tensor_metadata``, say): a loaded
    program's node for it carries no ``val``, and needs none."""
    schema = _operators.op_schema(target)
    return schema is not None and not schema.returns


def is_plain_call(target: Any) -> bool:
    """Whether a call target is Python arithmetic on sizes or tuple indexing, which
    a retrace reproduces unchanged."""
    module = getattr(target, "__module__", None)
    return module in ("_operator", "operator", "math", "builtins") or target in _SYM_FUNCTIONS


@attrs.frozen
class View:
    """A view of a tensor written in place.

    Attributes:
        owner: the tensor written in place.
        start: what its chain of views starts from (the tensor, or an in-place result
            aliasing it).
        chain: the views from ``start`` to this one, this one last.
    """

    owner: torch.fx.Node
    start: torch.fx.Node
    chain: tuple[torch.fx.Node, ...]


@attrs.frozen
class Plan:
    """What one walk over a program found.

    Attributes:
        reason: why the incremental path cannot promise torch's result (None: it can).
        no_write: in-place nodes the path takes only if their decomposition writes
            nothing (a CompositeImplicitAutograd op such as ``dropout_`` in eval
            mode, through a view or into an input), each with the reason to give
            when it does write.
        views: every view of a tensor written in place (see :class:`View`).
            Functionalization regenerates such a view from the tensor's current value
            where it is read after a write (see ``views``).
        through: in-place nodes that write through a view of an intermediate, each
            with that view: the last of a chain of views (see ``THROUGH``) from the
            tensor itself, which functionalization writes back with each view's
            inverse in turn (``writeback.INVERSES``).
    """

    reason: str | None
    no_write: Mapping[torch.fx.Node, str] = attrs.field(factory=dict)
    views: Mapping[torch.fx.Node, View] = attrs.field(factory=dict)
    through: Mapping[torch.fx.Node, torch.fx.Node] = attrs.field(factory=dict)


def unsafe_reason(ep: ExportedProgram, tables: table.Tables) -> str | None:
    """Why the incremental path cannot promise torch's result for ``ep`` (or None).

    One walk over the nodes, no tracing.
    """
    return check(ep, tables).reason


def check(ep: ExportedProgram, tables: table.Tables) -> Plan:
    """:func:`unsafe_reason` and what the splice must watch for (see :class:`Plan`)."""
    aliases = _Aliases(ep.graph)
    reason = _reason(ep, tables, aliases)
    if reason is None:
        reason = aliases.finish()
    return Plan(reason, aliases.no_write, aliases.regenerated(), aliases.through)


def _reason(ep: ExportedProgram, tables: table.Tables, aliases: _Aliases) -> str | None:
    if ep.dialect not in ("ATEN", "TRAINING"):
        return f"dialect {ep.dialect!r}"
    sig = ep.graph_signature
    if sig.backward_signature is not None:
        return "a joint (forward and backward) graph"
    for spec in sig.input_specs:
        if spec.kind in (InputKind.TOKEN, InputKind.CUSTOM_OBJ):
            return f"a {spec.kind.name.lower()} input ({spec.arg.name})"
    problem = _state_problem(ep)
    if problem is not None:
        return problem
    for out in sig.output_specs:
        if out.kind == OutputKind.TOKEN:
            return "effect tokens"
        if out.kind != OutputKind.USER_OUTPUT:
            return f"a mutation output ({out.kind.name.lower()} {out.target})"
    if table.has_packet_keys(tables):
        return "the table has an operator packet key"
    for node in ep.graph.nodes:
        if node.op in ("get_attr", "call_module") and not _is_body(node):
            return f"a {node.op} node ({node.name})"
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and (val.is_conj() or val.is_neg()):
            # The retrace resolves such a view (a clone) before any op that cannot
            # read the bit, a list kept in torch's C++ fallback.
            return f"a conjugate or negative view ({node.name})"
        if node.op == "placeholder" and not isinstance(
            node.meta.get("val"), (torch.Tensor, torch.SymInt, int, float, bool, type(None))
        ):
            return f"input {node.name} carries no value"
        if node.op != "call_function":
            continue
        target = node.target
        problem = aliases.see(node)
        if problem is not None:
            return problem
        if _operators.is_op_overload(target):
            if target.namespace != "aten" and (
                _operators.is_mutable_op(target)
                or _operators.is_view_op(target)
                or (table.is_cia(target) and not table.splices(node, tables))
            ):
                # The retrace functionalizes a write (``auto_functionalized``), a
                # view, or runs a CompositeImplicitAutograd kernel; another operator
                # (a custom op with a fake kernel) it keeps, computing its value.
                return f"a non-ATen op ({target} at {node.name})"
            if target in _DERIVED_SIZES and isinstance(val, torch.SymInt):
                # The retrace's trace computes it from the sizes it tracks (numel:
                # a product of sym_size nodes); a copy would keep the query.
                return f"a symbolic {target.overloadpacket.__name__} ({node.name})"
        elif _operators.is_higher_order(target):
            if target not in table.REGIONS:
                return f"a higher-order op ({target.name()} at {node.name})"
        elif not is_plain_call(target):
            return f"an unknown call target ({target!r} at {node.name})"
        if "val" not in node.meta and not _returns_nothing(target):
            return f"node {node.name} carries no value"
    return None


def _is_body(node: torch.fx.Node) -> bool:
    """Whether the ``get_attr`` ``node`` holds a region's body (``table.REGIONS``) and
    nothing else reads it: the region's trace runs it, and the retrace keeps no
    attribute."""
    return (
        node.op == "get_attr"
        and bool(node.users)
        and all(
            user.op == "call_function"
            and user.target in table.REGIONS
            and len(user.args) > table.REGIONS[user.target]
            and user.args[table.REGIONS[user.target]] is node
            and list(user.args).count(node) == 1
            and node not in user.kwargs.values()
            for user in node.users
        )
    )


# Size queries other than ``sym_size``: a trace re-derives a symbolic one.
_DERIVED_SIZES = frozenset(
    (
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_storage_offset.default,
    )
)


def written_argument(op: Any) -> int | None:
    """The position of the one argument an in-place operator writes into and returns
    (``relu_``'s ``self``), or None: ``op`` writes nothing, or writes otherwise (an
    ``out=`` argument, several arguments, a list, or returns something else)."""
    schema = _operators.op_schema(op)
    if schema is None:
        return None
    writes = [
        i
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]
    if len(writes) != 1:
        return None
    arg = schema.arguments[writes[0]]
    returns = schema.returns
    if (
        arg.kwarg_only
        or not isinstance(arg.type, torch.TensorType)
        or len(returns) != 1
        or returns[0].alias_info is None
        or returns[0].alias_info.before_set != arg.alias_info.before_set
    ):
        return None
    return writes[0]


def argument(node: torch.fx.Node, position: int) -> Any:
    """The value ``node`` passes for its operator's argument at ``position``."""
    if position < len(node.args):
        return node.args[position]
    schema = _operators.op_schema(node.target)
    assert schema is not None
    name = schema.arguments[position].name
    return node.kwargs.get(name, schema.arguments[position].default_value)


def _view_of(node: torch.fx.Node) -> Any:
    """The node whose storage ``node``'s value is a view of (None: its own storage); for
    an item of a multi-output view (``split``), that view."""
    target = node.target
    if target is operator.getitem:
        # An item of a multi-output op: a view where that op returns views (split).
        producer = node.args[0]
        if not isinstance(producer, torch.fx.Node) or not _operators.is_op_overload(
            producer.target
        ):
            return None
        return producer if _view_of(producer) is not None else None
    schema = _operators.op_schema(target)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return None
    # A view's schema marks the argument it aliases (``Tensor(a) self``, and
    # ``Tensor(a -> *) self`` where it returns a list of views: split, unbind).
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and not arg.alias_info.is_write:
            base = argument(node, i)
            return base if isinstance(base, torch.fx.Node) else None
    return None


# The view operators of a program a write may go through: each decomposes into one
# view whose inverse functionalization knows (``writeback.INVERSES``); the splice
# checks what the table made.
THROUGH = frozenset(
    {
        torch.ops.aten.alias.default,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.select.int,
        torch.ops.aten.diagonal.default,
        torch.ops.aten.narrow.default,
        torch.ops.aten.view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten.flatten.using_ints,
        torch.ops.aten.unflatten.int,
        torch.ops.aten.permute.default,
        torch.ops.aten.transpose.int,
        torch.ops.aten.t.default,
        torch.ops.aten.unsqueeze.default,
    }
)


# View operators that copy where their input's strides allow no view.
_MAYBE_COPIES = frozenset(
    {
        torch.ops.aten.contiguous.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten.flatten.using_ints,
    }
)


def _copies(node: torch.fx.Node) -> bool:
    """Whether ``node`` (``contiguous``, ``reshape``, ``flatten``) copies its input
    rather than view it: a new tensor, not an alias. ``contiguous`` returns its input
    itself or a copy with other strides; a reshape is decided where all sizes and
    strides are static (a symbolic one leaves it a view)."""
    if node.target not in _MAYBE_COPIES or not isinstance(node.args[0], torch.fx.Node):
        return False
    val, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    if node.target is torch.ops.aten.contiguous.default:
        return [str(s) for s in (*val.shape, *val.stride())] != [
            str(s) for s in (*out.shape, *out.stride())
        ]
    sizes = (*val.shape, *val.stride(), *out.shape)
    if not all(isinstance(s, int) for s in sizes):
        return False
    return not _views_as(tuple(val.shape), tuple(val.stride()), tuple(out.shape))


@functools.lru_cache(maxsize=1024)
def _views_as(shape: tuple[int, ...], stride: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` can be viewed with sizes ``out``."""
    try:
        torch.empty_strided(shape, stride, device="meta").view(out)
    except RuntimeError:  # no view has these sizes: a reshape copies
        return False
    return True


class _Aliases:
    """The writes of in-place operators the incremental path takes as the retrace's
    functionalization does: into an intermediate value (not a program input), itself
    or through a chain of views it can invert, with no view of it read after the
    write that it cannot make again. A walk in program order (``see`` each node in
    turn)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.root: dict[torch.fx.Node, torch.fx.Node] = {}  # alias -> its storage's owner
        self.views: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # owner -> its views
        self.base: dict[torch.fx.Node, torch.fx.Node] = {}  # view -> what it views
        self.written: set[torch.fx.Node] = set()  # in-place results
        self.owners: set[torch.fx.Node] = set()  # tensors written in place
        self.no_write: dict[torch.fx.Node, str] = {}  # see Plan
        self.through: dict[torch.fx.Node, torch.fx.Node] = {}  # see Plan
        self.writes: dict[torch.fx.Node, int] = {}  # owner -> in-place writes into it
        self.through_at: dict[torch.fx.Node, int] = {}  # see -> writes into owner so far

    def see(self, node: torch.fx.Node) -> str | None:
        """Record ``node``; why the incremental path cannot take it (None: it can)."""
        target = node.target
        if not (_operators.is_op_overload(target) and _operators.is_mutable_op(target)):
            base = _view_of(node)
            if base is not None and not _copies(node):
                owner = self.root.get(base, base)
                self.root[node] = owner
                self.base[node] = base
                self.views.setdefault(owner, []).append(node)
            return None
        at = written_argument(target)
        if at is None:
            return f"a mutating op ({target} at {node.name})"
        written = argument(node, at)
        if not isinstance(written, torch.fx.Node):
            return f"a mutating op ({target} at {node.name}) writing into a constant"
        owner = self.root.get(written, written)
        problem = self._problem(node, written, owner)
        if problem is not None:
            if not table.is_cia(target):
                return problem
            # Decomposed before functionalization: it may write nothing at all
            # (dropout_ in eval mode), which the splice checks; its result is then
            # the tensor itself.
            self.no_write[node] = problem
            self.root[node] = owner
            self.views.setdefault(owner, []).append(node)
            return None
        self.root[node] = owner
        self.owners.add(owner)
        self.writes[owner] = self.writes.get(owner, 0) + 1
        if written in self.root and written not in self.written:
            self.through[node] = written  # checked by _problem: views it can invert
            self.through_at[node] = self.writes[owner]
        else:
            self.written.add(node)
        return None

    def finish(self) -> str | None:
        """Why a view of a tensor written in place cannot be regenerated as the
        retrace regenerates it (None: each can): a view the program returns, what a
        write through a view returned
        when the program returns it after another write into the tensor, or a view of
        what a write through a view returned, where the tensor is written more than
        once."""
        for node, at in self.through_at.items():
            owner = self.root[node]
            if self.writes[owner] > at and any(user.op == "output" for user in node.users):
                return (
                    f"a view of {owner.name} written in place, returned ({node.name}, "
                    "written through)"
                )
        for owner in self.owners:
            for view in self.views.get(owner, ()):
                if view in self.no_write:
                    continue
                start = view
                while start in self.base:
                    start = self.base[start]
                if start in self.through and self.writes[owner] > 1:
                    return (
                        f"a view ({view.name}) of what a write through a view returned "
                        f"({start.name}), and {owner.name} is written more than once"
                    )
        return None

    def _invertible(self, view: torch.fx.Node, owner: torch.fx.Node) -> bool:
        """Whether ``view`` is a chain of views with an inverse from the intermediate
        ``owner`` (or from an in-place result that is ``owner`` itself: ``relu_``'s)."""
        if owner.op != "call_function":
            return False
        while view is not owner:
            if view in self.written:
                return self.root.get(view) is owner
            if view.target not in THROUGH:
                return False
            base = self.base.get(view)
            if base is None:
                return False
            view = base
        return True

    def regenerated(self) -> dict[torch.fx.Node, View]:
        """Each view of a tensor written in place."""
        found = {}
        for owner in self.owners:
            for view in self.views.get(owner, ()):
                if view in self.no_write:
                    continue
                chain = [view]
                while self.base[chain[-1]] in self.base:
                    chain.append(self.base[chain[-1]])
                found[view] = View(owner, self.base[chain[-1]], tuple(reversed(chain)))
        return found

    def _problem(
        self, node: torch.fx.Node, written: torch.fx.Node, owner: torch.fx.Node
    ) -> str | None:
        target = node.target
        if (
            written in self.root
            and written not in self.written
            and not (self._invertible(written, owner) and not table.is_cia(target))
        ):
            return f"a write through a view ({target} at {node.name}, into {written.name})"
        if owner.op != "call_function":
            return f"a write into input {owner.name} ({target} at {node.name})"
        return None


def _state_problem(ep: ExportedProgram) -> str | None:
    """Why the retrace would see other state tensors than the program recorded (None:
    it sees the same). The retrace fakes the state tensors themselves, and a
    decomposition may branch on any of their properties."""
    vals = {}
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            break
        vals[node.name] = node.meta.get("val")
    for name, tensor in (state_tensors(ep) | _constant_tensors(ep)).items():
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return f"a state tensor of type {type(tensor).__name__} ({name})"
        val = vals.get(name)
        if not isinstance(val, torch.Tensor) or (
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.dtype,
            tensor.device,
            tensor.layout,
        ) != (
            tuple(val.shape),
            tuple(val.stride()),
            val.storage_offset(),
            val.dtype,
            val.device,
            val.layout,
        ):
            return f"state tensor {name} is not the tensor the program recorded"
    return None


def retrace_grads(ep: ExportedProgram) -> frozenset[str]:
    """The placeholders whose value requires grad in the retrace: it traces the user's
    inputs as the program recorded them and fakes of the state tensors themselves,
    under ``no_grad`` (so no value computed in the graph requires grad)."""
    state = state_tensors(ep)
    grads = set()
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            break
        value = state.get(node.name, node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.requires_grad:
            grads.add(node.name)
    return frozenset(grads)


def state_tensors(ep: ExportedProgram) -> dict[str, Any]:
    """The tensors the retrace fakes for the parameter and buffer placeholders."""
    found = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target is not None:
            store = ep.state_dict if spec.target in ep.state_dict else ep.constants
            if spec.target in store:
                found[spec.arg.name] = store[spec.target]
    return found


def _constant_tensors(ep: ExportedProgram) -> dict[str, Any]:
    """The tensors of the constant-tensor placeholders, which the retrace also fakes
    from the tensors themselves (registered as buffers for the trace)."""
    return {
        spec.arg.name: ep.constants[spec.target]
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.CONSTANT_TENSOR
        and spec.target is not None
        and isinstance(ep.constants.get(spec.target), torch.Tensor)
    }


def returns_a_view_of_an_input(graph: torch.fx.Graph) -> bool:
    """Whether a traced graph returns one of its inputs, or a view of one."""
    for leaf in _tensors.tree_leaves(graph.output_node().args[0]):
        node = leaf
        while isinstance(node, torch.fx.Node) and node.op == "call_function":
            base = _view_of(node)
            if base is None:
                break
            node = base
        if isinstance(node, torch.fx.Node) and node.op == "placeholder":
            return True
    return False


def returns_its_input(template: Any, inputs: list[torch.fx.Node], args: Any, op: Any) -> bool:
    """Whether an in-place operator's template writes nothing: it returns the tensor
    it was to write, untouched."""
    at = written_argument(op)
    if at is None or at >= len(args):
        return False
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    result = template.graph.output_node().args[0]
    return any(
        ph is result and node is args[at] for ph, node in zip(placeholders, inputs, strict=True)
    )

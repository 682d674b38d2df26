"""The incremental decomposition engine: rewrite only the nodes a table decomposes.

Every torch internal it leans on is listed in ``INTERNALS`` and pinned by
``tests/test_decomp_internals.py``; ``docs/compat.md`` lists them too.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import operator
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    CustomObjArgument,
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    SymIntArgument,
    TensorArgument,
)

from epass import _program, _template_store
from epass._decomp import identity
from epass._program import pytree

__all__ = [
    "INTERNALS",
    "COMPARED_META",
    "LOCK",
    "CacheName",
    "Fallback",
    "OutOfTime",
    "Tables",
    "cache_info",
    "cache_name",
    "const_key",
    "clear_cache",
    "decompose",
    "fill",
    "first_difference",
    "is_plain_call",
    "missing_templates",
    "retrace_grads",
    "rewrites",
    "run_decompositions",
    "splices",
    "split_table",
    "template_work",
    "torch_state",
    "unsafe_reason",
]

# The torch internals this module uses, by dotted path. Each one is pinned by a test.
INTERNALS = (
    "torch.export.exported_program._split_decomp_table_to_cia_and_python_decomp",
    "torch.export.exported_program._override_composite_implicit_decomp",
    "torch.export.exported_program._get_updated_module_call_graph",
    "torch.export.exported_program._special_op_to_preserve_cia",
    "torch._export.utils._is_cia_op",
    "torch._export.utils._is_preservable_cia_op",
    "torch._export.utils._get_decomp_for_cia",
    "torch._export.utils._collect_all_valid_cia_ops",  # walked as it walks
    "torch._export.utils._collect_all_valid_cia_ops_for_aten_namespace",
    "torch._export.utils._materialize_cpp_cia_ops",
    "torch._ops._OpNamespace",
    "torch._ops.OpOverloadPacket.op_overloads",
    "torch._ops.OpOverload._overloadpacket",
    "torch._ops.OpOverload._overloadname",
    "torch._decomp._core_aten_decompositions_post_autograd",
    "torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS",
    "torch._export.utils._compiling_state_context",
    "torch.export._trace._ignore_backend_decomps",  # mirrored by _backend_decomps_off
    "torch._C._dispatch_get_registrations_for_dispatch_key",
    "torch._subclasses.functional_tensor.FunctionalTensorMode",
    "torch._functorch._aot_autograd.functional_utils.to_fun",
    "torch._functorch._aot_autograd.functional_utils.from_fun",
    "torch._functorch._aot_autograd.functional_utils.has_data_mutation",
    "torch._functorch._aot_autograd.functional_utils.has_metadata_mutation",
    "torch._guards.detect_fake_mode",
    "torch.fx.experimental.proxy_tensor.make_fx",
    "torch.fx.experimental.proxy_tensor.get_proxy_mode",  # .tracer.graph
    "torch._dispatch.python.enable_python_dispatcher",
    "torch.fx.traceback.preserve_node_meta",
    "torch.fx.traceback.set_current_meta",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv",  # var_to_range, unbacked_symint_counter
    "torch.fx.passes.runtime_assert.insert_deferred_runtime_asserts",
    "torch._export.passes._node_metadata_hook._set_node_metadata_hook",
    "torch._export.passes._node_metadata_hook._node_metadata_hook",
    "torch._dynamo.config.do_not_emit_runtime_asserts",
    "torch.fx.proxy._COPY_META_FIELDS",
    "torch._ops.OpOverload.py_kernels",
    "torch._ops.OpOverload._dispatch_cache",
    "torch._subclasses.fake_impls.op_implementations_dict",
    "torch._subclasses.fake_impls.op_implementations_checks",
)

# The stack trace the retrace gives the nodes its runtime-assertion pass adds
# (``torch/export/exported_program.py``, ``_decompose_and_get_gm_with_new_signature_constants``).
_RUNTIME_ASSERT_TRACE = (
    'File "torch/fx/passes/runtime_assert.py", line 24, in insert_deferred_runtime_asserts'
)

# Size queries: the retrace re-emits them as they are.
_SIZE_OPS = frozenset(
    (
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    )
)
_SYM_FUNCTIONS = frozenset(
    getattr(torch, name)
    for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
    if hasattr(torch, name)
)
# Node meta the retrace carries from an original node onto the nodes it becomes.
_CARRIED_META = ("stack_trace", "nn_module_stack", "custom")
# The retrace runs each node under a copy of that node's meta, and the tracer copies
# these fields from it onto every node it creates; the tracer itself may overwrite
# them meanwhile (``original_aten`` is set around each ATen call and reset to None
# after it). ``custom`` is merged and ``nn_module_stack`` follows its own rule.
_INHERITED_META = tuple(
    f
    for f in torch.fx.proxy._COPY_META_FIELDS
    if f not in ("from_node", "custom", "nn_module_stack")
)


class _Inherited:
    """Template meta value standing for "the rewritten node's own value, if any"."""

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        self.field = field

    def __copy__(self) -> _Inherited:
        return self  # the tracer copies meta values; the marker must stay itself

    def __deepcopy__(self, memo: Any) -> _Inherited:
        return self

    def __repr__(self) -> str:
        return f"<the rewritten node's {self.field}>"


_MARKERS = {f: _Inherited(f) for f in _INHERITED_META}


class Fallback(Exception):
    """The incremental path cannot promise torch's result; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- the table, split the way run_decompositions splits it ---------------------------


@attrs.frozen(eq=False)
class Tables:
    """A decomposition table split into CompositeImplicitAutograd overrides and
    Python decompositions, exactly as ``run_decompositions`` splits it.

    Attributes:
        cia: CIA op -> callable (torch's preserve marker keeps the op).
        python: post-autograd op -> decomposition.
        token: hashable identity of the table's state, part of every template key.
    """

    cia: Mapping[Any, Callable[..., Any]]
    python: Mapping[Any, Callable[..., Any]]
    token: Any


# --- torch's global state -------------------------------------------------------------

LOCK = threading.RLock()
"""The process-wide lock around torch's global state. Tracing a decomposition (which
overrides the CompositeImplicitAutograd kernels of every such operator and registers
fake tensor rules, for the whole process) and every ``run_decompositions`` epass calls
hold it, as does a whole incremental decomposition (templates are traced and values
propagated in the program's fake mode and shape environment, shared by every thread
working on that program). It also guards the caches of this module. Reentrant."""


@contextlib.contextmanager
def torch_state(ops: Iterable[Any]) -> Iterator[None]:
    """Hold :data:`LOCK`, and on the way out, whatever happened, put back the Python
    kernels of ``ops`` and torch's fake tensor rules as they were.

    torch's own CompositeImplicitAutograd override restores the kernels it patched
    only once it is fully set up, and drops the fake tensor rule of every op it
    patched, including rules that were there before (``aten.item``, for one).
    """
    from torch._subclasses import fake_impls

    with LOCK:
        kernels = [(op, op.py_kernels.copy()) for op in ops]
        rules = fake_impls.op_implementations_dict.copy()
        checks = list(fake_impls.op_implementations_checks)
        try:
            yield
        finally:
            for op, saved in kernels:
                if op.py_kernels != saved:
                    op.py_kernels.clear()
                    op.py_kernels.update(saved)
                    op._dispatch_cache.clear()
            if fake_impls.op_implementations_dict != rules:
                fake_impls.op_implementations_dict.clear()
                fake_impls.op_implementations_dict.update(rules)
            if fake_impls.op_implementations_checks != checks:
                fake_impls.op_implementations_checks[:] = checks


def _patchable_ops() -> frozenset[Any]:
    """The operators torch's CompositeImplicitAutograd override patches for any table
    (the CIA side of a split holds these and the table's own keys): the set of
    ``_collect_all_valid_cia_ops``, walked the way it walks, with the C++ registrations
    loaded once rather than once per namespace (a test pins the two sets equal). Not
    cached, as torch does not cache it: a library can go and come back with new
    operator objects under the same names."""
    from torch._export.utils import (
        _collect_all_valid_cia_ops_for_aten_namespace,
        _is_preservable_cia_op,
        _materialize_cpp_cia_ops,
    )

    _materialize_cpp_cia_ops()
    ops = set(_collect_all_valid_cia_ops_for_aten_namespace())  # torch caches this one
    for space_name in list(torch.ops):
        space = getattr(torch.ops, space_name)
        if space_name == "aten" or not isinstance(space, torch._ops._OpNamespace):
            continue
        for packet_name in list(space):
            for op in getattr(space, packet_name).op_overloads():
                if _is_preservable_cia_op(op):
                    ops.add(op)
    return frozenset(ops)


def run_decompositions(ep: ExportedProgram, table: Any = None) -> ExportedProgram:
    """``ep.run_decompositions(table)``, under :func:`torch_state` for every operator its
    CompositeImplicitAutograd override can patch. The only way epass calls it."""
    ops = set(_patchable_ops())
    if table is not None:
        # keys(): a CustomDecompTable is a dict whose entries live elsewhere
        keys = table.keys()
        ops.update(op for op in keys if _program.is_op_overload(op))
    with torch_state(ops):
        return ep.run_decompositions(table)


# --- the table, split the way run_decompositions splits it (continued) ---------------

_SPLITS: collections.OrderedDict[Any, Tables] = collections.OrderedDict()


class _Same:
    """A key part standing for one object: equal only to a part holding that same
    object, which it keeps alive for as long as the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __repr__(self) -> str:
        return f"_Same({self.obj!r})"


def _cia_registrations() -> frozenset[str]:
    return frozenset(
        torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    )


class _DefaultSide(Mapping[Any, Callable[..., Any]]):
    """One side (``"cia"`` or ``"python"``) of torch's default table less ``keep``,
    split as ``run_decompositions`` splits it.

    Building that split walks every operator torch knows (about 0.3 s, once per
    process), while a program asks about a few dozen: a lookup answers for one
    operator from the same rules torch's table and split follow (pinned operator by
    operator against torch's own split by a test), and iterating builds torch's split
    itself, which lookups use from then on.
    """

    def __init__(self, split: _DefaultSplit, side: str) -> None:
        self._split = split
        self._index = ("cia", "python").index(side)

    def _whole(self) -> Mapping[Any, Callable[..., Any]]:
        return self._split.materialize()[self._index]

    def __getitem__(self, op: Any) -> Callable[..., Any]:
        built = self._split.built
        side = built[self._index] if built is not None else None
        value: Callable[..., Any] | None = (
            side[op] if side is not None else self._split.lookup(op)[self._index]
        )
        if value is None:
            raise KeyError(op)
        return value

    def __iter__(self) -> Iterator[Any]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())


def _walk_meets(op: Any) -> bool:
    """Whether torch's walk of the loaded operators (``_collect_all_valid_cia_ops``, what
    its table and split take as preservable) meets this very object: its namespace's
    packet, and the overload that packet lists under its name. An object made by
    ``getattr(packet, "")`` is another object for the default overload, and the walk
    never meets it."""
    if op.namespace not in torch.ops:  # iterates what is loaded, creating nothing
        return False
    space = getattr(torch.ops, op.namespace)
    packet = op._overloadpacket
    return (
        isinstance(space, torch._ops._OpNamespace)
        and packet.__name__ in space
        and getattr(space, packet.__name__) is packet
        and op._overloadname in packet.overloads()
        and getattr(packet, op._overloadname) is op
    )


class _DefaultSplit:
    """torch's default table less ``keep``: answered operator by operator, built whole
    on demand (see :class:`_DefaultSide`)."""

    def __init__(self, keep: frozenset[Any]) -> None:
        from torch._decomp import _core_aten_decompositions_post_autograd

        self.keep = keep
        self.core = _core_aten_decompositions_post_autograd()
        self.built: tuple[dict[Any, Any], dict[Any, Any]] | None = None
        self._answers: dict[Any, tuple[Any, Any]] = {}

    def lookup(self, op: Any) -> tuple[Any, Any]:
        """``op``'s entry on the CIA side and on the Python side (None: no entry).

        torch's default table holds the core ATen decompositions and, for every
        CompositeImplicitAutograd op it may preserve (functional, not aliasing, with
        a kernel) outside a short ATen list it keeps, the op's own decomposition;
        ``keep`` comes off. The split moves every such preservable op to the CIA side,
        with the preserve marker where the table has no entry for it.
        """
        answer = self._answers.get(op)
        if answer is not None:
            return answer
        from torch._export.utils import _is_preservable_cia_op
        from torch.export.exported_program import _special_op_to_preserve_cia

        if _program.is_op_overload(op):
            if _is_preservable_cia_op(op) and _walk_meets(op):
                answer = (self._entry(op) or _special_op_to_preserve_cia, None)
            else:
                answer = (None, None if op in self.keep else self.core.get(op))
        else:
            answer = (None, None)  # the table's keys are operator overloads
        self._answers[op] = answer
        return answer

    def materialize(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """torch's split of the table (built once), from the same rules: every
        operator torch's walk finds preservable goes to the CIA side, every other
        entry of the core decompositions to the Python side. That is one walk where
        torch's table and split make two, each loading every C++ registration once per
        namespace (about 0.4 s in a fresh process). A core entry for a preservable
        operator the walk does not find is a case torch's split treats apart: the split
        is then torch's own. A test compares both sides with torch's, key by key."""
        from torch._export.utils import _is_preservable_cia_op
        from torch.export.exported_program import _special_op_to_preserve_cia

        with LOCK:
            if self.built is None:
                walked = _patchable_ops()
                cia = {op: self._entry(op) or _special_op_to_preserve_cia for op in walked}
                python = {}
                for op, fn in self.core.items():
                    if op in self.keep or op in walked:
                        continue
                    if _is_preservable_cia_op(op):
                        return self._torch_split()
                    python[op] = fn
                self.built = (cia, python)
            return self.built

    def _entry(self, op: Any) -> Any:
        """The table's entry for ``op``, a preservable operator (None: none)."""
        from torch._export.utils import _get_decomp_for_cia
        from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

        if op in self.keep:
            return None
        if op in self.core:
            return self.core[op]
        if op.namespace == "aten" and op in PRESERVED_ATEN_CIA_OPS:
            return None
        return _get_decomp_for_cia(op)

    def _torch_split(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp

        full = torch.export.default_decompositions()
        for op in self.keep:
            full.pop(op, None)
        self.built = _split_decomp_table_to_cia_and_python_decomp(dict(full.materialize()))
        return self.built


def split_table(
    table: Mapping[Any, Callable[..., Any]] | None, keep: tuple[Any, ...] = ()
) -> Tables:
    """Split ``table`` (``None``: torch's default table less ``keep``) like
    ``run_decompositions``.

    Splits are cached for the process (the last 32), keyed by the set of
    CompositeImplicitAutograd registrations (a newly registered op invalidates them)
    and by ``keep`` for the default table, or by the table's operators and callables
    for an explicit one. The key holds the callables themselves, never their ``id()``:
    a freed table's address can go to another function, which must not be served this
    table's templates. The key is the split's ``token``. The default table's sides
    answer lookups without building torch's split (see :class:`_DefaultSide`).
    """
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp

    regs = _cia_registrations()
    key: tuple[Any, ...]
    if table is None:
        key = ("default", regs, frozenset(keep))
    else:
        key = ("explicit", regs, frozenset((op, _Same(fn)) for op, fn in table.items()))
    with LOCK:
        cached = _SPLITS.get(key)
        if cached is not None:
            _SPLITS.move_to_end(key)
            return cached
    if table is None:
        split = _DefaultSplit(frozenset(keep))
        tables = Tables(_DefaultSide(split, "cia"), _DefaultSide(split, "python"), key)
    else:
        cia, python = _split_decomp_table_to_cia_and_python_decomp(dict(table))
        tables = Tables(cia, python, key)
    with LOCK:
        if any(k[1] != regs for k in _SPLITS):
            _SPLITS.clear()
        _SPLITS[key] = tables
        while len(_SPLITS) > 32:
            _SPLITS.popitem(last=False)
    return tables


def has_packet_keys(tables: Tables) -> bool:
    """Whether the table's Python side has an operator packet key (which stands for
    every overload of the op)."""
    python = tables.python
    if isinstance(python, _DefaultSide):
        return False  # torch's default table is keyed by overloads (a test pins it)
    return any(_program.is_op_packet(k) for k in python)


def rewrites(op: Any, tables: Tables) -> bool:
    """Whether a retrace with ``tables`` replaces the operator overload ``op``.

    The one answer: ``Decompose.skip_reason`` skips a program only when this is
    False for every op in it, and the engine splices exactly the nodes it is True
    for. Functionalization replaces a mutating op; the Python table rewrites its
    ops (a packet key stands for every overload); a CompositeImplicitAutograd op is
    decomposed unless the table preserves it (torch's split marks the preserved).
    """
    from torch._export.utils import _is_cia_op
    from torch.export.exported_program import _special_op_to_preserve_cia

    if op in _SIZE_OPS:
        return False
    if _program.is_mutable_op(op):
        return True
    if op in tables.python or op.overloadpacket in tables.python:
        return True
    if _is_cia_op(op):
        return tables.cia.get(op) is not _special_op_to_preserve_cia
    return False


def splices(node: torch.fx.Node, tables: Tables) -> bool:
    """Whether the engine replaces ``node`` with its operator's decomposition: a
    call of an operator overload that :func:`rewrites` says the table rewrites."""
    return (
        node.op == "call_function"
        and _program.is_op_overload(node.target)
        and rewrites(node.target, tables)
    )


# --- safety -------------------------------------------------------------------------


def _returns_nothing(target: Any) -> bool:
    """An operator that returns nothing (``_assert_tensor_metadata``, say): a loaded
    program's node for it carries no ``val``, and needs none."""
    schema = _program.op_schema(target)
    return schema is not None and not schema.returns


def is_plain_call(target: Any) -> bool:
    """Whether a call target is Python arithmetic on sizes or tuple indexing, which
    a retrace reproduces unchanged."""
    module = getattr(target, "__module__", None)
    return module in ("_operator", "operator", "math", "builtins") or target in _SYM_FUNCTIONS


def unsafe_reason(ep: ExportedProgram, tables: Tables) -> str | None:
    """Why the incremental path cannot promise torch's result for ``ep`` (or None).

    One walk over the nodes, no tracing.
    """
    if ep.dialect not in ("ATEN", "TRAINING"):
        return f"dialect {ep.dialect!r}"
    sig = ep.graph_signature
    if sig.backward_signature is not None:
        return "a joint (forward and backward) graph"
    for spec in sig.input_specs:
        if spec.kind in (InputKind.TOKEN, InputKind.CUSTOM_OBJ):
            return f"a {spec.kind.name.lower()} input ({spec.arg.name})"
        if spec.kind == InputKind.CONSTANT_TENSOR:
            # The retrace registers constants as buffers and lifts them again, in
            # an order of its own (by module, then by use).
            return f"a lifted constant input ({spec.arg.name}); the retrace re-orders them"
    problem = _state_problem(ep)
    if problem is not None:
        return problem
    for out in sig.output_specs:
        if out.kind == OutputKind.TOKEN:
            return "effect tokens"
        if out.kind != OutputKind.USER_OUTPUT:
            return f"a mutation output ({out.kind.name.lower()} {out.target})"
    if has_packet_keys(tables):
        return "the table has an operator packet key"
    for node in ep.graph.nodes:
        if node.op in ("get_attr", "call_module"):
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
        if _program.is_op_overload(target):
            if _program.is_mutable_op(target):
                return f"a mutating op ({target} at {node.name})"
            if target.namespace != "aten":
                return f"a non-ATen op ({target} at {node.name})"
        elif _program.is_higher_order(target):
            return f"a higher-order op ({target.name()} at {node.name})"
        elif not is_plain_call(target):
            return f"an unknown call target ({target!r} at {node.name})"
        if "val" not in node.meta and not _returns_nothing(target):
            return f"node {node.name} carries no value"
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
    for name, tensor in _state_tensors(ep).items():
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


# --- argument normalization, as the dispatcher hands arguments to Python -------------


def _is_default(value: Any, arg: Any) -> bool:
    if not arg.has_default_value():
        return False
    default = arg.default_value
    if isinstance(value, (torch.fx.Node, torch.SymInt, torch.SymFloat)):
        return False
    if type(value) is not type(default) and not (
        isinstance(value, (list, tuple)) and isinstance(default, (list, tuple))
    ):
        if not (value is None or default is None) and isinstance(value, (int, float)):
            return False
        if value is None or default is None:
            return value is default
    try:
        return (
            bool(value == default)
            if not isinstance(value, (list, tuple))
            else list(value) == list(default)
        )
    except Exception:
        return False


def normalize(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``(args, kwargs)`` the way the dispatcher passes them to a Python mode:
    positional arguments up to the last one that is not its default, keyword-only
    arguments only where they are not their default."""
    schema = _program.op_schema(op)
    assert schema is not None  # only operator overloads are normalized
    bound: list[Any] = []
    params = schema.arguments
    missing = object()
    for i, param in enumerate(params):
        if i < len(args):
            bound.append(args[i])
        elif param.name in kwargs:
            bound.append(kwargs[param.name])
        elif param.has_default_value():
            bound.append(param.default_value)
        else:
            bound.append(missing)
    if any(b is missing for b in bound):
        raise Fallback(f"cannot bind the arguments of {op}")
    positional = [i for i, p in enumerate(params) if not p.kwarg_only]
    last = -1
    for i in positional:
        if not _is_default(bound[i], params[i]):
            last = i
    new_args = tuple(bound[i] for i in positional if i <= last)
    new_kwargs = {
        p.name: bound[i]
        for i, p in enumerate(params)
        if p.kwarg_only and not _is_default(bound[i], p)
    }
    return new_args, new_kwargs


# --- templates ----------------------------------------------------------------------


@attrs.frozen(eq=False)
class _Template:
    """A traced decomposition. ``inherited`` maps each node to the meta fields it takes
    from the node being rewritten; ``own`` to the fields the tracer set itself."""

    graph: torch.fx.Graph
    n_inputs: int
    inherited: Mapping[torch.fx.Node, tuple[str, ...]]
    own: Mapping[torch.fx.Node, Mapping[str, Any]]


def _split_meta(
    graph: torch.fx.Graph,
) -> tuple[dict[torch.fx.Node, tuple[str, ...]], dict[torch.fx.Node, dict[str, Any]]]:
    inherited: dict[torch.fx.Node, tuple[str, ...]] = {}
    own: dict[torch.fx.Node, dict[str, Any]] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inherited[node] = tuple(
            f for f in _INHERITED_META if isinstance(node.meta.get(f), _Inherited)
        )
        own[node] = {
            f: node.meta[f]
            for f in _INHERITED_META
            if f in node.meta and not isinstance(node.meta[f], _Inherited)
        }
    return inherited, own


_CACHE: collections.OrderedDict[Any, _Template] = collections.OrderedDict()
_CACHE_SIZE = 4096
_STATS = {"hits": 0, "misses": 0}


def cache_info() -> dict[str, int]:
    """Template cache statistics: hits, misses, current size and bound."""
    with LOCK:
        return {**_STATS, "size": len(_CACHE), "maxsize": _CACHE_SIZE}


def clear_cache() -> None:
    """Forget every cached template and table split."""
    with LOCK:
        _CACHE.clear()
        _SPLITS.clear()
        _NAMED.clear()
        _STATS.update(hits=0, misses=0)


def _sym_key(value: Any) -> Any:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", type(value).__name__, str(value.node.expr))
    return value


# Constants are keyed by exact type and, for floats, by bit pattern: ``True == 1 == 1.0``
# hash alike, ``-0.0 == 0.0``, and NaN equals nothing (each NaN payload is its own key).
_BY_VALUE = (bool, int, str, type(None))
_BY_NAME = (torch.dtype, torch.layout, torch.memory_format)


def const_key(value: Any) -> Any:
    """The template key of a constant argument (or a size); equal keys are the same
    constant to every decomposition.

    Raises:
        Fallback: for a constant of a type the key cannot tell apart.
    """
    kind = type(value)
    if kind in _BY_VALUE:
        return (kind.__name__, value)
    if kind is float:
        return ("float", struct.pack("<d", value))
    if kind is complex:
        return ("complex", struct.pack("<dd", value.real, value.imag))
    if kind in _BY_NAME:
        return (kind.__name__, str(value))
    if kind is torch.device:
        return ("device", value.type, value.index)
    if kind in (torch.SymInt, torch.SymFloat, torch.SymBool):
        return _sym_key(value)
    raise Fallback(f"a constant argument of type {kind.__name__}")


def _tensor_key(t: torch.Tensor, requires_grad: bool) -> Any:
    """The key of a tensor input as a decomposition sees it in the retrace: every
    property :func:`_fresh_fake` gives the input a template is traced on (and a test
    checks that it gives them all)."""
    return (
        "tensor",
        type(t).__name__,
        tuple(const_key(s) for s in t.shape),
        tuple(const_key(s) for s in t.stride()),
        const_key(t.storage_offset()),
        const_key(t.dtype),
        const_key(t.device),
        const_key(t.layout),
        requires_grad,
        t.is_conj(),
        t.is_neg(),
    )


def _fresh_fake(fake_mode: Any, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new fake tensor with the properties :func:`_tensor_key` names.

    make_fx maps tensors to placeholders by identity: each input its own object."""
    if t.layout != torch.strided or t.is_conj() or t.is_neg():
        raise Fallback(f"an input of layout {t.layout} or with a conjugate or negative bit")
    with fake_mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        if t.storage_offset() != 0:
            base = torch.empty(
                t.storage_offset() + out.untyped_storage().nbytes() // t.element_size(),
                dtype=t.dtype,
                device=t.device,
            )
            out = base.as_strided(t.shape, t.stride(), t.storage_offset())
        if requires_grad:
            # A leaf that requires grad, as the retrace's fake parameters are (torch's
            # matmul, for one, takes another path for them).
            out = out.detach().requires_grad_(True)
    return out


def _symbol_count(shape_env: Any) -> Any:
    if shape_env is None:
        return None
    return (len(shape_env.var_to_range), shape_env.unbacked_symint_counter)


class _Session:
    """The traces of one decomposition: the CompositeImplicitAutograd override of the
    table, entered at the first trace and left (with torch's state put back) at the
    end of the decomposition, and the templates one batched trace made for it."""

    def __init__(self, tables: Tables, deadline: float | None = None) -> None:
        self.tables = tables
        self.deadline = deadline
        self.name = cache_name(tables)
        # The templates of a table without a name: this decomposition's alone.
        self.local: dict[Any, _Template] = {}
        self.grads: frozenset[str] = frozenset()
        # The program being decomposed, whose missing templates one batch traces.
        self.program: ExportedProgram | None = None
        self.traced = 0
        self.batched: dict[Any, _Template] = {}
        self._stack = contextlib.ExitStack()
        self._entered = False
        self._batch_done = False

    def take(self, key: Any, fake_mode: Any) -> _Template | None:
        """The template of ``key`` from the program's batched trace, which runs at the
        first template that is neither in memory nor on disk (a warm run never pays
        for the walk that collects them)."""
        if self.program is not None and not self._batch_done:
            self._batch_done = True
            _prefill(self.program, fake_mode, self)
        return self.batched.pop(key, None)

    def cache(self) -> collections.OrderedDict[Any, _Template] | dict[Any, _Template]:
        """Where this decomposition keeps its templates: the process's cache when the
        table has a name, else its own."""
        return _CACHE if self.name.table is not None else self.local

    @contextlib.contextmanager
    def overrides(self) -> Iterator[None]:
        from torch.export.exported_program import _override_composite_implicit_decomp

        if not self._entered:
            self._stack.enter_context(torch_state(self.tables.cia))
            self._stack.enter_context(_override_composite_implicit_decomp(self.tables.cia))
            self._entered = True
        yield

    def close(self) -> None:
        self._stack.close()
        self._entered = False
        self.batched.clear()
        self.local.clear()


class OutOfTime(Exception):
    """A cache-filling decomposition reached its deadline."""


def _blank() -> torch.fx.Node:
    """The node meta each decomposition runs under: no annotations, and a marker for
    every field the rewritten node's own value will fill in."""
    blank = torch.fx.Graph().placeholder("blank")
    blank.meta["custom"] = {}
    blank.meta.update(_MARKERS)
    return blank


def _call(op: Any, flat: list[Any], spec: Any, xs: Iterable[Any], blank: torch.fx.Node) -> Any:
    """Run ``op`` on the traced inputs ``xs`` (the tensor leaves of ``flat``),
    functionalized as export does; raise :class:`Fallback` when it mutates one."""
    from torch._functorch._aot_autograd.functional_utils import (
        from_fun,
        has_data_mutation,
        has_metadata_mutation,
        to_fun,
    )

    xs = list(xs)
    funs = [to_fun(x) for x in xs]
    it = iter(funs)
    filled = [next(it) if isinstance(a, torch.fx.Node) else a for a in flat]
    a, k = pytree.tree_unflatten(filled, spec)
    # The retrace runs each node under that node's meta (the interpreter's
    # set_current_meta), which drops annotations of the tracer's own frames.
    with torch.fx.traceback.set_current_meta(blank):
        out = op(*a, **k)
    for f, x in zip(funs, xs, strict=True):
        if isinstance(f, torch.Tensor) and (
            has_data_mutation(f) or has_metadata_mutation(f, x, check_only_storage_mutation=False)
        ):
            raise Fallback(f"the decomposition of {op} mutates an input")
    return pytree.tree_map(from_fun, out)


@contextlib.contextmanager
def _backend_decomps_off() -> Iterator[None]:
    """The backend switches export's retrace turns off around its trace
    (``torch.export._trace._ignore_backend_decomps``: mkldnn, nnpack, cudnn), set
    here without importing that module, which brings AOTAutograd and networkx with it
    (about 0.25 s in a fresh process a warm template cache never needs). A test
    checks that both leave every switch the same."""
    backends = (torch.backends.mkldnn, torch.backends.nnpack, torch.backends.cudnn)
    saved = [backend.set_flags(False) for backend in backends]
    try:
        yield
    finally:
        for backend, flags in zip(backends, saved, strict=True):
            backend.set_flags(*flags)


def _make_fx(
    fn: Callable[..., Any], fakes: list[Any], tables: Tables, fake_mode: Any, session: _Session
) -> torch.fx.GraphModule:
    """``make_fx(fn)(*fakes)`` under the stack a template trace runs in."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._export.utils import _compiling_state_context
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    # The same stack as AOTAutograd's graph capture inside export's retrace, less the
    # CompositeImplicitAutograd override: patching every such operator costs more
    # than most traces, so a session enters it once for all of a program's traces.
    with (
        session.overrides(),
        fake_mode,
        _backend_decomps_off(),
        _compiling_state_context(),
        torch.no_grad(),
        torch.fx.traceback.preserve_node_meta(),
        enable_python_dispatcher(),
        FunctionalTensorMode(pre_dispatch=False, export=False, _allow_token_discovery=True),
    ):
        return make_fx(
            fn,
            decomposition_table=dict(tables.python),
            record_module_stack=True,
            pre_dispatch=False,
        )(*fakes)


def _check_template(graph: torch.fx.Graph, op: Any, tables: Tables) -> None:
    """Raise :class:`Fallback` when a traced decomposition of ``op`` cannot be spliced."""
    for node in graph.nodes:
        if node.op == "get_attr":
            raise Fallback(f"the decomposition of {op} creates constants")
        if node.op == "call_function" and _program.is_op_overload(node.target):
            if _program.is_mutable_op(node.target):
                raise Fallback(f"the decomposition of {op} leaves a mutating op")
            if rewrites(node.target, tables):
                raise Fallback(f"the decomposition of {op} leaves {node.target} behind")
        elif node.op == "call_function" and not is_plain_call(node.target):
            raise Fallback(f"the decomposition of {op} calls {node.target!r}")


def _fakes(fake_mode: Any, values: Iterable[Any], grads: Iterable[bool]) -> list[Any]:
    return [
        _fresh_fake(fake_mode, v, g) if isinstance(v, torch.Tensor) else v
        for v, g in zip(values, grads, strict=True)
    ]


def _trace(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: list[Any],
    grads: list[bool],
    tables: Tables,
    fake_mode: Any,
    session: _Session,
) -> _Template:
    """Trace ``op`` on fresh fake inputs with the table, functionalized as export does."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    blank = _blank()

    def fn(*xs: Any) -> Any:
        return _call(op, flat, spec, xs, blank)

    shape_env = fake_mode.shape_env
    before = _symbol_count(shape_env)
    gm = _make_fx(fn, _fakes(fake_mode, inputs, grads), tables, fake_mode, session)
    if shape_env is not None and _symbol_count(shape_env) != before:
        raise Fallback(f"the decomposition of {op} creates new symbols")
    _check_template(gm.graph, op, tables)
    return _Template(gm.graph, len(inputs), *_split_meta(gm.graph))


# --- one trace for many templates ---------------------------------------------------


@attrs.frozen(eq=False)
class _Pending:
    """A template decomposing a program needs, neither in memory nor on disk."""

    key: Any
    disk_key: dict[str, Any] | None
    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    values: list[Any]
    grads: list[bool]


# fx names a node after its target, plus ``_<n>`` when the name is taken.
_NAME = re.compile(r"^(.*?)(?:_(\d+))?$")
_SUFFIXED = re.compile(r"_\d+$")


def _trace_batch(
    calls: list[_Pending], tables: Tables, fake_mode: Any, session: _Session
) -> dict[Any, _Template]:
    """The templates of ``calls`` from one ``make_fx`` call, by key: each op runs on
    its own fresh inputs, exactly as :func:`_trace` runs it, and the graph is split
    back into one template per call, each the graph :func:`_trace` gives.

    A call whose part of the graph fails a check of :func:`_trace`, or is not its
    own (a node reading another call's nodes), is left out; so is every call when the
    trace fails or creates symbols. Those are traced one at a time, as before.
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    plans = [pytree.tree_flatten((c.args, c.kwargs)) for c in calls]
    bounds: list[tuple[int, int]] = []

    def fn(*xs: Any) -> Any:
        mode = get_proxy_mode()
        assert mode is not None
        graph = mode.tracer.graph
        outs = []
        pos = 0
        for call, (flat, spec) in zip(calls, plans, strict=True):
            # Nodes are appended as they are created: a call owns the ones created
            # while it ran, factory ops (no inputs) included.
            start = len(graph.nodes)
            # Each call its own blank meta: a decomposition may annotate it.
            mine = xs[pos : pos + len(call.values)]
            outs.append(_call(call.op, flat, spec, mine, _blank()))
            bounds.append((start, len(graph.nodes)))
            pos += len(call.values)
        return tuple(outs)

    shape_env = fake_mode.shape_env
    before = _symbol_count(shape_env)
    fakes = _fakes(
        fake_mode, (v for c in calls for v in c.values), (g for c in calls for g in c.grads)
    )
    try:
        gm = _make_fx(fn, fakes, tables, fake_mode, session)
    except Exception:  # each call's own trace raises (or not) as it always did
        return {}
    if shape_env is not None and _symbol_count(shape_env) != before:
        return {}
    nodes = list(gm.graph.nodes)
    n_inputs = len(fakes)
    output = nodes[-1]
    results = output.args[0]
    if (
        any(n.op != "placeholder" for n in nodes[:n_inputs])
        or output.op != "output"
        or not isinstance(results, tuple)
        or len(results) != len(calls)
        or [b[0] for b in bounds] != [n_inputs] + [b[1] for b in bounds[:-1]]
        or bounds[-1][1] != len(nodes) - 1
    ):
        return {}  # some node claimed twice or by no call
    templates: dict[Any, _Template] = {}
    pos = 0
    for call, (start, end), result in zip(calls, bounds, results, strict=True):
        placeholders = nodes[pos : pos + len(call.values)]
        pos += len(call.values)
        template = _partition(placeholders, nodes[start:end], result, output, call.op, tables)
        if template is not None:
            templates[call.key] = template
    return templates


def _partition(
    placeholders: list[torch.fx.Node],
    body: list[torch.fx.Node],
    result: Any,
    output: torch.fx.Node,
    op: Any,
    tables: Tables,
) -> _Template | None:
    """One call's part of a batched trace as the graph its own trace gives (None:
    it cannot be told apart from the rest, or fails a check of :func:`_trace`)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, ph in enumerate(placeholders):
        # make_fx names its inputs arg0_1, arg1_1, ... by position.
        name = f"arg{i}_1"
        new = graph.create_node("placeholder", name, name=name, type_expr=ph.type)
        new.meta = ph.meta
        env[ph] = new

    def mapped(n: torch.fx.Node) -> torch.fx.Node:
        return env[n]  # KeyError: a node of another call

    try:
        for node in body:
            match = _NAME.match(node.name)
            assert match is not None
            base = match.group(1)
            target = node.target
            natural = getattr(getattr(target, "overloadpacket", target), "__name__", "")
            if _SUFFIXED.search(base) or _SUFFIXED.search(re.sub(r"\W", "_", str(natural))):
                # A name that ends in digits of its own: the trace's name is not
                # known from the batch's.
                return None
            new = graph.create_node(
                node.op,
                target,
                torch.fx.node.map_arg(node.args, mapped),
                torch.fx.node.map_arg(node.kwargs, mapped),
                name=base,
                type_expr=node.type,
            )
            new.meta = node.meta
            env[node] = new
        out = graph.output(torch.fx.node.map_arg(result, mapped))
    except KeyError:
        return None
    out.meta = dict(output.meta)
    try:
        _check_template(graph, op, tables)
    except Fallback:
        return None
    return _Template(graph, len(placeholders), *_split_meta(graph))


def _pending(
    ep: ExportedProgram, tables: Tables, session: _Session, checked: bool = False
) -> tuple[list[_Pending], int, int]:
    """The distinct templates decomposing ``ep`` needs that are neither in memory nor
    on disk, keyed from the nodes' values before any rewrite, in program order; how
    many calls could not be keyed; how many nodes the program has. One walk
    (``checked``: :func:`unsafe_reason` found nothing already).

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    from torch._guards import detect_fake_mode

    reason = None if checked else unsafe_reason(ep, tables)
    if reason is not None:
        raise Fallback(reason)  # the incremental path says so, and no estimate is due
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    grads = retrace_grads(ep)
    cache = session.cache()
    seen: set[Any] = set()
    pending: list[_Pending] = []
    unkeyed = 0
    nodes = 0
    for node in ep.graph.nodes:
        nodes += 1
        if not (
            node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and rewrites(node.target, tables)
        ):
            continue
        try:
            args, kwargs = normalize(node.target, node.args, dict(node.kwargs))
            spec, parts, inputs, flags = _template_key(node.target, args, kwargs, grads)
        except Exception:
            unkeyed += 1  # counted as a trace; the walk itself decides
            continue
        key = _memory_key(node.target, spec, parts, session.name, fake_mode)
        if key in seen:
            continue
        seen.add(key)
        with LOCK:
            if key in cache:
                continue
        disk_key = _disk_key(node.target, spec, parts, session.name)
        if disk_key is None or not _template_store.exists(disk_key):
            values = [a.meta["val"] for a in inputs]
            pending.append(_Pending(key, disk_key, node.target, args, kwargs, values, flags))
    return pending, unkeyed, nodes


def _batchable(call: _Pending) -> bool:
    # Symbolic templates are traced one at a time: calls sharing a symbol would
    # share its size nodes, and each trace's guards stay its own.
    return "'sym'" not in repr(call.key[2])


def _prefill(ep: ExportedProgram, fake_mode: Any, session: _Session) -> None:
    """Trace the templates ``ep`` needs at once, for the walk to take."""
    try:
        pending, _, _ = _pending(ep, session.tables, session, checked=True)
    except Exception:
        return  # the walk decides, and explains
    calls = [c for c in pending if _batchable(c) and c.key[-1] is fake_mode]
    if len(calls) > 1:
        session.batched.update(_trace_batch(calls, session.tables, fake_mode, session))


def fill(ep: ExportedProgram, tables: Tables, limit: int | None = None) -> int:
    """Trace, in one batch, up to ``limit`` (None: all) of the templates decomposing
    ``ep`` needs that are neither in memory nor on disk, in program order, and keep
    them for later decompositions (on disk where their key allows). Returns how many
    were kept: none for a table without a name (see :class:`CacheName`), whose
    templates no later decomposition may reuse. Holds :data:`LOCK`.

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    with LOCK:
        session = _Session(tables)
        if session.name.table is None:
            return 0
        pending, _, _ = _pending(ep, tables, session)
        fake_mode = _fake_mode(ep)
        calls = [c for c in pending if _batchable(c)][:limit]
        if not calls:
            return 0
        try:
            templates = _trace_batch(calls, tables, fake_mode, session)
        finally:
            session.close()
            _template_store.prune_soon()
        for call in calls:
            template = templates.get(call.key)
            if template is None:
                continue
            if call.disk_key is not None:
                _store(call.disk_key, template, tables)
            _keep(_CACHE, call.key, template)
        return len(templates)


def _memory_key(op: Any, spec: str, parts: tuple[Any, ...], name: CacheName, fake_mode: Any) -> Any:
    # Template values are fake tensors of one program's fake mode (and its symbols):
    # the mode is part of the key (last), and the cache keeps it alive while the
    # entry lives.
    return (op, spec, parts, name.table, name.settings, fake_mode)


def _keep(cache: dict[Any, _Template], key: Any, template: _Template) -> None:
    _STATS["misses"] += 1
    cache[key] = template
    if cache is _CACHE:
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)


def retrace_grads(ep: ExportedProgram) -> frozenset[str]:
    """The placeholders whose value requires grad in the retrace: it traces the user's
    inputs as the program recorded them and fakes of the state tensors themselves,
    under ``no_grad`` (so no value computed in the graph requires grad)."""
    state = _state_tensors(ep)
    grads = set()
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            break
        value = state.get(node.name, node.meta.get("val"))
        if isinstance(value, torch.Tensor) and value.requires_grad:
            grads.add(node.name)
    return frozenset(grads)


def _state_tensors(ep: ExportedProgram) -> dict[str, Any]:
    """The tensors the retrace fakes for the parameter and buffer placeholders."""
    found = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target is not None:
            store = ep.state_dict if spec.target in ep.state_dict else ep.constants
            if spec.target in store:
                found[spec.arg.name] = store[spec.target]
    return found


def _template_key(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grads: frozenset[str]
) -> tuple[str, tuple[Any, ...], list[torch.fx.Node], list[bool]]:
    """The key of a call's template (its argument structure and each argument's key),
    its input nodes, and whether each input requires grad in the retrace."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    inputs: list[torch.fx.Node] = []
    flags: list[bool] = []
    key_parts: list[Any] = []
    for a in flat:
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            grad = a.op == "placeholder" and a.name in grads
            inputs.append(a)
            flags.append(grad)
            key_parts.append(_tensor_key(v, grad) if isinstance(v, torch.Tensor) else const_key(v))
        else:
            key_parts.append(const_key(a))
    return str(spec), tuple(key_parts), inputs, flags


def _template(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tables: Tables,
    fake_mode: Any,
    session: _Session,
) -> tuple[_Template, list[torch.fx.Node]]:
    spec, parts, inputs, flags = _template_key(op, args, kwargs, session.grads)
    values = [a.meta["val"] for a in inputs]
    key = _memory_key(op, spec, parts, session.name, fake_mode)
    cache = session.cache()
    with LOCK:
        hit = cache.get(key)
        if hit is not None:
            if cache is _CACHE:
                _CACHE.move_to_end(key)
            _STATS["hits"] += 1
            return hit, inputs
    disk_key = _disk_key(op, spec, parts, session.name)
    template = (
        None if disk_key is None else _load(disk_key, (op, args, kwargs), flags, tables, fake_mode)
    )
    if template is None:
        if session.deadline is not None and time.perf_counter() > session.deadline:
            raise OutOfTime
        template = session.take(key, fake_mode)
        if template is None:
            template = _trace(op, args, kwargs, values, flags, tables, fake_mode, session)
        session.traced += 1
        if disk_key is not None:
            _store(disk_key, template, tables)
        elif session.name.table is None:
            _template_store.count("bypassed")
    with LOCK:
        _keep(cache, key, template)
    return template, inputs


def missing_templates(ep: ExportedProgram, tables: Tables) -> tuple[int, int]:
    """How many distinct templates decomposing ``ep`` would trace (neither in memory nor
    on disk), estimated from the nodes' values before any rewrite, and how many nodes
    the program has. One walk, no tracing.

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    pending, unkeyed, nodes = _pending(ep, tables, _Session(tables))
    return len(pending) + unkeyed, nodes


def template_work(ep: ExportedProgram, tables: Tables) -> tuple[int, int, int]:
    """What decomposing ``ep`` would trace: how many missing templates one batched
    trace takes, how many are traced one at a time (symbolic ones, and calls that
    cannot be keyed before the walk), and how many nodes the program has. One walk.

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    pending, unkeyed, nodes = _pending(ep, tables, _Session(tables))
    batched = sum(_batchable(c) for c in pending)
    if batched < 2:
        batched = 0  # a batch of one is a trace of its own
    return batched, len(pending) + unkeyed - batched, nodes


# --- templates on disk (epass/_template_store.py holds the files and the format) -----


@attrs.frozen
class CacheName:
    """What names one decomposition's templates in the caches.

    Attributes:
        table: a name of the table that is the same in every process running the same
            code and declarations (None: the table cannot be named, and its templates
            are traced afresh for this decomposition alone, never kept in memory or
            on disk for another).
        why_not: why the table has no name (None when it has one).
        settings: the process-wide settings torch's decompositions read.
    """

    table: str | None
    why_not: str | None
    settings: tuple[tuple[str, Any], ...]


# Per table: the names of torch's own entries (fixed for the process), and the other
# entries, named again at every decomposition (a declaration may come, go or change).
_NAMED: collections.OrderedDict[Any, tuple[str, list[Any]]] = collections.OrderedDict()


def cache_name(tables: Tables) -> CacheName:
    """The name of ``tables`` for this decomposition's template keys (see
    :class:`CacheName`). torch's own decompositions are named by identity; a user's
    only through the ``cache_key`` it declares (:mod:`epass._decomp.identity`)."""
    settings = identity.settings()
    library = identity.library_kernels()
    if library:
        more = f" and {len(library) - 2} more" if len(library) > 2 else ""
        why = (
            f"Python kernels registered through torch.library for {', '.join(library[:2])}"
            f"{more} cannot be named"
        )
        return CacheName(None, why, settings)
    with LOCK:
        known = _NAMED.get(tables.token)
    if known is None:
        known = _name_entries(tables)
        with LOCK:
            _NAMED[tables.token] = known
            while len(_NAMED) > 64:
                _NAMED.popitem(last=False)
    fixed, others = known
    if not others:
        return CacheName(fixed, None, settings)
    try:
        names = identity.name_table(others)
    except identity.Unnamed as exc:
        return CacheName(None, exc.reason, settings)
    return CacheName(_template_store.digest([fixed, names])[1], None, settings)


def _name_entries(tables: Tables) -> tuple[str, list[Any]]:
    """torch's own part of the table's name (a digest), and its other entries."""
    if isinstance(tables.cia, _DefaultSide):
        split = tables.cia._split
        from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

        fixed: list[Any] = [
            "default",
            sorted(str(op) for op in split.keep),
            sorted(str(op) for op in PRESERVED_ATEN_CIA_OPS),
            sorted(tables.token[1]),
        ]
        entries = [("python", op, fn) for op, fn in split.core.items()]
        entries += _python_cia_kernels()
    else:
        fixed = ["explicit", sorted(tables.token[1])]
        entries = [
            (side, op, fn)
            for side, part in (("cia", tables.cia), ("python", tables.python))
            for op, fn in part.items()
        ]
    names, others = [], []
    for side, op, fn in entries:
        own = (
            f"dispatch:{fn}"
            if isinstance(fn, torch._C.DispatchKey)
            else identity.torch_name(fn, op)
        )
        if own is not None:
            names.append((side, str(op), own))
        else:
            others.append((side, op, fn))
    return _template_store.digest([*fixed, sorted(names)])[1], others


def _python_cia_kernels() -> list[tuple[str, Any, Any]]:
    """Every loaded operator's Python CompositeImplicitAutograd kernel: what its own
    decomposition runs, in torch's default table."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    found = []
    for space_name in list(torch.ops):
        space = getattr(torch.ops, space_name)
        if not isinstance(space, torch._ops._OpNamespace):
            continue
        for packet_name in list(space):
            packet = getattr(space, packet_name)
            for overload_name in list(packet):
                op = getattr(packet, overload_name)
                kernel = op.py_kernels.get(key)
                if kernel is not None:
                    found.append(("kernel", op, kernel))
    return found


def _disk_key(op: Any, spec: str, parts: tuple[Any, ...], name: CacheName) -> dict[str, Any] | None:
    if name.table is None or not isinstance(op, torch._ops.OpOverload):
        return None
    if _template_store.directory() is None:
        return None
    text = repr(parts)
    if "'sym'" in text:
        # Symbolic templates stay in memory. A decomposition can branch on what the
        # program's shape environment knows of a size (its range, earlier guards),
        # which a symbol's name does not carry to another program; and recomputing
        # the values outside the trace evaluates meta functions the trace found in
        # fake tensor's cache, adding guards (fake convolution guards its batch
        # size) to the program's shape environment.
        return None
    return {
        **_template_store.environment(),
        "op": str(op),
        "spec": spec,
        "parts": text,
        "table": name.table,
        "settings": [list(item) for item in name.settings],
    }


def _storable(template: _Template, tables: Tables) -> bool:
    from torch._export.utils import _is_cia_op

    for node in template.graph.nodes:
        target = node.target
        # A kept CompositeImplicitAutograd op's value depends on the override that
        # was active when it was computed: traced ones only.
        if (
            node.op == "call_function"
            and isinstance(target, torch._ops.OpOverload)
            and (_is_cia_op(target) or rewrites(target, tables))
        ):
            return False
    return True


def _store(key: dict[str, Any], template: _Template, tables: Tables) -> None:
    if not _storable(template, tables):
        return
    try:
        body = _template_store.encode(template.graph, template.inherited, template.own)
    except _template_store.Unrepresentable:
        return
    _template_store.store(key, body)


def _load(
    key: dict[str, Any],
    call: tuple[Any, tuple[Any, ...], dict[str, Any]],
    grads: list[bool],
    tables: Tables,
    fake_mode: Any,
) -> _Template | None:
    body = _template_store.load(key)
    if body is None:
        return None
    op, args, kwargs = call
    values = [
        a.meta["val"] for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Node)
    ]
    try:
        fakes = _fakes(fake_mode, values, grads)
        with torch.no_grad():  # values as a trace computes them (under no_grad)
            graph, inherited, own = _template_store.decode(body, fakes, fake_mode, _INHERITED_META)
        for node in graph.nodes:
            if node.op == "call_function" and not (
                _program.is_op_overload(node.target) or is_plain_call(node.target)
            ):
                raise ValueError(f"calls {node.target!r}")
        template = _Template(graph, len(values), inherited, own)
        if not _storable(template, tables):
            raise ValueError("holds an operator the table rewrites")
        # An entry the checks above accept can still describe another computation;
        # one that does not even return what the operator returns is caught here.
        with fake_mode:
            expected = op(*_values(args), **_values(kwargs))
        problem = _result_mismatch(graph, expected)
        if problem:
            raise ValueError(problem)
    except Exception as exc:
        _template_store.reject(key, f"{type(exc).__name__}: {exc}")
        return None
    return template


def _result_mismatch(graph: torch.fx.Graph, expected: Any) -> str:
    """What differs between a template's result and the operator's own (shape, dtype,
    device and structure; strides may differ, as the retrace's do); empty: nothing."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    got = pytree.tree_leaves(_values(out.args[0]))
    want = pytree.tree_leaves(expected)
    if len(got) != len(want):
        return f"returns {len(got)} values where the operator returns {len(want)}"
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            if not (
                isinstance(a, torch.Tensor)
                and a.shape == b.shape
                and a.dtype == b.dtype
                and a.device == b.device
            ):
                return f"returns {_describe_val(a)} where the operator returns {_describe_val(b)}"
        elif type(a) is not type(b):
            return f"returns a {type(a).__name__} where the operator returns a {type(b).__name__}"
    return ""


# --- splicing -----------------------------------------------------------------------


def _same_meta(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        # Symbolic sizes compare by expression: ``==`` would ask the shape
        # environment (Min(64, 64*s0) == 64 holds there), and the retrace keeps
        # the expression its propagation computes.
        return bool(
            tuple(map(_sym_key, a.shape)) == tuple(map(_sym_key, b.shape))
            and tuple(map(_sym_key, a.stride())) == tuple(map(_sym_key, b.stride()))
            and a.dtype == b.dtype
            and _sym_key(a.storage_offset()) == _sym_key(b.storage_offset())
            and a.device == b.device
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return (
            isinstance(a, torch.SymInt)
            and isinstance(b, torch.SymInt)
            and (a.node.expr == b.node.expr)
        )
    if type(a) is not type(b):
        return False
    try:
        return bool(const_key(a) == const_key(b))  # -0.0 is not 0.0; a NaN is itself
    except Fallback:
        return bool(a == b)


def _symbolic(v: Any) -> bool:
    """Whether a tensor value has a symbolic size or stride. Its stored expressions
    are export's, simplified with what export knew then; the retrace propagates
    them again with what the shape environment knows now (Min(64, 64*s0) becomes 64)."""
    if not isinstance(v, torch.Tensor):
        return False
    return any(isinstance(x, torch.SymInt) for x in (*v.shape, *v.stride()))


def _values(arg: Any) -> Any:
    return torch.fx.node.map_arg(arg, lambda n: n.meta["val"])


class _Builder:
    """Copies the graph node by node, splicing templates in and re-propagating values."""

    def __init__(self, tables: Tables, fake_mode: Any, session: _Session) -> None:
        self.tables = tables
        self.fake_mode = fake_mode
        self.session = session
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, Any] = {}
        self.changed: set[torch.fx.Node] = set()
        self.sizes: dict[Any, torch.fx.Node] = {}
        self.decomposed = 0
        self.new_sizes = False

    def _emit(
        self, target: Any, args: Any, kwargs: Any, name: str, meta: dict[str, Any]
    ) -> torch.fx.Node:
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta.update(meta)
        return node

    def _propagate(self, node: torch.fx.Node, old: Any) -> bool:
        """Recompute ``node``'s value from its inputs; True when its metadata changed."""
        with self.fake_mode:
            new = node.target(*_values(node.args), **_values(node.kwargs))  # type: ignore[operator]
        if old is not None and _same_meta(new, old):
            node.meta["val"] = old
            return False
        node.meta["val"] = new
        return True

    def copy(self, node: torch.fx.Node) -> None:
        target = node.target
        if _program.is_op_overload(target) and target not in _SIZE_OPS:
            # The retrace names each node after its operator, as make_fx does.
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self.env.__getitem__)
            new = self.graph.create_node(
                node.op, target, args, kwargs, target.overloadpacket.__name__, node.type
            )
            new.meta = copy.copy(node.meta)
        else:
            new = self.graph.node_copy(node, lambda n: self.env[n])
            if node.target is operator.getitem and isinstance(new.args[0], torch.fx.Node):
                # The tracer unpacks a multi-output op's result inside that op's call:
                # each getitem records the producer's original_aten.
                producer = new.args[0].meta
                if "original_aten" in producer:
                    new.meta["original_aten"] = producer["original_aten"]
                else:
                    new.meta.pop("original_aten", None)
        if node.op == "call_function":
            if _program.is_op_overload(node.target):
                new.args, new.kwargs = normalize(node.target, new.args, dict(new.kwargs))
                if node.target in _SIZE_OPS:
                    new.meta.pop("original_aten", None)  # the retrace records none
                else:
                    new.meta["original_aten"] = node.target
            inputs = node.all_input_nodes
            if (
                any(i in self.changed for i in inputs) or _symbolic(node.meta.get("val"))
            ) and self._propagate(new, node.meta.get("val")):
                self.changed.add(node)
            if node.target in _SIZE_OPS or isinstance(new.meta.get("val"), torch.SymInt):
                expr = self._expr(new.meta.get("val"))
                if expr is not None:
                    self.sizes.setdefault(expr, new)
        elif node.op == "placeholder":
            if new.name != node.name:
                # fx renames names that shadow builtins (``input``); the signature
                # names the placeholders as export made them.
                _program.keep_node_name(self.graph, new, node.name)
            v = node.meta.get("val")
            if isinstance(v, torch.SymInt):
                expr = self._expr(v)
                if expr is not None:
                    self.sizes.setdefault(expr, new)
        if node.op == "call_function" and "nn_module_stack" not in new.meta:
            # The retrace records the (empty) module stack of its tracer.
            new.meta["nn_module_stack"] = collections.OrderedDict()
        self.env[node] = new

    @staticmethod
    def _expr(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return v.node.expr
        return None

    def splice(self, node: torch.fx.Node) -> None:
        op = node.target
        # Decompositions see the values as they are now, after upstream rewrites (a
        # decomposition may return other strides than the fused kernel did).
        mapped = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.env[n])
        args, kwargs = normalize(op, mapped[0], dict(mapped[1]))
        template, inputs = _template(op, args, kwargs, self.tables, self.fake_mode, self.session)
        meta = {k: node.meta[k] for k in _CARRIED_META if k in node.meta}
        meta.setdefault("nn_module_stack", collections.OrderedDict())
        local: dict[torch.fx.Node, Any] = {}
        phs = iter(inputs)
        result: Any = None
        for t in template.graph.nodes:
            if t.op == "placeholder":
                local[t] = next(phs)
            elif t.op == "output":
                result = torch.fx.node.map_arg(t.args[0], lambda n: local[n])
            else:
                args_t = torch.fx.node.map_arg(t.args, lambda n: local[n])
                kwargs_t = torch.fx.node.map_arg(t.kwargs, lambda n: local[n])
                val = t.meta.get("val")
                # make_fx binds each symbolic value to the first node computing it;
                # the retrace reuses the graph's node for an expression it already has.
                if isinstance(val, torch.SymInt):
                    existing = self.sizes.get(val.node.expr)
                    if existing is None and t.target in _SIZE_OPS:
                        # A size query the graph has no node for: the retrace's
                        # runtime-assertion pass re-binds it (after the placeholders,
                        # or as arithmetic on sizes it has); decompose() runs that pass.
                        self.new_sizes = True
                    elif existing is not None:
                        local[t] = existing
                        continue
                new = self._emit(t.target, args_t, kwargs_t, t.name, dict(meta))
                for field in template.inherited[t]:
                    if field in node.meta:
                        new.meta[field] = node.meta[field]
                for field, value in template.own[t].items():
                    new.meta[field] = value if field == "original_aten" else copy.copy(value)
                if t.meta.get("custom"):
                    # Annotations made while the decomposition ran (torch's dynamo
                    # guard on a decomposition records itself here).
                    new.meta["custom"] = {**meta.get("custom", {}), **t.meta["custom"]}
                new.meta["val"] = val
                if isinstance(new.meta.get("val"), torch.SymInt):
                    self.sizes.setdefault(new.meta["val"].node.expr, new)
                local[t] = new
        self.decomposed += 1
        self.env[node] = result
        old = node.meta.get("val")
        new_val = _values(result) if result is not None else None
        if not _same_meta(new_val, old):
            self.changed.add(node)


def _fake_mode(ep: ExportedProgram) -> Any:
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        raise Fallback("no fake tensor mode on the inputs")
    return mode


def decompose(
    ep: ExportedProgram, tables: Tables, deadline: float | None = None, limit: int | None = None
) -> tuple[ExportedProgram, int]:
    """The program ``ep.run_decompositions`` would produce, by rewriting only the nodes
    the table decomposes. Returns it and the number of nodes rewritten.

    ``deadline`` (a :func:`time.perf_counter` value): trace no template after it and
    raise :class:`OutOfTime` instead; for filling the cache within a time budget.
    ``limit``: splice only the first ``limit`` nodes that would be spliced (in graph
    order) and copy the others as they are (``Decompose(max_rewrites=...)``).

    Raises:
        Fallback: when the result could differ from torch's; ``reason`` says why.

    Holds :data:`LOCK` throughout.
    """
    with LOCK:
        session = _Session(tables, deadline)
        try:
            return _decompose(ep, tables, session, limit)
        finally:
            session.close()
            _template_store.prune_soon()


def _decompose(
    ep: ExportedProgram, tables: Tables, session: _Session, limit: int | None = None
) -> tuple[ExportedProgram, int]:
    from torch.export.exported_program import _get_updated_module_call_graph

    reason = unsafe_reason(ep, tables)
    if reason is not None:
        raise Fallback(reason)
    fake_mode = _fake_mode(ep)
    session.program = ep
    session.grads = retrace_grads(ep)
    builder = _Builder(tables, fake_mode, session)
    old_graph = ep.graph
    for node in old_graph.nodes:
        if node.op == "output":
            out = torch.fx.node.map_arg(node.args, lambda n: builder.env[n])
            builder.graph.output(out[0])
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if (
                isinstance(src, torch.fx.Node)
                and src.op == "call_function"
                and not isinstance(builder.env[src], torch.fx.Node)
            ):
                # The decomposed producer returned a tuple: index it directly.
                builder.env[node] = builder.env[src][node.args[1]]
                continue
        if splices(node, tables) and (limit is None or builder.decomposed < limit):
            builder.splice(node)
            continue
        builder.copy(node)
    graph = builder.graph
    out_node = graph.output_node()
    for leaf in _program.tree_leaves(out_node.args[0]):
        if not isinstance(leaf, torch.fx.Node):
            raise Fallback("an output became a constant")
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gm.meta.update(ep.graph_module.meta)
    if builder.new_sizes:
        _rebind_sizes(gm, fake_mode)
    signature = _signature(ep.graph_signature, gm)
    module_call_graph = _get_updated_module_call_graph(
        ep.graph_module, ep.graph_signature, gm, signature, ep.module_call_graph
    )
    # A retrace's program: a new state_dict over the same tensors, the constants
    # dict itself, and the ATEN dialect's verifier.
    out = _program.new_program(
        ep,
        gm,
        signature,
        dict(ep.state_dict),
        ep.constants,
        module_call_graph=module_call_graph,
        keep_dialect=False,
    )
    return out, builder.decomposed


def _rebind_sizes(gm: torch.fx.GraphModule, fake_mode: Any) -> None:
    """Run the retrace's runtime-assertion pass, which binds every size query to a
    node of its own: after the placeholders, or as arithmetic on sizes it has."""
    import functools

    import torch._dynamo.config
    from torch._export.passes._node_metadata_hook import (
        _node_metadata_hook,
        _set_node_metadata_hook,
    )
    from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

    shape_env = fake_mode.shape_env
    if shape_env is None or torch._dynamo.config.do_not_emit_runtime_asserts:
        raise Fallback("a new size query without a shape environment to bind it")
    # The pass only adds asserts the graph lacks; those export added are there already.
    with _set_node_metadata_hook(
        gm,
        functools.partial(_node_metadata_hook, metadata={"stack_trace": _RUNTIME_ASSERT_TRACE}),
    ):
        insert_deferred_runtime_asserts(gm, shape_env, "decomposed program", export=True)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _signature(old: ExportGraphSignature, gm: torch.fx.GraphModule) -> ExportGraphSignature:
    outputs = _program.tree_leaves(gm.graph.output_node().args[0])
    new_outputs = []
    for spec, node in zip(old.output_specs, outputs, strict=True):
        arg = spec.arg
        if isinstance(arg, TensorArgument):
            arg = TensorArgument(name=node.name)
        elif isinstance(arg, SymIntArgument):
            arg = SymIntArgument(name=node.name)
        elif not isinstance(arg, (ConstantArgument, CustomObjArgument)):
            raise Fallback(f"an output of kind {type(arg).__name__}")
        new_outputs.append(OutputSpec(spec.kind, arg, spec.target))
    return ExportGraphSignature(
        input_specs=copy.deepcopy(old.input_specs), output_specs=new_outputs
    )


# --- the differential check -----------------------------------------------------------

# Node meta compared by the check. ``from_node`` and ``seq_nr`` are left out on purpose:
# the retrace records its own trace history there, which a rewrite cannot reproduce.
COMPARED_META = ("stack_trace", "nn_module_stack", "original_aten", "custom")
_SUFFIX = re.compile(r"_\d+$")


def _plain_name(name: str) -> str:
    return _SUFFIX.sub("", name)


def _describe_val(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(v).__name__, str(v.node.expr))
    if isinstance(v, (list, tuple)):
        return tuple(_describe_val(x) for x in v)
    return (type(v).__name__, v if isinstance(v, (int, float, bool, str, type(None))) else "?")


def _spec_text(spec: Any) -> str:
    arg = spec.arg
    name = getattr(arg, "name", None)
    value = _plain_name(name) if isinstance(name, str) else repr(getattr(arg, "value", None))
    return f"{spec.kind.name}:{value}:{spec.target}"


def first_difference(fast: ExportedProgram, ref: ExportedProgram) -> str | None:
    """The first way ``fast`` differs from torch's ``ref`` (None: equivalent).

    Compares the op sequence and arguments (node references by position), each
    node's value shape, strides and dtype, the meta in ``COMPARED_META``, the
    signature modulo numeric name suffixes, range constraints and the module call
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
        if a.op != "output":
            va, vb = _describe_val(a.meta.get("val")), _describe_val(b.meta.get("val"))
            if va != vb:
                return f"{where}: value {va} / torch: {vb}"
        if a.op == "call_function":
            for key in COMPARED_META:
                ma, mb = a.meta.get(key), b.meta.get(key)
                if key == "original_aten":
                    ma, mb = str(ma) if ma else None, str(mb) if mb else None
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
    ca = [e.fqn for e in fast.module_call_graph]
    cb = [e.fqn for e in ref.module_call_graph]
    if ca != cb:
        return f"module call graph {ca} / torch: {cb}"
    if fast.dialect != ref.dialect:
        return f"dialect {fast.dialect} / torch: {ref.dialect}"
    return None

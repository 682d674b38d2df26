"""Every torch internal epass touches (``INTERNALS``), reached here and nowhere else,
called as the running release wants; every branch on the release; how an internal the
release lacks is named; the warnings torch raises from its own code, silenced.

One concept: epass's boundary with torch's private API, so that a release that changes
an internal changes this file only (``tests/test_torch_internals.py`` fails on a
private torch name elsewhere, and calls each internal as epass calls it).

Importing it loads only what ``import torch`` has loaded (the operator classes and
pytree); every other internal is imported by the function that calls it, so that one
a release lacks fails where the incremental path steps aside for the retrace and
names it (:func:`unexpected`), never at import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator, OperatorBase, OpOverload, OpOverloadPacket
from torch._ops import _OpNamespace as OpNamespace
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

__all__ = [
    # the list, the release, and naming what it lacks
    "INTERNALS", "RELEASE", "EXACT_RELEASE", "absent", "inexact", "resolve", "unexpected",
    # operators, decomposition tables and torch's kernel registrations
    "CIA_KEY", "DispatchKey", "HigherOrderOperator", "OpNamespace", "OpOverload",
    "OpOverloadPacket", "OperatorBase", "op_overloads", "schema", "overload_key", "python_kernels",
    "clear_dispatch_cache", "cia_registrations", "is_cia_op", "is_preservable_cia_op",
    "decomp_for_cia", "cia_binding_code", "aten_cia_ops", "preserve_marker", "split_decomp_table",
    "override_cia", "core_aten_decompositions", "preserved_aten_cia_ops", "decomposition_registry",
    "library_impls", "registered_from", "fake_rules",
    # tracing
    "make_fx_as_export", "to_fun", "from_fun", "mutated", "traced_graph", "python_dispatcher",
    "current_meta", "copied_meta_fields",
    # fake values and the shape environment
    "detect_fake_mode", "fake_cache_off", "is_contiguous_or_false", "forget_static_evaluations",
    "insert_runtime_asserts",
    # programs
    "pytree", "set_fields", "guards_code", "guards_fn", "graph_module_flat_inputs",
    "updated_range_constraints", "updated_module_call_graph", "rename_without_collisions",
    "placeholder_prefixes", "base_verifier", "verify_beyond_nodes", "one_value_module",
    "graph_guards_code",
    "lazy_graph_module", "construct_without_code",
    "reserve_name", "module_buffers", "version_counter", "spec_children",
    # archives
    "load_pt2", "zip_reader", "record_size", "serde_schema", "serialized_sym_ops",
    # warnings torch raises from its own code
    "quiet_leaf_specs", "quiet_loader",
]  # fmt: skip

RELEASE: str = torch.__version__.split("+")[0]
"""The running torch release without its build tag (``2.11.0`` for ``2.11.0+cu130``)."""

# torch 2.11 to 2.14, whose functionalization the write-backs through views and placed
# size queries mirror node for node (compat.sh checks each; 2.15 makes other programs
# there); on another release those cases keep the retrace (:func:`inexact`).
EXACT_RELEASE: bool = RELEASE.startswith(("2.11.", "2.12.", "2.13.", "2.14."))

_PROGRAM = "torch.export.exported_program"
_UTILS = "torch._export.utils"
_FUNCTIONAL = "torch._functorch._aot_autograd.functional_utils"

# Every torch internal epass touches, by dotted path: the functions below are the only
# code that reaches them. docs/compat.md lists each; tests/test_torch_internals.py
# calls each as epass calls it, on every declared release.
INTERNALS = (
    # operators: what a node's target is, its schema, kernels and dispatch cache
    "torch._ops.HigherOrderOperator", "torch._ops.OperatorBase", "torch._ops.OpOverload",
    "torch._ops.OpOverloadPacket", "torch._ops.OpOverloadPacket.overloads",  # each name looked up
    "torch._ops.OpOverload._schema", "torch._ops.OpOverload._overloadpacket",
    "torch._ops.OpOverload._overloadname", "torch._ops.OpOverload.py_kernels",
    "torch._ops.OpOverload._dispatch_cache", "torch._ops._OpNamespace",
    "torch._C.DispatchKey.CompositeImplicitAutograd",
    "torch._C._dispatch_get_registrations_for_dispatch_key",
    # the decomposition table and its split, as run_decompositions makes them
    f"{_PROGRAM}._split_decomp_table_to_cia_and_python_decomp",
    f"{_PROGRAM}._override_composite_implicit_decomp", f"{_PROGRAM}._special_op_to_preserve_cia",
    f"{_UTILS}._is_cia_op", f"{_UTILS}._is_preservable_cia_op", f"{_UTILS}._get_decomp_for_cia",
    f"{_UTILS}._collect_all_valid_cia_ops",  # walked as it walks (patchable_ops)
    f"{_UTILS}._collect_all_valid_cia_ops_for_aten_namespace",
    f"{_UTILS}._materialize_cpp_cia_ops", "torch._decomp._core_aten_decompositions_post_autograd",
    "torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS", f"{_UTILS}._compiling_state_context",
    "torch._decomp.global_decomposition_table",  # torch's own decompositions (identity)
    "torch.library._impls",  # the Python registrations of ATen kernels (identity)
    "torch._C._dispatch_dump",  # where each was registered from (identity)
    "torch._subclasses.fake_impls.op_implementations_dict",
    "torch._subclasses.fake_impls.op_implementations_checks",
    # tracing a template as the retrace traces
    "torch.export._trace._ignore_backend_decomps",  # mirrored by state.backend_decomps_off
    "torch._subclasses.functional_tensor.FunctionalTensorMode", f"{_FUNCTIONAL}.to_fun",
    f"{_FUNCTIONAL}.from_fun", f"{_FUNCTIONAL}.has_data_mutation",
    f"{_FUNCTIONAL}.has_metadata_mutation", "torch.fx.experimental.proxy_tensor.make_fx",
    "torch.fx.experimental.proxy_tensor.get_proxy_mode",  # .tracer.graph
    "torch._dispatch.python.enable_python_dispatcher", "torch.fx.traceback.preserve_node_meta",
    "torch.fx.traceback.set_current_meta", "torch.fx.proxy._COPY_META_FIELDS",
    # fake values and the shape environment
    "torch._prims_common.is_contiguous_for_memory_format_or_false",
    "torch._subclasses.fake_tensor.disable_fake_tensor_cache",  # sets cache_enabled
    # its guards, var_to_range, replacements, deferred_runtime_asserts, unbacked_symint_counter,
    # divisible, backed_var_to_val, settings, suppress_guards
    "torch.fx.experimental.symbolic_shapes.ShapeEnv", "torch._guards.detect_fake_mode",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv._maybe_evaluate_static",  # .cache_clear
    "torch.fx.passes.runtime_assert.insert_deferred_runtime_asserts",
    "torch._export.passes._node_metadata_hook._set_node_metadata_hook",
    "torch._export.passes._node_metadata_hook._node_metadata_hook",
    "torch._dynamo.config.do_not_emit_runtime_asserts",
    # programs: fields set without the constructor (which re-validates the graph, tens
    # of ms a pass: set_fields), and how the retrace rebuilds one
    f"{_PROGRAM}.ExportedProgram._state_dict", f"{_PROGRAM}.ExportedProgram._constants",
    f"{_PROGRAM}.ExportedProgram._graph_module", f"{_PROGRAM}.ExportedProgram._graph_signature",
    f"{_PROGRAM}.ExportedProgram._module_call_graph", f"{_PROGRAM}.ExportedProgram._guards_code",
    f"{_PROGRAM}.ExportedProgram._range_constraints",
    f"{_PROGRAM}.ExportedProgram._example_inputs", f"{_PROGRAM}.ExportedProgram._verifiers",
    f"{_PROGRAM}.ExportedProgram._graph_module_flat_inputs",
    "torch.export._unlift._unlift_exported_program_lifted_states",  # its _guards_fn
    f"{_PROGRAM}._create_graph_module_for_export", f"{_PROGRAM}._get_updated_range_constraints",
    f"{_PROGRAM}._get_updated_module_call_graph", "torch.Tensor._version",
    f"{_UTILS}._rename_without_collisions",  # the retrace's placeholder names
    f"{_UTILS}.placeholder_prefixes", "torch._export.verifier.Verifier",
    # a program rebuilt after erasures (_program.after_erasure); _get_shape_env reads meta["val"]
    "torch._export.verifier._verify_exported_program_signature", f"{_PROGRAM}._get_shape_env",
    "torch._export.verifier._verify_exported_program_module_call_graph",
    f"{_PROGRAM}._convert_guards_to_code", "torch._subclasses.fake_tensor.FakeTensor",
    "torch.fx._lazy_graph_module._LazyGraphModule", "torch.fx.Graph._graph_namespace",
    "torch.fx.graph._Namespace._obj_to_name", "torch.fx.graph._Namespace._used_names",
    "torch.nn.Module._buffers", "torch.utils._pytree",  # TreeSpec, flattening, serialized types
    # archives: reading one once it is screened, and the schema the screen walks
    "torch._C.PyTorchFileReader", "torch.export.pt2_archive._package.load_pt2",
    "torch._export.serde.schema",  # ExportedProgram, SCHEMA_VERSION
    "torch._export.serde.serialize._SYM_OPS", "torch._export.serde.union._Union",
)  # fmt: skip

CIA_KEY = DispatchKey.CompositeImplicitAutograd


# --- naming what a release lacks ------------------------------------------------------


def resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module prefix, then
    attributes. Raises ImportError or AttributeError when this torch has none."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module of {path!r} can be imported")


# Attributes that live on instances, not on their class: resolved on an example.
_INSTANCE_ATTRIBUTES: dict[str, Callable[[], Any]] = {
    **{
        f"torch._ops.OpOverload.{name}": lambda: torch.ops.aten.add.Tensor
        for name in ("_schema", "_overloadpacket", "_overloadname", "py_kernels", "_dispatch_cache")
    },
    "torch.fx.Graph._graph_namespace": torch.fx.Graph,
    "torch.fx.graph._Namespace._obj_to_name": lambda: torch.fx.Graph()._graph_namespace,
    "torch.fx.graph._Namespace._used_names": lambda: torch.fx.Graph()._graph_namespace,
    "torch.nn.Module._buffers": torch.nn.Module,
}


def absent(paths: Iterable[str]) -> str | None:
    """The first of ``paths`` this torch lacks, or None. Imports the modules they
    name: for a failure's diagnosis, not for every run."""
    for path in paths:
        owner, _, name = path.rpartition(".")
        example = _INSTANCE_ATTRIBUTES.get(path)
        try:
            if example is not None:
                getattr(example(), name)
            elif owner == f"{_PROGRAM}.ExportedProgram" and name.startswith("_"):
                # set by the constructor, declared on the class (a method is an attribute)
                program = resolve(owner)
                if name not in program.__annotations__ and not hasattr(program, name):
                    return path
            else:
                resolve(path)
        except (ImportError, AttributeError):
            return path
    return None


def unexpected(exc: BaseException, internals: Iterable[str] = INTERNALS) -> str:
    """What to say when torch raised ``exc`` in code that leans on ``internals``: the
    internal this release lacks where one is missing, else the error; with the release."""
    lines = str(exc).strip().splitlines()
    error = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
    if isinstance(exc, (AttributeError, ImportError, NameError, TypeError)):
        missing = absent(internals)
        if missing is not None:
            return f"torch {RELEASE} has no {missing}, an internal epass needs here ({error})"
    return f"{error} (torch {RELEASE})"


def inexact(what: str) -> str | None:
    """Why the engine cannot make ``what`` as this release's retrace does (None: it can):
    it mirrors torch 2.11 to 2.14's functionalization there (:data:`EXACT_RELEASE`)."""
    if EXACT_RELEASE:
        return None
    return f"{what}, made exact for torch 2.11 to 2.14 only (this is {torch.__version__})"


# --- operators ------------------------------------------------------------------------


def op_overloads(packet: Any, *, names: bool = False) -> list[Any]:
    """Every overload of an operator packet (or its name), in torch's order: what 2.13's
    ``OpOverloadPacket.op_overloads()`` does, on every declared release."""
    return list(packet.overloads()) if names else [getattr(packet, n) for n in packet.overloads()]


def schema(op: Any) -> torch.FunctionSchema:
    """The schema of the operator overload ``op``."""
    return op._schema


def overload_key(op: Any) -> tuple[Any, str]:
    """The packet the overload ``op`` belongs to, and its name there (``"default"``)."""
    return op._overloadpacket, op._overloadname


def python_kernels(op: Any) -> dict[Any, Any]:
    """The Python kernels of the overload ``op`` by dispatch key (torch's own dict)."""
    return op.py_kernels  # type: ignore[no-any-return]


def clear_dispatch_cache(op: Any) -> None:
    """Forget the kernels the overload ``op`` has looked up, after its Python kernels changed."""
    op._dispatch_cache.clear()


def cia_registrations() -> frozenset[str]:
    """The names (``aten::linear``) of the operators with a CompositeImplicitAutograd kernel."""
    reg = torch._C._dispatch_get_registrations_for_dispatch_key
    return frozenset(reg("CompositeImplicitAutograd"))


def is_cia_op(op: Any) -> bool:
    """Whether ``op`` has a CompositeImplicitAutograd kernel (``_is_cia_op``)."""
    from torch._export.utils import _is_cia_op

    return bool(_is_cia_op(op))


def is_preservable_cia_op(op: Any) -> bool:
    """Whether torch may keep the CIA operator ``op`` (functional, not aliasing, with a kernel)."""
    from torch._export.utils import _is_preservable_cia_op

    return bool(_is_preservable_cia_op(op))


def decomp_for_cia(op: Any) -> Callable[..., Any]:
    """The operator's own decomposition as torch's default table holds it."""
    from torch._export.utils import _get_decomp_for_cia

    return _get_decomp_for_cia(op)  # type: ignore[no-any-return]


@functools.cache
def cia_binding_code() -> types.CodeType | None:
    """The code of what :func:`decomp_for_cia` binds (a new ``functools.partial`` each call)."""
    from torch._export.utils import _get_decomp_for_cia

    for const in _get_decomp_for_cia.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "_special_op_to_decompose_cia":
            return const
    return None


def aten_cia_ops() -> set[Any]:
    """The ATen operators torch's override patches, C++ registrations loaded first."""
    from torch._export import utils

    utils._materialize_cpp_cia_ops()
    return set(utils._collect_all_valid_cia_ops_for_aten_namespace())


def preserve_marker() -> Any:
    """The entry a split gives an operator the table keeps."""
    from torch.export.exported_program import _special_op_to_preserve_cia

    return _special_op_to_preserve_cia


def split_decomp_table(table: dict[Any, Any]) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """torch's split of a decomposition table: its CIA side and its Python side."""
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp

    return _split_decomp_table_to_cia_and_python_decomp(table)  # type: ignore[no-any-return]


def override_cia(cia: Any) -> contextlib.AbstractContextManager[Any]:
    """torch's override of every CompositeImplicitAutograd kernel, for the whole process."""
    from torch.export.exported_program import _override_composite_implicit_decomp

    return _override_composite_implicit_decomp(cia)  # type: ignore[no-any-return]


def core_aten_decompositions() -> dict[Any, Any]:
    """torch's core ATen decompositions, the Python side of its default table."""
    from torch._decomp import _core_aten_decompositions_post_autograd

    return _core_aten_decompositions_post_autograd()  # type: ignore[no-any-return]


def preserved_aten_cia_ops() -> Collection[Any]:
    """The ATen CompositeImplicitAutograd operators torch's default table keeps."""
    from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

    return PRESERVED_ATEN_CIA_OPS  # type: ignore[no-any-return]


def decomposition_registry() -> dict[str, dict[Any, Any]]:
    """torch's registry of decompositions by kind (``"post_autograd"``...), then operator."""
    from torch._decomp import global_decomposition_table

    return global_decomposition_table  # type: ignore[no-any-return]


def library_impls() -> Collection[str]:
    """The kernels registered through ``torch.library`` (``"aten/gelu/CPU"``)."""
    from torch import library

    return library._impls  # type: ignore[no-any-return]


def registered_from(key: str) -> str:
    """The file that registered a :func:`library_impls` kernel, as the dispatcher
    recorded it (``"aten/gelu/Meta"``: torch's ``_meta_registrations.py``); ""
    when it does not say."""
    namespace, _, rest = key.partition("/")
    op, _, dispatch_key = rest.rpartition("/")
    for line in str(torch._C._dispatch_dump(f"{namespace}::{op}")).splitlines():
        head, found, where = line.partition(": registered at ")
        if found and head.split("[")[0] == dispatch_key:
            return where.split(" :: ")[0].rpartition(":")[0]
    return ""


def fake_rules() -> tuple[dict[Any, Any], list[Any]]:
    """torch's fake tensor rules: by operator, and the list of checks with rules."""
    from torch._subclasses import fake_impls

    return fake_impls.op_implementations_dict, fake_impls.op_implementations_checks


# --- tracing --------------------------------------------------------------------------


def make_fx_as_export(
    fn: Callable[..., Any], fakes: list[Any], table: dict[Any, Any], *, frames: bool
) -> torch.fx.GraphModule:
    """``make_fx(fn)(*fakes)`` with the decomposition ``table`` in the stack AOTAutograd's
    capture builds in export's retrace; ``frames``: record each node's stack trace.
    (torch 2.15 adds arguments whose defaults keep this: FunctionalTensorMode's
    ``_keep_input_mutations``, make_fx's ``dynamic_shapes``.)"""
    from torch._export.utils import _compiling_state_context
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with (
        _compiling_state_context(),
        torch.no_grad(),
        torch.fx.traceback.preserve_node_meta(),
        python_dispatcher(),
        FunctionalTensorMode(pre_dispatch=False, export=False, _allow_token_discovery=True),
    ):
        trace = make_fx(
            fn,
            decomposition_table=table,
            record_module_stack=True,
            pre_dispatch=False,
            record_stack_traces=frames,
        )
        return trace(*fakes)  # type: ignore[no-any-return]


def to_fun(t: Any) -> Any:
    """``t`` wrapped for the functionalization mode."""
    from torch._functorch._aot_autograd.functional_utils import to_fun

    return to_fun(t)


def from_fun(t: Any) -> Any:
    """The value a functional tensor holds now."""
    from torch._functorch._aot_autograd.functional_utils import from_fun

    return from_fun(t)


def mutated(f: Any, x: Any, *, data: bool) -> bool:
    """Whether the functional tensor ``f`` over ``x`` had its metadata (or, with
    ``data``, also its data) changed."""
    from torch._functorch._aot_autograd import functional_utils

    if functional_utils.has_metadata_mutation(f, x, check_only_storage_mutation=False):
        return True
    return data and bool(functional_utils.has_data_mutation(f))


def traced_graph() -> torch.fx.Graph:
    """The graph the running ``make_fx`` trace appends its nodes to."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    assert mode is not None, "no make_fx trace is running"
    return mode.tracer.graph  # type: ignore[no-any-return]


def python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """The Python dispatcher on: a kept operator runs torch's Python kernel."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()  # type: ignore[no-any-return]


def current_meta(node: torch.fx.Node) -> contextlib.AbstractContextManager[Any]:
    """Run as the retrace's interpreter runs ``node``: under its meta."""
    return torch.fx.traceback.set_current_meta(node)  # type: ignore[no-any-return]


def copied_meta_fields() -> tuple[str, ...]:
    """The node meta the tracer copies from the node being run onto each node it makes."""
    return tuple(torch.fx.proxy._COPY_META_FIELDS)


# --- fake values and the shape environment --------------------------------------------


def detect_fake_mode(values: list[Any]) -> Any:
    """The fake mode of ``values`` (None: they have none)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(values)


def fake_cache_off(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """The fake mode's cache neither answers nor keeps values while the block runs."""
    from torch._subclasses.fake_tensor import disable_fake_tensor_cache

    return disable_fake_tensor_cache(fake_mode)  # type: ignore[no-any-return]


def is_contiguous_or_false(t: Any, memory_format: Any = torch.contiguous_format) -> bool:
    """Whether ``t`` is contiguous in ``memory_format``; no guard (False if sizes leave it open)."""
    from torch._prims_common import is_contiguous_for_memory_format_or_false as contiguous

    return bool(contiguous(t, memory_format=memory_format))


def forget_static_evaluations(shape_env: Any) -> None:
    """Clear ``ShapeEnv._maybe_evaluate_static``'s cache."""
    shape_env._maybe_evaluate_static.cache_clear()


def insert_runtime_asserts(gm: torch.fx.GraphModule, shape_env: Any, stack_trace: str) -> bool:
    """The retrace's runtime-assertion pass on ``gm``, its new nodes given
    ``stack_trace``. False, and nothing run, where torch's config turns it off."""
    import torch._dynamo.config
    from torch._export.passes import _node_metadata_hook as hooks
    from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

    if torch._dynamo.config.do_not_emit_runtime_asserts:
        return False
    hook = functools.partial(hooks._node_metadata_hook, metadata={"stack_trace": stack_trace})
    with hooks._set_node_metadata_hook(gm, hook):
        insert_deferred_runtime_asserts(gm, shape_env, "decomposed program", export=True)
    return True


# --- programs -------------------------------------------------------------------------


def set_fields(ep: ExportedProgram, **fields: Any) -> None:
    """Set listed private fields of ``ep`` (``state_dict=`` sets ``_state_dict``)."""
    for name, value in fields.items():
        if f"{_PROGRAM}.ExportedProgram._{name}" not in INTERNALS:
            raise TypeError(f"ExportedProgram has no private field epass sets: {name}")
        setattr(ep, f"_{name}", value)


def guards_code(ep: ExportedProgram) -> list[str]:
    """The guards the program carries as code (checked by ``ep.module()``)."""
    return ep._guards_code  # type: ignore[no-any-return]


def guards_fn(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The guard check ``ep.module()`` gives the module it makes (None: it made none)."""
    return getattr(module, "_guards_fn", None)


def graph_module_flat_inputs(ep: ExportedProgram, args: Any, kwargs: Any) -> list[Any]:
    """What ``ep.graph_module`` takes for the call ``ep.module()(*args, **kwargs)``."""
    return list(ep._graph_module_flat_inputs(args, kwargs))


def updated_range_constraints(gm: Any, old: Any) -> dict[Any, Any]:
    """The range constraints of the symbols ``gm`` mentions, as a retrace updates them."""
    from torch.export.exported_program import _get_updated_range_constraints

    return _get_updated_range_constraints(gm, old)  # type: ignore[no-any-return]


def updated_module_call_graph(ep: ExportedProgram, gm: Any, signature: Any) -> list[Any]:
    """``ep``'s module call graph renamed for the retraced ``gm`` and its ``signature``."""
    from torch.export.exported_program import _get_updated_module_call_graph

    with quiet_leaf_specs():  # it deep-copies the call graph
        return _get_updated_module_call_graph(  # type: ignore[no-any-return]
            ep.graph_module, ep.graph_signature, gm, signature, ep.module_call_graph
        )


def rename_without_collisions(
    names: dict[str, str], taken: dict[str, int], used: set[str], old: str, new: str
) -> None:
    """Name the placeholder ``old`` ``new`` as the retrace does, suffixed where taken."""
    from torch._export.utils import _rename_without_collisions

    _rename_without_collisions(names, taken, used, old, new, is_placeholder=True)


def placeholder_prefixes() -> Mapping[Any, str]:
    """The prefix of each kind of lifted input's name (``p_``, ``b_``, ``c_``)."""
    from torch._export.utils import placeholder_prefixes

    return placeholder_prefixes  # type: ignore[no-any-return]


def base_verifier() -> type[Any]:
    """torch's base ``Verifier``: what ``ExportedProgram.validate`` runs at least."""
    from torch._export.verifier import Verifier

    return Verifier  # type: ignore[no-any-return]


def verify_beyond_nodes(ep: ExportedProgram) -> None:
    """torch's ``Verifier.check`` of ``ep`` but its walk of each node."""
    from torch._export import verifier

    verifier._verify_exported_program_module_call_graph(ep)
    verifier._verify_exported_program_signature(ep)


def one_value_module(gm: torch.fx.GraphModule) -> Any:
    """``gm`` cut to its first fake value, all ``_get_shape_env`` reads (one mode per graph)."""
    from torch._subclasses.fake_tensor import FakeTensor

    one = next((n for n in gm.graph.nodes if isinstance(n.meta.get("val"), FakeTensor)), None)
    return gm if one is None else types.SimpleNamespace(graph=types.SimpleNamespace(nodes=(one,)))


def graph_guards_code(gm: Any) -> list[str]:
    """The guards a program constructed over ``gm`` records (``_guards_code``)."""
    from torch.export.exported_program import _convert_guards_to_code as convert

    return convert(gm)  # type: ignore[no-any-return]


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module that generates its Python code when first read or called."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)  # type: ignore[no-any-return]


# Held while torch's constructor makes a module without code for this thread.
_WITHOUT_CODE = threading.Lock()


def construct_without_code(**fields: Any) -> ExportedProgram:
    """``ExportedProgram(**fields)`` whose graph module makes its code when first read or
    called (:func:`lazy_graph_module`): ``_create_graph_module_for_export`` is replaced
    for the one call, under a lock, for this thread only (others get torch's)."""
    from torch.export import exported_program as torch_program

    owner = threading.get_ident()
    with _WITHOUT_CODE:
        made_with = torch_program._create_graph_module_for_export

        def without_code(root: Any, graph: torch.fx.Graph) -> torch.fx.GraphModule:
            if threading.get_ident() != owner:
                return made_with(root, graph)  # type: ignore[no-any-return]
            return lazy_graph_module(root, graph)

        torch_program._create_graph_module_for_export = without_code
        try:
            return ExportedProgram(**fields)
        finally:
            torch_program._create_graph_module_for_export = made_with


def reserve_name(graph: torch.fx.Graph, node: torch.fx.Node, name: str) -> None:
    """Name ``node`` of ``graph`` exactly ``name`` and reserve it in the namespace."""
    namespace = graph._graph_namespace
    node.name = name
    namespace._obj_to_name[node] = name
    namespace._used_names.add(name)


def module_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """A module's own buffers dict (names to tensors, None for a removed one)."""
    return module._buffers  # type: ignore[no-any-return]


def version_counter(t: torch.Tensor) -> int:
    """The in-place write counter of ``t`` (raises for inference tensors and some subclasses)."""
    return int(t._version)


def spec_children(spec: Any) -> list[Any]:
    """The child specs of a pytree ``TreeSpec``. torch 2.13 deprecates the
    ``children_specs`` field; every declared release has ``children()``."""
    children = getattr(spec, "children", None)
    return list(children() if callable(children) else spec.children_specs)


# --- archives -------------------------------------------------------------------------


def load_pt2(f: Any) -> Any:
    """The contents of a .pt2 archive, through torch's archive loader (no fallback)."""
    from torch.export.pt2_archive._package import load_pt2

    return load_pt2(f)


def zip_reader(f: Any) -> Any:
    """torch's zip reader (``PyTorchFileReader``) over the file ``f``."""
    return torch._C.PyTorchFileReader(f)


def record_size(reader: Any, name: str) -> int:
    """The size of member ``name`` as torch's zip reader reads it. ``get_record_size``
    came with torch 2.13; before, the member is read once more to tell its size."""
    size = getattr(reader, "get_record_size", None)
    if size is not None:
        return int(size(name))
    return len(reader.get_record(name))


def serde_schema() -> tuple[types.ModuleType, type[Any]]:
    """torch's serialization schema module (``ExportedProgram``, ``SCHEMA_VERSION``) and
    the base class of its tagged unions."""
    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    return schema, _Union


def serialized_sym_ops() -> Collection[Any]:
    """The symbolic-shape functions torch's serializer writes as node targets."""
    from torch._export.serde.serialize import _SYM_OPS

    return _SYM_OPS  # type: ignore[no-any-return]


# --- warnings torch raises from its own code -------------------------------------------

# warnings.catch_warnings saves and restores the process's filter list: two threads
# that overlap would restore each other's filter, and leave it on for good.
_WARNINGS_LOCK = threading.RLock()


@contextlib.contextmanager
def _quiet(message: str, category: type[Warning]) -> Iterator[None]:
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)
        yield


def quiet_leaf_specs() -> contextlib.AbstractContextManager[None]:
    """Silence torch's ``LeafSpec`` ``FutureWarning`` (2.13 and later) while torch
    itself deep-copies a program's call graph (``run_decompositions`` and
    ``_get_updated_module_call_graph`` do): that one message, for that call. epass's
    own copies share leaf specs (``_program.copy_call_graph``) and raise none."""
    return _quiet(r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)


def quiet_loader() -> contextlib.AbstractContextManager[None]:
    """Silence the ``UserWarning`` torch 2.11 and 2.12 raise while loading an archive
    (``torch.frombuffer`` over bytes only the tensor owns): that message, for that call."""
    return _quiet(r"The given buffer is not writable", UserWarning)

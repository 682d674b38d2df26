"""The list of every torch internal epass touches (``INTERNALS``), the running release,
and how an internal the release lacks is named."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "INTERNALS",
    "RELEASE",
    "EXACT_RELEASE",
    "absent",
    "inexact",
    "resolve",
    "unexpected",
]

RELEASE: str = torch.__version__.split("+")[0]
"""The running torch release without its build tag (``2.11.0`` for ``2.11.0+cu130``)."""

# torch 2.11 to 2.14, whose functionalization the write-backs through views and placed
# size queries mirror node for node (compat.sh checks each; 2.15 makes other programs
# there); on another release those cases keep the retrace (:func:`inexact`).
EXACT_RELEASE: bool = RELEASE.startswith(("2.11.", "2.12.", "2.13.", "2.14."))

_PROGRAM = "torch.export.exported_program"
_UTILS = "torch._export.utils"
_FUNCTIONAL = "torch._functorch._aot_autograd.functional_utils"

# Every torch internal epass touches, by dotted path: the functions of this package's
# modules are the only code that reaches them. docs/compat.md lists each;
# tests/test_torch_internals.py calls each as epass calls it, on every declared release.
INTERNALS = (
    # operators: what a node's target is, its schema, kernels and dispatch cache
    "torch._ops.HigherOrderOperator",
    "torch._ops.OperatorBase",
    "torch._ops.OpOverload",
    "torch._ops.OpOverloadPacket",
    "torch._ops.OpOverloadPacket.overloads",  # each name looked up
    "torch._ops.OpOverload._schema",
    "torch._ops.OpOverload._overloadpacket",
    "torch._ops.OpOverload._overloadname",
    "torch._ops.OpOverload.py_kernels",
    "torch._ops.OpOverload._dispatch_cache",
    "torch._ops._OpNamespace",
    "torch._C.DispatchKey.CompositeImplicitAutograd",
    "torch._C._dispatch_get_registrations_for_dispatch_key",
    # the decomposition table and its split, as run_decompositions makes them
    f"{_PROGRAM}._split_decomp_table_to_cia_and_python_decomp",
    f"{_PROGRAM}._override_composite_implicit_decomp",
    f"{_PROGRAM}._special_op_to_preserve_cia",
    f"{_UTILS}._is_cia_op",
    f"{_UTILS}._is_preservable_cia_op",
    f"{_UTILS}._get_decomp_for_cia",
    f"{_UTILS}._collect_all_valid_cia_ops",  # walked as it walks (patchable_ops)
    f"{_UTILS}._collect_all_valid_cia_ops_for_aten_namespace",
    f"{_UTILS}._materialize_cpp_cia_ops",
    "torch._decomp._core_aten_decompositions_post_autograd",
    "torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS",
    # a consumer's table (ExecuTorch's, OpenVINO's), materialized as reading it does:
    # its decomp_table, deleted_custom_ops and has_materialized
    "torch.export.decomp_utils.CustomDecompTable",
    f"{_UTILS}._compiling_state_context",
    "torch._decomp.global_decomposition_table",  # torch's own decompositions (identity)
    "torch.library._impls",  # the Python registrations of ATen kernels (identity)
    "torch.library._del_library",  # each live library's finalizer, over its own keys
    "torch._library.custom_ops.OPDEFS",  # a custom_op operator's Python functions
    "torch._C._dispatch_dump",  # where each was registered from (identity)
    "torch._C._DispatchModule",  # a library's handle, read as torch's own (identity)
    "torch._subclasses.fake_impls.op_implementations_dict",
    "torch._subclasses.fake_impls.op_implementations_checks",
    # tracing a template as the retrace traces
    "torch.export._trace._ignore_backend_decomps",  # mirrored by state.backend_decomps_off
    "torch._subclasses.functional_tensor.FunctionalTensorMode",
    f"{_FUNCTIONAL}.to_fun",
    f"{_FUNCTIONAL}.from_fun",
    f"{_FUNCTIONAL}.has_data_mutation",
    f"{_FUNCTIONAL}.has_metadata_mutation",
    "torch.fx.experimental.proxy_tensor.make_fx",
    "torch.fx.experimental.proxy_tensor.get_proxy_mode",  # .tracer.graph
    "torch._dispatch.python.enable_python_dispatcher",
    "torch.fx.traceback.preserve_node_meta",
    "torch.fx.traceback.set_current_meta",
    "torch.fx.proxy._COPY_META_FIELDS",
    # fake values and the shape environment
    "torch._prims_common.is_contiguous_for_memory_format_or_false",
    "torch.fx.passes.shape_prop._extract_tensor_metadata",  # the tracer's tensor_meta
    "torch._subclasses.fake_tensor.disable_fake_tensor_cache",  # sets cache_enabled
    # its guards, var_to_range, replacements, deferred_runtime_asserts, unbacked_symint_counter,
    # divisible, backed_var_to_val, settings, suppress_guards
    "torch.fx.experimental.symbolic_shapes.ShapeEnv",
    "torch._guards.detect_fake_mode",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv._maybe_evaluate_static",  # .cache_clear
    "torch.fx.passes.runtime_assert.insert_deferred_runtime_asserts",
    "torch._export.passes._node_metadata_hook._set_node_metadata_hook",
    "torch._export.passes._node_metadata_hook._node_metadata_hook",
    "torch._dynamo.config.do_not_emit_runtime_asserts",
    # programs: fields set without the constructor (which re-validates the graph, tens
    # of ms a pass: set_fields), and how the retrace rebuilds one
    f"{_PROGRAM}.ExportedProgram._state_dict",
    f"{_PROGRAM}.ExportedProgram._constants",
    f"{_PROGRAM}.ExportedProgram._graph_module",
    f"{_PROGRAM}.ExportedProgram._graph_signature",
    f"{_PROGRAM}.ExportedProgram._module_call_graph",
    f"{_PROGRAM}.ExportedProgram._guards_code",
    f"{_PROGRAM}.ExportedProgram._range_constraints",
    f"{_PROGRAM}.ExportedProgram._example_inputs",
    f"{_PROGRAM}.ExportedProgram._verifiers",
    f"{_PROGRAM}.ExportedProgram._graph_module_flat_inputs",
    "torch.export._unlift._unlift_exported_program_lifted_states",  # its _guards_fn
    f"{_PROGRAM}._create_graph_module_for_export",
    f"{_PROGRAM}._get_updated_range_constraints",
    f"{_PROGRAM}._get_updated_module_call_graph",
    "torch.Tensor._version",
    f"{_UTILS}._rename_without_collisions",  # the retrace's placeholder names
    f"{_UTILS}.placeholder_prefixes",
    "torch._export.verifier.Verifier",
    # a program rebuilt after erasures (_program.after_erasure); _get_shape_env reads meta["val"]
    "torch._export.verifier._verify_exported_program_signature",
    f"{_PROGRAM}._get_shape_env",
    "torch._export.verifier._verify_exported_program_module_call_graph",
    f"{_PROGRAM}._convert_guards_to_code",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch.fx._lazy_graph_module._LazyGraphModule",
    "torch.fx.Graph._graph_namespace",
    "torch.fx.graph._Namespace._obj_to_name",
    "torch.fx.graph._Namespace._used_names",
    "torch.nn.Module._buffers",
    "torch.utils._pytree",  # TreeSpec, flattening, serialized types
    # archives: reading one once it is screened, and the schema the screen walks
    "torch._C.PyTorchFileReader",
    "torch.export.pt2_archive._package.load_pt2",
    "torch._export.serde.schema",  # ExportedProgram, SCHEMA_VERSION
    "torch._export.serde.serialize._SYM_OPS",
    "torch._export.serde.union._Union",
)


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

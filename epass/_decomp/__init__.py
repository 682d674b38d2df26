"""The incremental decomposition engine: rewrite only the nodes a table decomposes.

One concept a module, each importing only from those listed before it
(pyproject.toml's contract "the decomposition engine's modules"):

- ``store``: the files of the on-disk template cache (stdlib only at import, so that
  ``epass cache`` starts without torch); ``encoding``: a template as JSON data and
  back (stdlib only at import too).
- ``state``: torch's process-global state: ``LOCK``, ``torch_state``,
  ``run_decompositions`` as epass calls it.
- ``table``: a table split the way ``run_decompositions`` splits it, and
  ``rewrites``, the one answer to "does this table rewrite op X".
- ``identity``: the names of decomposition functions and tables in cache keys.
- ``safety``: what the incremental path can take (``unsafe_reason``, ``Fallback``).
- ``shapes``: the program's shape environment: the context fake values are computed
  in, the watch over it through a decomposition, symbols by position for disk keys.
- ``keys``: arguments as the dispatcher passes them, template keys, fresh fakes.
- ``tracing``: tracing one decomposition into a template.
- ``batch``: one trace for many templates.
- ``templates``: finding a template (memory, disk, batch, trace), the caches' public
  ``cache_info`` / ``clear_cache``, and what a program still needs traced.
- ``signature``: the retrace's inputs, in its order and under its names.
- ``splice``: ``decompose``, the engine itself.
- ``check``: check mode, ``first_difference`` from torch's program.

Every torch internal the engine leans on is listed in ``INTERNALS`` and pinned by
``tests/decomp/test_internals.py``; ``docs/compat.md`` lists them too. This module
imports nothing, torch least of all.
"""

from __future__ import annotations

__all__ = ["INTERNALS"]

# The torch internals the engine uses, by dotted path. Each one is pinned by a test.
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
    "torch._C.DispatchKey.CompositeImplicitAutograd",
    "torch._decomp.global_decomposition_table",  # torch's own decompositions (identity)
    "torch._ops.HigherOrderOperator",
    "torch._ops.OpOverload",
    "torch._ops.OpOverloadPacket",
    "torch._ops.OpOverloadPacket.overloads",  # each name looked up (_torch.op_overloads)
    "torch._ops.OpOverload._overloadpacket",
    "torch._ops.OpOverload._overloadname",
    "torch._decomp._core_aten_decompositions_post_autograd",
    "torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS",
    "torch._export.utils._compiling_state_context",
    "torch.export._trace._ignore_backend_decomps",  # mirrored by state.backend_decomps_off
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
    "torch._prims_common.is_contiguous_or_false",
    "torch._subclasses.fake_tensor.disable_fake_tensor_cache",  # sets cache_enabled
    "torch.fx.traceback.preserve_node_meta",
    "torch.fx.traceback.set_current_meta",
    # its guards, var_to_range, replacements, deferred_runtime_asserts,
    # unbacked_symint_counter, divisible, backed_var_to_val, settings, suppress_guards
    "torch.fx.experimental.symbolic_shapes.ShapeEnv",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv._maybe_evaluate_static",  # .cache_clear
    "torch.export.exported_program.ExportedProgram._guards_code",
    "torch.export._unlift._unlift_exported_program_lifted_states",  # its _guards_fn
    "torch.fx.passes.runtime_assert.insert_deferred_runtime_asserts",
    "torch._export.passes._node_metadata_hook._set_node_metadata_hook",
    "torch._export.passes._node_metadata_hook._node_metadata_hook",
    "torch._dynamo.config.do_not_emit_runtime_asserts",
    "torch.fx.proxy._COPY_META_FIELDS",
    "torch._ops.OpOverload.py_kernels",
    "torch._ops.OpOverload._dispatch_cache",
    "torch._subclasses.fake_impls.op_implementations_dict",
    "torch._subclasses.fake_impls.op_implementations_checks",
    "torch.library._impls",  # the Python registrations of ATen kernels (identity)
    "torch._export.utils._rename_without_collisions",  # the retrace's placeholder names
    "torch._export.utils.placeholder_prefixes",
)

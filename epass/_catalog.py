"""What ``epass passes`` shows of each built-in pass, without importing it or torch.

Data, not code: ``(description, options)`` per registry name, each option as
``(name, type, default in pipeline text, required)``, where the type is the
option model's text (``epass.options.OptionType.text``). The passes are the source
of truth: ``tests/test_layers.py`` checks this table against them and prints the
table to paste here when a docstring or an option changes. The command line also
checks the options of built-in passes against it before torch is imported.
"""

from __future__ import annotations

__all__ = ["BUILTIN_CATALOG"]

BUILTIN_CATALOG: dict[str, tuple[str, tuple[tuple[str, str, str | None, bool], ...]]] = {
    "cast-dtype": (
        "Convert floating parameters, buffers and constants to ``dtype`` (bf16 or fp16), "
        "so that the program computes in that dtype.",
        (
            ("dtype", "dtype", "bfloat16", False),
            ("keep_io", "bool", "true", False),
        ),
    ),
    "cleanup": (
        "Preset: clean a program up without lowering it",
        (),
    ),
    "cse": (
        "Merge nodes that compute the same operator on the same inputs.",
        (("max_rewrites", "int | none", "none", False),),
    ),
    "dce": (
        "Remove nodes whose results are never used, and state inputs nothing reads.",
        (),
    ),
    "decompose": (
        "Lower the program with a decomposition table: the program "
        "``ExportedProgram.run_decompositions`` returns, usually much faster.",
        (
            ("table", "dict[any, function] | none", "none", False),
            ("keep", "list[any] | any", "[]", False),
            ("coalesce", "bool", "false", False),
            ("method", '"auto" | "incremental" | "retrace"', '"auto"', False),
            ("check", "bool | none", "none", False),
            ("max_rewrites", "int | none", "none", False),
        ),
    ),
    "fold-constants": (
        "Evaluate every subgraph whose inputs are only parameters, buffers or constants "
        "and replace it with a new lifted constant.",
        (
            ("max_growth", "float", "1.0", False),
            ("fold_views", "bool", "false", False),
            ("max_rewrites", "int | none", "none", False),
        ),
    ),
    "fuse-conv-bn": (
        "Fold eval-mode BatchNorm into the convolution that feeds it.",
        (("max_rewrites", "int | none", "none", False),),
    ),
    "lift-constants": (
        "Lift tensor ``get_attr`` nodes to placeholders with ``CONSTANT_TENSOR`` specs.",
        (("fx", "function | none", "none", False),),
    ),
    "lower": (
        "Preset: decompose, remove-asserts, fold-constants, cse, dce",
        (),
    ),
    "remove-asserts": (
        "Remove runtime assertion nodes (``aten._assert_scalar``, "
        "``aten._assert_tensor_metadata``, ``sym_constrain_range*``, the functional "
        "``_assert_async`` variants and their kin; see :data:`ASSERTION_OPS`).",
        (),
    ),
    "replace-ops": (
        "Replace operators by other operators or by traced Python functions, and rewrite "
        "subgraph patterns.",
        (
            ("ops", "dict[any, any]", "{}", False),
            ("patterns", "list[any]", "[]", False),
            ("max_rewrites", "int | none", "none", False),
        ),
    ),
}

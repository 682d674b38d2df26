"""Operators: what a node's target is, its schema, kernels and dispatch cache; torch's
decomposition tables and their split; the kernels registered with torch."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator, OperatorBase, OpOverload, OpOverloadPacket
from torch._ops import _OpNamespace as OpNamespace

__all__ = [
    "CIA_KEY",
    "DispatchKey",
    "DispatchModule",
    "HigherOrderOperator",
    "OpNamespace",
    "OpOverload",
    "OpOverloadPacket",
    "OperatorBase",
    "op_overloads",
    "function_schema",
    "overload_key",
    "python_kernels",
    "clear_dispatch_cache",
    "cia_registrations",
    "is_cia_op",
    "is_preservable_cia_op",
    "decomp_for_cia",
    "cia_binding_code",
    "aten_cia_ops",
    "preserve_marker",
    "split_decomp_table",
    "override_cia",
    "core_aten_decompositions",
    "preserved_aten_cia_ops",
    "decomposition_registry",
    "library_impls",
    "library_key_sets",
    "registered_from",
    "custom_op_functions",
    "fake_rules",
]

CIA_KEY = DispatchKey.CompositeImplicitAutograd

# A torch.library.Library's handle on the dispatcher; None on a release without it
# (a custom op's kernels, which reach it, then have no name, nor the table with them).
DispatchModule: type | None = getattr(torch._C, "_DispatchModule", None)


def op_overloads(packet: Any, *, names: bool = False) -> list[Any]:
    """Every overload of an operator packet (or its name), in torch's order: what 2.13's
    ``OpOverloadPacket.op_overloads()`` does, on every declared release."""
    return list(packet.overloads()) if names else [getattr(packet, n) for n in packet.overloads()]


def function_schema(op: Any) -> torch.FunctionSchema:
    """The schema of the operator overload ``op``: its arguments, returns, aliasing."""
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


def materialized_table(table: Any, cia_ops: Callable[[], Collection[Any]]) -> dict[Any, Any] | None:
    """``dict(table)`` for torch's ``CustomDecompTable`` (None for any other mapping).

    Reading that table materializes it: every CompositeImplicitAutograd operator
    outside ATen that torch's walk (``_collect_all_valid_cia_ops``) finds, the table
    neither holds nor had deleted, gains its own decomposition. torch's walk loads
    every C++ registration once per namespace (about 40 ms); ``cia_ops`` is the same
    set from one walk. The table is left materialized, as reading it leaves it. A
    test compares the result with torch's on tables with custom operators, kept and
    deleted."""
    from torch.export.decomp_utils import CustomDecompTable

    if type(table) is not CustomDecompTable:
        return None
    if not table.has_materialized:
        entries, deleted = table.decomp_table, table.deleted_custom_ops
        for op in cia_ops():
            if op.name().split("::")[0] != "aten" and op not in entries and op not in deleted:
                entries[op] = decomp_for_cia(op)
        table.has_materialized = True
        table.deleted_custom_ops = set()
    return dict(table.decomp_table)


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


def library_key_sets() -> list[Collection[str]]:
    """The kernels each live ``torch.library.Library`` registered, one set of
    :func:`library_impls` keys a library, in the order they were made. A set is the
    library's own: it grows with each key the library registers, and the list loses
    it when the library is destroyed. torch keeps no list of its libraries; each one
    leaves a finalizer (``_del_library`` over its sets) in ``weakref.finalize``'s
    registry, read here."""
    import weakref

    from torch import library

    found = []
    for info in list(weakref.finalize._registry.values()):  # type: ignore[attr-defined]
        if info.func is library._del_library:
            found.append(info.args[1])  # (_impls, its own keys, _defs, its own defs, ...)
    return found


def registered_from(key: str) -> str:
    """The file that registered a :func:`library_impls` kernel, as the dispatcher
    recorded it (``"aten/gelu/Meta"``: torch's ``_meta_registrations.py``); ""
    when it does not say."""
    namespace, _, rest = key.partition("/")
    op, _, dispatch_key = rest.rpartition("/")
    # torch.library registers a kernel given no dispatch key as CompositeImplicitAutograd
    dispatch_key = dispatch_key or "CompositeImplicitAutograd"
    for line in str(torch._C._dispatch_dump(f"{namespace}::{op}")).splitlines():
        head, found, where = line.partition(": registered at ")
        if found and head.split("[")[0] == dispatch_key:
            return where.split(" :: ")[0].rpartition(":")[0]
    return ""


# The Python functions a torch.library.custom_op operator runs, each set by a public
# call (register_kernel, register_fake, register_autograd, register_torch_dispatch,
# register_vmap, register_autocast), which need not register anything anew.
_CUSTOM_OP_FIELDS = (
    "_init_fn",
    "_backend_fns",
    "_abstract_fn",
    "_setup_context_fn",
    "_backward_fn",
    "_torch_dispatch_fns",
    "_vmap_fn",
    "_autocast_dtype",
)


def custom_op_functions(qualname: str) -> tuple[Any, ...] | None:
    """What the ``torch.library.custom_op`` operator ``qualname`` (``"prims::abs"``)
    runs from Python: its functions field by field, a dict's keys and values in
    turn, the very objects torch holds (compared by identity, a call finds a change
    cheaply); None when it is no such operator (its kernels are registered from
    ``torch/_library/custom_ops.py``)."""
    from torch._library import custom_ops

    definition = custom_ops.OPDEFS.get(qualname)
    if definition is None:
        return None
    found: list[Any] = []
    for field in _CUSTOM_OP_FIELDS:
        value = getattr(definition, field, None)
        if isinstance(value, dict):
            for item in value.items():
                found += item
        else:
            found.append(value)
    return tuple(found)


def fake_rules() -> tuple[dict[Any, Any], list[Any]]:
    """torch's fake tensor rules: by operator, and the list of checks with rules."""
    from torch._subclasses import fake_impls

    return fake_impls.op_implementations_dict, fake_impls.op_implementations_checks

"""Programs: an ExportedProgram's private fields, and how the retrace rebuilds one; graph
names, module buffers, tensor versions and pytree specs."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

from epass._torch import quiet
from epass._torch.internals import INTERNALS

__all__ = [
    "pytree",
    "set_fields",
    "guards_code",
    "guards_fn",
    "graph_module_flat_inputs",
    "updated_range_constraints",
    "updated_module_call_graph",
    "rename_without_collisions",
    "placeholder_prefixes",
    "base_verifier",
    "verify_beyond_nodes",
    "one_value_module",
    "graph_guards_code",
    "lazy_graph_module",
    "construct_without_code",
    "reserve_name",
    "module_buffers",
    "version_counter",
    "spec_children",
]

# How INTERNALS names ExportedProgram's private fields: this prefix, then the field.
_FIELDS = "torch.export.exported_program.ExportedProgram._"


def set_fields(ep: ExportedProgram, **fields: Any) -> None:
    """Set listed private fields of ``ep`` (``state_dict=`` sets ``_state_dict``)."""
    for name, value in fields.items():
        if f"{_FIELDS}{name}" not in INTERNALS:
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

    out = _get_updated_range_constraints(gm, old)
    if not isinstance(out, dict):  # a program takes what it is given: check the shape
        raise TypeError(f"_get_updated_range_constraints returned {type(out).__name__}, not a dict")
    return out


def updated_module_call_graph(ep: ExportedProgram, gm: Any, signature: Any) -> list[Any]:
    """``ep``'s module call graph renamed for the retraced ``gm`` and its ``signature``."""
    from torch.export.exported_program import _get_updated_module_call_graph

    with quiet.leaf_specs():  # it deep-copies the call graph
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

    out = convert(gm)
    if not (isinstance(out, list) and all(isinstance(g, str) for g in out)):
        raise TypeError(f"_convert_guards_to_code returned {type(out).__name__}, not a list of str")
    return out


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

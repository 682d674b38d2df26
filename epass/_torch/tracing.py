"""A decomposition traced as export's retrace traces it: make_fx under AOTAutograd's
stack, functionalization, the Python dispatcher and the node meta the tracer copies."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "make_fx_as_export",
    "to_fun",
    "from_fun",
    "mutated",
    "traced_graph",
    "python_dispatcher",
    "current_meta",
    "copied_meta_fields",
]


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

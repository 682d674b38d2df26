"""Fake values and the shape environment: finding a fake mode, its cache, contiguity
asked without a guard, forgetting symbols a given-up trace made, and the retrace's
runtime assertions."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection
from typing import Any

import torch

__all__ = [
    "detect_fake_mode",
    "fake_cache_off",
    "is_contiguous_or_false",
    "forget_static_evaluations",
    "forget_symbols",
    "insert_runtime_asserts",
    "tensor_metadata",
]


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


# What a shape environment records of each symbol, by symbol.
_BY_SYMBOL = (
    "var_to_range",
    "var_to_range_sloc",
    "var_to_stack",
    "unbacked_var_to_val",
    "oblivious_var_to_val",
    "var_to_hint_override",
    "deferred_runtime_asserts",
    "replacements",
    "replacements_slocs",
)


def forget_symbols(shape_env: Any, known: Collection[Any]) -> None:
    """Drop every symbol the shape environment made since it knew only ``known`` (the
    keys of its ``var_to_range`` then): a trace that made symbols and was given up
    leaves no trace of them (torch's retrace lists each symbol it finds there, with
    no replacement, among the program's range constraints)."""
    made = [s for s in shape_env.var_to_range if s not in known]
    if not made:
        return
    for field in _BY_SYMBOL:
        held = getattr(shape_env, field, None)
        if isinstance(held, dict):
            for symbol in made:
                held.pop(symbol, None)
    size_like = getattr(shape_env, "size_like", None)
    if isinstance(size_like, set):
        size_like.difference_update(made)
    pending = getattr(shape_env, "pending_fresh_unbacked_symbols", None)
    if isinstance(pending, list):
        pending[:] = [s for s in pending if s not in made]


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


def tensor_metadata(value: torch.Tensor) -> Any:
    """The ``tensor_meta`` torch's tracer gives a node whose value is ``value``
    (shape, dtype, strides, memory format, quantization): a retrace sets it on every
    node whose value is a tensor, and consumers read it (OpenVINO's input types)."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    return _extract_tensor_metadata(value)

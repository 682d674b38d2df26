"""Tensors as epass compares them without reading their bytes: write counters, views of
the same memory, and the leaves of nested outputs."""

from __future__ import annotations

from typing import Any

import torch

from epass._torch import programs
from epass._torch.programs import pytree

__all__ = ["same_view", "tensor_marks", "tensor_version", "tree_leaves"]


def tree_leaves(value: Any) -> list[Any]:
    """The leaves of a nested structure of outputs (``torch.utils._pytree``, the
    flattening torch.export itself uses for program inputs and outputs)."""
    return list(pytree.tree_leaves(value))


def tensor_version(value: Any) -> int | None:
    """The in-place write counter of a tensor, or None for other values."""
    if isinstance(value, torch.Tensor):
        try:
            return programs.version_counter(value)
        except (RuntimeError, AttributeError):  # inference tensors and some subclasses
            return None
    return None


def tensor_marks(values: list[torch.Tensor]) -> list[tuple[int | None, bool]]:
    """What an in-place change of each tensor changes: its write counter (as
    :func:`tensor_version`) and its ``requires_grad`` flag, read in one loop (the
    manager reads them for every store entry around every pass)."""
    marks: list[tuple[int | None, bool]] = []
    for t in values:
        try:
            version: int | None = programs.version_counter(t)
        except (RuntimeError, AttributeError):  # inference tensors and some subclasses
            version = None
        marks.append((version, t.requires_grad))
    return marks


def same_view(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are the same object, or tensors viewing the same memory
    with the same dtype, shape, strides, offset, device, Parameter-ness and lazy
    conjugate/negative bits.

    No tensor bytes are read. The linker calls this once per state entry, so the
    common case is one dispatcher call (``is_set_to`` compares storage, offset,
    sizes and strides at once).
    """
    if a is b:
        return True
    if type(a) is not type(b):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if isinstance(a, torch.nn.Parameter) is not isinstance(b, torch.nn.Parameter):
            return False
    elif not isinstance(a, torch.Tensor):
        return False
    if a.dtype is not b.dtype:  # is_set_to compares geometry in elements, not bytes
        return False
    try:
        # is_set_to is False whenever either side is a lazy conjugate/negative view
        # (it resolves them into copies), so True also means equal conj/neg bits.
        if a.is_set_to(b):  # raises for sparse and other storage-less layouts
            return True
        if a.is_conj() or a.is_neg() or b.is_conj() or b.is_neg():
            # Such views share memory with their base but read other values.
            return bool(
                a.is_conj() == b.is_conj()
                and a.is_neg() == b.is_neg()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.device == b.device
                and a.shape == b.shape
                and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset()
            )
        # Empty tensors may have no storage to compare; equal geometry is enough.
        return bool(
            a.numel() == 0
            and a.device == b.device
            and a.device.type != "meta"
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
        )
    except (RuntimeError, NotImplementedError):  # meta, fake and storage-less subclasses
        return False

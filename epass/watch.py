"""StoreWatch: which store tensors were written in place since a moment, by version
counter and, on request, by a fingerprint of their bytes and layout."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from epass import _tensors

__all__ = ["StoreWatch", "tensor_bytes", "tensor_layout"]


# --- tensor bytes without numpy (torch does not depend on numpy) -------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's element bytes in row-major order, read on the CPU.

    ``Tensor.numpy()`` needs numpy, which torch does not install, and iterating an
    ``UntypedStorage`` is per byte; a contiguous CPU copy is read in one call.
    """
    import ctypes

    t = t.detach()
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:  # a wrapper subclass (torchao's quantized weights...)
        names, context = flatten()
        inner = b"".join(tensor_bytes(getattr(t, name)) for name in names)
        return repr(context).encode() + inner
    if t.is_nested:  # its components, each with its shape
        return b"".join(repr(c.shape).encode() + tensor_bytes(c) for c in t.unbind())
    if t.layout != torch.strided:  # sparse layouts: their values, densified
        t = t.to_dense()
    # A lazy conjugate or negative view reads other values than its memory holds.
    flat = t.resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8).cpu()
    return ctypes.string_at(flat.data_ptr(), flat.numel()) if flat.numel() else b""


def tensor_layout(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's dtype, layout, shape, strides and storage offset, as far as its
    layout has them (sparse and nested tensors have no strides)."""
    if t.is_nested:
        return (str(t.dtype), "nested", t.dim())
    if t.layout != torch.strided or hasattr(t, "__tensor_flatten__"):
        return (str(t.dtype), str(t.layout), type(t).__name__, tuple(t.shape))
    return (str(t.dtype), tuple(t.shape), t.stride(), t.storage_offset())


# One store entry as it was before a pass: (label, key, tensor, mark).
_Entry = tuple[str, str, Any, "tuple[int | None, bool]"]


def _store_entries(ep: ExportedProgram) -> list[_Entry]:
    # list(d.items()) copies in one step, so keys another thread adds meanwhile
    # neither break the loop nor join the snapshot.
    items = [
        (label, key, value)
        for label, d in (("state_dict", ep.state_dict), ("constants", ep.constants))
        for key, value in list(d.items())
        if isinstance(value, torch.Tensor)
    ]
    # A mark is the version counter and the requires_grad flag
    # (requires_grad_ does not count as a write).
    marks = _tensors.tensor_marks([value for _, _, value in items])
    return [(*item, mark) for item, mark in zip(items, marks, strict=True)]


def _fingerprint(entries: list[_Entry]) -> list[int | None]:
    """A hash of each entry's bytes, dtype, shape, strides and storage offset."""
    out: list[int | None] = []
    for _, _, value, _ in entries:
        if value.device.type == "meta":
            out.append(None)
            continue
        digest = hashlib.blake2b(tensor_bytes(value), digest_size=8)
        digest.update(repr(tensor_layout(value)).encode())
        out.append(int.from_bytes(digest.digest(), "little"))
    return out


@attrs.define
class StoreWatch:
    """The store tensors of some programs as they were at one moment, to tell later
    which of them were written in place: the check the manager makes around every
    pass, and the hand-offs around every consumer.

    Example::

        watch = StoreWatch.of([ep], fingerprint=True)
        consumer(ep)
        assert watch.touched() == []
    """

    entries: list[_Entry]
    prints: list[int | None] | None

    @classmethod
    def of(cls, programs: Iterable[ExportedProgram], *, fingerprint: bool = False) -> StoreWatch:
        """Snapshot the ``state_dict`` and ``constants`` tensors of ``programs``:
        version counters and ``requires_grad``, and with ``fingerprint`` a hash of
        each tensor's bytes and layout. A tensor held by several programs (or
        under several keys) is watched once, under its first key."""
        seen: set[int] = set()
        entries: list[_Entry] = []
        for ep in programs:
            for entry in _store_entries(ep):
                if id(entry[2]) not in seen:
                    seen.add(id(entry[2]))
                    entries.append(entry)
        return cls(entries, _fingerprint(entries) if fingerprint else None)

    def touched(self) -> list[str]:
        """The entries written in place since the snapshot, as ``"state_dict:<key>"``
        / ``"constants:<key>"``. A flipped ``requires_grad`` flag counts and is set
        back (the one change that can be undone)."""
        touched = []
        marks = _tensors.tensor_marks([value for _, _, value, _ in self.entries])
        for (label, key, value, mark), now in zip(self.entries, marks, strict=True):
            if now != mark:
                touched.append(f"{label}:{key}")
                if now[1] != mark[1]:
                    value.requires_grad_(mark[1])
        if self.prints is not None:
            after = _fingerprint(self.entries)
            touched += [
                f"{label}:{key}"
                for (label, key, _, _), h, now in zip(self.entries, self.prints, after, strict=True)
                if h != now and f"{label}:{key}" not in touched
            ]
        return touched

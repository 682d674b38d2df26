"""StoreWatch: which store tensors were written in place since a moment, by version
counter and, on request, by a fingerprint of their bytes and layout."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from epass import _program

__all__ = ["StoreWatch"]


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
    marks = _program.tensor_marks([value for _, _, value in items])
    return [(*item, mark) for item, mark in zip(items, marks, strict=True)]


def _fingerprint(entries: list[_Entry]) -> list[int | None]:
    """A hash of each entry's bytes, dtype, shape, strides and storage offset."""
    out: list[int | None] = []
    for _, _, value, _ in entries:
        if value.device.type == "meta":
            out.append(None)
            continue
        digest = hashlib.blake2b(_program.tensor_bytes(value), digest_size=8)
        digest.update(repr(_program.tensor_layout(value)).encode())
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
        marks = _program.tensor_marks([value for _, _, value, _ in self.entries])
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

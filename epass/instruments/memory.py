"""``MemoryAccounting``: storage bytes held by each program's state, per pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.export import ExportedProgram

from epass.instrumentation import Instrument
from epass.records import PassInfo, PassRecord, PipelineResult

if TYPE_CHECKING:
    from epass.manager import PassManager

__all__ = ["MemoryAccounting", "MemoryEntry", "StateMemory", "state_memory"]

StorageKey = tuple[str, int]


def _tensors(program: ExportedProgram) -> Iterator[tuple[str, torch.Tensor]]:
    for label, d in (("state_dict", program.state_dict), ("constants", program.constants)):
        for key, value in d.items():
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                yield f"{label}:{key}", value


def _storage(t: torch.Tensor) -> tuple[StorageKey, int] | None:
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # fake tensors, some subclasses
        return None


@attrs.frozen
class StateMemory:
    """The memory a program's state holds.

    Attributes:
        storages: bytes of each distinct storage, by (device, data pointer).
        entries: how many state entries hold tensors.
        duplicates: groups of entries whose bytes are equal (same dtype and shape)
            but live in different storages; a linker comparing values could share them.
    """

    storages: dict[StorageKey, int]
    entries: int
    duplicates: tuple[tuple[str, ...], ...] = ()
    duplicate_bytes: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def state_memory(program: ExportedProgram, *, duplicates: bool = True) -> StateMemory:
    """Measure ``program``'s state: unique storage bytes and byte-identical copies."""
    storages: dict[StorageKey, int] = {}
    groups: dict[Any, list[tuple[str, torch.Tensor, StorageKey]]] = {}
    entries = 0
    for name, t in _tensors(program):
        found = _storage(t)
        if found is None:
            continue
        key, nbytes = found
        storages[key] = nbytes
        entries += 1
        if duplicates and t.numel() > 0:
            groups.setdefault((t.dtype, tuple(t.shape), t.device), []).append((name, t, key))
    dup_groups: list[tuple[str, ...]] = []
    dup_bytes = 0
    for members in groups.values():
        # Classes of equal values, one representative storage each.
        classes: list[tuple[torch.Tensor, set[StorageKey], list[str]]] = []
        for name, t, key in members:
            for rep, keys, names in classes:
                if key in keys or torch.equal(rep, t):
                    keys.add(key)
                    names.append(name)
                    break
            else:
                classes.append((t, {key}, [name]))
        for rep, keys, names in classes:
            if len(keys) > 1:
                dup_groups.append(tuple(names))
                dup_bytes += (len(keys) - 1) * rep.numel() * rep.element_size()
    return StateMemory(storages, entries, tuple(dup_groups), dup_bytes)


@attrs.frozen
class MemoryEntry:
    """State memory after one pass run.

    Attributes:
        path: the pass (prefixed by enclosing pipelines).
        step: the fixed-point round.
        depth: nesting depth.
        bytes: unique storage bytes held by the output's state.
        new_bytes: bytes in storages the pass's input did not hold.
        released_bytes: bytes in storages the output no longer references.
        duplicates: groups of byte-identical entries in different storages.
        duplicate_bytes: bytes those duplicates cost beyond one copy each.
    """

    path: str
    step: int
    depth: int
    bytes: int
    new_bytes: int
    released_bytes: int
    duplicates: tuple[tuple[str, ...], ...]
    duplicate_bytes: int


_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _unit(largest: int) -> tuple[str, int]:
    return next((name, size) for name, size in _UNITS if largest >= size or size == 1)


class MemoryAccounting(Instrument):
    """Per pass: the unique storage bytes of the state, what was added, and duplicates.

    Args:
        duplicates: look for byte-identical entries in different storages (reads
            tensor bytes of same-shaped entries; turn off for very large models).

    ``baseline`` measures the pipeline's input, ``entries`` each pass run, and
    ``table()`` renders them.

    Example::

        memory = MemoryAccounting()
        PassManager([Decompose()], instruments=[memory]).run(ep)
        print(memory.table())
    """

    def __init__(self, *, duplicates: bool = True) -> None:
        self.duplicates = duplicates
        self.baseline: StateMemory | None = None
        self.entries: list[MemoryEntry] = []
        self._inputs: dict[int, StateMemory] = {}
        self._last: tuple[ExportedProgram, StateMemory] | None = None

    def _measure(self, program: ExportedProgram) -> StateMemory:
        # An unmodified pass hands back the same program; do not re-read its bytes.
        if self._last is not None and self._last[0] is program:
            return self._last[1]
        memory = state_memory(program, duplicates=self.duplicates)
        self._last = (program, memory)
        return memory

    def before_pipeline(
        self, manager: PassManager, program: ExportedProgram, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self.entries = []
            self._last = None
            self.baseline = self._measure(program)

    def after_pipeline(
        self, manager: PassManager, result: PipelineResult, parent: PassInfo | None = None
    ) -> None:
        if parent is None:
            self._last = None

    def before_pass(self, info: PassInfo, program: ExportedProgram) -> None:
        self._inputs[info.depth] = self._measure(program)

    def pass_failed(self, info: PassInfo, program: ExportedProgram, error: BaseException) -> None:
        self._inputs.pop(info.depth, None)

    def after_pass(self, info: PassInfo, program: ExportedProgram, record: PassRecord) -> None:
        before = self._inputs.pop(info.depth)
        after = self._measure(program)
        new = sum(n for k, n in after.storages.items() if k not in before.storages)
        gone = sum(n for k, n in before.storages.items() if k not in after.storages)
        self.entries.append(
            MemoryEntry(
                info.path,
                info.step,
                info.depth,
                after.bytes,
                new,
                gone,
                after.duplicates,
                after.duplicate_bytes,
            )
        )

    def table(self) -> str:
        """Per pass: state size, bytes added and released, duplicated bytes (entries),
        in the unit that suits the largest state (B, KiB, MiB or GiB)."""
        sizes = [e.bytes for e in self.entries]
        if self.baseline is not None:
            sizes.append(self.baseline.bytes)
        unit, size = _unit(max(sizes, default=0))

        def fmt(n: int) -> str:
            return f"{n / size:.2f}"

        lines = [
            f"{'pass':<28} {'state ' + unit:>10} {'+new':>8} {'-released':>10} {'duplicated':>14}"
        ]
        if self.baseline is not None:
            b = self.baseline
            dup = f"{fmt(b.duplicate_bytes)} ({sum(len(g) for g in b.duplicates)})"
            lines.append(f"{'<input>':<28} {fmt(b.bytes):>10} {'':>8} {'':>10} {dup:>14}")
        for e in self.entries:
            name = "  " * e.depth + e.path.rsplit("/", 1)[-1]
            dup = f"{fmt(e.duplicate_bytes)} ({sum(len(g) for g in e.duplicates)})"
            lines.append(
                f"{name:<28} {fmt(e.bytes):>10} {fmt(e.new_bytes):>8} "
                f"{fmt(e.released_bytes):>10} {dup:>14}"
            )
        return "\n".join(lines)

"""StateLinker: reconcile a pass output's ``state_dict`` and ``constants`` with its input's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputSpec

from epass import _program
from epass.errors import ArgumentTypeError, StateConflictError

__all__ = [
    "STORE_LOCK",
    "DictReport",
    "Journal",
    "LinkReport",
    "LinkResult",
    "Policy",
    "StateLinker",
]

Policy = Literal["share", "strict", "in_place"]
_POLICIES = ("share", "strict", "in_place")
_MISSING = object()


@attrs.frozen
class DictReport:
    """How the entries of one dict (``state_dict`` or ``constants``) were linked.

    Attributes:
        unchanged: keys whose value was the very same object.
        relinked: keys whose value was a new object over the same memory; the
            output now holds the original object.
        relinked_by_value: keys whose value was equal by ``torch.equal`` (only
            with ``compare_values=True``); the output holds the original object.
        added: keys the pass introduced.
        removed: keys the pass dropped.
        changed: keys whose value the pass replaced.
        shared: whether the output's dict is the store (the input's dict object).
    """

    unchanged: tuple[str, ...] = ()
    relinked: tuple[str, ...] = ()
    relinked_by_value: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    shared: bool = True

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class LinkReport:
    """The outcome of linking one program to another, for both dicts."""

    policy: str
    state_dict: DictReport
    constants: DictReport

    @property
    def shared(self) -> bool:
        """True when both output dicts are the store's dict objects."""
        return self.state_dict.shared and self.constants.shared

    @property
    def added(self) -> tuple[str, ...]:
        return _qualified(self, "added")

    @property
    def removed(self) -> tuple[str, ...]:
        return _qualified(self, "removed")

    @property
    def changed(self) -> tuple[str, ...]:
        return _qualified(self, "changed")

    def summary(self) -> str:
        """One line, e.g. ``shared; +2 added, -1 removed``."""
        parts = []
        for label, keys in (("added", self.added), ("removed", self.removed)):
            if keys:
                parts.append(f"{len(keys)} {label}")
        if self.changed:
            parts.append(f"{len(self.changed)} changed")
        head = "shared" if self.shared else "diverged"
        return head + (f"; {', '.join(parts)}" if parts else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "shared": self.shared,
            "state_dict": self.state_dict.as_dict(),
            "constants": self.constants.as_dict(),
        }


def _qualified(report: LinkReport, field: str) -> tuple[str, ...]:
    return tuple(f"state_dict:{k}" for k in getattr(report.state_dict, field)) + tuple(
        f"constants:{k}" for k in getattr(report.constants, field)
    )


@attrs.frozen
class LinkResult:
    """The linked program and the report of how its state was linked."""

    program: ExportedProgram
    report: LinkReport


# Guards every write into a store and every rollback, so that pipelines on the same
# program in several threads see each other's writes whole; the manager also holds
# it while it copies a store for a pass's view (a rollback rewrites a store in two
# steps, clear and update).
STORE_LOCK = threading.RLock()


@attrs.define(eq=False)
class _Pending:
    """A store entry that a run still in progress added, and the runs relying on it."""

    store: dict[str, Any]
    key: str
    value: Any
    owners: list[Journal]


# (id(store), key) -> entries added by runs that have neither committed nor rolled
# back. A rollback deletes such an entry only when no other run relies on it; once
# any run relying on it commits, it is permanent (and leaves this table).
_PENDING: dict[tuple[int, str], _Pending] = {}


class Journal:
    """Records writes into store dicts so that a failed pipeline can undo them.

    Rollback undoes this journal's own writes only: an entry someone else wrote
    since (another pipeline on the same program, in another thread or started from
    inside a pass) is kept, and so is an entry this run added that another run's
    output now uses. :meth:`commit` ends the journal of a successful run.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[dict[str, Any], str, Any, Any]] = []
        self._orders: dict[int, tuple[dict[str, Any], list[str]]] = {}
        self._pending: list[tuple[int, str]] = []

    def _touch(self, store: dict[str, Any]) -> None:
        if id(store) not in self._orders:
            self._orders[id(store)] = (store, list(store))

    def set(self, store: dict[str, Any], key: str, value: Any) -> None:
        with STORE_LOCK:
            self._touch(store)
            old = store.get(key, _MISSING)
            self._entries.append((store, key, old, value))
            store[key] = value
            if old is _MISSING:
                _PENDING[(id(store), key)] = _Pending(store, key, value, [self])
                self._pending.append((id(store), key))

    def delete(self, store: dict[str, Any], key: str) -> None:
        with STORE_LOCK:
            self._touch(store)
            self._entries.append((store, key, store[key], _MISSING))
            del store[key]

    def rely(self, store: dict[str, Any], keys: Any) -> None:
        """Note that this run's output uses the store entries ``keys``: one another
        run added and may still roll back stays while this run needs it."""
        for key in keys:
            pending = _PENDING.get((id(store), key))
            if pending is not None and self not in pending.owners:
                pending.owners.append(self)
                self._pending.append((id(store), key))

    def commit(self) -> None:
        """The run succeeded: the entries it added or uses stay for good."""
        with STORE_LOCK:
            for ref in self._pending:
                _PENDING.pop(ref, None)
            self._pending.clear()
            self._entries.clear()
            self._orders.clear()

    def _release(self, ref: tuple[int, str]) -> None:
        """Drop this run's claim on a pending entry; delete the entry when it was the
        last run relying on it."""
        pending = _PENDING.get(ref)
        if pending is None or self not in pending.owners:
            return  # made permanent by a run that committed
        pending.owners.remove(self)
        if not pending.owners:
            del _PENDING[ref]
            if pending.store.get(pending.key, _MISSING) is pending.value:
                del pending.store[pending.key]

    def rollback(self) -> None:
        """Undo every recorded write that is still in place, newest first. Keys this
        journal did not write keep their values; the keys it knew end in their
        original order, and keys added by others follow them."""
        with STORE_LOCK:
            added = set(self._pending)
            while self._entries:
                store, key, old, new = self._entries.pop()
                if old is _MISSING and (id(store), key) in added:
                    continue  # released below, unless another run relies on it
                if store.get(key, _MISSING) is not new:
                    continue  # written again since by someone else: theirs now
                if old is _MISSING:
                    del store[key]
                else:
                    store[key] = old
            for ref in reversed(self._pending):
                self._release(ref)
            self._pending.clear()
            for store, order in self._orders.values():
                known = [k for k in order if k in store]
                if list(store)[: len(known)] != known:
                    kept = set(known)
                    items = [(k, store[k]) for k in known]
                    items += [(k, v) for k, v in store.items() if k not in kept]
                    store.clear()
                    store.update(items)
            self._orders.clear()


@attrs.define
class _Plan:
    report: DictReport
    output: dict[str, Any]  # values for the output dict, originals where unchanged


def _plan(store: dict[str, Any], new: dict[str, Any], compare_values: bool) -> _Plan:
    unchanged: list[str] = []
    relinked: list[str] = []
    by_value: list[str] = []
    added: list[str] = []
    changed: list[str] = []
    output: dict[str, Any] = {}
    for key, value in new.items():
        old = store.get(key, _MISSING)
        if old is _MISSING:
            added.append(key)
            output[key] = value
        elif old is value:
            unchanged.append(key)
            output[key] = old
        elif _program.same_view(old, value):
            relinked.append(key)
            output[key] = old
        elif compare_values and _equal_values(old, value):
            by_value.append(key)
            output[key] = old
        else:
            changed.append(key)
            output[key] = value
    removed = [k for k in store if k not in new] if len(output) - len(added) != len(store) else []
    report = DictReport(
        unchanged=tuple(unchanged),
        relinked=tuple(relinked),
        relinked_by_value=tuple(by_value),
        added=tuple(added),
        removed=tuple(removed),
        changed=tuple(changed),
    )
    return _Plan(report, output)


def _layout(t: torch.Tensor) -> tuple[Any, ...] | None:
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, t.device)
    except (RuntimeError, NotImplementedError):  # meta, fake and storage-less tensors
        return None


def _reuse_keys(original: ExportedProgram, new: ExportedProgram, plans: dict[str, _Plan]) -> None:
    """Let each added entry that is the same tensor as an existing store entry
    (same storage, offset, strides, dtype, shape) take that entry's key, when
    ``new``'s signature does not use the key already: a second identical run then
    adds nothing to the store. Edits ``plans`` and ``new``'s signature."""
    renames: dict[str, str] = {}
    for name, plan in plans.items():
        if not plan.report.added:
            continue
        store: dict[str, Any] = getattr(original, name)
        index: dict[tuple[Any, ...], list[str]] = {}
        for key, value in store.items():
            layout = _layout(value) if isinstance(value, torch.Tensor) else None
            if layout is not None and layout[0]:
                index.setdefault(layout, []).append(key)
        if not index:
            continue
        used = {s.target for s in new.graph_signature.input_specs if s.target is not None}
        taken = set(renames.values())
        added = list(plan.report.added)
        for key in plan.report.added:
            value = plan.output[key]
            layout = _layout(value) if isinstance(value, torch.Tensor) else None
            for candidate in index.get(layout, ()) if layout is not None else ():
                old = store[candidate]
                mine = plan.output.get(candidate, old)
                if (
                    candidate in used
                    or candidate in taken
                    or not _program.same_view(old, value)
                    or not _program.same_view(old, mine)
                ):
                    continue
                renames[key] = candidate
                taken.add(candidate)
                del plan.output[key]
                plan.output[candidate] = old
                added.remove(key)
                break
        if len(added) != len(plan.report.added):
            removed = [k for k in plan.report.removed if k not in plan.output]
            plan.report = attrs.evolve(plan.report, added=tuple(added), removed=tuple(removed))
    if not renames:
        return
    sig = new.graph_signature
    inputs = [
        InputSpec(s.kind, s.arg, renames[s.target], s.persistent) if s.target in renames else s
        for s in sig.input_specs
    ]
    _program.set_signature(
        new, ExportGraphSignature(input_specs=inputs, output_specs=list(sig.output_specs))
    )


def _note_reliance(
    original: ExportedProgram,
    new: ExportedProgram,
    dicts: dict[str, dict[str, Any]],
    journal: Journal | None,
) -> None:
    """Record that ``new`` uses store entries other runs added and may roll back."""
    targets = {s.target for s in new.graph_signature.input_specs if s.target is not None}
    for name in ("state_dict", "constants"):
        store = getattr(original, name)
        if dicts[name] is not store:
            continue  # the output holds its own dict, values included
        keys = [k for k in targets if (id(store), k) in _PENDING]
        if journal is not None:
            journal.rely(store, keys)
        else:  # a link outside any run: the entries are needed for good
            for key in keys:
                _PENDING.pop((id(store), key), None)


def _equal_values(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if isinstance(a, torch.nn.Parameter) is not isinstance(b, torch.nn.Parameter):
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.device.type == "meta":
        return False
    return bool(torch.equal(a, b))


@attrs.define
class StateLinker:
    """Reconciles a new program's ``state_dict`` and ``constants`` with an original's.

    The original's dicts are the *store*. With the default ``share`` policy the
    output reuses the store's dict objects whenever no existing value changed,
    inserting any added entries into the store; when values changed, the output
    gets its own dict in which every unchanged entry is still the original
    object, and the store is left alone. ``strict`` raises
    :class:`~epass.StateConflictError` instead, and ``in_place`` writes the
    changes into the store (the original program is consumed).

    An added entry that is the same tensor as a store entry the output does not
    reference yet takes that entry's key (the output's signature is renamed), so
    repeating a run adds nothing. No tensor bytes are read unless
    ``compare_values`` is set.

    Example::

        ep = torch.export.export(model, args)
        out = StateLinker().link(ep, ep.run_decompositions()).program
        assert out.state_dict is ep.state_dict
    """

    policy: Policy = attrs.field(default="share", validator=attrs.validators.in_(_POLICIES))
    compare_values: bool = False

    def link(
        self,
        original: ExportedProgram,
        new: ExportedProgram,
        *,
        pass_name: str | None = None,
        journal: Journal | None = None,
    ) -> LinkResult:
        """Rewire ``new``'s dicts against ``original``'s and return it with a report.

        ``new`` is updated in place (its dict references, and the signature's
        targets of added entries that reuse a store key) and returned. Writes into
        the store go through ``journal`` when one is given; planning and writing
        hold a lock, so links of several threads into one store do not interleave.

        Raises:
            ArgumentTypeError: ``original`` or ``new`` is not an ExportedProgram.
        """
        for arg, value in (("original", original), ("new", new)):
            if not isinstance(value, ExportedProgram):
                raise ArgumentTypeError(
                    f"StateLinker.link: {arg} must be an ExportedProgram, "
                    f"got {type(value).__name__}"
                )
        with STORE_LOCK:
            return self._link(original, new, pass_name, journal)

    def _link(
        self,
        original: ExportedProgram,
        new: ExportedProgram,
        pass_name: str | None,
        journal: Journal | None,
    ) -> LinkResult:
        plans = {
            "state_dict": _plan(original.state_dict, new.state_dict, self.compare_values),
            "constants": _plan(original.constants, new.constants, self.compare_values),
        }
        if new is not original:
            _reuse_keys(original, new, plans)
        if self.policy == "strict":
            conflicts = [f"{name}:{k}" for name, p in plans.items() for k in p.report.changed]
            if conflicts:
                raise StateConflictError(
                    f"changed the value of existing state entries {conflicts}; the "
                    "'strict' policy forbids this (use 'share' to give the output its "
                    "own dict, or 'in_place' to overwrite the store)",
                    keys=conflicts,
                    pass_name=pass_name,
                )
        write: Callable[[dict[str, Any], str, Any], None]
        delete: Callable[[dict[str, Any], str], None]
        if journal is not None:
            write, delete = journal.set, journal.delete
        else:
            write, delete = dict.__setitem__, dict.__delitem__
        dicts: dict[str, dict[str, Any]] = {}
        reports: dict[str, DictReport] = {}
        for name, plan in plans.items():
            store: dict[str, Any] = getattr(original, name)
            report = plan.report
            if new is original:
                dicts[name], reports[name] = store, report
                continue
            if self.policy == "in_place" or not report.changed:
                for key in report.added:
                    write(store, key, plan.output[key])
                if self.policy == "in_place":
                    for key in report.changed:
                        write(store, key, plan.output[key])
                    for key in report.removed:
                        delete(store, key)
                dicts[name] = store
            else:
                dicts[name] = plan.output
                report = attrs.evolve(report, shared=False)
            reports[name] = report
        if _PENDING and new is not original:
            _note_reliance(original, new, dicts, journal)
        _program.set_state(new, dicts["state_dict"], dicts["constants"])
        return LinkResult(
            program=new,
            report=LinkReport(
                policy=self.policy,
                state_dict=reports["state_dict"],
                constants=reports["constants"],
            ),
        )

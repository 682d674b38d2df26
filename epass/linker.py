"""StateLinker: reconcile a pass output's ``state_dict`` and ``constants`` with its input's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs
import torch
from torch.export import ExportedProgram

from epass import _program, _tensors
from epass.errors import ArgumentTypeError, StateConflictError

__all__ = [
    "STORE_LOCK",
    "DictReport",
    "Journal",
    "LinkReport",
    "LinkResult",
    "Owner",
    "Policy",
    "StateLinker",
    "owners_text",
]

Policy = Literal["share", "strict", "in_place"]
_POLICIES = ("share", "strict", "in_place")
_MISSING = object()


Owner = Literal["user", "own"]


@attrs.frozen
class DictReport:
    """How the entries of one dict (``state_dict`` or ``constants``) were linked.

    Attributes:
        unchanged: keys whose value was the very same object.
        relinked: keys whose value was a new object over the same memory; the
            output now holds the original object.
        relinked_by_value: keys whose value was equal by ``torch.equal`` (only
            with ``compare_values=True``); the output holds the original object.
        added: keys the pass introduced (they are in the output's own dict only).
        removed: keys the pass dropped.
        changed: keys whose value the pass replaced.
        shared: whether the output's dict is its input's dict object.
        owner: ``"user"`` when the output's dict is the user's dict object (the
            dict of the program the pipeline was given), ``"own"`` when it is a
            dict epass made for this output or an earlier one of the same run.
    """

    unchanged: tuple[str, ...] = ()
    relinked: tuple[str, ...] = ()
    relinked_by_value: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    shared: bool = True
    owner: Owner = "user"

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
        """True when both output dicts are the input's dict objects."""
        return self.state_dict.shared and self.constants.shared

    @property
    def owners(self) -> dict[str, Owner]:
        """Whose dict each of the output's dicts is: ``"user"`` or ``"own"``."""
        return {"state_dict": self.state_dict.owner, "constants": self.constants.owner}

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
        """One line that cannot be misread, e.g. ``user's state_dict, own constants;
        2 entries added, 1 no longer used by the output; your dicts are untouched``
        (under ``in_place``: ``1 deleted from your dicts``)."""
        in_place = self.policy == "in_place"
        counts = [
            (len(self.added), "added"),
            (
                len(self.removed),
                "deleted from your dicts" if in_place else "no longer used by the output",
            ),
            (
                len(self.changed),
                "overwritten in your dicts" if in_place else "changed in its own dict",
            ),
        ]
        parts = [f"{n} {what}" for n, what in counts if n]
        if not parts:
            return owners_text(self.owners)
        first = next(n for n, _ in counts if n)  # "1 entry added, 2 no longer used ..."
        parts[0] = parts[0].replace(" ", f" {'entry' if first == 1 else 'entries'} ", 1)
        touched = in_place and bool(self.removed or self.changed)
        untouched = "" if touched else "; your dicts are untouched"
        return f"{owners_text(self.owners)}; {', '.join(parts)}{untouched}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "shared": self.shared,
            "owners": self.owners,
            "state_dict": self.state_dict.as_dict(),
            "constants": self.constants.as_dict(),
        }


def owners_text(owners: Mapping[str, str]) -> str:
    """``user's dicts``, ``own dicts`` or ``user's state_dict, own constants``."""
    sd, consts = owners["state_dict"], owners["constants"]
    if sd == consts:
        return "user's dicts" if sd == "user" else "own dicts"
    word = {"user": "user's", "own": "own"}
    return f"{word[sd]} state_dict, {word[consts]} constants"


def _qualified(report: LinkReport, field: str) -> tuple[str, ...]:
    return tuple(f"state_dict:{k}" for k in getattr(report.state_dict, field)) + tuple(
        f"constants:{k}" for k in getattr(report.constants, field)
    )


@attrs.frozen
class LinkResult:
    """The linked program and the report of how its state was linked."""

    program: ExportedProgram
    report: LinkReport


# Guards every write into a store and every rollback (only the ``in_place`` policy
# writes into a store), so that pipelines on the same program in several threads
# see each other's writes whole; the manager also holds it while it copies a store
# for a pass's view (a rollback rewrites a store in two steps, clear and update).
STORE_LOCK = threading.RLock()


class Journal:
    """Records the ``in_place`` policy's writes into store dicts so that a failed
    pipeline can undo them.

    Rollback undoes this journal's own writes only: an entry someone else wrote
    since (another pipeline on the same program, in another thread or started
    from inside a pass) keeps its value. :meth:`commit` ends the journal of a
    successful run. No other policy writes into a store, so their journals stay
    empty.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[dict[str, Any], str, Any, Any]] = []
        self._orders: dict[int, tuple[dict[str, Any], list[str]]] = {}

    def _touch(self, store: dict[str, Any]) -> None:
        if id(store) not in self._orders:
            self._orders[id(store)] = (store, list(store))

    def set(self, store: dict[str, Any], key: str, value: Any) -> None:
        with STORE_LOCK:
            self._touch(store)
            self._entries.append((store, key, store.get(key, _MISSING), value))
            store[key] = value

    def delete(self, store: dict[str, Any], key: str) -> None:
        with STORE_LOCK:
            self._touch(store)
            self._entries.append((store, key, store[key], _MISSING))
            del store[key]

    def commit(self) -> None:
        """The run succeeded: its writes stay."""
        with STORE_LOCK:
            self._entries.clear()
            self._orders.clear()

    def rollback(self) -> None:
        """Undo every recorded write that is still in place, newest first; a key
        deleted and put back returns to its original position."""
        with STORE_LOCK:
            while self._entries:
                store, key, old, new = self._entries.pop()
                if store.get(key, _MISSING) is not new:
                    continue  # written again since by someone else: theirs now
                if old is _MISSING:
                    del store[key]
                else:
                    store[key] = old
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


def _refuse_changes(plans: Mapping[str, _Plan], pass_name: str | None) -> None:
    """The ``strict`` policy: raise StateConflictError when a value changed."""
    conflicts = [f"{name}:{k}" for name, p in plans.items() for k in p.report.changed]
    if conflicts:
        raise StateConflictError(
            f"changed the value of existing state entries {conflicts}; the "
            "'strict' policy forbids this (use 'share' to give the output its "
            "own dict, or 'in_place' to overwrite the store)",
            keys=conflicts,
            pass_name=pass_name,
        )


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
        elif _tensors.same_view(old, value):
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

    The original's dicts are the *store*. One rule holds under every policy: the
    linker never inserts a key into a store. With the default ``share`` policy the
    output reuses the store's dict object when it holds the same entries (same
    objects, or new objects over the same memory) or fewer; when the pass added
    an entry or changed a value, the output gets its own dict ("copy on add"), in
    which every entry it shares with the store is still the store's object, and
    the store is left alone. A store that is not ``user``'s dict (an earlier
    output's own) is also copied, without them, when the pass dropped entries.
    ``strict`` raises :class:`~epass.StateConflictError` for changed values
    instead, and ``in_place`` writes changed values and
    removals into the store (the original program is consumed); added entries go
    into the output's own dict under every policy. No tensor bytes are read unless
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
        user: ExportedProgram | None = None,
    ) -> LinkResult:
        """Rewire ``new``'s dicts against ``original``'s and return it with a report.

        ``new`` is updated in place (its dict references) and returned. The
        ``in_place`` policy's writes into the store go through ``journal`` when one
        is given; planning and writing hold a lock, so links of several threads
        into one store do not interleave. The report's ``owner`` fields say
        whether each output dict is ``user``'s dict object (default: the
        original's) or one of its own.

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
            return self._link(original, new, pass_name, journal, user or original)

    def _link(
        self,
        original: ExportedProgram,
        new: ExportedProgram,
        pass_name: str | None,
        journal: Journal | None,
        user: ExportedProgram,
    ) -> LinkResult:
        plans = {
            "state_dict": _plan(original.state_dict, new.state_dict, self.compare_values),
            "constants": _plan(original.constants, new.constants, self.compare_values),
        }
        if self.policy == "strict":
            _refuse_changes(plans, pass_name)
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
                dicts[name] = store
            else:
                if self.policy == "in_place":
                    for key in report.changed:
                        write(store, key, plan.output[key])
                    for key in report.removed:
                        delete(store, key)
                    own = bool(report.added)
                else:
                    # A dict that is not the user's belongs to an earlier output of
                    # the same run: one that dropped entries gets a copy without
                    # them, so an own dict holds what its output holds.
                    dropped = bool(report.removed) and store is not getattr(user, name)
                    own = bool(report.added or report.changed or dropped)
                # Copy on add: an entry the store lacks never enters the store, which
                # other programs (the user's among them) read whole.
                dicts[name] = plan.output if own else store
                if own:
                    report = attrs.evolve(report, shared=False)
            owner: Owner = "user" if dicts[name] is getattr(user, name) else "own"
            reports[name] = attrs.evolve(report, owner=owner)
        _program.set_state(new, dicts["state_dict"], dicts["constants"])
        return LinkResult(
            program=new,
            report=LinkReport(
                policy=self.policy,
                state_dict=reports["state_dict"],
                constants=reports["constants"],
            ),
        )

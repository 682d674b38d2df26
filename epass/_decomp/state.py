"""torch's process-global state: the lock around it, the operators whose kernels a
retrace may patch, and ``run_decompositions`` as epass calls it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _operators
from epass._torch import internals, operators, quiet

__all__ = [
    "LOCK",
    "backend_decomps_off",
    "is_preservable",
    "patchable_ops",
    "run_decompositions",
    "torch_state",
]


LOCK = threading.RLock()
"""The process-wide lock around torch's global state. Tracing a decomposition (which
overrides the CompositeImplicitAutograd kernels of every such operator and registers
fake tensor rules, for the whole process) and every ``run_decompositions`` epass calls
hold it, as does a whole incremental decomposition (templates are traced and values
propagated in the program's fake mode and shape environment, shared by every thread
working on that program). It also guards the engine's caches (table splits, table
names, templates). Reentrant."""


@contextlib.contextmanager
def torch_state(ops: Iterable[Any]) -> Iterator[None]:
    """Hold :data:`LOCK`, and on the way out, whatever happened, put back the Python
    kernels of ``ops`` and torch's fake tensor rules as they were.

    torch's own CompositeImplicitAutograd override restores the kernels it patched
    only once it is fully set up, and drops the fake tensor rule of every op it
    patched, including rules that were there before (``aten.item``, for one).
    """
    with LOCK:
        kernels = [(op, operators.python_kernels(op).copy()) for op in ops]
        rule_dict, rule_checks = operators.fake_rules()
        rules = rule_dict.copy()
        checks = list(rule_checks)
        try:
            yield
        finally:
            for op, saved in kernels:
                current = operators.python_kernels(op)
                if current != saved:
                    current.clear()
                    current.update(saved)
                    operators.clear_dispatch_cache(op)
            if rule_dict != rules:
                rule_dict.clear()
                rule_dict.update(rules)
            if rule_checks != checks:
                rule_checks[:] = checks


def patchable_ops() -> frozenset[Any]:
    """The operators torch's CompositeImplicitAutograd override patches for any table
    (the CIA side of a split holds these and the table's own keys): the set of
    ``_collect_all_valid_cia_ops``, walked the way it walks, with the C++ registrations
    loaded once rather than once per namespace (a test pins the two sets equal). Not
    cached, as torch does not cache it: a library can go and come back with new
    operator objects under the same names."""
    ops = operators.aten_cia_ops()
    for space_name in list(torch.ops):
        space = getattr(torch.ops, space_name)
        if space_name == "aten" or not isinstance(space, operators.OpNamespace):
            continue
        for packet_name in list(space):
            for op in operators.op_overloads(getattr(space, packet_name)):
                if operators.is_preservable_cia_op(op):
                    ops.add(op)
    return frozenset(ops)


def is_preservable(op: Any) -> bool:
    """Whether torch may preserve the CompositeImplicitAutograd operator ``op``
    (functional, not aliasing, with a kernel: ``_is_preservable_cia_op``)."""
    return operators.is_preservable_cia_op(op)


def run_decompositions(
    ep: ExportedProgram, table: Any = None
) -> tuple[ExportedProgram, str | None]:
    """``ep.run_decompositions(table)``, under :func:`torch_state` for every operator its
    CompositeImplicitAutograd override can patch. The only way epass calls it.

    Returns torch's program, and None, or why it ran without that guard: finding the
    operators leans on torch internals, and where this release lacks or changed one
    the retrace, which is torch's public API, runs all the same (under :data:`LOCK`).
    """
    with contextlib.ExitStack() as stack:
        bare = None
        try:
            ops = set(patchable_ops())
            if table is not None:
                # keys(): a CustomDecompTable is a dict whose entries live elsewhere
                ops.update(op for op in table.keys() if _operators.is_op_overload(op))  # noqa: SIM118
            stack.enter_context(torch_state(ops))
        except Exception as exc:
            bare = (
                "run_decompositions ran without the guard that puts back the kernels "
                f"its override patches: {internals.unexpected(exc)}"
            )
            stack.enter_context(LOCK)
        stack.enter_context(quiet.leaf_specs())
        return ep.run_decompositions(table), bare


@contextlib.contextmanager
def backend_decomps_off() -> Iterator[None]:
    """The backend switches export's retrace turns off around its trace
    (``torch.export._trace._ignore_backend_decomps``: mkldnn, nnpack, cudnn), set
    here without importing that module, which brings AOTAutograd and networkx with it
    (about 0.25 s in a fresh process a warm template cache never needs). A test
    checks that both leave every switch the same."""
    backends = (torch.backends.mkldnn, torch.backends.nnpack, torch.backends.cudnn)
    saved = [backend.set_flags(False) for backend in backends]
    try:
        yield
    finally:
        for backend, flags in zip(backends, saved, strict=True):
            backend.set_flags(*flags)

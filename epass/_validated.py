"""Validation marks: what torch's verifier read of a program when it passed
``validate()``, so that the check need not run again while none of it has changed."""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
from torch.export import ExportedProgram

from epass._torch import programs

__all__ = [
    "carry_mark",
    "forget_validated",
    "has_mark",
    "mark_validated",
    "still_validated",
]


# Programs new_program built, with what torch's verifier read of them right after
# the constructor validated them: verify_program need not run validate() again
# while none of it has changed (weak keys: a freed program leaves no entry).
_VALIDATED: weakref.WeakKeyDictionary[ExportedProgram, list[Any]] = weakref.WeakKeyDictionary()


# The Verifier methods that read a program; a subclass that keeps them (torch's
# TrainingIRVerifier sets only its dialect) reads what the base one reads.
_VERIFIER_READS = ("check", "_check_graph_module", "check_valid_op", "check_additional")


def _verified_state(ep: ExportedProgram) -> list[Any] | None:
    """Everything torch's base ``Verifier`` reads of ``ep``: its verifiers (their
    dialect), every module and graph, each node's name, op, target, arguments and
    ``meta["val"]`` / ``meta["torch_fn"]``, the objects ``get_attr`` nodes name, the
    signature, the dicts' entries and the module call graph's argument names. None
    when one of ``ep``'s verifiers checks more than the base one (ExecuTorch's
    dialects do), since it may read anything. One flat list, with no tuple per node
    (fewer objects for the collector to walk): each node's entries start with the
    node and its op, and a list value's items follow their count, so two lists are
    equal exactly when every fact in them is."""
    verifier = programs.base_verifier()
    for v in ep.verifiers:
        if any(getattr(v, m) is not getattr(verifier, m) for m in _VERIFIER_READS):
            return None
    gm = ep.graph_module
    sig = ep.graph_signature
    state: list[Any] = [
        gm,
        sig,
        list(ep.verifiers),  # the dialect: an ATEN program may hold no in-place call
        [(s.kind, repr(s.arg), s.target, s.persistent) for s in sig.input_specs],
        [(s.kind, repr(s.arg), s.target) for s in sig.output_specs],
        list(ep.state_dict.items()),
        list(ep.constants.items()),
        [
            (e.fqn, None if e.signature is None else repr(e.signature.inputs + e.signature.outputs))
            for e in ep.module_call_graph
        ],
    ]
    add, extend = state.append, state.extend
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            extend((module, list(vars(module).items())))
            continue
        buffers = list(programs.module_buffers(module).items())
        extend((module, module.graph, list(vars(module).items()), buffers))
        for node in module.graph.nodes:
            meta = node.meta
            val = meta.get("val")
            torch_fn = meta.get("torch_fn")
            extend((node, node.op, node.name, node.target, node.args, node.kwargs, val, torch_fn))
            if type(val) in (list, tuple):  # its items, after their count
                add(len(val))
                extend(val)
            else:
                add(None)
            if node.op == "get_attr":
                try:
                    add(operator.attrgetter(str(node.target))(module))
                except AttributeError:
                    add(None)
    return state


def mark_validated(ep: ExportedProgram) -> None:
    """Record that ``ep`` has just passed ``validate()`` (its constructor ran it)."""
    state = _verified_state(ep)
    if state is not None:
        _VALIDATED[ep] = state


def forget_validated(ep: ExportedProgram) -> None:
    """Drop ``ep``'s record of passing ``validate()`` (:func:`mark_validated`): a pass
    epass does not vouch for may have edited its graph, and no check has run since."""
    _VALIDATED.pop(ep, None)


def still_validated(ep: ExportedProgram) -> bool:
    """Whether ``ep`` passed ``validate()`` (:func:`mark_validated`) and nothing the
    verifier reads has changed since, so that running it again would pass."""
    before = _VALIDATED.get(ep)
    if before is None:
        return False
    try:
        # Lists and tuples compare identical items by identity first: fake values
        # are never compared element-wise; an odd __eq__ counts as a change.
        return bool(_verified_state(ep) == before)
    except Exception:
        return False


def has_mark(ep: ExportedProgram) -> bool:
    """Whether ``ep`` was marked as having passed ``validate()`` (:func:`mark_validated`)
    and the mark was not dropped since; :func:`still_validated` also checks that nothing
    the verifier reads has changed."""
    return ep in _VALIDATED


def carry_mark(ep: ExportedProgram, clone: ExportedProgram) -> None:
    """Give ``clone``, a program sharing ``ep``'s fields, ``ep``'s mark if it has one:
    :func:`still_validated` compares it with the clone's own fields."""
    state = _VALIDATED.get(ep)
    if state is not None:
        _VALIDATED[clone] = state

"""The ``Pass`` protocol, ``PassResult``, and adapters for functions and torch.fx passes.

The contract, checked by :class:`~epass.PassManager` around every call:

=====================  =========================================================
what a pass may do     what the manager guarantees
=====================  =========================================================
return a new program   it is verified and its state linked to the store; a
                       program the pass did not get from the manager (the
                       caller's own input) is linked as a shallow clone, so
                       the caller's object is never re-pointed
return its input       unmodified when returned unchanged; when the pass
                       edited it in place (graph, node meta, signature, state
                       keys or entries) it is the output, verified and linked
mutate its input       the input is a private view: dict copies always, and a
                       graph copy (nested ``meta`` containers copied too)
                       unless the pass declares ``changes_input = False``;
                       such a pass that returns its input edited is an error
write to a dict        the dicts a pass sees are private copies; the linker
                       never inserts into a dict another program reads (an
                       output with added entries owns a new dict)
write to a tensor      detected (``_version`` counters, optionally a
                       fingerprint of bytes and layout) and raised as
                       :class:`~epass.StateMutationError` naming the keys
add an in-place write  its output fails verification when it writes into
into state             state in place that its input did not write and its
                       signature does not declare
return PassResult      the ``modified`` flag is trusted; so is that of any
                       result carrying a program and a ``modified`` flag
                       (ExecuTorch's ``ExportedProgramPassResult``)
=====================  =========================================================
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassBase

from epass import _graph
from epass.errors import ArgumentTypeError

__all__ = [
    "FxPass",
    "Pass",
    "PassLike",
    "PassResult",
    "adapt",
    "pass_name",
]


@attrs.frozen
class PassResult:
    """What a pass returns: the resulting program and whether it differs from the input."""

    program: ExportedProgram = attrs.field(validator=attrs.validators.instance_of(ExportedProgram))
    modified: bool = attrs.field(validator=attrs.validators.instance_of(bool))


@runtime_checkable
class Pass(Protocol):
    """Anything callable as ``(ExportedProgram) -> PassResult | ExportedProgram``.

    Optional attributes a pass may declare:

    * ``name``: used in records and errors (default: the function or class name);
    * ``requires(ep)`` / ``ensures(ep)``: checks on the input / on the *result*;
      return False or raise to fail;
    * ``run_before`` / ``run_after``: names or types of passes it must precede or follow;
    * ``changes_input``: set False when the pass never mutates the program it gets,
      so the manager need not copy the graph for it (returning it edited anyway
      is then a :class:`~epass.PassError`);
    * ``skip_reason(ep)``: return a reason string when the pass would be a no-op on
      ``ep``; the manager then skips it and records why;
    * ``merge(next_pass)``: return one pass doing the work of this one and the next,
      or None; the manager merges adjacent passes this way when it is built.
    """

    def __call__(self, ep: ExportedProgram, /) -> PassResult | ExportedProgram: ...


PassLike: TypeAlias = "Pass | PassBase | Callable[[ExportedProgram], Any]"


def pass_name(p: Any) -> str:
    """The name a pass goes by in records and errors."""
    name = getattr(p, "name", None)
    if isinstance(name, str) and name:
        return name
    if hasattr(p, "__name__"):
        return str(p.__name__)
    return type(p).__name__


class FxPass:
    """Runs a torch.fx pass (``GraphModule -> PassResult | GraphModule | None``) on a program.

    The pass works on a copy of the graph, so the input program's graph is never
    touched (unlike ``ExportedProgram._transform_do_not_use``); tensors are never
    copied. The signature is re-derived from the new graph: placeholders may be
    removed (their state entries leave the output's dicts); adding inputs or
    changing the number of outputs is an error. Tensors the pass registers on the
    GraphModule and reads through ``get_attr`` are lifted to new ``constants``
    entries (see :class:`~epass.passes.LiftConstants`).

    Example::

        def relu_to_gelu(gm):
            for node in gm.graph.nodes:
                if node.target is torch.ops.aten.relu.default:
                    node.target = torch.ops.aten.gelu.default
            gm.recompile()
            return gm

        PassManager([FxPass(relu_to_gelu)]).run(ep)
    """

    changes_input = False

    def __init__(self, fn: Callable[[torch.fx.GraphModule], Any], *, name: str | None = None):
        if not callable(fn):
            raise ArgumentTypeError(f"FxPass needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or pass_name(fn)

    def __repr__(self) -> str:
        return f"FxPass({self.name})"

    def __call__(self, ep: ExportedProgram) -> PassResult:
        program, modified = _graph.run_graph_pass(ep, self.fn, self.name)
        return PassResult(program, modified)


def adapt(p: Any, *, position: int | None = None) -> Any:
    """Turn a pass-like object into something the manager can call, or raise TypeError.

    Names and pipeline text are resolved by the manager through the text layer.
    """
    if isinstance(p, PassBase):
        return FxPass(p, name=pass_name(p))
    if isinstance(p, (str, ExportedProgram, torch.nn.Module)) or not callable(p):
        where = f"pipeline position {position}: " if position is not None else ""
        raise ArgumentTypeError(
            f"{where}{p!r} ({type(p).__name__}) is not a pass; a pass is a callable "
            "taking an ExportedProgram and returning a PassResult or ExportedProgram, "
            "a torch.fx PassBase, or FxPass(fn) around a GraphModule function"
        )
    return p


def ordering_names(p: Any, attr: str) -> Sequence[Any]:
    value = getattr(p, attr, ())
    if isinstance(value, (str, type)):
        return (value,)
    return tuple(value or ())

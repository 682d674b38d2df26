"""LiftConstants: turn tensor ``get_attr`` nodes into lifted constant inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram

from epass import _graph
from epass.options import checked
from epass.protocol import PassResult, unreported_edit

__all__ = ["LiftConstants", "lift_constants"]


def lift_constants(ep: ExportedProgram, gm: torch.fx.GraphModule) -> ExportedProgram:
    """Build a program from ``ep`` with graph ``gm`` (a graph copy derived from ``ep``'s),
    lifting every tensor ``get_attr`` of ``gm`` to a ``CONSTANT_TENSOR`` input."""
    return _graph.lift_tensor_attributes(ep, gm)


@checked
@attrs.define(eq=False)
class LiftConstants:
    """Lift tensor ``get_attr`` nodes to placeholders with ``CONSTANT_TENSOR`` specs.

    torch.export's verifier rejects tensor attributes, so a graph rewrite that
    registers a tensor on the GraphModule (``gm.register_buffer`` + ``get_attr``)
    cannot become a program by itself. Give such a rewrite as ``fx``: it runs on a
    copy of the graph, and whatever tensors it left as attributes are lifted. Used
    alone, the pass lifts the tensor attributes of a program built without the
    verifier.

    Graph: each tensor ``get_attr`` becomes a placeholder before the user inputs.
    State: **adds** one ``constants`` entry per attribute, holding the same tensor
    object; changes and removes nothing. The output shares the user's
    ``state_dict`` and holds a ``constants`` dict of its own (the user's tensor
    objects plus the lifted ones); the user's dicts gain nothing.

    Args:
        fx: optional ``GraphModule -> GraphModule | None`` rewrite to run first.

    Example::

        def add_bias(gm):
            gm.register_buffer("bias", torch.ones(4))
            ...  # insert get_attr("bias") nodes
        out = PassManager([LiftConstants(fx=add_bias)]).run(ep)
    """

    name: ClassVar[str] = "lift-constants"
    changes_input: ClassVar[bool] = False

    fx: Callable[[torch.fx.GraphModule], Any] | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )

    def __call__(self, ep: ExportedProgram) -> PassResult:
        if self.fx is not None:
            program, modified, unreported = _graph.run_graph_pass(ep, self.fx, self.name)
            return PassResult(program, modified, notices=unreported_edit(unreported))
        if not _graph.tensor_attributes(ep.graph_module):
            return PassResult(ep, False)
        return PassResult(_graph.lift_tensor_attributes(ep, _graph.editable_graph(ep)), True)

    @property
    def _takes_lease(self) -> bool:
        # An fx function may keep the module it is given: it always gets a copy.
        return self.fx is None

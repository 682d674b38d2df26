"""An example epass plugin: ``swap-activation`` replaces one activation op by another."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from torch.export import ExportedProgram

from epass import FxPass, PassResult

__all__ = ["SwapActivation"]


def _op(value: Any) -> Any:
    if not callable(value):
        raise TypeError(f"expected an operator such as aten.gelu.default, got {value!r}")
    return value


@attrs.define(eq=False)
class SwapActivation:
    """Replace every call of one elementwise activation by another.

    Graph: retargets matching ``call_function`` nodes; state: untouched, so the
    output shares every tensor with the input.

    Example::

        PassManager(["swap-activation(source=aten.relu.default, target=aten.gelu.default)"])
    """

    name: ClassVar[str] = "swap-activation"
    changes_input: ClassVar[bool] = False

    source: Any = attrs.field(default=torch.ops.aten.relu.default, converter=_op)
    target: Any = attrs.field(default=torch.ops.aten.gelu.default, converter=_op)

    def _rewrite(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is self.source:
                node.target = self.target
        return gm

    def __call__(self, ep: ExportedProgram) -> PassResult:
        if not any(n.target is self.source for n in ep.graph.nodes):
            return PassResult(ep, False)
        return FxPass(self._rewrite, name=self.name)(ep)

"""DeadCodeElimination: remove unused nodes and unused state inputs."""

from __future__ import annotations

from typing import ClassVar

import attrs
from torch.export import ExportedProgram

from epass import _dce, _graph
from epass.options import checked
from epass.protocol import PassResult

__all__ = ["DeadCodeElimination"]


def _has_dead_code(ep: ExportedProgram, state_names: set[str]) -> bool:
    impure = _dce.impure_test()
    for node in ep.graph.nodes:
        if node.users or node.op == "output":
            continue
        if node.op == "placeholder":
            if node.name in state_names:
                return True
        elif not impure(node):
            return True
    return False


@checked
@attrs.define(eq=False)
class DeadCodeElimination:
    """Remove nodes whose results are never used, and state inputs nothing reads.

    Built on ``torch.fx.Graph.eliminate_dead_code``, which keeps side-effecting
    nodes (in-place ops, assertions, anything ``Node.is_impure`` flags). Added on
    top: unused parameter, buffer, constant and custom-object placeholders are
    removed and the signature is rebuilt (user inputs, tokens and mutated buffers
    stay, since they are part of the calling convention); unused submodules go
    too. A first scan decides whether there is anything to remove, so a clean
    program is returned as is without copying its graph.

    State: **removes** the entries of the dropped inputs from the output's dicts.
    The user's dicts keep them (the input still needs them) and the link report
    lists them as removed; nothing is added or changed, so the output shares the
    dicts it was given.
    Works on training-IR and decomposed programs.

    Example::

        out = PassManager([DeadCodeElimination()]).run(ep)
    """

    name: ClassVar[str] = "dce"
    changes_input: ClassVar[bool] = False
    _takes_lease: ClassVar[bool] = True

    def __call__(self, ep: ExportedProgram) -> PassResult:
        sig = ep.graph_signature
        kinds = (*_graph.STATE_KINDS, _graph.InputKind.CUSTOM_OBJ)
        mutated = set(sig.buffers_to_mutate.values())
        state_names = {
            s.arg.name
            for s in sig.input_specs
            if s.kind in kinds and hasattr(s.arg, "name") and s.target not in mutated
        }
        if not _has_dead_code(ep, state_names):
            return PassResult(ep, False)
        gm = _graph.editable_graph(ep)
        _dce.eliminate_dead_code(gm)
        _graph.remove_unused_state_placeholders(gm, sig, only=state_names)
        with _dce.keeping_nested_submodules(gm):  # a cond's branches' branches
            gm.delete_all_unused_submodules()
        return PassResult(_graph.build_program(ep, gm, erased_only=True), True)

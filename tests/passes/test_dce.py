"""DeadCodeElimination: dead nodes and unused state inputs go; the store stays."""

from __future__ import annotations

import pass_helpers as h
import torch

import epass
from epass.passes import DeadCodeElimination

aten = torch.ops.aten


def _add_dead_relu(gm: torch.fx.GraphModule) -> None:
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(first):
        dead = gm.graph.call_function(aten.relu.default, (first,))
    dead.meta["val"] = first.meta["val"]


@h.zoo_params()
def test_dce_keeps_numerics_and_input(name: str, dynamic: bool, form: str) -> None:
    ep = epass.PassManager([epass.FxPass(_add_dead_relu)]).run(h.program(name, dynamic, form))
    before = len(ep.graph.nodes)
    result = h.run_checked(DeadCodeElimination(), ep)
    assert result.modified
    assert len(result.program.graph.nodes) < before
    h.assert_close(result.program, name, dynamic)
    again = DeadCodeElimination()(result.program)
    assert again.modified is False and again.program is result.program


def test_dce_removes_unused_parameter_and_reports_it() -> None:
    ep = h.program("mixed")  # the tied embed.weight is never read
    result = epass.PassManager([DeadCodeElimination()])(ep)
    link = result.records[0].link
    assert link is not None and link.removed == ("state_dict:embed.weight",)
    assert "embed.weight" in ep.state_dict  # kept in the store
    assert result.program.state_dict is ep.state_dict
    targets = {s.target for s in result.program.graph_signature.input_specs}
    assert "embed.weight" not in targets


def test_dce_keeps_in_place_updates_and_assertions() -> None:
    ep = h.program("seed")  # training IR: count.add_(1)
    result = DeadCodeElimination()(ep)
    assert result.modified is False
    assert h.node_count(result.program, aten.add_.Tensor) == 1


def test_dce_is_idempotent_on_the_zoo() -> None:
    for name, dynamic in h.ZOO:
        for form in h.FORMS:
            ep = epass.PassManager([DeadCodeElimination()]).run(h.program(name, dynamic, form))
            assert DeadCodeElimination()(ep).modified is False

"""The helpers the passes share, and the private torch API they reach through _program."""

from __future__ import annotations

import operator

import pytest
import torch

from epass import _graph, _program
from epass.passes import CastDtype, ConstantFold, DeadCodeElimination


def test_op_schema_reads_operator_schemas() -> None:
    schema = _program.op_schema(torch.ops.aten.add_.Tensor)
    assert schema is not None and schema.is_mutable and schema.name == "aten::add_"
    assert not _program.op_schema(torch.ops.aten.add.Tensor).is_mutable  # type: ignore[union-attr]
    assert _program.op_schema(operator.getitem) is None
    assert _program.op_schema(torch.ops.aten.add) is None  # a packet, not an overload


def test_is_op_overload() -> None:
    assert _program.is_op_overload(torch.ops.aten.relu.default)
    assert not _program.is_op_overload(torch.ops.aten.relu)
    assert not _program.is_op_overload(torch.relu)


def _builtin_named() -> torch.export.ExportedProgram:
    # nn.Sequential's argument is called "input", which graph copies rename.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    return torch.export.export(model, (torch.randn(2, 4),)).run_decompositions()


def test_copy_graph_keeps_specs_of_renamed_placeholders() -> None:
    ep = _builtin_named()
    assert "input" in ep.graph_signature.user_inputs
    gm = _graph.copy_graph(ep)
    out = _graph.build_program(ep, gm)
    assert [s.kind for s in out.graph_signature.input_specs] == [
        s.kind for s in ep.graph_signature.input_specs
    ]


@pytest.mark.parametrize("make", [CastDtype, ConstantFold, DeadCodeElimination])
def test_passes_handle_an_input_named_like_a_builtin(make: type) -> None:
    ep = _builtin_named()
    out = make()(ep).program
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), ep.module()(x), atol=5e-2, rtol=5e-2)


def test_mutated_nodes_follows_views() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v = self.b.view(2, 2)
            self.b.add_(1)
            return x + v.sum()

    ep = torch.export.export(M(), (torch.ones(1),))
    names = {n.name for n in _graph.mutated_nodes(ep.graph_module)}
    assert {"b_b", "view", "add_"} <= names
    assert "x" not in names


def test_unique_key() -> None:
    assert _graph.unique_key("a", {"b"}) == "a"
    assert _graph.unique_key("a", {"a", "a_1"}, {"a_2"}) == "a_3"

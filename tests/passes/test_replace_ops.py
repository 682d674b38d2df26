"""ReplaceOps: operator swaps, traced Python replacements and subgraph patterns."""

from __future__ import annotations

import pass_helpers as h
import pytest
import torch

from epass.passes import ReplaceOps

aten = torch.ops.aten


def clamp_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, min=0)


def _targets(ep: torch.export.ExportedProgram) -> set[object]:
    return {n.target for n in ep.graph.nodes if n.op == "call_function"}


@h.zoo_params()
def test_replace_ops_traced_function_keeps_numerics(name: str, dynamic: bool, form: str) -> None:
    ep = h.program(name, dynamic, form)
    result = h.run_checked(ReplaceOps({aten.relu.default: clamp_relu}), ep)
    has_relu = aten.relu.default in _targets(ep)
    assert result.modified is has_relu
    assert aten.relu.default not in _targets(result.program)
    h.assert_close(result.program, name, dynamic)
    assert result.program.state_dict is ep.state_dict


@pytest.mark.parametrize("form", h.FORMS)
def test_replace_ops_retargets_an_operator(form: str) -> None:
    ep = h.program("mlp", True, form)
    out = h.run_checked(ReplaceOps({aten.relu.default: aten.gelu.default}), ep).program
    assert aten.relu.default not in _targets(out)
    assert aten.gelu.default in _targets(out)
    x = h.inputs("mlp", True)[0]
    net = h.models.fresh_eager("mlp").net
    expected = net[4](torch.nn.functional.gelu(net[2](torch.nn.functional.gelu(net[0](x)))))
    torch.testing.assert_close(out.module()(x), expected)


def test_replace_ops_traces_a_tanh_gelu() -> None:
    class Gelu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x) * 2

    def tanh_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x**3)))

    ep = torch.export.export(Gelu(), (torch.randn(8),))
    out = ReplaceOps({aten.gelu.default: tanh_gelu})(ep).program
    assert aten.gelu.default not in _targets(out)
    assert aten.tanh.default in _targets(out)
    x = torch.randn(8)
    expected = torch.nn.functional.gelu(x, approximate="tanh") * 2
    torch.testing.assert_close(out.module()(x), expected)


def test_replace_ops_rewrites_a_pattern_with_fake_values() -> None:
    def pattern(x: torch.Tensor) -> torch.Tensor:
        return aten.relu.default(x)

    def replacement(x: torch.Tensor) -> torch.Tensor:
        return aten.clamp_min.default(x, 0.0)

    ep = h.program("mlp", True, "decomposed")
    out = h.run_checked(ReplaceOps(patterns=[(pattern, replacement)]), ep).program
    clamps = [n for n in out.graph.nodes if n.target == aten.clamp_min.default]
    assert len(clamps) == 2
    assert all("val" in n.meta for n in clamps)
    h.assert_close(out, "mlp", True)


def test_replace_ops_without_matches_is_unmodified() -> None:
    ep = h.program("mlp")
    for p in (
        ReplaceOps({aten.tanh.default: clamp_relu}),
        ReplaceOps({aten.tanh.default: aten.relu.default}),
        ReplaceOps(patterns=[(lambda x: aten.tanh.default(x), lambda x: x)]),
    ):
        result = p(ep)
        assert result.modified is False and result.program is ep


def test_replace_ops_validates_its_options() -> None:
    with pytest.raises(TypeError, match="operator overloads"):
        ReplaceOps({"relu": clamp_relu})
    with pytest.raises(TypeError, match="pairs"):
        ReplaceOps(patterns=[(clamp_relu,)])

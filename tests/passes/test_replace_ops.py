"""ReplaceOps: operator swaps, traced Python replacements and subgraph patterns."""

from __future__ import annotations

from typing import Any

import pass_helpers as h
import pytest
import torch
import torch.nn.functional as F

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


def test_replace_ops_copies_no_graph_for_rewrites_that_cannot_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retarget whose operator is absent and a pattern with a call the graph lacks
    (by kind and target, as the subgraph matcher compares) are not applied: the
    graph is not copied for them. A pattern whose calls are all present is tried."""
    from epass import _graph

    copies: list[object] = []
    real = _graph.copy_graph
    monkeypatch.setattr(_graph, "copy_graph", lambda ep: copies.append(ep) or real(ep))

    ep = h.program("mlp", True, "decomposed")
    relu_then_tanh = torch.fx.symbolic_trace(lambda x: aten.tanh.default(aten.relu.default(x)))
    absent = ReplaceOps(
        {aten.tanh.default: aten.relu.default},
        patterns=[(relu_then_tanh, lambda x: x), (lambda x: aten.sigmoid.default(x), lambda x: x)],
    )
    result = absent(ep)
    assert result.modified is False and result.program is ep and copies == []

    # Every call present (relu then addmm), but not in that order: tried, no match.
    def relu_into_addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return aten.addmm.default(b, aten.relu.default(x), w)

    assert {aten.relu.default, aten.addmm.default} <= {n.target for n in ep.graph.nodes}
    tried = ReplaceOps(patterns=[(relu_into_addmm, lambda b, x, w: x)])(ep)
    assert len(copies) == 1
    assert tried.modified is (len(tried.program.graph.nodes) != len(ep.graph.nodes))


def test_replace_ops_validates_its_options() -> None:
    with pytest.raises(TypeError, match="operator overloads"):
        ReplaceOps({"relu": clamp_relu})
    with pytest.raises(TypeError, match="pairs"):
        ReplaceOps(patterns=[(clamp_relu,)])


class GeluTwice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(torch.nn.functional.gelu(x) * 2)


@pytest.mark.parametrize("form", ["training", "decomposed"])
def test_replace_ops_function_calling_the_replaced_op_does_not_recurse(form: str) -> None:
    ep = torch.export.export(GeluTwice(), (torch.randn(8),))
    if form == "decomposed":
        ep = ep.run_decompositions({})
    tanh = ReplaceOps(
        {aten.gelu.default: lambda x, approximate="none": F.gelu(x, approximate="tanh")}
    )
    out = h.run_checked(tanh, ep).program
    gelus = [n for n in out.graph.nodes if n.target == aten.gelu.default]
    assert [n.kwargs.get("approximate") for n in gelus] == ["tanh", "tanh"]
    x = torch.randn(8)
    expected = F.gelu(F.gelu(x, approximate="tanh") * 2, approximate="tanh")
    torch.testing.assert_close(out.module()(x), expected)
    assert not torch.allclose(out.module()(x), GeluTwice()(x))  # the replacement did run


def test_replace_ops_functions_calling_each_others_ops_are_not_replaced_inside() -> None:
    # Inside any replacement, no replaced op is replaced again: each call site is
    # rewritten once, so a cycle (relu -> gelu, gelu -> relu) terminates.
    class Both(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) + F.gelu(x)

    swap = ReplaceOps(
        {
            aten.relu.default: lambda x: F.gelu(x),
            aten.gelu.default: lambda x, approximate="none": torch.relu(x),
        }
    )
    out = h.run_checked(swap, torch.export.export(Both(), (torch.randn(8),))).program
    x = torch.randn(8)
    torch.testing.assert_close(out.module()(x), F.gelu(x) + torch.relu(x))


def _relu_program() -> torch.export.ExportedProgram:
    class Relu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) - torch.relu(-x)

    return torch.export.export(Relu(), (torch.randn(3),)).run_decompositions()


def relu_pattern(x: torch.Tensor) -> torch.Tensor:
    return aten.relu.default(x)


@pytest.mark.parametrize(
    ("replacement", "scale"),
    [
        (lambda x: aten.mul.Tensor(x, torch.tensor([1.0, 2.0, 3.0])), [1.0, 2.0, 3.0]),
        (lambda x: aten.mul.Tensor(x, aten.ones.default([3])), [1.0, 1.0, 1.0]),
    ],
    ids=["torch.tensor", "aten.ones"],
)
def test_replace_ops_pattern_creating_a_tensor_lifts_it_to_a_constant(
    replacement: Any, scale: list[float]
) -> None:
    ep = _relu_program()
    keys = set(ep.constants)
    result = h.run_checked(ReplaceOps(patterns=[(relu_pattern, replacement)]), ep)
    out = result.program
    assert aten.relu.default not in _targets(out)
    added = set(out.constants) - keys
    assert len(added) == 1  # both matches use the one tensor the replacement created
    (key,) = added
    torch.testing.assert_close(out.constants[key], torch.tensor(scale))
    assert set(ep.constants) == keys and out.state_dict is ep.state_dict
    x = torch.randn(3)
    s = torch.tensor(scale)
    torch.testing.assert_close(out.module()(x), x * s - (-x) * s)


def test_replace_ops_patterns_creating_tensors_keep_them_apart() -> None:
    def neg_pattern(x: torch.Tensor) -> torch.Tensor:
        return aten.neg.default(x)

    def by_two(x: torch.Tensor) -> torch.Tensor:
        return aten.mul.Tensor(x, torch.tensor([2.0, 2.0, 2.0]))

    def by_three(x: torch.Tensor) -> torch.Tensor:
        return aten.mul.Tensor(x, torch.tensor([3.0, 3.0, 3.0]))

    ep = _relu_program()
    keys = set(ep.constants)
    p = ReplaceOps(patterns=[(relu_pattern, by_two), (neg_pattern, by_three)])
    out = h.run_checked(p, ep).program
    added = sorted(set(out.constants) - keys)
    values = sorted(out.constants[k][0].item() for k in added)
    assert values == [2.0, 3.0]
    x = torch.randn(3)
    torch.testing.assert_close(out.module()(x), x * 2 - (x * 3) * 2)


def test_replace_ops_composite_op_calling_itself_does_not_recurse() -> None:
    # aten.linear is CompositeImplicitAutograd: torch replaces it through another path.
    def doubled_linear(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
        return F.linear(x, w, b) * 2

    ep = h.program("mlp")
    out = h.run_checked(ReplaceOps({aten.linear.default: doubled_linear}), ep).program
    assert h.node_count(out, aten.linear.default) == h.node_count(ep, aten.linear.default) > 0
    assert h.node_count(out, aten.mul.Tensor) == h.node_count(ep, aten.linear.default)
    net = h.models.fresh_eager("mlp").net
    x = h.inputs("mlp")[0]
    hidden = torch.relu(net[0](x) * 2)
    torch.testing.assert_close(out.module()(x), net[4](torch.relu(net[2](hidden) * 2)) * 2)


def test_replace_ops_reads_a_pattern_as_it_traces_now() -> None:
    # What a function traces to may change between runs (the globals or cells it
    # reads): the match check traces it each time, as the rewriter does.
    chosen = [aten.sigmoid.default]

    def pattern(x: torch.Tensor) -> torch.Tensor:
        return chosen[0](x)

    def replacement(x: torch.Tensor) -> torch.Tensor:
        return aten.clamp_min.default(x, 0.0)

    ep = h.program("mlp", True, "decomposed")
    p = ReplaceOps(patterns=[(pattern, replacement)])
    assert p(ep).modified is False  # no sigmoid in the program
    chosen[0] = aten.relu.default
    out = p(ep)
    assert out.modified is True
    assert aten.clamp_min.default in {n.target for n in out.program.graph.nodes}

"""The rewrite counter: passes that make many independent rewrites apply only the
first N of them, and bisect goes below the pass to the one rewrite that breaks a
program."""

from __future__ import annotations

import functools
from typing import Any

import models
import pytest
import torch
from fingerprint import fingerprint
from torch import nn
from torch.fx.passes.dialect.common.cse_pass import CSEPass

from epass import Decompose, PassManager, bisect
from epass.errors import ArgumentTypeError, ArgumentValueError, IncrementalDecompositionError
from epass.passes import CSE, ConstantFold, FuseConvBN, ReplaceOps
from epass.passes.cse import _banned
from epass.protocol import RewriteCounter, adapt

aten = torch.ops.aten


class Widths(nn.Module):
    """Four linear layers with a gelu each; only the second is 32 wide."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 32)
        self.c = nn.Linear(32, 16)
        self.d = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.a(x))
        x = nn.functional.gelu(self.b(x))
        x = nn.functional.gelu(self.c(x))
        return nn.functional.gelu(self.d(x))


def fast_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """A gelu replacement with a bug on one node only: the 32-wide layer's."""
    if x.shape[-1] == 32:
        return x * torch.sigmoid(x)  # silu, not gelu
    return nn.functional.gelu(x, approximate="tanh")


@functools.cache
def widths() -> tuple[nn.Module, torch.export.ExportedProgram, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    module = Widths().eval()
    args = (torch.randn(4, 8),)
    return module, torch.export.export(module, args), args


def matches(module: nn.Module, args: tuple[Any, ...], atol: float) -> Any:
    expected = module(*args)

    def predicate(program: torch.export.ExportedProgram) -> bool:
        return torch.allclose(program.module()(*args), expected, atol=atol)

    return predicate


def test_the_counter_allows_the_first_n_rewrites_and_names_the_last() -> None:
    counter = RewriteCounter(2)
    assert [counter.allow(aten.gelu.default, f"gelu_{i}") for i in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    assert counter.notes == {
        "rewrites": 2,
        "last_rewrite": "aten.gelu.default at node gelu_1",
        "held_back": 2,
    }
    unlimited = RewriteCounter(None)
    assert all(unlimited.allow("op", "n") for _ in range(5))
    assert unlimited.notes == {"rewrites": 5, "last_rewrite": "op at node n"}
    with pytest.raises(ArgumentTypeError):
        RewriteCounter(-1)


COUNTED = [
    Decompose(),
    ReplaceOps({aten.gelu.default: fast_gelu}),
    CSE(),
    ConstantFold(),
    FuseConvBN(),
]


@pytest.mark.parametrize("p", COUNTED, ids=lambda p: p.name)
def test_every_counted_pass_takes_a_limit_in_python_and_in_pipeline_text(p: Any) -> None:
    model = adapt(p)
    assert model.limit_rewrites is not None
    limited = model.limit_rewrites(3)
    assert limited.max_rewrites == 3 and p.max_rewrites is None
    if p.name != "replace-ops":  # its options have no text form
        text = PassManager([limited]).to_text()
        assert text == f"{p.name}(max_rewrites=3)"
        assert PassManager.from_text(text).passes[0].max_rewrites == 3


@pytest.mark.parametrize("limit", [0, 2, 10])
def test_replace_ops_applies_exactly_the_first_n_replacements(limit: int) -> None:
    _, ep, _ = widths()
    result = PassManager([ReplaceOps({aten.gelu.default: fast_gelu}, max_rewrites=limit)])(ep)
    notes = result.records[0].notes
    assert notes["rewrites"] == min(limit, 4)
    approximate = [
        n.kwargs.get("approximate", "none")
        for n in result.program.graph.nodes
        if n.target is aten.gelu.default
    ]
    replaced = min(limit, 4)
    # The 32-wide layer's gelu (the second) becomes a sigmoid, not a gelu.
    assert approximate.count("tanh") == replaced - (replaced >= 2)
    if replaced:
        assert (
            notes["last_rewrite"]
            == f"aten.gelu.default at node gelu{'' if replaced == 1 else f'_{replaced - 1}'}"
        )


@pytest.mark.parametrize("limit", [0, 5])
def test_decompose_splices_only_the_first_n_nodes(limit: int) -> None:
    _, ep, _ = models.export("transformer")
    full = Decompose()(ep)
    before = fingerprint(ep)
    result = Decompose(max_rewrites=limit)(ep)
    assert fingerprint(ep) == before
    total = full.rewritten
    assert total is not None and total > 20
    assert result.notes["rewrites"] == result.rewritten == limit
    assert result.notes["held_back"] == total - limit
    assert result.method == "incremental"
    if limit:
        spliced = [
            n
            for n in ep.graph.nodes
            if n.op == "call_function" and n.name in result.notes["last_rewrite"]
        ]
        assert spliced


def test_decompose_with_every_rewrite_is_the_unlimited_program() -> None:
    _, ep, _ = models.export("transformer")
    full = Decompose()(ep)
    limited = Decompose(max_rewrites=10_000)(ep)
    assert limited.program.graph_module.code == full.program.graph_module.code


def test_decompose_with_a_limit_says_when_the_incremental_path_cannot_be_taken() -> None:
    _, ep, _ = models.export("seed")  # an in-place buffer update: the retrace's
    with pytest.raises(IncrementalDecompositionError, match=r"max_rewrites.*into input b_count"):
        Decompose(max_rewrites=1)(ep)
    with pytest.raises(ArgumentValueError, match="retrace"):
        Decompose(method="retrace", max_rewrites=1)


def test_decompose_passes_with_limits_do_not_merge() -> None:
    assert Decompose(max_rewrites=2).merge(Decompose()) is None
    assert Decompose().merge(Decompose(max_rewrites=2)) is None


@pytest.mark.parametrize("name", ["transformer", "mlp", "convbn"])
def test_cse_merges_what_torch_cse_pass_merges(name: str) -> None:
    _, ep, _ = models.export(name)
    program = PassManager([Decompose()]).run(ep)
    gm = program.graph_module
    expected = CSEPass(banned_ops=_banned(gm)).call(gm)
    result = CSE()(program)
    assert result.modified == expected.modified
    if expected.modified:
        expected.graph_module.graph.eliminate_dead_code()
        expected.graph_module.recompile()
        assert result.program.graph_module.code == expected.graph_module.code


def test_cse_with_a_limit_makes_only_the_first_merges() -> None:
    x = torch.randn(3, 4)

    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x) + torch.sin(x) + torch.cos(x) * torch.cos(x)

    ep = torch.export.export(Twice(), (x,))
    full = CSE()(ep)
    assert full.notes == {"rewrites": 2, "last_rewrite": "aten.cos.default at node cos_1"}
    one = CSE(max_rewrites=1)(ep)
    assert one.notes["rewrites"] == 1 and one.notes["held_back"] == 1
    ops = [n.target for n in one.program.graph.nodes if n.op == "call_function"]
    assert ops.count(aten.sin.default) == 1 and ops.count(aten.cos.default) == 2
    assert CSE(max_rewrites=0)(ep).modified is False


def test_constant_fold_and_fuse_conv_bn_count_their_rewrites() -> None:
    _, ep, _ = models.export("convbn")
    fused = FuseConvBN(max_rewrites=1)(ep)
    assert fused.notes == {
        "rewrites": 1,
        "last_rewrite": "aten.batch_norm.default at node batch_norm",
        "held_back": 1,
    }
    assert [str(n.target) for n in fused.program.graph.nodes].count("aten.batch_norm.default") == 1
    program = PassManager([Decompose()]).run(models.export("mlp")[1])
    folded = ConstantFold(fold_views=True)(program)
    one = ConstantFold(fold_views=True, max_rewrites=1)(program)
    assert folded.notes["rewrites"] == len(folded.folded) > 1
    assert one.folded == folded.folded[:1] and one.notes["held_back"] == len(folded.folded) - 1
    x = models.CASES["mlp"].inputs()
    assert torch.allclose(one.program.module()(*x), program.module()(*x))


def test_bisect_names_the_rewrite_that_breaks_the_program() -> None:
    module, ep, args = widths()
    before = fingerprint(ep)
    passes = [
        Decompose(keep=[aten.gelu.default]),
        ReplaceOps({aten.gelu.default: fast_gelu}),
        CSE(),
    ]
    found = bisect(ep, passes, matches(module, args, atol=1e-3))
    assert found is not None and found.index == 1 and found.rewrite is not None
    assert (found.rewrite.number, found.rewrite.total) == (2, 4)
    assert found.rewrite.rewrite == "aten.gelu.default at node gelu_1"
    assert str(found) == (
        "culprit: pass 'replace-ops' at position 1, "
        "rewrite 2 of 4: aten.gelu.default at node gelu_1"
    )
    assert found.rewrite.after is not None
    assert matches(module, args, 1e-3)(found.rewrite.before)
    assert not matches(module, args, 1e-3)(found.rewrite.after)
    assert fingerprint(ep) == before


def test_bisect_goes_below_decompose_to_the_node() -> None:
    _, ep, _ = models.export("transformer")
    linears = [n.name for n in ep.graph.nodes if n.target is aten.linear.default]

    def keeps_two_of_the_first_three_linears(program: torch.export.ExportedProgram) -> bool:
        left = sum(n.target is aten.linear.default for n in program.graph.nodes)
        return left > len(linears) - 3

    found = bisect(ep, [Decompose()], keeps_two_of_the_first_three_linears)
    assert found is not None and found.rewrite is not None
    assert found.rewrite.rewrite == f"aten.linear.default at node {linears[2]}"
    assert found.rewrite.total == Decompose()(ep).rewritten
    limited = Decompose(max_rewrites=found.rewrite.number)(ep)
    assert limited.notes["last_rewrite"] == found.rewrite.rewrite


def test_bisect_without_rewrites_or_with_an_uncounted_pass_stops_at_the_pass() -> None:
    module, ep, args = widths()
    passes = [ReplaceOps({aten.gelu.default: fast_gelu})]
    found = bisect(ep, passes, matches(module, args, atol=1e-3), rewrites=False)
    assert found is not None and found.rewrite is None

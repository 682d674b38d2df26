"""ConstantFold: numerics, state outcome, guards."""

from __future__ import annotations

import pass_helpers as h
import pytest
import torch

import epass
from epass.passes import ConstantFold, ConstantFoldResult

aten = torch.ops.aten


@pytest.mark.parametrize("fold_views", [False, True], ids=["", "fold-views"])
@h.zoo_params()
def test_constant_fold_keeps_numerics_and_input(
    name: str, dynamic: bool, form: str, fold_views: bool
) -> None:
    ep = h.program(name, dynamic, form)
    result = h.run_checked(ConstantFold(fold_views=fold_views), ep)
    h.assert_close(result.program, name, dynamic)
    assert result.program.state_dict is ep.state_dict
    # Added folded values give the output a constants dict of its own.
    added = result.records[0].link.constants.added if result.modified else ()
    assert (result.program.constants is ep.constants) == (not added)
    assert not set(added) & set(ep.constants)


def test_constant_fold_leaves_views_of_state_alone_by_default() -> None:
    ep = h.program("mlp", form="decomposed")
    result = ConstantFold()(ep)
    assert result.modified is False and result.program is ep
    assert h.node_count(ep, aten.permute.default) == 3


class _Views(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 4))
        self.register_buffer("b", torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # every state read is a chain of views: slice, transpose, expand, t, reshape
        w = self.w[1:5].transpose(0, 1).t().reshape(2, 2, 4).unsqueeze(0).squeeze(0)
        b = self.b.view(6)[:4].expand(2, 4)
        return x @ w.reshape(4, 4).t() + b


def test_constant_fold_leaves_chains_of_views_alone_unless_asked() -> None:
    module = _Views()
    x = torch.randn(2, 4)
    ep = torch.export.export(module, (x,)).run_decompositions()
    assert ConstantFold()(ep).modified is False
    folded = ConstantFold(fold_views=True)(ep)
    assert isinstance(folded, ConstantFoldResult) and folded.modified
    assert folded.bytes_added == 0  # views of the state
    torch.testing.assert_close(folded.program.module()(x), module(x))


def test_constant_fold_still_folds_computations_on_views() -> None:
    class ScaledT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ (self.w.t() * 2)

    ep = torch.export.export(ScaledT(), (torch.randn(2, 4),)).run_decompositions()
    result = ConstantFold()(ep)
    assert isinstance(result, ConstantFoldResult) and len(result.folded) == 1
    assert h.node_count(result.program, aten.mul.Tensor) == 0


def test_constant_fold_views_drop_the_split_calls_source_meta() -> None:
    # XNNPACK rebuilds linear(x, w) from nodes labelled "linear"; once the weight's
    # permute is a constant, the addmm left must not claim to be that call.
    ep = h.program("mlp", form="decomposed")
    before = {n.name: dict(n.meta) for n in ep.graph.nodes}
    out = ConstantFold(fold_views=True)(ep).program
    for node in out.graph.nodes:
        if node.target == aten.addmm.default:
            assert "torch_fn" not in node.meta and "source_fn_stack" not in node.meta
            scopes = [v[1] for v in node.meta["nn_module_stack"].values()]
            assert not any(s.endswith("Linear") for s in scopes), scopes
        if node.target == aten.relu.default:
            assert node.meta["torch_fn"] == before[node.name]["torch_fn"]  # not folded
    after = {n.name: dict(n.meta) for n in ep.graph.nodes}
    assert after == before  # the input's meta is untouched


def test_constant_fold_lifts_transposed_weights_into_the_outputs_constants() -> None:
    ep = h.program("mlp", form="decomposed")
    assert h.node_count(ep, aten.permute.default) == 3
    result = epass.PassManager([ConstantFold(fold_views=True)])(ep)
    out, link = result.program, result.records[0].link
    assert h.node_count(out, aten.permute.default) == 0
    assert link is not None and link.owners == {"state_dict": "user", "constants": "own"}
    added = link.constants.added
    assert len(added) == 3 and not set(added) & set(ep.constants)
    # The transposed weights are views over the parameters' memory: no new bytes.
    weights = {ep.state_dict[f"net.{i}.weight"].data_ptr() for i in (0, 2, 4)}
    for key in added:
        value = out.constants[key]
        assert not value.is_contiguous() and not value.requires_grad
        assert not isinstance(value, torch.nn.Parameter)
        assert value.data_ptr() in weights
    # The weights lost their last user: they left the signature, not the store.
    removed = link.state_dict.removed
    assert set(removed) == {"net.0.weight", "net.2.weight", "net.4.weight"}
    assert all(k in ep.state_dict for k in removed)
    targets = {s.target for s in out.graph_signature.input_specs}
    assert not targets & set(removed)


def test_constant_fold_result_reports_bytes() -> None:
    ep = h.program("mlp", form="decomposed")
    result = ConstantFold(fold_views=True)(ep)
    assert isinstance(result, ConstantFoldResult)
    assert result.bytes_added == 0  # the folded permutes are views of the weights
    assert len(result.folded) == 3 and len(result.added) == 3
    assert set(result.added) <= set(result.program.constants)
    assert not set(result.added) & set(ep.constants)  # the pass wrote no user dict


def test_constant_fold_shares_one_constant_between_tied_weights() -> None:
    ep = h.program("mixed", form="decomposed")
    result = ConstantFold(fold_views=True)(ep)
    assert isinstance(result, ConstantFoldResult)
    assert len(result.folded) == 2 and len(result.added) == 1


def test_constant_fold_is_unmodified_without_state_only_subgraphs() -> None:
    ep = h.program("mlp")  # training IR: linear takes the weight directly
    result = ConstantFold()(ep)
    assert result.modified is False and result.program is ep


def test_constant_fold_leaves_mutated_buffers_alone() -> None:
    ep = h.program("seed", form="decomposed")
    result = ConstantFold(fold_views=True)(ep)
    assert isinstance(result, ConstantFoldResult)
    # only the weight permute folds; "count + 1" reads a buffer mutated every call
    assert [n for n in result.folded] == ["permute"]
    h.assert_close(result.program, "seed")


class _Expand(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))
        self.register_buffer("b", torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (self.w * 2 + self.b).expand(64, 16)  # 64x bigger than its input
        return x + scale


def test_constant_fold_size_guard_keeps_expand() -> None:
    module = _Expand()
    x = torch.randn(64, 16)
    ep = torch.export.export(module, (x,))
    result = ConstantFold()(ep)
    assert isinstance(result, ConstantFoldResult)
    out = result.program
    assert h.node_count(out, aten.expand.default) == 1
    assert result.bytes_added == 16 * 4  # the small input of the expand was folded
    torch.testing.assert_close(out.module()(x), module(x))
    unguarded = ConstantFold(max_growth=100)(ep)
    assert isinstance(unguarded, ConstantFoldResult)
    assert unguarded.bytes_added == 64 * 16 * 4


class _Random(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(self.b) * 0 + self.b.new_empty(4).zero_()


def test_constant_fold_skips_random_and_uninitialized_ops() -> None:
    ep = torch.export.export(_Random(), (torch.randn(4),)).run_decompositions()
    result = ConstantFold()(ep)
    out = result.program
    random = [n for n in out.graph.nodes if "rand" in str(n.target)]
    assert random, "the random op was folded"
    x = torch.randn(4)
    torch.testing.assert_close(out.module()(x), x)


def test_constant_fold_rejects_negative_growth() -> None:
    with pytest.raises(ValueError):
        ConstantFold(max_growth=-1)


def test_constant_fold_size_guard_sees_through_views_of_expands() -> None:
    # Decomposed attention computes view(expand(permute(in_proj_weight))): only the
    # permute may fold, not the batch-sized copy behind the view.
    ep = h.program("transformer", form="decomposed")
    result = ConstantFold(fold_views=True)(ep)
    assert isinstance(result, ConstantFoldResult)
    suffixes = ("in_proj_weight", "out_proj.weight", "linear1.weight", "linear2.weight")
    weights = [v for k, v in ep.state_dict.items() if k.endswith(suffixes)]
    assert len(weights) == 8
    folded = [result.program.constants[k] for k in result.added]
    assert sorted(t.nbytes for t in folded) == sorted(w.nbytes for w in weights)
    assert {t.data_ptr() for t in folded} == {w.data_ptr() for w in weights}  # views
    assert result.bytes_added == 0
    h.assert_close(result.program, "transformer")


def test_constant_fold_computed_values_own_their_memory() -> None:
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ (self.w * 2).t()

    ep = torch.export.export(Scaled(), (torch.randn(2, 4),)).run_decompositions()
    result = ConstantFold()(ep)
    assert isinstance(result, ConstantFoldResult)
    (key,) = result.added
    value = result.program.constants[key]
    assert value.data_ptr() != ep.state_dict["w"].data_ptr()
    assert value.untyped_storage().nbytes() == value.nbytes  # nothing extra retained
    assert result.bytes_added == value.nbytes
    x = torch.randn(2, 4)
    torch.testing.assert_close(result.program.module()(x), x @ (ep.state_dict["w"] * 2).t())

"""``epass._decomp.check``: check mode compares the incremental program with torch's and
names the first difference."""

from __future__ import annotations

import re

import models
import pytest
import torch

from epass import Decompose, PassError, PassManager
from epass._decomp import check, splice
from epass.errors import DecompositionMismatchError
from epass.passes import decompose as decompose_module

aten = torch.ops.aten


def test_check_raises_naming_the_first_differing_node(monkeypatch):
    _, ep, _ = models.export("mlp")
    real = splice.decompose

    def wrong(ep, tables):
        out, n = real(ep, tables)
        node = next(n for n in out.graph.nodes if n.target is aten.addmm.default)
        node.target = aten.mm.default if False else aten.sub.Tensor  # a different op
        node.args = node.args[:2]
        return out, n

    monkeypatch.setattr(splice, "decompose", wrong)
    with pytest.raises(DecompositionMismatchError, match="addmm") as info:
        Decompose(check=True)(ep)
    assert "node" in info.value.difference


def test_check_env_variable_turns_check_mode_on(monkeypatch):
    _, ep, _ = models.export("mlp")
    monkeypatch.setenv("EPASS_DECOMPOSE_CHECK", "1")
    assert Decompose()(ep).notes["checked"] is True
    monkeypatch.setenv("EPASS_DECOMPOSE_CHECK", "0")
    assert Decompose()(ep).notes["checked"] is False
    assert Decompose(check=False)(ep).notes["checked"] is False


def test_check_mode_failure_is_a_pass_error_in_a_pipeline(monkeypatch):
    _, ep, _ = models.export("mlp")
    monkeypatch.setattr(decompose_module, "first_difference", lambda a, b: "node 3 (x / torch: y)")
    with pytest.raises(PassError) as info:
        PassManager([Decompose(check=True)]).run(ep)
    assert isinstance(info.value.__cause__, DecompositionMismatchError)
    assert "node 3" in str(info.value)


def _two_summation_orders() -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits summed in two orders, as a matrix product gives them with
    another thread split: equal but for rounding, some of them near zero."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 256, generator=g)
    weight = torch.randn(256, 512, generator=g) * 0.02
    terms = hidden[:, :, None] * weight[None]  # (8, 256, 512)
    forward = terms.sum(1)
    backward = terms.flip(1).cumsum(1)[:, -1]
    return forward, backward


def test_numeric_difference_lets_rounding_through_where_allclose_does_not():
    got, want = _two_summation_orders()
    assert not torch.equal(got, want)
    assert not torch.allclose(got, want)  # the defaults' atol=1e-8 at values near zero
    assert check.numeric_difference(got, want, "output 0") is None
    half = (got.to(torch.bfloat16), want.to(torch.bfloat16))
    assert check.numeric_difference(*half, "output 0") is None


def test_numeric_difference_names_a_real_difference_and_where_it_is():
    got, want = _two_summation_orders()
    wrong = got.clone()
    wrong[3, 17] += 1e-3 * float(want.abs().max())
    said = check.numeric_difference(wrong, want, "output 1")
    assert said is not None
    assert said.startswith("output 1 differs by ") and "at (3, 17)" in said
    scaled = check.numeric_difference(got * 1e6, want * 1e6, "output 0")
    assert scaled is None  # the tolerance scales with the output's magnitude


@pytest.mark.parametrize(
    ("got", "want", "said"),
    [
        (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), "NaN in other places"),
        (torch.tensor([float("inf")]), torch.tensor([-float("inf")]), "infinities"),
        (torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), "differs in 1 of 3 elements"),
        (torch.tensor([True]), torch.tensor([False]), "differs in 1 of 1"),
        (torch.zeros(2, 3), torch.zeros(3, 2), r"torch.float32 \(2, 3\) / torch: torch.float32"),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64), "torch.float64"),
        (3, 4, "is 3 / torch: 4"),
    ],
)
def test_numeric_difference_is_exact_where_rounding_cannot_explain(got, want, said):
    found = check.numeric_difference(got, want, "output 0")
    assert found is not None and re.search(said, found), found


def test_numeric_difference_takes_nan_and_infinity_in_the_same_places():
    a = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    assert check.numeric_difference(a, a.clone(), "output 0") is None
    assert check.numeric_difference(torch.zeros(0), torch.zeros(0), "output 0") is None


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor([2.0, 3.0])  # a plain attribute: a lifted constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.relu(x) * self.scale


def test_check_raises_on_a_constant_whose_value_differs_from_torchs(monkeypatch):
    ep = torch.export.export(_Scaled(), (torch.randn(4, 2),))
    (name,) = ep.constants
    real = splice.decompose

    def wrong(ep, tables):
        out, n = real(ep, tables)
        out._constants = {**out.constants, name: torch.tensor([2.0, 3.5])}
        return out, n

    monkeypatch.setattr(splice, "decompose", wrong)
    with pytest.raises(DecompositionMismatchError, match=r"output 0 differs by .* example inputs"):
        Decompose(check=True)(ep)

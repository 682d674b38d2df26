"""CSE: merges duplicates, never random ops or reads around an in-place write."""

from __future__ import annotations

import pass_helpers as h
import torch

from epass.passes import CSE

aten = torch.ops.aten


@h.zoo_params()
def test_cse_keeps_numerics_and_input(name: str, dynamic: bool, form: str) -> None:
    ep = h.program(name, dynamic, form)
    result = h.run_checked(CSE(), ep)
    h.assert_close(result.program, name, dynamic)
    assert result.program.state_dict is ep.state_dict
    again = CSE()(result.program)
    assert again.modified is False and again.program is result.program


def test_cse_merges_tied_weight_transposes() -> None:
    ep = h.program("mixed", form="decomposed")
    assert h.node_count(ep, aten.permute.default) == 2
    result = CSE()(ep)
    assert result.modified
    assert h.node_count(result.program, aten.permute.default) == 1
    h.assert_close(result.program, "mixed")


class _Tricky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = self.b.view(3)
        before = view * 2
        self.b.add_(1)
        after = view * 2  # same node inputs as "before", different value
        noise = torch.rand_like(x) - torch.rand_like(x)
        return x + before + after + noise.abs().sum() * 0 + (x * 3) + (x * 3)


def test_cse_is_correct_around_in_place_writes_and_random_ops() -> None:
    ep = torch.export.export(_Tricky(), (torch.ones(3),))
    out = CSE()(ep).program
    assert h.node_count(out, aten.rand_like.default) == 2
    torch.testing.assert_close(out.module()(torch.ones(3)), _Tricky()(torch.ones(3)))


def test_cse_merges_in_functional_graphs_with_mutated_buffers() -> None:
    ep = torch.export.export(_Tricky(), (torch.ones(3),)).run_decompositions()
    muls = h.node_count(ep, aten.mul.Tensor)
    result = CSE()(ep)
    assert result.modified
    assert h.node_count(result.program, aten.mul.Tensor) < muls
    assert h.node_count(result.program, aten.rand_like.default) == 2
    torch.testing.assert_close(result.program.module()(torch.ones(3)), _Tricky()(torch.ones(3)))

"""RemoveAssertions: runtime checks and what only they used are removed and counted."""

from __future__ import annotations

import operator

import pass_helpers as h
import pytest
import torch

import epass
from epass.passes import RemoveAssertions, RemoveAssertionsResult

aten = torch.ops.aten


class _Checked(torch.nn.Module):
    """Produces ``_assert_scalar`` (from ``.item()``) and ``_assert_tensor_metadata``
    (from ``.to``)."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        return x.to(torch.float64).sum() + x.new_ones(k).sum()


def _assertions(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if "assert" in str(n.target)]


@pytest.mark.parametrize("form", h.FORMS)
def test_remove_assertions_removes_and_counts(form: str) -> None:
    ep = torch.export.export(_Checked(), (torch.randn(3), torch.tensor(4)))
    if form == "decomposed":
        ep = ep.run_decompositions()
    assert len(_assertions(ep)) == 2
    result = RemoveAssertions()(ep)
    assert isinstance(result, RemoveAssertionsResult)
    assert result.removed == 2
    out = result.program
    assert _assertions(out) == []
    # "u0 >= 0" fed only the assertion and went with it.
    assert any(n.target is operator.ge for n in ep.graph.nodes)
    assert not any(n.target is operator.ge for n in out.graph.nodes)
    assert not any(n.op == "call_function" and not n.users for n in out.graph.nodes)
    x, n = torch.randn(3), torch.tensor(5)
    torch.testing.assert_close(out.module()(x, n), _Checked()(x, n))
    again = RemoveAssertions()(out)
    assert again.modified is False and again.program is out


@h.zoo_params()
def test_remove_assertions_keeps_numerics_and_input(name: str, dynamic: bool, form: str) -> None:
    ep = h.program(name, dynamic, form)
    result = h.run_checked(RemoveAssertions(), ep)
    h.assert_close(result.program, name, dynamic)
    assert result.program.state_dict is ep.state_dict


def test_remove_assertions_in_a_manager_shares_state() -> None:
    ep = torch.export.export(_Checked(), (torch.randn(3), torch.tensor(4)))
    result = epass.PassManager([RemoveAssertions()])(ep)
    assert result.modified
    assert result.records[0].op_delta["aten._assert_scalar.default"] == -1
    assert result.program.state_dict is ep.state_dict

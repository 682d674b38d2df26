"""CastDtype: the state-changing pass. The user's program keeps its bytes, objects and
outputs; the output owns the cast tensors; untouched entries keep their identity."""

from __future__ import annotations

import pass_helpers as h
import pytest
import torch

import epass
from epass.passes import CastDtype


@h.zoo_params()
def test_cast_dtype_keeps_numerics_and_input(name: str, dynamic: bool, form: str) -> None:
    ep = h.program(name, dynamic, form)
    args = h.inputs(name, dynamic)
    before = ep.module()(*args) if name != "seed" else None
    result = h.run_checked(CastDtype(torch.bfloat16), ep)
    out = result.program
    h.assert_close(out, name, dynamic, tol=6e-2)  # outputs stay float32
    if before is not None:  # the user's program computes exactly what it did
        torch.testing.assert_close(ep.module()(*args), before, atol=0, rtol=0)
    link = result.records[0].link
    assert link is not None and not link.shared and link.changed
    assert out.state_dict is not ep.state_dict


def test_cast_dtype_state_outcome() -> None:
    ep = h.program("convbn")
    originals = dict(ep.state_dict)
    out = epass.PassManager([CastDtype()]).run(ep)
    # the store is untouched: same keys, same objects, still float32
    assert ep.state_dict == originals and all(ep.state_dict[k] is v for k, v in originals.items())
    assert ep.state_dict["conv1.weight"].dtype == torch.float32
    for key, value in out.state_dict.items():
        if originals[key].is_floating_point():
            assert value.dtype == torch.bfloat16 and value is not originals[key]
        else:  # num_batches_tracked: not cast, still the original object
            assert value is originals[key]
    assert isinstance(out.state_dict["conv1.weight"], torch.nn.Parameter)
    assert out.state_dict["conv1.weight"].requires_grad


def test_cast_dtype_keeps_unreferenced_entries_and_ties() -> None:
    ep = h.program("mixed")
    out = epass.PassManager([CastDtype()]).run(ep)
    assert out.state_dict["embed.weight"] is out.state_dict["head.weight"]
    assert out.constants["offset"].dtype == torch.bfloat16
    assert ep.constants["offset"].dtype == torch.float32


def test_cast_dtype_keeps_integer_only_programs_unmodified() -> None:
    class Count(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.arange(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.n

    ep = torch.export.export(Count(), (torch.arange(4),))
    result = CastDtype()(ep)
    assert result.modified is False and result.program is ep


def test_cast_dtype_without_keep_io_takes_and_returns_the_new_dtype() -> None:
    ep = h.program("mlp")
    out = CastDtype(torch.float16, keep_io=False)(ep).program
    x = h.inputs("mlp")[0]
    y = out.module()(x.half())
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), h.models.fresh_eager("mlp")(x), atol=2e-2, rtol=2e-2)


def test_cast_dtype_buffer_mutation_writes_the_cast_buffer() -> None:
    ep = h.program("seed", form="decomposed")
    out = epass.PassManager([CastDtype()]).run(ep)
    module = out.module()
    module(*h.inputs("seed"))
    assert module.count.dtype == torch.bfloat16
    assert torch.equal(module.count, torch.ones(4, dtype=torch.bfloat16))
    assert torch.equal(ep.state_dict["count"], torch.zeros(4))


def test_cast_dtype_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError):
        CastDtype(torch.float64)


class _ScalesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y.mul_(2)  # an in-place write to a user input (kept as mul_ in the training IR)
        return x * self.w


@pytest.mark.parametrize("decompose", [False, True])
def test_cast_dtype_keeps_in_place_writes_to_user_inputs(decompose: bool) -> None:
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    ep = torch.export.export(_ScalesItsInput(), (x, y.clone()))
    passes = [epass.Decompose(), CastDtype()] if decompose else [CastDtype()]
    out = epass.PassManager(passes).run(ep)
    got = y.clone()
    out.module()(x, got)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, y * 2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["mlp", "seed", "mixed"])
def test_cast_dtype_is_idempotent(name: str) -> None:
    ep = h.program(name)
    result = epass.PassManager([CastDtype()], steps=3)(ep)
    assert [r.modified for r in result.records] == [True, False]
    out = result.program
    again = CastDtype()(out)
    assert not again.modified and again.program is out


class _Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            x.sum() > 0, lambda x: self.linear(x).relu(), lambda x: self.linear(x), (x,)
        )


def test_cast_dtype_refuses_control_flow_with_a_clear_error() -> None:
    ep = torch.export.export(_Branches(), (torch.randn(2, 4),))
    with pytest.raises(epass.PassError, match=r"control-flow subgraphs.*true_graph_0"):
        epass.PassManager([CastDtype()]).run(ep)


@pytest.mark.parametrize("name", ["transformer", "mlp"])
def test_cast_dtype_keeps_a_dynamic_program_dynamic_and_its_shape_environment_as_it_was(
    name: str,
) -> None:
    # The values of the cast graph are made again as export's tracer makes them: a
    # composite operator run outside the Python dispatcher (aten.linear on torch 2.12)
    # reads a dynamic size as an int, which specializes it in the shape environment
    # the user's program shares with its copies.
    from epass import _graph

    ep = h.program(name, dynamic=True)
    env = _graph.fake_mode(ep.graph_module).shape_env
    before = (dict(env.replacements), len(env.guards), str(ep.range_constraints))
    out = h.run_checked(CastDtype(torch.bfloat16), ep).program
    assert (dict(env.replacements), len(env.guards), str(ep.range_constraints)) == before
    assert str(out.range_constraints) == before[2] and ep.range_constraints
    h.assert_close(out, name, dynamic=True, tol=6e-2)  # a batch size export did not see

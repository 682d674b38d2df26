"""ExecuTorch's passes of every kind run in an epass pipeline unchanged: graph passes,
program functions, ``ExportedProgramPassBase`` and ``ExportedProgramPassManager``."""

from __future__ import annotations

from typing import Any

import models
import pytest
import torch
from fingerprint import fingerprint
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as FxPassResult

import epass
from epass.passes import DeadCodeElimination, Decompose

pass_base = pytest.importorskip("executorch.exir.pass_base", reason="executorch is not installed")
pass_manager = pytest.importorskip("executorch.exir.pass_manager")

aten = torch.ops.aten


def _relu_to_gelu(gm: torch.fx.GraphModule) -> bool:
    modified = False
    for node in gm.graph.nodes:
        if node.target is aten.relu.default:
            node.target = aten.gelu.default
            modified = True
    gm.recompile()
    return modified


class ExportPassReluToGelu(pass_base.ExportPass):  # type: ignore[misc]
    """ExecuTorch's retracing graph pass."""

    def call_operator(self, op: Any, args: Any, kwargs: Any, meta: Any) -> Any:
        if op is aten.relu.default:
            op = aten.gelu.default
        return super().call_operator(op, args, kwargs, meta)


class FxReluToGelu(PassBase):
    """A torch.fx graph pass editing the graph module in place."""

    def call(self, gm: torch.fx.GraphModule) -> FxPassResult:
        return FxPassResult(gm, _relu_to_gelu(gm))


class InPlaceReluToGelu(pass_base.ExportedProgramPassBase):  # type: ignore[misc]
    """ExecuTorch's program pass editing the program it is given and returning it."""

    def call(self, ep: torch.export.ExportedProgram) -> Any:
        return pass_base.ExportedProgramPassResult(ep, _relu_to_gelu(ep.graph_module))


class NewProgramReluToGelu(pass_base.ExportedProgramPassBase):  # type: ignore[misc]
    """ExecuTorch's program pass returning a new program (decomposed, then rewritten)."""

    def call(self, ep: torch.export.ExportedProgram) -> Any:
        out = ep.run_decompositions()
        _relu_to_gelu(out.graph_module)
        return pass_base.ExportedProgramPassResult(out, True)


class Untouched(pass_base.ExportedProgramPassBase):  # type: ignore[misc]
    """ExecuTorch's program pass that reports no change."""

    def call(self, ep: torch.export.ExportedProgram) -> Any:
        return pass_base.ExportedProgramPassResult(ep, False)


def program_function(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """An ``fn(ep) -> ep`` program pass editing its input in place."""
    _relu_to_gelu(ep.graph_module)
    return ep


PASSES = {
    "export_pass": ExportPassReluToGelu,
    "fx_pass_base": FxReluToGelu,
    "program_function": lambda: program_function,
    "program_pass_in_place": InPlaceReluToGelu,
    "program_pass_new_program": NewProgramReluToGelu,
    "program_pass_manager": lambda: pass_manager.ExportedProgramPassManager(
        [FxReluToGelu(), InPlaceReluToGelu()]
    ),
    "program_pass_manager_new_program": lambda: pass_manager.ExportedProgramPassManager(
        [NewProgramReluToGelu()]
    ),
}


def _gelu_mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    for layer in linears[:-1]:
        x = torch.nn.functional.gelu(layer(x))
    return linears[-1](x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", list(PASSES))
def test_executorch_pass_runs_unchanged_and_shares_state(kind: str) -> None:
    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    result = epass.PassManager([PASSES[kind]()])(ep)
    out = result.program
    assert result.modified
    assert out is not ep
    ops = {n.target for n in out.graph.nodes}
    assert aten.gelu.default in ops and aten.relu.default not in ops
    with torch.no_grad():
        torch.testing.assert_close(out.module()(*args), _gelu_mlp(module, *args))
    assert fingerprint(ep) == before, "the user's program changed"
    assert out.state_dict is ep.state_dict and out.constants is ep.constants
    for key, value in ep.state_dict.items():
        assert out.state_dict[key] is value, key


def test_executorch_pass_result_flag_is_trusted() -> None:
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)
    result = epass.PassManager([Untouched()])(ep)
    assert result.program is ep and not result.modified
    assert not result.records[0].modified
    assert fingerprint(ep) == before


def test_executorch_pass_manager_nests_between_epass_passes() -> None:
    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    et = pass_manager.ExportedProgramPassManager([InPlaceReluToGelu()])
    result = epass.PassManager([Decompose(), et, DeadCodeElimination()])(ep)
    assert [r.name for r in result.records] == [
        "decompose",
        "ExportedProgramPassManager",
        "dce",
    ]
    assert result.records[1].modified
    with torch.no_grad():
        torch.testing.assert_close(result.program.module()(*args), _gelu_mlp(module, *args))
    assert fingerprint(ep) == before
    assert result.program.state_dict is ep.state_dict


def test_a_result_without_a_program_names_both_shapes() -> None:
    _, ep, _ = models.export("mlp")

    def returns_a_flag(ep: torch.export.ExportedProgram) -> Any:
        return pass_base.ExportedProgramPassResult(None, True)

    with pytest.raises(epass.PassError, match="ExportedProgramPassResult"):
        epass.PassManager([returns_a_flag]).run(ep)

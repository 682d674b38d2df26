"""The one hand-off shape: a private program for the consumer, its writes into shared
tensors named, what it hands back relinked to the user's state."""

from __future__ import annotations

import copy
import subprocess
import sys

import models
import pytest
import torch
from fingerprint import fingerprint

import epass
from epass import _handoff, _program
from epass.passes import ConstantFold, presets

aten = torch.ops.aten


class Folding(torch.nn.Module):
    """A forward that computes on state alone: folding adds a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (self.scale * 2 + 1)


def test_private_program_owns_its_graph_and_dicts_and_holds_the_users_tensors() -> None:
    ep = torch.export.export(Folding().eval(), (torch.randn(2, 4),))
    folded = epass.PassManager([presets.lower(), ConstantFold()]).run(ep)
    # the pipeline's output holds entries its signature no longer references
    referenced = {s.target for s in folded.graph_signature.input_specs if s.target}
    assert set(folded.state_dict) | set(folded.constants) != referenced
    private = _handoff.private_program(folded)
    assert private.graph_module is not folded.graph_module
    assert private.state_dict is not folded.state_dict
    assert private.constants is not folded.constants
    assert set(private.state_dict) | set(private.constants) == referenced
    for key, value in private.state_dict.items():
        assert value is folded.state_dict[key], key
    for key, value in private.constants.items():
        assert value is folded.constants[key], key


def test_consumer_edits_to_its_program_never_reach_the_user() -> None:
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)
    hand_off = _handoff.start({"forward": ep}, None, "consumer")
    assert hand_off.programs["forward"] is ep and hand_off.pipelines == {}

    def edit(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        for node in program.graph.nodes:
            if node.target is aten.relu.default:
                node.target = aten.gelu.default
        program.graph_module.recompile()
        program.state_dict.clear()
        return program

    hand_off.call(edit, hand_off.private["forward"])
    assert fingerprint(ep) == before


def test_a_consumer_writing_into_a_shared_tensor_is_named() -> None:
    _, ep, _ = models.export("mlp")
    hand_off = _handoff.start({"forward": ep}, presets.lower(), "careless.convert")

    def write(program: torch.export.ExportedProgram) -> None:
        program.state_dict["net.0.bias"].data.add_(1)  # bypasses _version

    with pytest.raises(epass.StateMutationError, match=r"careless\.convert") as info:
        hand_off.call(write, hand_off.private["forward"])
    assert info.value.keys == ("state_dict:net.0.bias",)


def test_a_consumer_that_writes_and_raises_is_named() -> None:
    _, ep, _ = models.export("mlp")
    hand_off = _handoff.start({"forward": ep}, None, "careless.convert")

    def write_then_fail(program: torch.export.ExportedProgram) -> None:
        with torch.no_grad():
            program.state_dict["net.0.weight"].mul_(2)
        raise RuntimeError("conversion failed")

    with pytest.raises(epass.StateMutationError, match=r"careless\.convert") as info:
        hand_off.call(write_then_fail, hand_off.private["forward"])
    assert isinstance(info.value.__cause__, RuntimeError)


def _exit() -> None:
    sys.exit(3)


def _interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("leave", [_exit, _interrupt], ids=["sys.exit", "interrupted"])
def test_a_consumer_that_writes_and_exits_or_is_interrupted_is_named(leave) -> None:
    _, ep, _ = models.export("mlp")
    hand_off = _handoff.start({"forward": ep}, None, "careless.convert")

    def write_then_leave(program: torch.export.ExportedProgram) -> None:
        with torch.no_grad():
            program.state_dict["net.0.weight"].mul_(2)
        leave()

    with pytest.raises(epass.StateMutationError, match=r"careless\.convert") as info:
        hand_off.call(write_then_leave, hand_off.private["forward"])
    assert isinstance(info.value.__cause__, (SystemExit, KeyboardInterrupt))
    assert info.value.keys == ("state_dict:net.0.weight",)


@pytest.mark.parametrize("leave", [_exit, _interrupt], ids=["sys.exit", "interrupted"])
def test_a_consumer_that_only_exits_or_is_interrupted_is_let_go(leave) -> None:
    _, ep, _ = models.export("mlp")
    hand_off = _handoff.start({"forward": ep}, None, "careful.convert")
    kind = SystemExit if leave is _exit else KeyboardInterrupt
    with pytest.raises(kind):
        hand_off.call(lambda program: leave(), hand_off.private["forward"])


def test_relink_gives_back_the_users_dicts_and_tensors() -> None:
    _, ep, _ = models.export("mlp")
    hand_off = _handoff.start({"forward": ep}, presets.lower(), "consumer")
    out = hand_off.programs["forward"]
    assert out.state_dict is ep.state_dict
    # what a consumer typically hands back: a program with new dicts of equal-memory views
    kept = copy.copy(hand_off.private["forward"])
    _program.set_state(
        kept,
        {k: torch.nn.Parameter(v.detach()) for k, v in kept.state_dict.items()},
        dict(kept.constants),
    )
    report = hand_off.relink("forward", kept)
    assert kept.state_dict is ep.state_dict and kept.constants is out.constants
    assert report.shared
    for key, value in ep.state_dict.items():
        assert kept.state_dict[key] is value


def test_import_epass_imports_no_backend() -> None:
    code = (
        "import sys, epass, epass.tvm, epass.iree, epass.onnx, epass.executorch\n"
        "loaded = [m for m in ('tvm', 'iree', 'iree.turbine', 'executorch', 'onnxscript') "
        "if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

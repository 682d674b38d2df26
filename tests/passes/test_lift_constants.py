"""LiftConstants: tensor attributes become lifted constants in the store."""

from __future__ import annotations

import re

import pass_helpers as h
import pytest
import torch
from torch.export.graph_signature import InputKind

import epass
import epass.pipeline
from epass.passes import LiftConstants

aten = torch.ops.aten


def _add_offset(gm: torch.fx.GraphModule) -> None:
    """An fx rewrite that adds a tensor attribute to the graph's last output (the
    user output; buffer mutations come first)."""
    gm.register_buffer("offset", torch.full((4,), 0.25))
    output = gm.graph.output_node()
    *rest, last = output.args[0]
    with gm.graph.inserting_before(output):
        attr = gm.graph.get_attr("offset")
        add = gm.graph.call_function(aten.add.Tensor, (last, attr))
    output.args = ((*rest, add),)


def test_lift_constants_runs_an_fx_rewrite_and_lifts_its_tensors() -> None:
    ep = h.program("mlp")
    result = h.run_checked(LiftConstants(fx=_add_offset), ep)
    out = result.program
    assert out.state_dict is ep.state_dict and out.constants is not ep.constants
    assert "offset" in out.constants and "offset" not in ep.constants
    spec = next(s for s in out.graph_signature.input_specs if s.target == "offset")
    assert spec.kind == InputKind.CONSTANT_TENSOR
    assert not [n for n in out.graph.nodes if n.op == "get_attr"]
    # placed before the user input, like torch.export does
    kinds = [s.kind for s in out.graph_signature.input_specs]
    assert kinds[-1] == InputKind.USER_INPUT
    args = h.inputs("mlp")
    expected = h.models.fresh_eager("mlp")(*args) + 0.25
    torch.testing.assert_close(out.module()(*args), expected)


def test_lift_constants_keeps_the_tensor_object() -> None:
    tensor = torch.full((4,), 0.25)

    def add(gm: torch.fx.GraphModule) -> None:
        _add_offset(gm)
        gm.offset = tensor

    out = epass.PassManager([LiftConstants(fx=add)]).run(h.program("mlp"))
    assert out.constants["offset"] is tensor


def test_lift_constants_renames_on_a_clash() -> None:
    ep = h.program("mixed")  # already has a constant named "offset"
    out = LiftConstants(fx=_add_offset)(ep).program
    assert out.constants["offset"] is ep.constants["offset"]
    assert "offset_1" in out.constants


def test_lift_constants_on_a_verified_program_is_unmodified() -> None:
    ep = h.program("mixed", form="decomposed")
    result = LiftConstants()(ep)
    assert result.modified is False and result.program is ep
    assert LiftConstants(fx=lambda gm: None)(ep).modified is False


@pytest.mark.parametrize("form", h.FORMS)
def test_lift_constants_works_on_both_forms(form: str) -> None:
    ep = h.program("seed", form=form)
    out = h.run_checked(LiftConstants(fx=_add_offset), ep).program
    args = h.inputs("seed")
    expected = h.models.fresh_eager("seed")(*args) + 0.25
    torch.testing.assert_close(out.module()(*args), expected)


def test_lift_constants_rejects_a_non_callable_fx_when_built() -> None:
    # From Python the same check and message as from text (the option model).
    with pytest.raises(epass.OptionError, match=re.escape("takes function | none, got 3 (int)")):
        LiftConstants(fx=3)  # type: ignore[arg-type]
    with pytest.raises(
        epass.pipeline.PipelineError,
        match=re.escape("option 'fx' of pass 'lift-constants' takes function | none"),
    ):
        epass.PassManager.from_text('lift-constants(fx="abc")')

"""``epass._decomp.check``: check mode compares the incremental program with torch's and
names the first difference."""

from __future__ import annotations

import models
import pytest
import torch

from epass import Decompose, PassError, PassManager
from epass._decomp import splice
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

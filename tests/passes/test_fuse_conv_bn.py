"""FuseConvBN: BatchNorm folded into convolutions, the fused values constants of the output."""

from __future__ import annotations

import pass_helpers as h
import pytest
import torch

import epass
from epass.passes import FuseConvBN

aten = torch.ops.aten
BN_OPS = (aten.batch_norm.default, aten._native_batch_norm_legit_no_training.default)


def _bn_count(ep: torch.export.ExportedProgram) -> int:
    return sum(h.node_count(ep, op) for op in BN_OPS)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("form", h.FORMS)
def test_fuse_conv_bn_folds_both_forms(form: str, dynamic: bool) -> None:
    ep = h.program("convbn", dynamic, form)
    assert _bn_count(ep) == 2
    result = h.run_checked(FuseConvBN(), ep)
    out = result.program
    assert _bn_count(out) == 0
    h.assert_close(out, "convbn", dynamic)
    # state: two new constants per pair in the output's own constants dict; BN and
    # old conv entries left the signature but stay in the user's state_dict, which
    # the output still shares (no parameter was added or changed)
    link = result.records[0].link
    assert link is not None and not link.changed and not link.state_dict.added
    assert link.owners == {"state_dict": "user", "constants": "own"}
    fused = {"conv1.weight_fused", "conv1.bias_fused", "conv2.weight_fused", "conv2.bias_fused"}
    assert set(link.constants.added) == fused
    assert out.state_dict is ep.state_dict
    assert not fused & (set(ep.state_dict) | set(ep.constants))
    targets = {s.target for s in out.graph_signature.input_specs}
    for key in ("bn1.weight", "bn1.running_mean", "bn2.running_var", "conv1.weight"):
        assert key not in targets and key in ep.state_dict
    assert set(link.state_dict.removed) >= {"bn1.weight", "bn1.running_var", "conv2.bias"}
    kinds = {s.target: s.kind.name for s in out.graph_signature.input_specs}
    for key in fused:
        value = out.constants[key]
        assert kinds[key] == "CONSTANT_TENSOR"
        assert not isinstance(value, torch.nn.Parameter) and not value.requires_grad
    again = FuseConvBN()(out)
    assert again.modified is False and again.program is out


def test_fuse_conv_bn_without_conv_bias_or_affine() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4, affine=False)
    ).eval()
    model[1].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 6, 6)
    for form in h.FORMS:
        ep = torch.export.export(model, (x,))
        if form == "decomposed":
            ep = ep.run_decompositions()
        out = epass.PassManager([FuseConvBN()]).run(ep)
        assert _bn_count(out) == 0
        torch.testing.assert_close(out.module()(x), model(x), atol=1e-5, rtol=1e-5)


def test_fuse_conv_bn_skips_a_conv_with_other_users() -> None:
    class Branch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y

    ep = torch.export.export(Branch().eval(), (torch.randn(1, 3, 5, 5),))
    result = FuseConvBN()(ep)
    assert result.modified is False and result.program is ep


@h.zoo_params(exclude=("convbn",))
def test_fuse_conv_bn_leaves_other_models_alone(name: str, dynamic: bool, form: str) -> None:
    ep = h.program(name, dynamic, form)
    result = FuseConvBN()(ep)
    assert result.modified is False and result.program is ep


def test_fuse_conv_bn_keeps_float64_precision() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).double()
    model[1].running_mean.uniform_(-0.5, 0.5)
    model[1].running_var.uniform_(0.5, 1.5)
    model.eval()
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    ep = torch.export.export(model, (x,))
    out = epass.PassManager([FuseConvBN()]).run(ep)
    assert _bn_count(out) == 0
    assert out.constants["0.weight_fused"].dtype == torch.float64
    torch.testing.assert_close(out.module()(x), model(x), atol=1e-12, rtol=1e-12)

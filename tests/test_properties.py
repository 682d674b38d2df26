"""Property test: random small modules x random pipelines of built-in passes.

Numerics are preserved within tolerance, the user's program keeps every entry it
had (object, bytes, version) and its graph, and the sharing invariant holds: when
no pass changes state, the output's dicts are the user's dict objects.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from epass import PassManager
from epass.passes import (
    CSE,
    CastDtype,
    ConstantFold,
    DeadCodeElimination,
    Decompose,
    FuseConvBN,
    LiftConstants,
    RemoveAssertions,
    presets,
)

LAYERS = ["linear", "conv", "relu", "gelu", "tanh", "buffer", "np_buffer", "constant", "bn"]


class Drawn(nn.Module):
    """A stack of layers over a (batch, channels, length) input, built from a spec."""

    def __init__(self, spec: list[str], channels: int = 3, length: int = 8) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList()
        self.extras: list[str] = []
        c, n = channels, length
        for i, kind in enumerate(spec):
            layer: nn.Module = nn.Identity()
            if kind == "linear":
                layer = nn.Linear(n, n + 1)
                n += 1
            elif kind == "conv":
                layer = nn.Conv1d(c, c + 1, 3, padding=1)
                c += 1
            elif kind == "bn":
                layer = nn.BatchNorm1d(c).eval()
                layer.running_mean.uniform_(-0.5, 0.5)
                layer.running_var.uniform_(0.5, 1.5)
            elif kind == "buffer":
                self.register_buffer(f"buf{i}", torch.randn(n))
            elif kind == "np_buffer":
                self.register_buffer(f"buf{i}", torch.randn(n), persistent=False)
            elif kind == "constant":
                setattr(self, f"const{i}", torch.rand(n) + 0.5)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (kind, layer) in enumerate(zip(self.spec, self.layers, strict=True)):
            if kind in ("buffer", "np_buffer"):
                x = x + getattr(self, f"buf{i}")
            elif kind == "constant":
                x = x * getattr(self, f"const{i}")
            elif kind in ("relu", "gelu", "tanh"):
                x = getattr(torch, kind)(x) if kind != "gelu" else nn.functional.gelu(x)
            else:
                x = layer(x)
        return x


def pipeline_parts() -> dict[str, Any]:
    """Factories of built-in passes (name -> factory). All but cast-dtype keep the
    values of existing state entries; they only add or drop entries."""
    return {
        "decompose": Decompose,
        "decompose-keep-linear": lambda: Decompose(keep=[torch.ops.aten.linear.default]),
        "remove-asserts": RemoveAssertions,
        "fold-constants": ConstantFold,
        "cse": CSE,
        "dce": DeadCodeElimination,
        "lift-constants": LiftConstants,
        "fuse-conv-bn": FuseConvBN,
        "lower": presets.lower,
        "cleanup": presets.cleanup,
        "cast-dtype": lambda: CastDtype(dtype=torch.float16),
    }


def _snapshot(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    def entries(d: dict[str, Any]) -> dict[str, tuple[int, int, bytes]]:
        return {
            k: (
                id(v),
                v._version,
                v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
            )
            for k, v in d.items()
        }

    return {"code": ep.graph_module.code, "sd": entries(ep.state_dict), "c": entries(ep.constants)}


@pytest.mark.slow
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=5),
    pipeline=st.lists(st.sampled_from(sorted(pipeline_parts())), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
# A conv and its batch norm fused: the fused weights are constants the run added.
@example(spec=["conv", "bn"], pipeline=["fuse-conv-bn"], seed=0)
def test_random_modules_and_pipelines(spec: list[str], pipeline: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    module = Drawn(spec).eval()
    reference = copy.deepcopy(module)
    x = torch.randn(2, 3, 8)
    ep = torch.export.export(module, (x,))
    before = _snapshot(ep)
    parts = pipeline_parts()
    out = PassManager([parts[name]() for name in pipeline]).run(ep)

    cast = "cast-dtype" in pipeline
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if cast else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out.module()(x), reference(x), **tolerance)
    after = _snapshot(ep)
    assert after["code"] == before["code"]
    assert after["sd"] == before["sd"]
    # The user's dicts hold exactly the keys they had.
    assert after["c"] == before["c"]
    if not cast:
        assert out.state_dict is ep.state_dict
        # A run that adds a constant (folded, fused, lifted) gives the output its own
        # dict ("copy on add"); otherwise the output holds the user's.
        if set(out.constants) <= set(ep.constants):
            assert out.constants is ep.constants
    for mine, theirs in ((out.state_dict, ep.state_dict), (out.constants, ep.constants)):
        for key, value in mine.items():
            if key in theirs and value.dtype == theirs[key].dtype:
                assert value is theirs[key], key

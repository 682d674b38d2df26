"""``epass._decomp.keys``: a template is reused only for the same constants, by exact
type and bits, and the same inputs, every property torch's decompositions read."""

from __future__ import annotations

import math
import struct

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epass import Decompose
from epass._decomp import disk, keys, safety
from epass._decomp.check import first_difference
from epass._decomp.state import run_decompositions

aten = torch.ops.aten


_NAN = float("nan")
_OTHER_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (0.0, -0.0),
        (True, 1),
        (1, 1.0),
        (True, 1.0),
        (False, 0),
        (_NAN, _OTHER_NAN),
        (torch.float32, torch.float64),
        (torch.contiguous_format, torch.channels_last),
        (torch.device("cpu"), torch.device("meta")),
        (complex(0.0, 0.0), complex(-0.0, 0.0)),
        ("0", 0),
        (None, 0),
    ],
    ids=repr,
)
def test_constants_that_compare_equal_get_different_keys(a, b):
    assert keys.const_key(a) != keys.const_key(b)
    assert keys.const_key(a) == keys.const_key(a)


def test_a_nan_is_its_own_key():
    assert math.isnan(_OTHER_NAN)
    assert keys.const_key(_NAN) == keys.const_key(float("nan"))
    assert hash(keys.const_key(_NAN)) == hash(keys.const_key(float("nan")))


def test_a_constant_of_an_unknown_type_falls_back():
    with pytest.raises(safety.Fallback, match="Frac"):
        from fractions import Fraction as Frac

        keys.const_key(Frac(1, 2))


class _Fill(nn.Module):
    # Templates are shared within one program (one fake mode): both fills in one graph.
    def __init__(self, *values):
        super().__init__()
        self.values = values

    def forward(self, x):
        return tuple(1 / x.masked_fill(x > 0, v) for v in self.values)


@pytest.mark.parametrize(
    "values",
    [(0.0, -0.0), (-0.0, 0.0), (True, 1), (1, True), (_NAN, _OTHER_NAN), (2, 2.0)],
    ids=repr,
)
def test_templates_of_equal_comparing_constants_are_not_shared(values):
    x = torch.tensor([1.0, -2.0, 3.0])
    module = _Fill(*values)
    ep = torch.export.export(module, (x,))
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "incremental"
    for got, want in zip(result.program.module()(x), module(x), strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_negative_zero_fill_gives_negative_infinity():
    x = torch.tensor([1.0, -2.0])
    ep = torch.export.export(_Fill(0.0, -0.0), (x,))
    positive, negative = Decompose(method="incremental")(ep).program.module()(x)
    assert positive[0].item() == math.inf
    assert negative[0].item() == -math.inf


class _MatmulWeight(nn.Module):
    """``weight @ x.transpose(1, 2)``: torch's matmul folds to ``mm`` when the weight
    requires grad (transformers' Mamba does this)."""

    def __init__(self, parameter: bool) -> None:
        super().__init__()
        weight = torch.randn(8, 4)
        if parameter:
            self.weight = nn.Parameter(weight)
        else:
            self.register_buffer("weight", weight)

    def forward(self, x):
        return self.weight @ x.transpose(1, 2)


class _Reshape(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1) * 2


class _Mean(nn.Module):
    def forward(self, x):
        return torch.var_mean(x, dim=1)[0] + x.sum()


class _Attention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


def _program(module, x):
    return torch.export.export(module.eval(), (x,))


_X = torch.randn(2, 3, 4)


_IMAGE = torch.randn(2, 3, 4, 5)


# Pairs of programs whose nodes differ in exactly one property of one input.
_VARIANTS = {
    "requires_grad (buffer, then parameter)": lambda: [
        _program(_MatmulWeight(False), _X),
        _program(_MatmulWeight(True), _X),
    ],
    "requires_grad of a user input": lambda: [
        _program(_MatmulWeight(False), _X),
        _program(_MatmulWeight(False), _X.clone().requires_grad_(True)),
    ],
    "memory format": lambda: [
        _program(_Reshape(), _IMAGE),
        _program(_Reshape(), _IMAGE.to(memory_format=torch.channels_last)),
    ],
    "strides": lambda: [
        _program(_Reshape(), _X),
        _program(_Reshape(), _X.transpose(1, 2).contiguous().transpose(1, 2)),
    ],
    "dtype": lambda: [
        _program(_Mean(), _X),
        _program(_Mean(), _X.to(torch.float64)),
    ],
    "device": lambda: [
        _program(_Mean(), _X),
        _program(_Mean(), _X.to("meta")),
    ],
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_programs_differing_in_one_input_property_each_get_torchs_graph(
    variant, tmp_path, monkeypatch
):
    monkeypatch.setenv(disk.DIR_ENV, str(tmp_path))  # a disk cache of its own
    for ep in _VARIANTS[variant]():
        result = Decompose(method="incremental")(ep)
        ref = run_decompositions(ep)[0]
        assert first_difference(result.program, ref) is None, variant
        ops = [str(n.target) for n in result.program.graph.nodes if n.op == "call_function"]
        assert ops == [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]


def test_a_parameter_gets_the_retraces_mm_path_after_a_buffer_of_its_shape():
    _, parameter = _VARIANTS["requires_grad (buffer, then parameter)"]()
    Decompose(method="incremental")(_program(_MatmulWeight(False), _X))
    out = Decompose(method="incremental")(parameter).program
    assert aten.mm.default in {n.target for n in out.graph.nodes}


def test_the_retraces_view_of_a_state_tensor_decides_its_key():
    ep = _program(_MatmulWeight(True), _X)
    ep.state_dict["weight"].requires_grad_(False)  # the retrace fakes this tensor
    out = Decompose(method="incremental")(ep).program
    assert first_difference(out, run_decompositions(ep)[0]) is None


def test_a_state_tensor_unlike_the_one_recorded_keeps_the_retrace():
    ep = _program(_MatmulWeight(True), _X)
    ep.state_dict["weight"] = nn.Parameter(torch.randn(4, 8).t())  # other strides
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    why = result.notes["fallback"]
    assert "state tensor p_weight is not the tensor the program recorded" in why


def test_the_attention_backend_setting_is_part_of_the_key():
    ep = _program(_Attention(), torch.randn(1, 2, 8, 16))
    flash = torch.backends.cuda.flash_sdp_enabled()
    try:
        for enabled in (True, False, True):
            torch.backends.cuda.enable_flash_sdp(enabled)
            out = Decompose(method="incremental")(ep).program
            assert first_difference(out, run_decompositions(ep)[0]) is None
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)


def test_a_fresh_fake_has_every_property_its_key_names():
    ep = _program(_MatmulWeight(True), _X)
    fake_mode = keys.fake_mode_of(ep)
    values = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"]
    with fake_mode:
        values.append(torch.empty(40).as_strided((2, 3), (1, 4), 5))  # strides, an offset
        values.append(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last))
        values.append(torch.empty(3, dtype=torch.float16, device="meta"))
    for value in values:
        for grad in (False, True):
            fake = keys.fresh_fake(fake_mode, value, grad)
            assert fake is not value and fake.requires_grad is grad
            assert keys.tensor_key(fake, fake.requires_grad) == keys.tensor_key(value, grad)


class _ByTransposedParameter(nn.Module):
    """BotNet's relative position logits: a 4-d query whose strides do not fold,
    times a transposed parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = nn.Parameter(torch.randn(31, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.permute(0, 2, 1).reshape(8, 16, 16, 64)
        return q @ self.rel.transpose(-1, -2)


@pytest.mark.parametrize("read", ["transpose", "split"])
def test_a_view_of_a_parameter_requires_grad_in_the_retrace(read, tmp_path, monkeypatch):
    # The retrace computes under no_grad, yet a view of a parameter requires grad
    # there as in eager mode, and matmul folds into mm because of it.
    monkeypatch.setenv(disk.DIR_ENV, str(tmp_path))
    module = _ByTransposedParameter()
    if read == "split":
        module.forward = lambda x: (  # type: ignore[method-assign]
            x.permute(0, 2, 1).reshape(8, 16, 16, 64) @ module.rel.split(16)[0].T
        )
    ep = torch.export.export(module, (torch.randn(8, 64, 256),))
    result = Decompose(method="incremental", check=True)(ep)
    assert result.notes["checked"]
    assert aten.mm.default in {n.target for n in result.program.graph.nodes}
    with torch.no_grad():
        view = module.rel.T
    assert view.requires_grad


def test_a_detached_view_of_a_parameter_does_not_require_grad():
    graph = torch.fx.Graph()
    weight = graph.placeholder("p_weight")
    t = graph.call_function(aten.t.default, (weight,))
    detached = graph.call_function(aten.detach.default, (t,))
    grads = frozenset({"p_weight"})
    assert keys.requires_grad(t, grads) and not keys.requires_grad(detached, grads)
    assert not keys.requires_grad(graph.call_function(aten.neg.default, (t,)), grads)

"""The template cache's keys: a template is reused only for the same table and the same
constants, whatever was freed before."""

from __future__ import annotations

import gc
import math
import struct
import weakref

import pytest
import torch
from torch import nn

from epass import Decompose
from epass._decomp import keys, safety
from epass._decomp.check import first_difference
from epass._decomp.table import split_table

aten = torch.ops.aten


def _silu_times(k: int):
    # A new function object each call: freed ones leave their address to the next.
    def silu(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), float(k))

    return silu


@pytest.mark.slow  # 50 retraces; test_table_token_keeps_the_tables_functions_alive is quick
def test_freed_tables_never_serve_their_templates_to_new_ones():
    ep = torch.export.export(nn.SiLU(), (torch.randn(2, 3),))
    x = torch.randn(2, 3)
    for k in range(50):
        table = {aten.silu.default: _silu_times(k)}
        fast = Decompose(table=table, method="incremental")(ep).program
        ref = ep.run_decompositions(table)
        assert first_difference(fast, ref) is None, k
        torch.testing.assert_close(fast.module()(x), ref.module()(x))
        torch.testing.assert_close(fast.module()(x), nn.functional.silu(x) * k)
        del table, fast, ref
        gc.collect()


def test_table_token_keeps_the_tables_functions_alive():
    fn = _silu_times(3)
    alive = weakref.ref(fn)
    token = split_table({aten.silu.default: fn}).token
    assert token == split_table({aten.silu.default: fn}).token
    assert token != split_table({aten.silu.default: _silu_times(3)}).token
    del fn
    gc.collect()
    # While a key holds the function, its address cannot pass to another one.
    assert alive() is not None
    assert token == split_table({aten.silu.default: alive()}).token


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

"""``epass._decomp.safety``: a program the incremental path cannot promise torch's result
for keeps the retrace, and says why."""

from __future__ import annotations

import models
import pytest
import torch
from decomp_helpers import assert_same_as_torch
from torch import nn

from epass import Decompose

aten = torch.ops.aten


@pytest.mark.parametrize("loaded", [False, True], ids=["exported", "loaded"])
def test_ops_that_return_nothing_need_no_value(loaded, tmp_path):
    # A dtype cast exports an _assert_tensor_metadata node, which returns nothing and
    # carries no value; it must not send the program to the retrace.
    class Casts(nn.Module):
        def forward(self, x):
            return nn.functional.gelu(x.to(torch.float64)).to(torch.float32) + 1

    ep = torch.export.export(Casts(), (torch.randn(2, 3),))
    if loaded:
        torch.export.save(ep, tmp_path / "casts.pt2")
        ep = torch.export.load(tmp_path / "casts.pt2")
    asserts = [n for n in ep.graph.nodes if n.target == aten._assert_tensor_metadata.default]
    assert asserts and all(n.meta.get("val") is None for n in asserts)
    result = assert_same_as_torch(ep)
    assert result.notes["method"] == "incremental" and result.notes["fallback"] is None
    kept = [n for n in result.program.graph.nodes if n.target == asserts[0].target]
    assert len(kept) == len(asserts)


def test_auto_falls_back_on_buffer_mutation_and_says_why():
    _, ep, _ = models.export("seed")
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "a write into input b_count" in result.notes["fallback"]


def test_incremental_falls_back_on_control_flow():
    class Cond(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t.relu(), lambda t: t.tanh(), (x,))

    ep = torch.export.export(Cond(), (torch.randn(3),))
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "get_attr" in result.notes["fallback"]


def test_lifted_constants_in_the_retraces_order_take_the_incremental_path():
    class Consts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.rand(3)
            self.b = torch.rand(3)

        def forward(self, x):
            return nn.functional.gelu(x * self.b) * self.a

    module = Consts()
    x = torch.rand(2, 3)
    ep = torch.export.export(module, (x,))
    result = Decompose(check=True)(ep)  # the retrace re-orders them; so does the result
    assert result.notes["method"] == "incremental" and result.notes["checked"] is True
    torch.testing.assert_close(result.program.module()(x), module(x))


class _Numel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.numel()


def test_a_symbolic_numel_keeps_the_retrace():
    # Export records aten.sym_numel; the retrace's trace makes the value from the
    # sizes it tracks (a sym_size node times the static sizes), which a copy would not.
    dims = ({0: torch.export.Dim("batch", min=2, max=8)},)
    ep = torch.export.export(_Numel(), (torch.randn(3, 4),), dynamic_shapes=dims)
    assert any(n.target == torch.ops.aten.sym_numel.default for n in ep.graph.nodes)
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "retrace"
    assert result.notes["fallback"] == "a symbolic sym_numel (sym_numel_default)"
    static = torch.export.export(_Numel(), (torch.randn(3, 4),))
    assert Decompose(check=True)(static).notes["method"] == "incremental"


@pytest.fixture(scope="module")
def custom_ops():
    """Custom operators as libraries define them: a functional one with a fake kernel
    (transformers' ``grouped_mm_fallback``), one that writes into an argument, and a
    CompositeImplicitAutograd one."""
    lib = torch.library.Library("epass_safety_test", "FRAGMENT")
    lib.define("project(Tensor x, Tensor w) -> Tensor")
    lib.impl("project", lambda x, w: x @ w.t(), "CompositeExplicitAutograd")
    lib._register_fake("project", lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0])))
    lib.define("accumulate(Tensor x, Tensor(a!) into) -> ()")

    def accumulate(x, into):
        into.add_(x.sum())

    lib.impl("accumulate", accumulate, "CompositeExplicitAutograd")
    lib._register_fake("accumulate", lambda x, into: None)
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    try:
        yield torch.ops.epass_safety_test
    finally:
        lib._destroy()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_custom_op_the_retrace_keeps_is_kept_on_the_incremental_path(custom_ops, dynamic):
    class Projects(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = nn.functional.silu(self.fc(x))
            return nn.functional.gelu(custom_ops.twice(custom_ops.project(h, self.fc.weight)))

    shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
    ep = torch.export.export(Projects(), (torch.randn(3, 4),), dynamic_shapes=shapes)
    result = Decompose(method="incremental", check=True)(ep)
    assert result.notes["checked"]
    targets = {n.target for n in result.program.graph.nodes}
    assert custom_ops.project.default in targets and custom_ops.twice.default not in targets


def test_a_custom_op_that_writes_keeps_the_retrace(custom_ops):
    class Accumulates(nn.Module):
        def forward(self, x):
            total = x * 2
            custom_ops.accumulate(x, total)
            return total + 1

    ep = torch.export.export(Accumulates(), (torch.randn(3, 4),))
    result = Decompose()(ep)
    assert result.notes["fallback"] == (
        "a mutating op (epass_safety_test.accumulate.default at accumulate)"
    )
    x = torch.randn(3, 4)
    torch.testing.assert_close(result.program.module()(x), Accumulates()(x))

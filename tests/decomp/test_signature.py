"""``epass._decomp.signature``: the incremental path gives a program's inputs the order
and the names the retrace gives them, lifted constants included, without retracing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epass import Decompose
from epass._decomp import signature

aten = torch.ops.aten


class _Sub(nn.Module):
    def __init__(self, k=None, with_param=True, non_persistent=False):
        super().__init__()
        if with_param:
            self.lin = nn.Linear(4, 4)
        self.register_buffer("buf", torch.ones(4))
        if non_persistent:
            self.register_buffer("np", torch.ones(4) * 2, persistent=False)
        self.k = torch.randn(4) if k is None else k  # a tensor attribute: a lifted constant

    def forward(self, x):
        y = x * self.k + self.buf
        if hasattr(self, "np"):
            y = y + self.np
        if hasattr(self, "lin"):
            y = self.lin(y)
        return y


class _RootConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Sub()
        self.c = torch.randn(4)
        self.register_buffer("rb", torch.ones(4))

    def forward(self, x):
        return self.a(x * self.c) + self.rb


class _SharedConstant(nn.Module):  # one tensor used by two submodules
    def __init__(self):
        super().__init__()
        k = torch.randn(4)
        self.a = _Sub(k)
        self.b = _Sub(k)

    def forward(self, x):
        return self.b(self.a(x))


class _ConstantBeforeParameters(nn.Module):  # a submodule of constants and buffers first
    def __init__(self):
        super().__init__()
        self.first = _Sub(with_param=False)
        self.lin = nn.Linear(4, 4)
        self.last = _Sub()

    def forward(self, x):
        return self.last(self.lin(self.first(x)))


class _NonPersistent(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("np_root", torch.ones(4), persistent=False)
        self.a = _Sub(non_persistent=True)
        self.b = _Sub()
        self.c2 = torch.randn(4)
        self.register_buffer("rb", torch.ones(4))

    def forward(self, x):
        return self.b(self.a(x + self.np_root)) * self.c2 + self.rb


class _MadeInForward(nn.Module):  # constants created in forward: lifted_tensor_N
    def __init__(self):
        super().__init__()
        self.a = _Sub()
        self.register_buffer("rb", torch.ones(4))

    def forward(self, x):
        return self.a(x + torch.tensor([1.0, 2.0, 3.0, 4.0])) + self.rb * torch.tensor(2.0)


class _Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Sub()
        self.k2 = torch.randn(4)

    def forward(self, x):
        return self.inner(x) * self.k2


class _Nested(nn.Module):  # constants at several depths
    def __init__(self):
        super().__init__()
        self.d = _Deep()
        self.e = _Sub(with_param=False)
        self.k0 = torch.randn(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.e(self.d(x * self.k0)))


class _UsedInReverse(nn.Module):  # submodules used in the reverse of their registration
    def __init__(self):
        super().__init__()
        self.a = _Sub()
        self.b = _Sub()
        self.k = torch.randn(4)

    def forward(self, x):
        return self.a(self.b(x)) * self.k


class _BuffersBeforeParameters(nn.Module):  # a module of buffers registered first
    def __init__(self):
        super().__init__()
        self.stats = _Sub(with_param=False)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + self.stats.buf


class _NameCollision(nn.Module):  # a root constant a_k and a.k both want c_a_k
    def __init__(self):
        super().__init__()
        self.a = _Sub()
        self.a_k = torch.randn(4)

    def forward(self, x):
        return self.a(x) * self.a_k


class _NameCollisionReversed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a_k = torch.randn(4)
        self.a = _Sub()

    def forward(self, x):
        return self.a(x * self.a_k)


class _TiedParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l2.weight = self.l1.weight
        self.k = torch.randn(4)

    def forward(self, x):
        return self.l2(self.l1(x * self.k))


class _InputNamedLikeAConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = torch.randn(4)
        self.a = _Sub()

    def forward(self, c_k):
        return self.a(c_k * self.k)


_MODULES = [
    _RootConstant,
    _SharedConstant,
    _ConstantBeforeParameters,
    _NonPersistent,
    _MadeInForward,
    _Nested,
    _UsedInReverse,
    _BuffersBeforeParameters,
    _NameCollision,
    _NameCollisionReversed,
    _TiedParameters,
    _InputNamedLikeAConstant,
]


def _inputs(ep):
    return [(s.kind.name, s.target, s.arg.name) for s in ep.graph_signature.input_specs]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("module", _MODULES, ids=[m.__name__.strip("_") for m in _MODULES])
def test_inputs_come_in_the_retraces_order_under_its_names(module, dynamic):
    shapes = ({0: torch.export.Dim("batch", min=2, max=8)},) if dynamic else None
    ep = torch.export.export(module().eval(), (torch.randn(2, 4),), dynamic_shapes=shapes)
    reference = ep.run_decompositions()
    assert [(old.arg.name, new.arg.name) for old, new in signature.retrace_inputs(ep)] == [
        (old, new)
        for old, new in zip(
            [s.arg.name for s in _reordered(ep, reference)],
            [s.arg.name for s in reference.graph_signature.input_specs],
            strict=True,
        )
    ]
    result = Decompose(method="incremental", check=True)(ep)
    assert result.notes["method"] == "incremental"
    assert _inputs(result.program) == _inputs(reference)
    placeholders = [n.name for n in result.program.graph.nodes if n.op == "placeholder"]
    assert placeholders == [s.arg.name for s in reference.graph_signature.input_specs]


def _reordered(ep, reference):
    """``ep``'s input specs in the order of the retrace's, matched by kind and target."""
    by_target = {
        (s.kind, s.target if s.target is not None else s.arg.name): s
        for s in ep.graph_signature.input_specs
    }
    return [
        by_target[(s.kind, s.target if s.target is not None else s.arg.name)]
        for s in reference.graph_signature.input_specs
    ]


def test_a_tensor_made_in_forward_becomes_the_retraces_clone():
    ep = torch.export.export(_MadeInForward(), (torch.randn(2, 4),))
    assert aten.lift_fresh_copy.default in {n.target for n in ep.graph.nodes}
    out = Decompose(method="incremental", check=True)(ep).program
    targets = {n.target for n in out.graph.nodes}
    assert aten.clone.default in targets and aten.lift_fresh_copy.default not in targets


def test_the_operators_functionalization_replaces_are_the_ones_the_engine_rewrites():
    from epass._decomp import table

    found = set()
    for name in torch._C._dispatch_get_registrations_for_dispatch_key("Functionalize"):
        namespace, _, rest = name.partition("::")
        packet, _, overload = rest.partition(".")
        if namespace != "aten":
            continue
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        schema = op._schema
        if not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns):
            found.add(op)
    # _to_copy has a kernel of its own too, and keeps the operator.
    assert found == {*table.FUNCTIONALIZED, aten._to_copy.default}

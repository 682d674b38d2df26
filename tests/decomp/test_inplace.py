"""In-place writes on the incremental path: a write into an intermediate becomes what
the retrace's functionalization makes of it, node for node; writes it cannot prove
the same keep the retrace and say why."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from epass import Decompose
from epass._decomp import check, safety, views
from epass._torch import internals

aten = torch.ops.aten

# Write-backs through chains of views, into views a decomposition returns, items of a
# split of a written tensor and size queries placed where the retrace makes them are
# made exact for the functionalization of torch 2.11 to 2.14; on another release they keep the
# retrace (internals.EXACT_RELEASE).
only_exact_release = pytest.mark.skipif(
    not internals.EXACT_RELEASE, reason="made exact for torch 2.11 to 2.14 only; retraces elsewhere"
)


class _Write(nn.Module):
    """``h = x * 2``, an in-place write into ``h``, then a read of ``h``."""

    def __init__(self, write: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        self.write(h)
        return h + 1


_WRITES: dict[str, Callable[[torch.Tensor], object]] = {
    "relu_": torch.relu_,
    "hardtanh_": lambda h: F.hardtanh(h, inplace=True),
    "relu6_ (CompositeImplicitAutograd)": lambda h: F.relu6(h, inplace=True),
    "hardswish_": lambda h: F.hardswish(h, inplace=True),
    "hardsigmoid_": lambda h: F.hardsigmoid(h, inplace=True),
    "silu_": lambda h: F.silu(h, inplace=True),
    "mish_": lambda h: F.mish(h, inplace=True),
    "sigmoid_": torch.sigmoid_,
    "tanh_": torch.tanh_,
    "leaky_relu_": lambda h: F.leaky_relu(h, 0.2, inplace=True),
    "elu_": lambda h: F.elu(h, inplace=True),
    "threshold_": lambda h: F.threshold(h, 0.1, 0.0, inplace=True),
    "dropout_ in eval": lambda h: F.dropout(h, 0.5, training=False, inplace=True),
    "add_": lambda h: h.add_(h * 3, alpha=2),
    "add_ scalar": lambda h: h.add_(3.0),
    "sub_": lambda h: h.sub_(1),
    "mul_": lambda h: h.mul_(h),
    "div_": lambda h: h.div_(7),
    "pow_": lambda h: h.pow_(2),
    "clamp_": lambda h: h.clamp_(-1, 1),
    "clamp_min_": lambda h: h.clamp_min_(0),
    "clamp_max_": lambda h: h.clamp_max_(0.5),
    "fill_": lambda h: h.fill_(3.0),
    "zero_": lambda h: h.zero_(),
    "masked_fill_": lambda h: h.masked_fill_(h > 0, 0.5),
    "addcmul_": lambda h: h.addcmul_(h, h, value=0.5),
    "copy_": lambda h: h.copy_(h.flip(0)),
    "a chain": lambda h: h.add_(3).clamp_(0, 6).div_(6),
}


def _incremental(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The incremental path's program, checked against the retrace by Decompose."""
    result = Decompose(method="incremental", check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    return result.program


@pytest.mark.parametrize("write", list(_WRITES))
def test_a_write_into_an_intermediate_becomes_the_retraces_functional_graph(write):
    ep = torch.export.export(_Write(_WRITES[write]), (torch.randn(3, 4),))
    out = _incremental(ep)
    assert not any(
        isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in out.graph.nodes
    )
    x = torch.randn(3, 4)
    torch.testing.assert_close(out.module()(x), ep.module()(x))


class _Reads(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        before = h * 3  # reads the value before the write
        view = h.view(-1)  # a view read only before the write
        first = view.sum()
        written = h.relu_()
        h.add_(1)  # the earlier in-place result now holds this value too
        return before, first, written, h


def test_reads_before_a_write_see_the_old_value_and_every_later_read_the_new():
    ep = torch.export.export(_Reads(), (torch.randn(3, 4),))
    out = _incremental(ep)
    x = torch.randn(3, 4)
    for got, want in zip(out.module()(x), _Reads()(x), strict=True):
        torch.testing.assert_close(got, want)


class _Residual(nn.Module):
    """A torchvision-style residual block: in-place add into a batch norm's output,
    then an in-place relu of the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.conv(x))
        out += x
        return self.relu(out)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_residual_block_with_inplace_add_and_relu(dynamic):
    shapes = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    ep = torch.export.export(_Residual().eval(), (torch.randn(2, 4, 6, 6),), dynamic_shapes=shapes)
    out = _incremental(ep)
    assert [n.target for n in out.graph.nodes if n.op == "call_function"][-2:] == [
        aten.add.Tensor,
        aten.relu.default,
    ]


class _IntoInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.relu_()
        return x * 2


class _IntoBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x + self.count


class _ThroughSqueeze(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.squeeze(0).relu_()
        return h + 1


class _ViewReturned(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.relu_()
        return h.view(-1)


class _IntoSliceOfProduct(nn.Module):
    """torchvision's MViT v2: ``attn[:, :, 1:, 1:] += rel_pos`` on ``attn = q @ k``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = torch.matmul(x.view(1, 2, 2, 4), x.view(1, 2, 4, 2))
        attn[:, :, 1:] += 1
        return attn.softmax(-1)


class _SplitReadAfter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        a, b = h.split(2)
        h.relu_()
        return a + b


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (_IntoInput, "a write into input x (aten.relu_.default at relu_)"),
        (_IntoBuffer, "a write into input b_count (aten.add_.Tensor at add_)"),
        (_ThroughSqueeze, "a write through a view (aten.relu_.default at relu_, into squeeze)"),
    ],
    ids=["user input", "buffer", "through a view"],
)
def test_writes_the_incremental_path_cannot_prove_keep_the_retrace_and_say_why(module, why):
    ep = torch.export.export(module(), (torch.randn(4, 4),))
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert result.notes["fallback"].startswith(why), result.notes["fallback"]
    reference = ep.run_decompositions()
    assert check.first_difference(result.program, reference) is None


class _Flatten(nn.Module):
    """An in-place activation, then a view read by a linear layer of another module:
    the retrace makes the view again inside the linear's decomposition, with the
    linear's module stack (GhostNet's and many classifiers' head)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flat(self.act(x * 3)))


_VIEWS: dict[str, Callable[[torch.Tensor], object]] = {
    "made after the write": lambda x: (x * 3).relu_().flatten(1) * 2,
    "read after another read": lambda x: _two_reads(x * 3),
    "a chain of views": lambda x: _chain(x * 3),
    "made before the write, read after it": lambda x: _before(x * 3),
    "read across a second write": lambda x: _across(x * 3),
    "permuted": lambda x: (x * 3).relu_().permute(0, 2, 3, 1) * 2,
    "views of a reshape that copies": lambda x: _of_a_copy(x * 3),
    "items of a split": lambda x: _split_after(x * 3),
    "items of a split made before the write": lambda x: _split_before(x * 3),
}


def _split_after(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # MixNet's mixed convolution: each item is made again, split and all, where read.
    h.relu_()
    a, b = h.split([1, 3], 1)
    return a * 2, b + 1


def _split_before(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    a, b = h.split([1, 3], 1)
    first = a.sum()
    h.relu_()
    return first, a * 2, b + 1, h


def _of_a_copy(h: torch.Tensor) -> torch.Tensor:
    # The reshape of a permuted tensor copies: its views are never stale.
    h.relu_()
    y = h.permute(0, 2, 3, 1).reshape(2, -1)
    return y.unsqueeze(1) - y.unsqueeze(2)


def _two_reads(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h.relu_()
    y = h.flatten(1)
    return y * 2, h * 1, y + 1


def _chain(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h.relu_()
    y = h.flatten(1).view(2, 4, 4)
    return y * 2, y + 1


def _before(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = h.view(2, -1)
    first = y.sum()
    h.relu_()
    return first, y + 1, h * 2


def _across(h: torch.Tensor) -> torch.Tensor:
    h.relu_()
    y = h.flatten(1)
    h.add_(1)
    return y * 2


class _Views(nn.Module):
    def __init__(self, case: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.case = case

    def forward(self, x: torch.Tensor) -> object:
        return self.case(x)


@only_exact_release
@pytest.mark.parametrize("case", [*_VIEWS, "a linear of another module"])
def test_views_of_a_written_tensor_are_made_again_where_the_retrace_makes_them(case):
    module = _Flatten() if case not in _VIEWS else _Views(_VIEWS[case])
    ep = torch.export.export(module, (torch.randn(2, 4, 2, 2),))
    out = _incremental(ep)
    x = torch.randn(2, 4, 2, 2)
    got, want = out.module()(x), module(x)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True
    ):
        torch.testing.assert_close(a, b)


class _IntoSliceOfCat(nn.Module):
    """GhostNet's block: ``x += shortcut`` into the first channels of a ``cat`` (an
    ``alias`` when they are all of them, a ``slice`` otherwise)."""

    def __init__(self, keep: int) -> None:
        super().__init__()
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([x * 2, x + 1], 1)[:, : self.keep]
        out += x.repeat(1, 2, 1, 1)[:, : self.keep]
        return torch.relu(out)


class _SiblingReadAfter(nn.Module):
    """A write through one slice of a tensor; another slice of it and the tensor itself
    are read after the write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([x * 2, x + 1], 1)
        head, tail = out[:, :4], out[:, 4:]
        head += x
        return torch.relu(tail) + out.sum(1, keepdim=True)


class _BaseReturned(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        view = out[:, :]
        view += 1
        return out


class _TwoWritesThroughViews(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([x * 2, x + 1], 1)
        head, tail = out[:, :4], out[:, 4:]
        head += x
        tail += x
        return out


class _TwoViewsDeep(nn.Module):
    """``out[:, :2, :1] += 1``: an ``add_`` into a slice of a slice, then a ``copy_``
    of its result into a second such chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out[:, :2, :1] += 1
        return out.relu()


class _Mask(nn.Module):
    """Two ``fill_`` writes, each through a slice of a slice of a ``new_zeros``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.new_zeros(1, 8, 8, 1)
        m[:, 0:4, 0:4, :] = 1
        m[:, 4:, 0:4, :] = 2
        return x + m.sum()


class _ShiftedWindowMask(nn.Module):
    """Swin's attention mask for shifted windows: nine writes through slices of a
    ``new_zeros``, then windows of it (a ``reshape`` that copies, and views of that)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        img = x.new_zeros((1, 8, 8, 1))
        count = 0
        for h in (slice(0, -4), slice(-4, -2), slice(-2, None)):
            for w in (slice(0, -4), slice(-4, -2), slice(-2, None)):
                img[:, h, w, :] = count
                count += 1
        windows = img.view(1, 2, 4, 2, 4, 1).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16)
        mask = windows.unsqueeze(1) - windows.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        return x.sum() + mask


class _Selects(nn.Module):
    """Writes through ``select`` (whose inverse, ``select_scatter``, torch's table
    decomposes) and through a ``select`` of a ``slice``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out[:, 0] = 5
        out[1, :, 2] += 1
        out[0][:, 1:3] = 7
        return out.relu()


class _Diagonal(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out[0, 0].diagonal().add_(1)
        return out + 1


class _AfterADirectWrite(nn.Module):
    """A write through a slice of ``relu_``'s result, the tensor itself; that result
    read after it."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        r = h.relu_()
        h[:, :2] += 1
        return r * 2, h.sum()


class _ReadAfterAnotherWrite(nn.Module):
    """The view written through and the one below it, read after other writes into
    the tensor: each is made again on its new value where read, the first with the
    write's stack trace, the other with its own."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        below = h[:, 1:3]
        v = below[:, :, 1]
        v.add_(1)
        h[:, 2:].mul_(2)
        first = below + 1
        second = v * 2
        h.mul_(3)
        return first, second, v + 1, h[:, 1:3] + 1, h


class _ThroughTranspose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.transpose(0, 1)[:, 0].add_(1)
        return h + 1


class _ThroughView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.view(-1).relu_()
        return h + 1


class _ThroughAViewOfTheBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        h.view(h.shape[0], -1).mul_(3)
        return h.sum(1), h * 1


class _ThroughReshapes(nn.Module):
    """Funnel's ``positional_attn *= cls_mask``: a write through a slice of a reshape of
    a slice of a reshape; the view written through is read after."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        n = h.shape[0]
        v = h.reshape(n, 4, 9)[:, 1:].reshape(n, 3, 3, 3)[:, :, 1:]
        v *= 3
        return h + 1, v * 2


class _ThroughPermute(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        p = h.permute(0, 2, 3, 1)
        p.add_(1)
        return p * 2, h + 1


class _ThroughFlattenAndUnflatten(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        f = h.flatten(2)
        f[:, :, 0] = 0.0
        h.unflatten(1, (2, 2)).mul_(2)
        return h * 3, f + 1


class _ThroughNarrowAndUnsqueeze(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.narrow(1, 1, 2).add_(1)
        h.unsqueeze(1).mul_(2)
        return h.sum(1)


class _IntoCopyingContiguous(nn.Module):
    """BEiT's relative position index: ``c = (...).permute(1, 2, 0).contiguous()``, then
    ``c[:, :, 0] += ...``: a contiguous of a permuted tensor copies it, so the write is
    into a new tensor, not through a view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = (x * 2).permute(0, 2, 3, 1).contiguous()
        c[:, :, :, 0] += 3
        return c.sum(-1)


class _IntoCopyingReshape(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = (x * 3).transpose(2, 3).reshape(x.shape[0], -1)
        r.add_(1)
        return r.sum()


class _IntoViewingContiguous(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        c = h.contiguous()
        c.add_(1)
        return h * 2


class _ViewsReturned(nn.Module):
    """Views of a tensor written in place, returned: made again as the trace ends."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x * 2
        before = h.transpose(2, 3)
        below = h[:, 1:]
        h.relu_()
        return before, below, h.view(-1), below * 2, h[0, 0].t()


_THROUGH = {
    "views returned": _ViewsReturned,
    "a view returned": _ViewReturned,
    "view": _ThroughView,
    "a view by the batch size": _ThroughAViewOfTheBatch,
    "transpose, then select": _ThroughTranspose,
    "reshapes and slices, read after": _ThroughReshapes,
    "permute, read after": _ThroughPermute,
    "flatten and unflatten": _ThroughFlattenAndUnflatten,
    "narrow and unsqueeze": _ThroughNarrowAndUnsqueeze,
    "a contiguous that copies": _IntoCopyingContiguous,
    "a contiguous that views": _IntoViewingContiguous,
    "alias (all channels)": lambda: _IntoSliceOfCat(8),
    "slice": lambda: _IntoSliceOfCat(3),
    "sibling and base read after": _SiblingReadAfter,
    "base returned": _BaseReturned,
    "two writes into one tensor": _TwoWritesThroughViews,
    "two views deep": _TwoViewsDeep,
    "a mask filled through slices of slices": _Mask,
    "a shifted-window mask": _ShiftedWindowMask,
    "select": _Selects,
    "diagonal": _Diagonal,
    "after a direct write": _AfterADirectWrite,
    "read after another write": _ReadAfterAnotherWrite,
}


@only_exact_release
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", list(_THROUGH))
def test_a_write_through_a_view_is_written_back_as_the_retrace_writes_it(case, dynamic):
    # The view's inverse (slice_scatter, alias) writes the result into the tensor, the
    # view is made again on its new value, and other views are made again where read.
    module = _THROUGH[case]().eval()
    shapes = ({0: torch.export.Dim("batch", min=1, max=8)},) if dynamic else None
    ep = torch.export.export(module, (torch.randn(2, 4, 3, 3),), dynamic_shapes=shapes)
    out = _incremental(ep)
    other = torch.randn(3 if dynamic else 2, 4, 3, 3)
    got, want = out.module()(other), module(other)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True
    ):
        torch.testing.assert_close(a, b)


@only_exact_release
def test_a_write_two_slices_deep_replays_the_outer_slice_and_nests_the_inverses():
    # base' = slice_scatter(base, slice_scatter(slice(base), new, ...), ...)
    ep = torch.export.export(_Mask(), (torch.randn(2, 3),))
    out = _incremental(ep)
    calls = [n for n in out.graph.nodes if n.op == "call_function"]
    first = [n.target for n in calls][2:8]
    assert first == [
        aten.slice.Tensor,
        aten.slice.Tensor,
        aten.copy.default,
        aten.slice.Tensor,
        aten.slice_scatter.default,
        aten.slice_scatter.default,
    ]
    inner, outer = calls[6], calls[7]
    assert inner.args[0] is calls[5] and calls[5].args[0] is calls[0]  # slice(full)
    assert outer.args[:2] == (calls[0], inner)


class _ReturnedAfterAnotherWrite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        r = h[:, :2].add_(1)
        h.mul_(2)
        return r


class _ThroughAsStrided(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.as_strided((2, 2), (1, 2)).add_(1)
        return h + 1


class _ThroughSplitItem(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        a, _ = h.split([1, 3], 1)
        a.add_(1)
        return h + 1


class _IntoALinearsView(nn.Module):
    """An in-place relu of a linear layer's output, which its decomposition makes a
    ``view`` of an ``addmm`` (torchvision's Swin V2 position-bias MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 5)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x)) * 2


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (_ThroughSplitItem, "a write through a view (aten.add_.Tensor at add_, into getitem)"),
        (_ReturnedAfterAnotherWrite, "a view of mul written in place, returned (add_, written"),
        (_ThroughAsStrided, "a write through a view (aten.add_.Tensor at add_, into as_strided)"),
    ],
    ids=[
        "an item of a split",
        "returned after another write",
        "as_strided",
    ],
)
def test_writes_through_views_it_cannot_write_back_keep_the_retrace(module, why):
    ep = torch.export.export(module(), (torch.randn(2, 4, 3, 3),))
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert result.notes["fallback"].startswith(why), result.notes["fallback"]
    assert check.first_difference(result.program, ep.run_decompositions()) is None


@only_exact_release
def test_a_write_into_a_reshape_that_copies_is_a_write_into_a_new_tensor():
    # Decided on static sizes: with a dynamic one the reshape stays a view, and the
    # write keeps the retrace.
    module = _IntoCopyingReshape().eval()
    ep = torch.export.export(module, (torch.randn(2, 4, 3, 3),))
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(_incremental(ep).module()(x), module(x))
    dynamic = torch.export.export(
        module, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},)
    )
    result = Decompose()(dynamic)
    assert result.notes["fallback"] == "a write through a view the table rewrites (reshape)"


def test_a_write_through_a_view_the_table_rewrites_into_another_view_is_torchs():
    # The view functionalization sees (alias) and its inverse, made as the table makes them.
    module = _IntoSliceOfCat(8)
    ep = torch.export.export(module, (torch.randn(2, 4, 3, 3),))
    table = {aten.alias.default: lambda x: aten.view.default(x, list(x.shape))}
    result = Decompose(table=table, check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"]


def test_a_write_through_a_view_the_table_rewrites_into_no_view_keeps_the_retrace():
    module = _IntoSliceOfCat(8)
    ep = torch.export.export(module, (torch.randn(2, 4, 3, 3),))
    result = Decompose(table={aten.alias.default: aten.clone.default})(ep)
    assert result.notes["method"] == "retrace"
    assert result.notes["fallback"] == "a write through a view the table rewrites (alias)"
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(result.program.module()(x), module(x))


class _WriteIntoProduct(nn.Module):
    """An in-place write into the result of a matrix product of a 3-d tensor, whose
    decomposition returns a view of an ``mm`` (Falcon's ``mlp_output += attention``)."""

    def __init__(self, write: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.write(x, self.weight)  # type: ignore[return-value]


class _ThroughSlicesOfAnEinsum(nn.Module):
    """Funnel's relative attention: ``positional_attn *= cls_mask`` through a reshape
    and a slice of an ``einsum`` (a chain of views of its ``bmm``), read after."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scores = torch.einsum("bnd,bjd->bnj", x, x[:, :2] * 2)
        below = scores.reshape(x.shape[0], -1)[:, 1:]
        below *= 3
        return scores.softmax(-1), below + 1


class _ThroughASliceOfALinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.fc(x)
        h[:, :, 2:].relu_()
        h[:, 1] += 1
        return h * 2, h[:, 0]


class _ThroughAViewOfAMatmulByAMatrix(nn.Module):
    """A 3-d by 2-d matmul ends in an ``_unsafe_view`` of its ``mm``, which
    functionalization replays and inverts as a ``view`` under its own name."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x @ self.w
        y.view(y.shape[0], -1).mul_(2)
        y.permute(0, 2, 1)[:, 1:].add_(1)
        return y.softmax(-1), y * 1


_THROUGH_PRODUCTS = {
    "views of a matmul by a matrix": (_ThroughAViewOfAMatmulByAMatrix, (2, 3, 4), True),
    "a slice of a matmul (MViT)": (_IntoSliceOfProduct, (16,), False),
    "reshape and slice of an einsum (Funnel)": (_ThroughSlicesOfAnEinsum, (2, 3, 4), True),
    "slices of a 3-d linear, twice": (_ThroughASliceOfALinear, (2, 3, 4), True),
}


@only_exact_release
@pytest.mark.parametrize(
    ("case", "dynamic"),
    [
        (case, dynamic)
        for case, (_, _, batch) in _THROUGH_PRODUCTS.items()
        for dynamic in ((False, True) if batch else (False,))
    ],
)
def test_a_write_through_views_of_a_view_a_decomposition_returns_reaches_its_base(case, dynamic):
    # Functionalization writes back through the decomposition's views too (matmul's
    # view of its bmm), and makes the tensor and its views again from the new base
    # where each is next read.
    module_type, shape, _ = _THROUGH_PRODUCTS[case]
    dims = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    module = module_type().eval()
    ep = torch.export.export(module, (torch.randn(*shape),), dynamic_shapes=dims)
    out = _incremental(ep)
    x = torch.randn(3, *shape[1:]) if dynamic else torch.randn(*shape)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(out.module()(x)),
        torch.utils._pytree.tree_leaves(module(x)),
        strict=True,
    ):
        torch.testing.assert_close(a, b)


_PRODUCT_WRITES: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "matmul, add_": lambda x, w: (x @ w.T).add_(x),
    "linear, add_": lambda x, w: F.linear(x, w).add_(1),
    "matmul, relu_": lambda x, w: torch.relu_(x @ w),
}


@only_exact_release
@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("write", list(_PRODUCT_WRITES), ids=list(_PRODUCT_WRITES))
def test_a_write_into_a_view_a_decomposition_returns_is_written_back_into_its_base(
    write, dynamic, rank
):
    shape = (2, 3, 4, 8)[4 - rank :]
    dims = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    module = _WriteIntoProduct(_PRODUCT_WRITES[write])
    ep = torch.export.export(module, (torch.randn(*shape),), dynamic_shapes=dims)
    result = Decompose(check=True)(ep)  # raises where the program differs from torch's
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    x = torch.randn(*shape)
    torch.testing.assert_close(result.program.module()(x), module(x))


@only_exact_release
def test_a_write_into_a_linears_view_views_the_new_value_back_and_again():
    # relu(view_1); view_2 = view(relu, [8, 5]) (the addmm's shape); view_3 = view(view_2, ...)
    ep = torch.export.export(_IntoALinearsView(), (torch.randn(2, 4, 3),))
    out = _incremental(ep)
    calls = [n for n in out.graph.nodes if n.op == "call_function"]
    addmm, made, relu, back, again, mul = calls[-6:]
    assert [n.target for n in calls[-6:]] == [
        aten.addmm.default,
        aten.view.default,
        aten.relu.default,
        aten.view.default,
        aten.view.default,
        aten.mul.Tensor,
    ]
    assert made.args[0] is addmm and relu.args[0] is made
    assert back.args == (relu, [8, 5]) and again.args == (back, [2, 4, 5])
    assert mul.args[0] is again
    assert back.meta["stack_trace"] == relu.meta["stack_trace"]


class _LinearReluLinear(nn.Module):
    """Swin V2's position-bias MLP: an in-place ReLU between two linear layers."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu_(self.a(x))
        if self.read == "linear":
            return self.b(h)  # type: ignore[no-any-return]
        if self.read == "matmul":
            return h @ self.b.weight.T
        return h.sin()


@only_exact_release
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("read", ["linear", "matmul", "sin"])
def test_a_view_a_decomposition_makes_of_a_view_written_back_is_made_again_where_read(
    read, dynamic
):
    # The second linear's view of the written tensor is made again from the new base
    # before its addmm reads it; the view made again at the write is left dead.
    dims = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    module = _LinearReluLinear(read)
    ep = torch.export.export(module, (torch.randn(2, 4, 3),), dynamic_shapes=dims)
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    x = torch.randn(3 if dynamic else 2, 4, 3)
    torch.testing.assert_close(result.program.module()(x), module(x))


class _WritesTwiceIntoProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.weight
        before = h * 3
        h.relu_()
        h.add_(1)
        return h + before, h


@only_exact_release
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_two_writes_into_a_view_a_decomposition_returns_are_each_written_back(dynamic):
    dims = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    module = _WritesTwiceIntoProduct()
    ep = torch.export.export(module, (torch.randn(2, 4, 8),), dynamic_shapes=dims)
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(result.program.module()(x), module(x))


class _IntoAViewedProduct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight
        first = h[:, 0]
        h.relu_()
        return first + 1


def test_a_write_into_a_decompositions_view_of_a_tensor_the_program_views_keeps_the_retrace():
    ep = torch.export.export(_IntoAViewedProduct(), (torch.randn(2, 4, 8),))
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "retrace"
    assert result.notes["fallback"] == (
        "a write (aten.relu_.default at relu_) into a tensor its decomposition makes a view "
        "(aten.view.default), of a tensor the program views and reads after it (select)"
    )


class _IntoAProductViewedBefore(nn.Module):
    """timm's MViT-v2: a sum with a view of the attention product, copied back into it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight
        b = h.shape[0]
        summed = h[:, 0:].view(b, 2, 2, 8) + torch.arange(8.0)
        h.copy_(summed.view(b, 4, 8))
        return h.softmax(-1)


@only_exact_release
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_write_into_a_decompositions_view_of_a_tensor_viewed_only_before_it(dynamic):
    dims = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    module = _IntoAProductViewedBefore()
    ep = torch.export.export(module, (torch.randn(2, 4, 8),), dynamic_shapes=dims)
    assert any(n.target == aten.copy_.default for n in ep.graph.nodes)
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"], result.notes
    x = torch.randn(3 if dynamic else 2, 4, 8)
    torch.testing.assert_close(result.program.module()(x), module(x))


# --- views a decomposition makes of a tensor written in place ---
# Functionalization makes such a view again where an operator that is not a view
# first reads it (after the views the decomposition made of other tensors), with the
# program's own views of the tensor made again there too.


def _written(x: torch.Tensor) -> torch.Tensor:
    h = x * 2
    h.relu_()
    return h


def _written_through_a_view(x: torch.Tensor) -> torch.Tensor:
    h = x * 1
    h[:, 0] = 3.0
    torch.relu_(h[:, 2:])
    return h


_MATMULS: dict[str, tuple[Callable[..., torch.Tensor], tuple[int, ...], tuple[int, ...]]] = {
    "3-d, the written tensor first": (lambda x, y: _written(x) @ y, (2, 4, 8), (2, 8, 3)),
    "3-d, broadcast": (lambda x, y: _written(x) @ y, (2, 4, 8), (1, 8, 3)),
    "3-d, the written tensor second": (lambda x, y: y @ _written(x), (2, 4, 8), (2, 3, 4)),
    "a view of it": (lambda x, y: _written(x).view(2, 4, 8) @ y, (2, 4, 8), (2, 8, 3)),
    "4-d, same batch": (
        lambda x, y: _written(x).unsqueeze(1) @ y.unsqueeze(3),
        (2, 4, 8),
        (2, 1, 8),
    ),
    "diff": (lambda x, y: _written(x).diff(dim=-1) + y.sum(), (2, 4, 8), (2,)),
    "einsum": (
        lambda x, y: torch.einsum("bij,bkj->bik", _written(x), _written(x)) + y.sum(),
        (2, 4, 8),
        (2,),
    ),
    "diff, written through a view": (
        lambda x, y: _written_through_a_view(x).diff(dim=-1) + y.sum(),
        (2, 4, 8),
        (2,),
    ),
    "einsum, written through a view": (
        lambda x, y: torch.einsum("bij,bkj->bik", *[_written_through_a_view(x)] * 2) + y.sum(),
        (2, 4, 8),
        (2,),
    ),
    "diff, an in-place dropout in eval (no write)": (
        lambda x, y: F.dropout(x * 1, 0.1, False, True).diff(dim=-1) + y.sum(),
        (2, 4, 8),
        (2,),
    ),
    "matmul, an in-place dropout in eval (no write)": (
        lambda x, y: (
            (lambda h: h @ h.transpose(1, 2))(F.dropout(x * 1, 0.1, False, True)) + y.sum()
        ),
        (2, 4, 8),
        (2,),
    ),
    "4-d, broadcast (a copy reads it)": (
        lambda x, y: _written(x).unsqueeze(1) @ y.unsqueeze(3),
        (2, 4, 8),
        (2, 4, 8),
    ),
}


class _Calls(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


@pytest.mark.parametrize("case", list(_MATMULS))
def test_views_a_decomposition_makes_of_a_written_tensor_are_made_where_read(case):
    fn, x_shape, y_shape = _MATMULS[case]
    args = (torch.randn(x_shape), torch.randn(y_shape))
    ep = torch.export.export(_Calls(fn), args)
    out = _incremental(ep)
    torch.testing.assert_close(out.module()(*args), fn(*args))


class _GlobalContext(nn.Module):
    """timm's GlobalContext attention pooling after an in-place SiLU (GCResNet)."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)
        self.attn = nn.Conv2d(channels, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.conv(x), inplace=True)
        b, c, h, w = x.shape
        attn = self.attn(x).reshape(b, 1, h * w).softmax(-1).unsqueeze(3)
        context = x.reshape(b, c, h * w).unsqueeze(1) @ attn
        return context.view(b, c, 1, 1) + x


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_global_context_pooling_after_an_in_place_activation_is_torchs_graph(dynamic):
    dims = ({0: torch.export.Dim("batch", min=1, max=16)},) if dynamic else None
    module = _GlobalContext().eval()
    ep = torch.export.export(module, (torch.randn(2, 8, 4, 4),), dynamic_shapes=dims)
    out = _incremental(ep)
    x = torch.randn(3 if dynamic else 2, 8, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(out.module()(x), module(x))


def _template(build: Callable[[torch.fx.Graph, torch.fx.Node], None]) -> list[torch.fx.Node]:
    """The nodes ``build`` adds after a placeholder ``root`` (a decomposition's)."""
    graph = torch.fx.Graph()
    root = graph.placeholder("root")
    build(graph, root)
    return [n for n in graph.nodes if n.op == "call_function"]


def _call(graph: torch.fx.Graph, op: Any, *args: Any) -> torch.fx.Node:
    return graph.call_function(op, args)


def test_the_views_of_a_written_tensor_end_where_an_operator_reads_them():
    def build(g, root):
        v = _call(g, aten.view.default, root, [8])
        _call(g, aten.neg.default, g.placeholder("other"))
        e = _call(g, aten.expand.default, v, [2, 8])
        g.output(_call(g, aten.sum.default, e))

    emitted = _template(build)
    root = emitted[0].args[0]
    ((first, end, chain),) = views._views_of(root, emitted, {emitted[-1]}, fresh=True)
    assert [n.target for n in chain] == [aten.view.default, aten.expand.default]
    assert first is emitted[-1] and end is chain[-1]


def test_branches_of_views_of_a_written_tensor_are_each_made_where_read():
    # diff: x[1:] - x[:-1], each slice made again before the subtraction, in its order.
    def build(g, root):
        late = _call(g, aten.slice.Tensor, root, 0, 0, 3)
        early = _call(g, aten.slice.Tensor, root, 0, 1, 4)
        g.output(_call(g, aten.sub.Tensor, early, late))

    emitted = _template(build)
    root = emitted[0].args[0]
    placed = views._views_of(root, emitted, {emitted[-1]}, fresh=False)
    assert [(first, chain) for first, _, chain in placed] == [
        (emitted[-1], [emitted[1]]),
        (emitted[-1], [emitted[0]]),
    ]


@pytest.mark.parametrize(
    "build",
    [
        lambda g, r: (
            _call(g, aten.sum.default, _call(g, aten.view.default, r, [8])),
            _call(g, aten.sum.default, _call(g, aten.expand.default, r, [2, 8])),
        ),
        lambda g, r: (
            v := _call(g, aten.view.default, r, [8]),
            _call(g, aten.neg.default, r),
            _call(g, aten.sum.default, v),
        )[1:],
    ],
    ids=["two branches", "as it is and through a view"],
)
def test_a_regenerated_view_read_in_two_ways_keeps_the_retrace(build):
    # The retrace would make the regenerated view again for each of them.
    emitted = _template(lambda g, r: g.output(build(g, r)))
    root = next(iter(emitted[0].graph.nodes))
    with pytest.raises(safety.Fallback, match="in a way the retrace makes otherwise"):
        views._views_of(root, emitted, set(), fresh=True)


def test_views_branching_from_a_view_keep_the_retrace():
    def build(g, root):
        v = _call(g, aten.view.default, root, [8])
        a = _call(g, aten.slice.Tensor, v, 0, 0, 4)
        b = _call(g, aten.slice.Tensor, v, 0, 4, 8)
        g.output(_call(g, aten.sub.Tensor, a, b))

    emitted = _template(build)
    with pytest.raises(safety.Fallback, match="in a way the retrace makes otherwise"):
        views._views_of(emitted[0].args[0], emitted, {emitted[-1]}, fresh=False)


# --- items of a split the table rewrites, of a tensor written in place ---


class _SplitAfter(nn.Module):
    """timm's SKNet and Res2Net: a split (which the table rewrites into
    split_with_sizes) of an in-place activation's output."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = torch.relu_(x * 2).split(2, 1)
        return a * 2, b * 3


class _ChunkAfter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.relu_(x + 1).chunk(2, 1)
        return torch.stack([p.sum(1) for p in parts])


@only_exact_release
@pytest.mark.parametrize(
    ("module", "dynamic"),
    [
        (_SplitAfter, False),
        (_SplitAfter, True),
        (_ChunkAfter, False),
        (_ChunkAfter, True),
        (_SplitReadAfter, False),  # splits the batch: static only
    ],
    ids=["split", "split-dynamic", "chunk", "chunk-dynamic", "split before the write"],
)
def test_items_of_a_split_the_table_rewrites_are_made_again_where_read(module, dynamic):
    # Each item is made again, with its own split_with_sizes, where it is first read;
    # the split made before (or at) the write is left dead.
    dims = ({0: torch.export.Dim("batch", min=2, max=8)},) if dynamic else None
    ep = torch.export.export(module(), (torch.randn(4, 4),), dynamic_shapes=dims)
    out = _incremental(ep)
    splits = [n for n in out.graph.nodes if n.target == aten.split_with_sizes.default]
    assert len(splits) == 2
    x = torch.randn(4, 4)
    for got, want in zip(
        torch.utils._pytree.tree_leaves(out.module()(x)),
        torch.utils._pytree.tree_leaves(module()(x)),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


class _ProgramViewThenReader(nn.Module):
    """A view the program takes of a tensor written in place (before or after the
    write), read by an operator whose decomposition views it again (linear of a 3-d
    input) or not (add, softmax)."""

    def __init__(self, before: bool, reader: str) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.before = before
        self.reader = reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        if self.before:
            v = h.transpose(1, 2)
        h.relu_()
        if not self.before:
            v = h.transpose(1, 2)
        if self.reader == "linear":
            return self.fc(v)
        return v.softmax(-1) if self.reader == "softmax" else v + 1


@pytest.mark.parametrize("reader", ["add", "softmax", "linear"])
@pytest.mark.parametrize("before", [True, False], ids=["made before", "made after"])
def test_a_view_made_again_where_a_decomposition_views_it_takes_the_readers_stack_trace(
    before, reader
):
    # Read through matmul's own views, the view is made again inside linear's call.
    module = _ProgramViewThenReader(before, reader).eval()
    ep = torch.export.export(module, (torch.randn(2, 6, 6),))
    out = _incremental(ep)
    permutes = [n for n in out.graph.nodes if n.target == aten.permute.default]
    made_again = [n for n in permutes if n.args[0].target == aten.relu.default]
    assert len(made_again) == 1
    line = "return self.fc(v)" if reader == "linear" else "v = h.transpose(1, 2)"
    assert line in made_again[0].meta["stack_trace"]


class _FlattenAfterAWrite(nn.Module):
    def __init__(self, reader: str) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 5)
        self.reader = reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.relu_()
        flat = h.flatten(2)
        return self.fc(flat.transpose(1, 2)) if self.reader == "linear" else flat.softmax(-1)


@pytest.mark.parametrize("reader", ["softmax", "linear"])
def test_a_size_a_view_made_after_a_write_computes_is_read_only_where_torch_reads_it(reader):
    # flatten of two dynamic dimensions computes h*w; the retrace binds it to the view
    # it made after the write, and a decomposition reading it (linear's) keeps that
    # view in the graph, dead: the incremental path keeps the retrace there.
    dims = {0: torch.export.Dim("b", min=1, max=8), 2: torch.export.Dim("h", min=4, max=32)}
    dims[3] = torch.export.Dim("w", min=4, max=32)
    ep = torch.export.export(
        _FlattenAfterAWrite(reader), (torch.randn(2, 3, 9, 7),), dynamic_shapes=(dims,)
    )
    result = Decompose(check=True)(ep)
    if reader == "linear":
        assert result.notes["fallback"].startswith("linear reads a size (s")
        assert "that a view (flatten) of a tensor written in place" in result.notes["fallback"]
    else:
        assert result.notes["method"] == "incremental" and result.notes["checked"]


class _Router(nn.Module):
    """Mixtral's routing, twice: the top-k weights normalized in place and flattened,
    and an inverse permutation of the sorted expert indices (the same size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            w, idx = torch.topk(x.softmax(-1), 2)
            w /= w.sum(-1, keepdim=True)
            flat_w = w.reshape(-1)
            _, perm = idx.reshape(-1).sort()
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel())
            x = x + (flat_w[perm] * inv).sum()
        return x


@only_exact_release
def test_a_size_of_a_view_made_after_a_write_is_not_read_from_it_by_a_tensor_of_its_own():
    # The sort's indices have the size the view of the written weights computes
    # (4*s), their own: the retrace reads it from them.
    dims = ({1: torch.export.Dim("s", min=2, max=32)},)
    ep = torch.export.export(_Router(), (torch.randn(2, 5, 8),), dynamic_shapes=dims)
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "incremental", result.notes
    assert result.notes["checked"] is True
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(result.program.module()(x), _Router()(x))


class _ReadAfterAWriteThroughAProduct(nn.Module):
    def __init__(self, reader: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.fc = nn.Linear(6, 5)
        self.reader = reader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w
        y.view(y.shape[0], -1).mul_(2)
        if self.reader == "linear":
            return self.fc(y)
        t = y.transpose(1, 2)
        return F.linear(t, torch.ones(5, 3))


def test_a_read_of_a_product_written_through_a_view_it_cannot_place_keeps_the_retrace():
    module = _ReadAfterAWriteThroughAProduct("linear").eval()
    ep = torch.export.export(module, (torch.randn(2, 3, 4),))
    result = Decompose()(ep)
    assert result.notes["fallback"].startswith(
        "the decomposition of linear views a tensor made again from what its own"
    ), result.notes["fallback"]
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(result.program.module()(x), module(x))


class _LaterViewOfAProduct(nn.Module):
    """``t``, a view of a matmul written through a view of it, taken after the write;
    read at once or later, the matmul itself read after or not."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.case = case

    def forward(self, x: torch.Tensor) -> Any:
        h = x @ self.w
        h[..., 0] = 1.0
        t = h.transpose(1, 2)
        if self.case == "read at once, then the product":
            return t + 1, h + 1
        y = x * 2
        if self.case == "read later":
            return t + 1, y
        if self.case == "read later, then the product":
            return t.softmax(-1), y, h * 3
        if self.case == "by a linear":
            return F.linear(t, torch.ones(5, 4)), y
        return t, y  # returned


@only_exact_release
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    "case",
    [
        "read at once, then the product",
        "read later",
        "read later, then the product",
        "by a linear",
        "returned",
    ],
)
def test_a_view_of_a_product_taken_after_a_write_through_it_is_torchs_graph(case, dynamic):
    # Taking the view makes the product again there (dead unless read later); the view
    # is made again from the product's own base where read.
    module = _LaterViewOfAProduct(case).eval()
    shapes = ({0: Dim("batch", min=2, max=8)},) if dynamic else None
    ep = torch.export.export(module, (torch.randn(3, 4, 6),), dynamic_shapes=shapes)
    program = _incremental(ep)
    x = torch.randn(5 if dynamic else 3, 4, 6)
    torch.testing.assert_close(program.module()(x), module(x))


_WRITTEN_PRODUCTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "matmul by a matrix": lambda x: x @ torch.eye(6),
    "linear": lambda x: F.linear(x, torch.eye(6)),
    "einsum": lambda x: torch.einsum("bij,jk->bik", x, torch.eye(6)),
}


class _ReluOfAProduct(nn.Module):
    def __init__(self, product: str, reader: str) -> None:
        super().__init__()
        self.product = _WRITTEN_PRODUCTS[product]
        self.reader = reader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.product(x)
        y.relu_()
        read = F.linear(y, torch.ones(5, 6)) if self.reader == "linear" else y.softmax(-1)
        return read, y * 1


@only_exact_release
@pytest.mark.parametrize("reader", ["softmax", "linear"])
@pytest.mark.parametrize("product", list(_WRITTEN_PRODUCTS))
def test_a_write_into_a_product_read_through_a_decompositions_views(product, reader):
    # The view written back is made again under the name functionalization saw it by
    # (_unsafe_view); einsum's chain of views keeps the retrace.
    module = _ReluOfAProduct(product, reader).eval()
    ep = torch.export.export(module, (torch.randn(2, 4, 6),))
    result = Decompose(check=True)(ep)
    if product == "einsum":
        assert result.notes["fallback"] == (
            "a write (aten.relu_.default at relu_) into a tensor its decomposition makes "
            "a view (aten.view.default)"
        )
    else:
        assert result.notes["method"] == "incremental" and result.notes["checked"]


class _SliceReadByALinear(nn.Module):
    def __init__(self, read_again: bool) -> None:
        super().__init__()
        self.read_again = read_again

    def forward(self, x: torch.Tensor) -> Any:
        h = x * 1
        y = h[:, :, 1:]
        h[:, 1:].add_(1)
        out = F.linear(y, torch.ones(5, 5))
        return (out, y * 1) if self.read_again else out


@only_exact_release
@pytest.mark.parametrize("read_again", [False, True], ids=["read once", "read again"])
def test_a_view_a_decomposition_views_again_and_read_later_keeps_the_retrace(read_again):
    # torch makes such a view again twice, for the decomposition and for later reads.
    ep = torch.export.export(_SliceReadByALinear(read_again), (torch.randn(2, 4, 6),))
    result = Decompose(check=True)(ep)
    if read_again:
        assert result.notes["fallback"] == (
            "a view (slice_1) of a tensor written in place, made again where the "
            "decomposition of linear views it, is read again"
        )
    else:
        assert result.notes["method"] == "incremental" and result.notes["checked"]


class _ViewsOfViews(nn.Module):
    """Views of views of a tensor written in place, each taken on a line of its own."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case

    def forward(self, x: torch.Tensor) -> Any:
        h = x * 1
        a = h[..., 1:]
        b = a.unsqueeze(1)
        if self.case == "a chain made before a write into the tensor":
            h.relu_()
            return b * 2
        if self.case == "a view of a view made before a write":
            y = h.transpose(1, 2)
            h[:, 1:].add_(1)
            return y.transpose(1, 2).softmax(-1)
        if self.case == "a view of a view made before a write through its view":
            b.relu_()
            t = a.transpose(0, 1)
            return t * 2
        if self.case == "a view of a view below the view written through":
            a.relu_()
            t = b.transpose(0, 1)
            return t * 2
        # Views of what a write through a view returned, the first read after the second.
        a.relu_()
        t = a.transpose(0, 1)
        u = t.unsqueeze(0)
        y = x * 3
        return u * 2, y, t * 3


@only_exact_release
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    "case",
    [
        "a chain made before a write into the tensor",
        "a view of a view made before a write",
        "a view of a view made before a write through its view",
        "a view of a view below the view written through",
        "views of what a write through a view returned",
    ],
)
def test_views_of_views_are_made_again_from_the_tensor_under_the_views_stack_trace(case, dynamic):
    # Taking a view syncs what it views; a view is made again through its whole chain
    # from the tensor (through the view written through), every node under the stack
    # trace of the view made again.
    module = _ViewsOfViews(case)
    shapes = ({0: Dim("batch", min=2, max=8)},) if dynamic else None
    ep = torch.export.export(module, (torch.randn(3, 4, 6),), dynamic_shapes=shapes)
    program = _incremental(ep)
    x = torch.randn(5 if dynamic else 3, 4, 6)
    torch.testing.assert_close(program.module()(x), module(x))


class _SizeOfAnUnreadView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 1
        h.reshape(x.shape[0], -1)  # read by nothing
        h[..., 0] = 1.0
        return h.softmax(-1)


@only_exact_release
def test_a_size_the_program_queries_for_a_view_nothing_reads_binds_later_reads():
    # The retrace reads the batch from the program's own size query, which stays live.
    ep = torch.export.export(
        _SizeOfAnUnreadView(), (torch.randn(3, 4, 6),), dynamic_shapes=({0: Dim("b", max=16)},)
    )
    program = _incremental(ep)
    (query,) = [n for n in program.graph.nodes if n.target is aten.sym_size.int]
    assert query.args[0].op == "placeholder"


class _ReturnAProductWrittenThroughAView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ x.transpose(1, 2)
        h.transpose(1, 2).add_(1.5)
        return h


@only_exact_release
def test_a_product_written_through_a_view_and_returned_is_made_again_as_the_trace_ends():
    program = _incremental(
        torch.export.export(_ReturnAProductWrittenThroughAView(), (torch.randn(3, 4, 6),))
    )
    (out,) = program.graph.output_node().args[0]
    assert "stack_trace" not in out.meta and out.meta["nn_module_stack"] == {}
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(program.module()(x), _ReturnAProductWrittenThroughAView()(x))

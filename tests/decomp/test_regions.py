"""Regions: higher-order ops the retrace inlines (``wrap_with_autocast``,
``wrap_with_set_grad_enabled``), taken by the incremental path with torch's program,
node for node (timm's EfficientViT turns autocast off around its attention)."""

from __future__ import annotations

import pytest
import torch
from decomp_helpers import assert_same_as_torch
from fingerprint import fingerprint
from torch import nn
from torch.export import Dim

from epass import Decompose, _operators
from epass._decomp import check, table, templates


class _Autocast(nn.Module):
    """A linear attention with autocast set around it, as EfficientViT writes it."""

    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).relu().chunk(3, dim=-1)
        v = nn.functional.pad(v, (0, 1), value=1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            kv = k.transpose(-1, -2).float() @ v.float()
            out = q.float() @ kv
            out = out[..., :-1] / (out[..., -1:] + 1e-5)
        return out.float().softmax(-1) + x


class _GradMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            g = torch.nn.functional.gelu(h @ h.transpose(-1, -2)).sum(-1, keepdim=True)
        return h * g


def _exported(module: nn.Module, dynamic: bool) -> torch.export.ExportedProgram:
    shapes = ({0: Dim("batch", min=1, max=32)},) if dynamic else None
    return torch.export.export(module.eval(), (torch.randn(2, 5, 8),), dynamic_shapes=shapes)


def _regions(ep: torch.export.ExportedProgram) -> list[str]:
    return [n.target.name() for n in ep.graph.nodes if _operators.is_higher_order(n.target)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    ("module", "region"),
    [
        (lambda: _Autocast(enabled=False), "wrap_with_autocast"),
        (lambda: _Autocast(enabled=True), "wrap_with_autocast"),
        (_GradMode, "wrap_with_set_grad_enabled"),
    ],
    ids=["autocast off", "autocast on (bfloat16)", "no_grad"],
)
def test_a_region_is_inlined_as_the_retrace_inlines_it(module, region, dynamic):
    torch.manual_seed(0)
    m = module()
    ep = _exported(m, dynamic)
    assert _regions(ep) == [region]  # the program has one; torch's has none
    before = fingerprint(ep)
    result = assert_same_as_torch(ep)
    assert result.notes["method"] == "incremental", result.notes
    assert result.notes["checked"] is True
    out = result.program
    assert _regions(out) == []
    assert not [n for n in out.graph.nodes if n.op == "get_attr"]
    assert fingerprint(ep) == before
    x = torch.randn(3 if dynamic else 2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(out.module()(x), m(x))


def test_the_bodys_nodes_carry_the_frames_the_retrace_records():
    ep = _exported(_Autocast(enabled=False), dynamic=False)
    out = Decompose(method="incremental")(ep).program  # the retrace records them itself
    inside = [
        n for n in out.graph.nodes if n.meta.get("torch_fn", ("",))[0] == "wrap_with_autocast"
    ]
    assert inside  # the body's nodes, under the region's module stack and torch_fn
    for node in inside:
        trace = node.meta["stack_trace"]
        assert trace.startswith('File "<eval_with_key>.') and "in forward" in trace, trace


def test_check_mode_reads_the_code_files_counter_as_the_same_file():
    a = 'File "<eval_with_key>.117", line 12, in forward\n    matmul = x'
    b = 'File "<eval_with_key>.153", line 12, in forward\n    matmul = x'
    assert check._code_file(a) == check._code_file(b)
    assert check._code_file(a) != check._code_file(b.replace("line 12", "line 13"))


class _ReturnsAView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        with torch.no_grad():
            y = h.transpose(0, 1)
        return y + 1


def test_a_body_returning_a_view_of_its_input_keeps_the_retrace_and_says_why():
    # The program's alias analysis cannot see through the region to what it views.
    ep = torch.export.export(_ReturnsAView(), (torch.randn(2, 3),))
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "retrace"
    assert "the body of wrap_with_set_grad_enabled returns a view of its input" in (
        result.notes["fallback"] or ""
    )


@pytest.mark.parametrize("limit", [0, 2])
def test_a_region_is_inlined_whole_under_max_rewrites_and_not_counted(limit):
    ep = _exported(_Autocast(enabled=False), dynamic=False)
    full = Decompose()(ep)
    result = Decompose(max_rewrites=limit)(ep)
    assert result.method == "incremental"
    assert _regions(result.program) == []
    assert result.notes["rewrites"] == result.rewritten == limit
    assert result.notes["held_back"] == full.rewritten - limit


def _region_traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The region traces made from now on, by the region's name."""
    from epass._decomp import tracing

    made: list[str] = []
    real = tracing.trace

    def trace(op, *args, **kwargs):
        if op in table.REGIONS:
            made.append(op.name())
        return real(op, *args, **kwargs)

    monkeypatch.setattr(tracing, "trace", trace)
    return made


class _ThreeRegions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Autocast(True), _Autocast(True), _Autocast(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_warm_decomposition_finds_each_region_in_memory_by_its_bodys_code(monkeypatch, dynamic):
    ep = _exported(_ThreeRegions(), dynamic)
    made = _region_traces(monkeypatch)
    first = assert_same_as_torch(ep)
    assert made == ["wrap_with_autocast"] * 3
    made.clear()
    again = assert_same_as_torch(ep)  # torch's program, node for node, from memory
    assert made == [] and again.method == "incremental"
    assert again.program.graph_module.code == first.program.graph_module.code
    traces = [[n.meta.get("stack_trace") for n in r.program.graph.nodes] for r in (first, again)]
    assert traces[0] == traces[1]


def test_a_body_whose_code_changed_is_traced_again():
    ep = _exported(_Autocast(enabled=False), dynamic=False)
    Decompose()(ep)
    (body,) = [m for m in ep.graph_module.children() if isinstance(m, torch.fx.GraphModule)]
    (eps,) = [n for n in body.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    eps.args = (eps.args[0], 0.5)  # what the body adds to the denominator
    body.recompile()
    out = assert_same_as_torch(ep).program
    assert 0.5 in [a for n in out.graph.nodes for a in n.args]
    assert 1e-5 not in [a for n in out.graph.nodes for a in n.args]


def test_the_body_key_is_its_code_and_calls_and_those_of_the_bodies_it_nests():
    ep = _exported(_Autocast(enabled=True), dynamic=False)
    (body,) = [m for m in ep.graph_module.children() if isinstance(m, torch.fx.GraphModule)]
    code, calls = templates.body_key(body)
    assert code == body.code
    assert calls == tuple(n.target for n in body.graph.nodes if n.op == "call_function")
    graph = torch.fx.Graph()
    graph.output((graph.placeholder("x"), graph.get_attr("inner")))
    outer = torch.fx.GraphModule({"inner": body}, graph)
    assert templates.body_key(outer) == (f"{outer.code}\n# inner\n{code}", calls)
    # A body reading a tensor: its code does not say what the tensor holds.
    graph = torch.fx.Graph()
    graph.output(graph.call_function(torch.add, (graph.placeholder("x"), graph.get_attr("w"))))
    held = torch.fx.GraphModule({"w": torch.nn.Parameter(torch.ones(1))}, graph)
    assert templates.body_key(held) is None


def _call(fn):
    graph = torch.fx.Graph()
    graph.output(graph.call_function(fn, (graph.placeholder("x"),)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_bodies_calling_functions_of_one_name_have_other_keys():
    # FX writes a function it cannot import by its name: the code of two bodies is
    # then the same, the functions they call are not.
    def make(scale):
        def helper(x):
            return x * scale

        return helper

    one, two = _call(make(2.0)), _call(make(3.0))
    assert one.code == two.code
    assert templates.body_key(one) != templates.body_key(two)

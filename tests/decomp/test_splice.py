"""The incremental decomposition path: same program as run_decompositions, or a retrace."""

from __future__ import annotations

import operator

import models
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_properties import LAYERS, Drawn
from torch import nn
from torch.export import Dim

from epass import Decompose, PassError, PassManager
from epass._decomp import splice, templates
from epass._decomp.table import rewrites, splices, split_table
from epass.errors import (
    DecompositionMismatchError,
    EpassError,
    IncrementalDecompositionError,
)
from epass.passes import decompose as decompose_module
from epass.passes.decompose import DecomposeResult

aten = torch.ops.aten


def _relu_by_mask(x):
    return aten.mul.Tensor(x, aten.gt.Scalar(x, 0))


def _assert_same_as_torch(ep, **options):
    """Decompose(check=True) runs both paths and raises on the first difference."""
    result = Decompose(check=True, **options)(ep)
    assert isinstance(result, DecomposeResult)
    return result


@pytest.mark.parametrize("name", ["no_constants", "mlp", "convbn", "transformer"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_incremental_matches_run_decompositions_on_models(name, dynamic):
    _, ep, args = models.export(name, dynamic=dynamic)
    result = _assert_same_as_torch(ep)
    assert result.notes["method"] == "incremental"
    assert result.notes["checked"] is True
    assert result.notes["fallback"] is None
    assert result.program.dialect == "ATEN"
    torch.testing.assert_close(result.program.module()(*args), ep.module()(*args))


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
    result = _assert_same_as_torch(ep)
    assert result.notes["method"] == "incremental" and result.notes["fallback"] is None
    kept = [n for n in result.program.graph.nodes if n.target == asserts[0].target]
    assert len(kept) == len(asserts)


def test_incremental_is_the_default_and_is_recorded():
    _, ep, _ = models.export("mlp")
    result = PassManager([Decompose()])(ep)
    (record,) = result.records
    assert record.notes["method"] == "incremental"
    assert record.notes["fallback"] is None
    assert record.notes["rewritten"] == 3
    assert record.as_dict()["notes"]["method"] == "incremental"


def test_incremental_rewrites_only_decomposed_nodes_and_keeps_their_meta():
    _, ep, _ = models.export("mlp")
    out = Decompose(method="incremental")(ep).program
    linears = [n for n in ep.graph.nodes if n.target is aten.linear.default]
    by_trace = {n.meta.get("stack_trace") for n in out.graph.nodes if n.op == "call_function"}
    assert all(n.meta["stack_trace"] in by_trace for n in linears)
    assert not any(n.target is aten.linear.default for n in out.graph.nodes)


def test_retrace_method_forces_torch_path(monkeypatch):
    _, ep, _ = models.export("mlp")
    calls = []
    original = torch.export.ExportedProgram.run_decompositions

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", spy)
    result = Decompose(method="retrace")(ep)
    assert calls == [1]
    assert result.notes == {
        "method": "retrace",
        "fallback": None,
        "rewritten": None,
        "checked": False,
    }
    calls.clear()
    assert Decompose()(ep).notes["method"] == "incremental"
    assert calls == []


def test_auto_falls_back_on_buffer_mutation_and_says_why():
    _, ep, _ = models.export("seed")
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "mutat" in result.notes["fallback"]


def test_incremental_method_raises_naming_the_reason():
    _, ep, _ = models.export("seed")
    with pytest.raises(IncrementalDecompositionError, match="add_"):
        Decompose(method="incremental")(ep)
    assert issubclass(IncrementalDecompositionError, EpassError)


def test_incremental_falls_back_on_control_flow():
    class Cond(nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t.relu(), lambda t: t.tanh(), (x,))

    ep = torch.export.export(Cond(), (torch.randn(3),))
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "get_attr" in result.notes["fallback"]


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="method"):
        Decompose(method="fast")  # type: ignore[arg-type]


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


def test_explicit_table_and_keep_match_torch():
    _, ep, _ = models.export("mlp")
    _assert_same_as_torch(ep, keep=[aten.linear.default])
    _assert_same_as_torch(ep, table={aten.relu.default: _relu_by_mask})
    result = _assert_same_as_torch(ep, table={})
    assert result.notes["method"] == "incremental"


def test_few_ops_left_rewrites_only_those():
    _, ep, _ = models.export("transformer")
    kept = Decompose(keep=[aten.linear.default])(ep).program
    result = _assert_same_as_torch(kept)
    linears = sum(n.target is aten.linear.default for n in kept.graph.nodes)
    assert result.notes["rewritten"] == linears


def test_merge_carries_method_and_check():
    assert Decompose(method="retrace").merge(Decompose()).method == "retrace"
    assert Decompose().merge(Decompose(method="incremental")).method == "incremental"
    assert Decompose(method="retrace").merge(Decompose(method="incremental")) is None
    assert Decompose(check=True).merge(Decompose()).check is True
    plain = Decompose()
    assert plain.merge(Decompose()) is plain


def test_template_cache_is_bounded_and_reused():
    templates.clear_memory()
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    first = templates.memory_info()
    assert first["misses"] > 0 and first["size"] <= first["maxsize"]
    Decompose(method="incremental")(ep)
    second = templates.memory_info()
    assert second["misses"] == first["misses"]  # every template came from the cache
    assert second["hits"] > first["hits"]


def test_default_table_split_is_cached_and_follows_keep():
    a = split_table(None)
    assert split_table(None) is a
    b = split_table(None, keep=(aten.linear.default,))
    assert b is not a
    assert not rewrites(aten.linear.default, b)
    assert rewrites(aten.linear.default, a)


_TABLES = {
    "default": {},
    "keep-linear": {"keep": [aten.linear.default]},
    "empty": {"table": {}},
    "relu-mask": {"table": {aten.relu.default: _relu_by_mask}},
    "gelu-core": {"table": torch._decomp.get_decompositions([aten.gelu.default])},
}


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=5),
    table=st.sampled_from(sorted(_TABLES)),
    dynamic=st.booleans(),
    twice=st.booleans(),
    seed=st.integers(0, 2**16),
)
# A size computed before the decomposition's first ATen call keeps the rewritten node's
# own original_aten, which a node of the ATen dialect has.
@example(spec=["linear"], table="default", dynamic=True, twice=True, seed=0)
def test_random_modules_and_tables_match_torch(spec, table, dynamic, twice, seed):
    torch.manual_seed(seed)
    module = Drawn(spec).eval()
    x = torch.randn(2, 3, 8)
    shapes = ({0: Dim("batch", min=1, max=16)},) if dynamic else None
    ep = torch.export.export(module, (x,), dynamic_shapes=shapes)
    if twice:  # start from the ATen dialect, with only a kept op left to decompose
        ep = Decompose(keep=[aten.linear.default])(ep).program
    result = Decompose(check=True, **_TABLES[table])(ep)
    if result.notes["method"] == "incremental":
        torch.testing.assert_close(result.program.module()(x), module(x), rtol=1e-4, atol=1e-5)


def test_ci_profile_runs_the_same_examples_everywhere():
    import os
    from pathlib import Path

    ci = settings.get_profile("ci")
    assert ci.derandomize is True
    assert ci.database is None
    assert settings.get_profile("fuzz").derandomize is False
    if "CI" in os.environ:
        assert settings.get_current_profile_name() == "ci"
        assert settings.default.derandomize is True
        assert settings.default.database is None
    fuzz = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz.sh"
    assert os.access(fuzz, os.X_OK)
    assert "--hypothesis-profile=fuzz" in fuzz.read_text()


class _Diff(nn.Module):
    def forward(self, x):
        return torch.diff(x, dim=1, prepend=x[:, :1] - 1)


class _PoolFlat(nn.Module):
    def forward(self, x):
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1) * 2


class _CheckedFlat(nn.Module):
    def forward(self, x):
        torch._check(x.shape[0] <= 32)
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1).sum(0) + x.shape[0]


@pytest.mark.parametrize(
    ("module", "shape", "dims"),
    [
        (_Diff, (3, 5), {0: Dim("b", min=2), 1: Dim("s", min=2, max=64)}),
        (_PoolFlat, (3, 4, 6, 6), {0: Dim("b", min=2)}),
        (_CheckedFlat, (3, 4, 6, 6), {0: Dim("b", min=2, max=32)}),
    ],
    ids=["diff", "pool-flatten", "checked-range"],
)
def test_new_size_queries_are_bound_as_the_retrace_binds_them(module, shape, dims):
    # The decomposition asks for a size (of an intermediate, or of an input the
    # program never measured); the retrace's runtime-assertion pass re-binds it.
    x = torch.randn(*shape)
    ep = torch.export.export(module(), (x,), dynamic_shapes=(dims,))
    result = _assert_same_as_torch(ep)
    assert result.notes["method"] == "incremental"
    assert result.notes["checked"] is True
    other = torch.randn(4, *shape[1:])
    torch.testing.assert_close(result.program.module()(other), module()(other))


def test_nodes_without_module_stack_get_the_retraces_empty_one():
    from epass.passes import CastDtype

    torch.manual_seed(0)
    ep = torch.export.export(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),))
    cast = PassManager([CastDtype(dtype=torch.float16)]).run(ep)
    assert any("nn_module_stack" not in n.meta for n in cast.graph.nodes if n.op == "call_function")
    assert _assert_same_as_torch(cast).notes["method"] == "incremental"


def test_sizes_computed_before_the_first_aten_call_keep_the_nodes_original_aten():
    # The retrace runs each node under a copy of its meta: the symbolic `mul` that
    # linear's decomposition computes first inherits the node's original_aten, which a
    # node already in the ATen dialect has (aten.linear.default).
    x = torch.randn(2, 3, 8)
    ep = torch.export.export(nn.Linear(8, 9), (x,), dynamic_shapes=({0: Dim("b")},))
    kept = Decompose(keep=[aten.linear.default])(ep).program
    (linear,) = [n for n in kept.graph.nodes if n.target is aten.linear.default]
    assert linear.meta["original_aten"] is aten.linear.default
    result = _assert_same_as_torch(kept)
    assert result.notes["method"] == "incremental"
    first = next(n for n in result.program.graph.nodes if n.op == "call_function")
    second = first.next
    assert str(second.target) == "<built-in function mul>"
    assert second.meta["original_aten"] is aten.linear.default


def test_lifted_constants_fall_back_because_the_retrace_reorders_them():
    class Consts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.rand(3)
            self.b = torch.rand(3)

        def forward(self, x):
            return nn.functional.gelu(x * self.b) * self.a

    ep = torch.export.export(Consts(), (torch.rand(2, 3),))
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "retrace"
    assert "lifted constant" in result.notes["fallback"]


# Blocks over a (batch, 6) float input, each returning the same shape: multi-output
# ops (their getitem nodes), and complex programs (conjugate views, view_as_real).
_BLOCKS = {
    "topk": lambda x: x + torch.topk(x, 2)[0].sum(-1, keepdim=True) + torch.topk(x, 2)[1][:, :1],
    "sort": lambda x: torch.sort(x, dim=-1)[0] * 2 + torch.sort(x, dim=-1)[1],
    "max.dim": lambda x: x - x.max(dim=1, keepdim=True)[0] + x.max(dim=1, keepdim=True)[1],
    "var_mean": lambda x: (
        (x - torch.var_mean(x, 1, keepdim=True)[1])
        / (torch.var_mean(x, 1, keepdim=True)[0] + 1).sqrt()
    ),
    "aminmax": lambda x: x * torch.aminmax(x, dim=1, keepdim=True)[1],
    "chunk": lambda x: torch.cat(list(reversed(x.chunk(2, dim=1))), 1),
    "conj": lambda x: (torch.complex(x, -x).conj() * 2).real,
    "conj-abs": lambda x: torch.complex(x, x).conj().abs(),
    "view_as_real": lambda x: torch.view_as_real(torch.complex(x, x) * 2).sum(-1),
    "complex-scalar": lambda x: torch.view_as_real(torch.complex(x, x) * (1 - 2j))[..., 1],
    "gelu": nn.functional.gelu,
}


class _Blocks(nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names

    def forward(self, x):
        for name in self.names:
            x = _BLOCKS[name](x)
        return x


def _check_blocks(names, dynamic, **options):
    x = torch.randn(4, 6)
    module = _Blocks(names)
    shapes = ({0: Dim("batch", min=2, max=16)},) if dynamic else None
    ep = torch.export.export(module, (x,), dynamic_shapes=shapes)
    result = _assert_same_as_torch(ep, **options)
    torch.testing.assert_close(result.program.module()(x), module(x), rtol=1e-4, atol=1e-5)
    return result


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(_BLOCKS))
def test_check_mode_agrees_on_multi_output_and_complex_ops(name, dynamic):
    result = _check_blocks([name], dynamic)
    if name.startswith("conj"):
        # The retrace resolves a conjugate view before an op that cannot read the
        # bit (a clone); which ops can is torch's C++ list, so these retrace.
        assert result.notes["method"] == "retrace"
        assert "conjugate" in result.notes["fallback"]
    else:
        assert result.notes["method"] == "incremental"


def test_getitems_after_a_multi_output_op_record_its_original_aten():
    result = _check_blocks(["topk"], dynamic=False)
    getitems = [n for n in result.program.graph.nodes if n.target is operator.getitem]
    assert getitems
    assert all(n.meta["original_aten"] is aten.topk.default for n in getitems)


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    names=st.lists(st.sampled_from(sorted(_BLOCKS)), min_size=1, max_size=4),
    table=st.sampled_from(sorted(_TABLES)),
    dynamic=st.booleans(),
)
def test_random_multi_output_and_complex_ops_match_torch(names, table, dynamic):
    _check_blocks(names, dynamic, **_TABLES[table])


# --- one answer to "does this table rewrite op X", for the skip and the engine --------


def _default_table():
    return dict(torch.export.default_decompositions().materialize())


def _without(table, *ops):
    return {op: fn for op, fn in table.items() if op not in ops}


def _one_op_program(op):
    """The shape of program ``skip_reason`` reads: an ATen-dialect graph with one call."""
    from types import SimpleNamespace

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(op, (x,)))
    return SimpleNamespace(dialect="ATEN", graph_module=torch.fx.GraphModule({}, graph))


AGREEMENT_PASSES = {
    "default table": lambda: Decompose(),
    "one python decomposition": lambda: Decompose(
        table={aten.addcmul.default: _default_table()[aten.addcmul.default]}
    ),
    "one CIA op": lambda: Decompose(
        table={aten.linear.default: _default_table()[aten.linear.default]}
    ),
    "default table less a few ops": lambda: Decompose(
        table=_without(_default_table(), aten.addcmul.default, aten.hardswish.default),
        keep=[aten.linear.default],
    ),
    "default table with keep": lambda: Decompose(keep=[aten.linear.default, aten.addcmul.default]),
}
# Beside every op of the default table: core ops no table names, mutating ops, size
# queries, and CIA ops that may alias (export always decomposes them).
OTHER_OPS = (
    aten.add.Tensor,
    aten.mm.default,
    aten.add_.Tensor,
    aten.relu_.default,
    aten.sym_size.int,
    aten.reshape.default,
    aten.linear.default,
    aten.scaled_dot_product_attention.default,
)


@pytest.mark.parametrize("name", AGREEMENT_PASSES)
def test_skip_reason_and_the_engine_agree_op_by_op(name):
    pass_ = AGREEMENT_PASSES[name]()
    tables = pass_._tables()
    ops = {op for op in _default_table() if isinstance(op, torch._ops.OpOverload)}
    ops.update(OTHER_OPS)
    disagree = []
    rewritten = 0
    for op in sorted(ops, key=str):
        program = _one_op_program(op)
        (node,) = [n for n in program.graph_module.graph.nodes if n.op == "call_function"]
        engine = splices(node, tables)
        skips = pass_.skip_reason(program) is not None
        rewritten += engine
        if skips == engine:
            disagree.append(f"{op}: engine splices {engine}, skip_reason skips {skips}")
    assert not disagree, disagree
    # Both answers are non-trivial: each table rewrites some ops and leaves others.
    assert 0 < rewritten < len(ops)


@pytest.mark.parametrize(
    ("name", "op", "expected"),
    [
        ("default table", aten.addcmul.default, True),
        ("default table", aten.mm.default, False),
        ("default table with keep", aten.linear.default, False),
        ("default table with keep", aten.addcmul.default, False),
        ("one python decomposition", aten.addcmul.default, True),
        ("one python decomposition", aten.linear.default, False),  # preserved by the split
        ("one CIA op", aten.linear.default, True),
        ("one CIA op", aten.reshape.default, True),  # may alias: always decomposed
        ("default table less a few ops", aten.hardswish.default, False),
        ("default table less a few ops", aten.add_.Tensor, True),  # functionalized
    ],
)
def test_rewrites_answers_as_the_retrace_splits_the_table(name, op, expected):
    assert rewrites(op, AGREEMENT_PASSES[name]()._tables()) is expected


@pytest.mark.parametrize("table", [None, {}], ids=["default table", "empty table"])
def test_skip_engine_and_retrace_agree_on_a_custom_cia_op(table):
    lib = torch.library.Library("epass_rewrites_test", "FRAGMENT")
    try:
        lib.define("scale(Tensor x) -> Tensor")
        lib.impl("scale", lambda x: x * 2, "CompositeImplicitAutograd")
        op = torch.ops.epass_rewrites_test.scale.default

        class Scale(nn.Module):
            def forward(self, x):
                return op(x) + 1

        ep = torch.export.export(Scale(), (torch.randn(3),))
        aten_ep = ep.run_decompositions({})  # ATen dialect, the custom op still there
        retraced = ep.run_decompositions(table) if table is not None else ep.run_decompositions()
        torch_rewrites = op not in {n.target for n in retraced.graph.nodes}
        pass_ = Decompose(table=table)
        assert rewrites(op, pass_._tables()) is torch_rewrites
        assert (pass_.skip_reason(aten_ep) is None) is torch_rewrites
    finally:
        lib._destroy()

"""``epass._decomp.table``: a table split as ``run_decompositions`` splits it, cached by
what it holds, and ``rewrites``, the one answer the skip and the engine share."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from epass import Decompose
from epass._decomp.check import first_difference
from epass._decomp.table import rewrites, splices, split_table

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


def test_default_table_split_is_cached_and_follows_keep():
    a = split_table(None)
    assert split_table(None) is a
    b = split_table(None, keep=(aten.linear.default,))
    assert b is not a
    assert not rewrites(aten.linear.default, b)
    assert rewrites(aten.linear.default, a)


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

"""The helpers the passes share, and the private torch API they reach through _program."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from epass import PassManager, _graph, _operators, _program, _writes, verification
from epass.passes import CSE, CastDtype, ConstantFold, DeadCodeElimination


def test_op_schema_reads_operator_schemas() -> None:
    schema = _operators.op_schema(torch.ops.aten.add_.Tensor)
    assert schema is not None and schema.is_mutable and schema.name == "aten::add_"
    assert not _operators.op_schema(torch.ops.aten.add.Tensor).is_mutable  # type: ignore[union-attr]
    assert _operators.op_schema(operator.getitem) is None
    assert _operators.op_schema(torch.ops.aten.add) is None  # a packet, not an overload


def test_is_op_overload() -> None:
    assert _operators.is_op_overload(torch.ops.aten.relu.default)
    assert not _operators.is_op_overload(torch.ops.aten.relu)
    assert not _operators.is_op_overload(torch.relu)


def _builtin_named() -> torch.export.ExportedProgram:
    # nn.Sequential's argument is called "input", which graph copies rename.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    return torch.export.export(model, (torch.randn(2, 4),)).run_decompositions()


def test_copy_graph_keeps_specs_of_renamed_placeholders() -> None:
    ep = _builtin_named()
    assert "input" in ep.graph_signature.user_inputs
    gm = _graph.copy_graph(ep)
    out = _graph.build_program(ep, gm)
    assert [s.kind for s in out.graph_signature.input_specs] == [
        s.kind for s in ep.graph_signature.input_specs
    ]


@pytest.mark.parametrize("make", [CastDtype, ConstantFold, DeadCodeElimination])
def test_passes_handle_an_input_named_like_a_builtin(make: type) -> None:
    ep = _builtin_named()
    out = make()(ep).program
    x = torch.randn(2, 4)
    torch.testing.assert_close(out.module()(x), ep.module()(x), atol=5e-2, rtol=5e-2)


def test_mutated_nodes_follows_views() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v = self.b.view(2, 2)
            self.b.add_(1)
            return x + v.sum()

    ep = torch.export.export(M(), (torch.ones(1),))
    names = {n.name for n in _writes.mutated_nodes(ep.graph_module)}
    assert {"b_b", "view", "add_"} <= names
    assert "x" not in names


def test_unique_key() -> None:
    assert _graph.unique_key("a", {"b"}) == "a"
    assert _graph.unique_key("a", {"a", "a_1"}, {"a_2"}) == "a_3"


# --- the one in-place-write walk, through torch.cond branches and while_loop bodies ---
# torch.export refuses a cond branch or a while_loop body that writes in place
# (UncapturedHigherOrderOpError), so these programs get their write by editing the
# exported body: ``buf * 2`` becomes ``buf.mul_(2)``. Reading ``buf * 3`` before and
# after the higher-order op then gives two different values.

aten = torch.ops.aten


class _CondWritesBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = self.buf * 3
        y = torch.cond(x.sum() > 0, lambda x, b: x + b * 2, lambda x, b: x - b, (x, self.buf))
        return before + y + self.buf * 3  # type: ignore[no-any-return]


class _LoopWritesBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = self.buf * 3
        _, y = torch._higher_order_ops.while_loop(
            lambda i, y: i < 2, lambda i, y: (i + 1, y + self.buf * 2), (torch.tensor(0), x)
        )
        return before + y + self.buf * 3  # type: ignore[no-any-return]


def _body_writes_buffer(model: type[torch.nn.Module]) -> torch.export.ExportedProgram:
    ep = torch.export.export(model(), (torch.ones(4),))
    for module in ep.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule) and module is not ep.graph_module:
            for node in module.graph.nodes:
                if node.target is aten.mul.Tensor:
                    node.target = aten.mul_.Tensor
            module.recompile()
    return ep


BODY_WRITES = {"cond branch": _CondWritesBuffer, "while_loop body": _LoopWritesBuffer}
# buf starts at ones: the cond doubles it once (3 + 3 + 6), the loop twice (3 + 7 + 12).
EXPECTED = {"cond branch": 12.0, "while_loop body": 22.0}
_HOPS = (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop)


def _reads_of_buffer(ep: torch.export.ExportedProgram) -> int:
    return sum(
        node.target is aten.mul.Tensor and node.args[0].name == "b_buf"  # type: ignore[union-attr]
        for node in ep.graph.nodes
    )


def _run(ep: torch.export.ExportedProgram) -> torch.Tensor:
    # Running writes into the program's buffer: each run gets its own copy.
    return ep.module()(torch.ones(4))  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", BODY_WRITES)
def test_in_place_writes_follow_cond_branches_and_while_loop_bodies(kind: str) -> None:
    ep = _body_writes_buffer(BODY_WRITES[kind])
    writes = _writes.in_place_writes(ep.graph_module)
    hop = next(n for n in ep.graph.nodes if n.target in _HOPS)
    assert {n.name for n in writes.writers[hop]} == {"b_buf"}
    assert "b_buf" in {n.name for n in _writes.mutated_nodes(ep.graph_module)}
    assert verification.state_writes(ep) == ({"buf"}, set())  # verification reads the same walk
    assert torch.equal(_run(copy.deepcopy(ep)), torch.full((4,), EXPECTED[kind]))


@pytest.mark.parametrize("kind", BODY_WRITES)
@pytest.mark.parametrize("make", [ConstantFold, CSE], ids=["fold-constants", "cse"])
def test_passes_do_not_merge_or_fold_reads_of_a_buffer_a_body_writes(kind: str, make: type) -> None:
    ep = _body_writes_buffer(BODY_WRITES[kind])
    out = PassManager([make()]).run(copy.deepcopy(ep))
    assert _reads_of_buffer(out) == 2  # buf * 3 before and after the write, both kept
    assert torch.equal(_run(copy.deepcopy(out)), torch.full((4,), EXPECTED[kind]))


# --- the walk over nested graphs -------------------------------------------------------


class _NestedBodies(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def true_fn(t: torch.Tensor) -> torch.Tensor:
            return torch.cond(t.sum() > 1, lambda u: u.relu(), lambda u: u.neg(), (t,))

        y = torch.cond(x.sum() > 0, true_fn, lambda t: t.tanh(), (x,))
        _, z = torch._higher_order_ops.while_loop(
            lambda i, z: i < 2, lambda i, z: (i + 1, z.relu() + 1), (torch.tensor(0), y)
        )
        return z  # type: ignore[no-any-return]


def _nested_bodies() -> torch.export.ExportedProgram:
    return torch.export.export(_NestedBodies(), (torch.ones(4),)).run_decompositions()


def test_graphs_lists_every_nested_graph_once_in_module_order() -> None:
    gm = _nested_bodies().graph_module
    modules = dict(gm.named_modules())
    names = ["", "true_graph_0", "true_graph_0.true_graph_0", "true_graph_0.false_graph_0"]
    names += ["false_graph_0", "while_loop_cond_graph_0", "while_loop_body_graph_0"]
    assert _program.graphs(gm) == [modules[name].graph for name in names]


@pytest.mark.parametrize("body", ["true_graph_0.true_graph_0", "while_loop_body_graph_0"])
def test_decompose_skip_reason_reads_nested_cond_branches_and_while_bodies(body: str) -> None:
    from epass import Decompose

    ep = _nested_bodies()
    assert Decompose().skip_reason(ep) is not None  # already decomposed everywhere
    graph = dict(ep.graph_module.named_modules())[body].graph
    relu = next(n for n in graph.nodes if n.target is aten.relu.default)
    relu.target = aten.silu.default  # which the default table decomposes
    assert Decompose().skip_reason(ep) is None

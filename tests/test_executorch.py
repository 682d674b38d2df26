"""The ExecuTorch hand-off: edge programs share the user's state; the .pte matches eager."""

from __future__ import annotations

import models
import pytest
import torch
from fingerprint import fingerprint

import epass
import epass.executorch
from epass.passes import CSE, ConstantFold, DeadCodeElimination, Decompose, ReplaceOps, presets

exir = pytest.importorskip("executorch.exir", reason="executorch is not installed")


def _run_pte(buffer: bytes, args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer)  # ``buffer`` stays referenced here
    return list(program.load_method("forward").execute(list(args)))


def _fold_views() -> epass.PassManager:
    # lower() with pre-transposed weights: the store holds non-contiguous views
    return epass.PassManager([Decompose(), ConstantFold(fold_views=True), CSE()])


def _assert_users_objects(edge_program: torch.export.ExportedProgram, ep) -> None:
    for key, value in edge_program.state_dict.items():
        if key in ep.state_dict:
            assert value is ep.state_dict[key], key


def test_executorch_to_edge_alone_writes_copies_into_the_given_dicts() -> None:
    # The problem the hand-off solves: to_edge replaces the views in the dicts of the
    # program it is given (the user's store) by contiguous copies, and gives the edge
    # program a state_dict of its own.
    _, ep, _ = models.export("mlp")
    lowered = _fold_views().run(ep)
    views = dict(lowered.constants)
    assert views and not any(v.is_contiguous() for v in views.values())
    edge = exir.to_edge(lowered)
    assert edge.exported_program().state_dict is not ep.state_dict
    assert any(lowered.constants[k] is not v for k, v in views.items())


def test_to_edge_shares_the_users_state_and_runs() -> None:
    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    result = epass.executorch.to_edge(ep, pipeline=presets.lower())
    edge_program = result.exported_program()
    assert edge_program.state_dict is ep.state_dict
    assert edge_program.constants is ep.constants
    _assert_users_objects(edge_program, ep)
    assert result.shared and result.links["forward"].changed == ()
    assert result.pipelines["forward"].records[0].name == "decompose"
    pte = result.to_executorch().buffer
    assert fingerprint(ep) == before  # to_executorch wrote nothing either
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


def test_to_edge_keeps_copies_out_of_the_users_dict() -> None:
    module, ep, args = models.export("mlp")
    lowered = _fold_views().run(ep)
    store = dict(lowered.constants)
    before = fingerprint(ep)
    result = epass.executorch.to_edge(lowered)
    assert lowered.constants == store  # the same objects under the same keys, no new ones
    assert all(lowered.constants[k] is v for k, v in store.items())
    assert fingerprint(ep) == before
    link = result.links["forward"]
    # ExecuTorch made the transposed weights contiguous: the edge program keeps those
    # in a dict of its own and shares the rest.
    assert set(link.constants.changed) == set(store) and not link.constants.shared
    edge_program = result.exported_program()
    assert edge_program.state_dict is ep.state_dict
    _assert_users_objects(edge_program, ep)
    pte = result.to_executorch().buffer
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


def test_edge_manager_hands_out_the_live_program() -> None:
    # Relinking goes through EdgeProgramManager.exported_program(name): it must return
    # the program to_executorch serializes, not a copy.
    _, ep, _ = models.export("mlp")
    result = epass.executorch.to_edge(ep)
    edge = result.edge
    assert edge.exported_program() is edge.exported_program("forward")
    assert list(edge.methods) == ["forward"]
    assert edge.exported_program().state_dict is ep.state_dict


def test_to_edge_transform_and_lower_through_xnnpack() -> None:
    xnnpack = pytest.importorskip(
        "executorch.backends.xnnpack.partition.xnnpack_partitioner",
        reason="executorch was built without XNNPACK",
    )
    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    result = epass.executorch.to_edge_transform_and_lower(
        ep, pipeline=presets.lower(), partitioner=[xnnpack.XnnpackPartitioner()]
    )
    assert result.exported_program().state_dict is ep.state_dict
    # the delegate took the weights: they left the edge program, not the user's dict
    removed = result.links["forward"].state_dict.removed
    assert "net.0.weight" in removed and "net.0.weight" in ep.state_dict
    pte = result.to_executorch().buffer
    assert fingerprint(ep) == before
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


def test_to_edge_exports_a_module_and_takes_method_dicts() -> None:
    module = models.build("mlp")
    args = models.CASES["mlp"].inputs()
    result = epass.executorch.to_edge(module, args, pipeline=[Decompose(), DeadCodeElimination()])
    sd = result.exported_program().state_dict
    for key, value in module.state_dict(keep_vars=True).items():
        assert sd[key] is value, key
    _, ep, _ = models.export("seed")
    keys = list(ep.state_dict)
    both = epass.executorch.to_edge({"forward": ep, "again": ep})
    assert set(both.links) == {"forward", "again"}
    # ExecuTorch lifts "count.add_(1)"'s scalar into the state_dict on each call:
    # each edge program holds it in a state_dict of its own; the user's never gains it.
    added = [r.state_dict.added for r in both.links.values()]
    assert added == [("_lifted_tensor_constant1",)] * 2 and not both.shared
    assert list(ep.state_dict) == keys
    for name in both.links:
        sd = both.exported_program(name).state_dict
        assert sd is not ep.state_dict and all(sd[k] is ep.state_dict[k] for k in keys)


def test_to_edge_renames_lifted_scalars_that_collide_with_the_store() -> None:
    # ExecuTorch names the scalars it lifts by position, per program; an earlier
    # hand-off of another program may have put another value under that name.
    module, ep, args = models.export("seed")
    other = torch.tensor(7)
    ep.state_dict["_lifted_tensor_constant1"] = other
    result = epass.executorch.to_edge(ep)
    assert ep.state_dict["_lifted_tensor_constant1"] is other
    (added,) = result.links["forward"].state_dict.added
    edge_state = result.exported_program().state_dict
    assert added == "_lifted_tensor_constant1_1" and edge_state[added].item() == 1
    assert added not in ep.state_dict
    targets = {s.target for s in result.exported_program().graph_signature.input_specs}
    assert added in targets and "_lifted_tensor_constant1" not in targets
    pte = result.to_executorch().buffer
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


def test_to_edge_rejects_bad_input() -> None:
    from epass.errors import HandOffError

    with pytest.raises(HandOffError, match="needs example args"):
        epass.executorch.to_edge(models.build("mlp"))
    with pytest.raises(HandOffError, match="got str"):
        epass.executorch.to_edge("model.pt2")  # type: ignore[arg-type]
    _, ep, _ = models.export("mlp")
    with pytest.raises(HandOffError, match=r"methods \['head'\]"):
        epass.executorch.to_edge({"forward": ep, "head": "model.pt2"})  # type: ignore[dict-item]
    assert issubclass(HandOffError, TypeError)


def test_xnnpack_lowers_pre_transposed_weights() -> None:
    # With fold_views=True the addmm reads a constant W^T; it no longer claims to be
    # F.linear, so XNNPACK's ConvertToLinearPass leaves it alone.
    xnnpack = pytest.importorskip(
        "executorch.backends.xnnpack.partition.xnnpack_partitioner",
        reason="executorch was built without XNNPACK",
    )
    module, ep, args = models.export("mlp")
    result = epass.executorch.to_edge_transform_and_lower(
        ep, pipeline=_fold_views(), partitioner=[xnnpack.XnnpackPartitioner()]
    )
    assert result.exported_program().state_dict is ep.state_dict
    pte = result.to_executorch().buffer
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


def _targets(program: torch.export.ExportedProgram) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_to_edge_runs_lower_at_its_own_decomposition_keeping_preserved_ops() -> None:
    # to_edge decomposes with ExecuTorch's table less the preserved operators; lower()
    # before it would have decomposed aten.linear away. The pipeline runs at that
    # call instead, its Decompose taking ExecuTorch's table, and nothing is
    # decomposed twice.
    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    config = exir.EdgeCompileConfig(preserve_ops=[torch.ops.aten.linear.default])
    result = epass.executorch.to_edge(ep, pipeline=presets.lower(), compile_config=config)
    plain = exir.to_edge(ep, compile_config=config)
    edge_program = result.exported_program()
    assert "aten.linear.default" in _targets(result.pipelines["forward"].program)
    assert _targets(edge_program) == _targets(plain.exported_program())
    assert result.served is not None
    (entry,) = result.served.served
    assert (entry.how, entry.pipeline) == ("incremental", "lower")
    # the pipeline's output is reported as one run before the hand-off would be
    assert result.programs["forward"] is result.pipelines["forward"].program
    assert result.programs["forward"].state_dict is ep.state_dict
    assert edge_program.state_dict is ep.state_dict and result.shared
    pte = result.to_executorch().buffer
    assert fingerprint(ep) == before
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


class _Unused(torch.nn.Module):
    # ExecuTorch removes the unused parameter from the graph and the dicts of the
    # program its decomposition returned, in place, and lifts the scalar it adds
    # into them.
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.extra = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.extra * 2  # dead: export keeps the parameter as an input
        return self.lin(x) + 1


def test_executorch_never_edits_the_program_a_pipeline_made_at_its_decomposition() -> None:
    args = (torch.randn(2, 8),)
    module = _Unused().eval()
    ep = torch.export.export(module, args)
    keys = list(ep.state_dict)
    result = epass.executorch.to_edge(ep, pipeline=[Decompose()])  # keeps every input
    assert result.served is not None and result.served.served[0].pipeline is not None
    made = result.pipelines["forward"].program
    placeholders = [n.name for n in made.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["p_extra", "p_lin_weight", "p_lin_bias", "x"]
    assert list(made.state_dict) == keys and made.state_dict is ep.state_dict
    link = result.links["forward"].state_dict
    assert (link.added, link.removed) == (("_lifted_tensor_constant0",), ("extra",))
    assert list(ep.state_dict) == keys
    pte = result.to_executorch().buffer
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))


def _twice_addmm(bias, x, weight):
    return torch.ops.aten.addmm.default(bias, x, weight) * 2


def test_a_pipeline_matching_core_aten_after_decompose_runs_before_to_edge() -> None:
    # ReplaceOps on addmm must see core ATen: the pipeline runs as written, and
    # to_edge's own decomposition is served on its output.
    _, ep, args = models.export("mlp")
    pipeline = [Decompose(), ReplaceOps({torch.ops.aten.addmm.default: _twice_addmm})]
    result = epass.executorch.to_edge(ep, pipeline=pipeline)
    assert result.served is not None
    assert [e.pipeline for e in result.served.served] == [None]
    made = result.pipelines["forward"].program
    assert "aten.addmm.default" in _targets(made) and "aten.mul.Tensor" in _targets(made)
    pte = result.to_executorch().buffer
    torch.testing.assert_close(_run_pte(pte, args)[0], made.module()(*args))


class _Offset(torch.nn.Module):
    # lower() folds ``offset * 2`` into a new constant, named after its operator.
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.offset = torch.linspace(0, 1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset * 2


def test_a_pipeline_run_at_to_edges_decomposition_sees_the_users_whole_dicts() -> None:
    # An entry no signature references (left by an earlier lowering) holds the name
    # the fold would take: the pipeline names its constant around it, as it does when
    # it runs before the hand-off, and ExecuTorch gets only what the output uses.
    module = _Offset().eval()
    args = (torch.randn(2, 4),)
    made = []
    for serve in (True, False):
        ep = torch.export.export(module, args)
        stray = torch.full((4,), 99.0)
        ep.state_dict["folded_mul"] = stray
        result = epass.executorch.to_edge(ep, pipeline=presets.lower(), serve_decompositions=serve)
        assert ep.state_dict["folded_mul"] is stray
        specs = result.exported_program().graph_signature.input_specs
        made.append(([s.target for s in specs], result.links["forward"].as_dict()))
        pte = result.to_executorch().buffer
        torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))
    deferred, written = made
    assert deferred == written and "folded_mul_1" in deferred[0]
    assert list(deferred[1]["state_dict"]["removed"]) == ["folded_mul"]


@pytest.mark.slow
def test_hand_offs_from_two_threads_at_once_all_succeed() -> None:
    # ExecuTorch's to_edge fails now and then when two threads convert one program at
    # once (its passes share the fake tensor mode of the program's values; plain
    # to_edge failed 9 of 16 calls here): the hand-offs take turns.
    import threading

    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    results: list[epass.executorch.EdgeResult] = []
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            results.append(epass.executorch.to_edge(ep, pipeline=presets.lower()))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    for _ in range(10):
        threads = [threading.Thread(target=convert) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == [] and len(results) == 20
    assert fingerprint(ep) == before
    pte = results[-1].to_executorch().buffer
    torch.testing.assert_close(_run_pte(pte, args)[0], module(*args))

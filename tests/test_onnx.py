"""The ONNX hand-off: the exporter's program shares the user's state; ORT matches eager."""

from __future__ import annotations

import hf_models
import models
import pytest
import torch
from fingerprint import fingerprint

import epass
import epass.onnx
from epass import Decompose, FxPass
from epass._handoff import _deferrable, start
from epass.errors import EpassError, PassError, StateMutationError
from epass.manager import as_pipeline
from epass.passes import CSE, ReplaceOps, presets

aten = torch.ops.aten

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")


def _quiet() -> dict[str, object]:
    return {"verbose": False}


def _assert_shares(exported: torch.export.ExportedProgram, ep: torch.export.ExportedProgram):
    assert exported.state_dict is ep.state_dict
    assert exported.constants is ep.constants
    for key, value in exported.state_dict.items():
        assert value is ep.state_dict[key], key


def test_torch_onnx_export_alone_gives_a_new_state_dict():
    # The problem this module solves (pytorch#114628): without relinking, the
    # exporter's program holds a dict of its own.
    _, ep, args = models.export("seed")
    onnx_program = torch.onnx.export(ep, args, dynamo=True, verbose=False)
    assert onnx_program.exported_program.state_dict is not ep.state_dict


def test_onnx_export_relinks_state_to_the_users_dicts():
    _, ep, args = models.export("seed")
    before = fingerprint(ep)
    onnx_program = epass.onnx.export(ep, args, **_quiet())
    _assert_shares(onnx_program.exported_program, ep)
    assert fingerprint(ep) == before


def test_onnx_export_with_pipeline_keeps_identity_and_input():
    _, ep, args = models.export("mixed")
    before = fingerprint(ep)
    onnx_program = epass.onnx.export(ep, args, pipeline=[Decompose()], **_quiet())
    _assert_shares(onnx_program.exported_program, ep)
    assert fingerprint(ep) == before
    torch.testing.assert_close(onnx_program(*args)[0], models.build("mixed")(*args))


def test_onnx_export_from_module_shares_the_modules_tensors():
    module = models.build("mlp")
    args = models.CASES["mlp"].inputs()
    onnx_program = epass.onnx.export(module, args, pipeline=epass.PassManager([]), **_quiet())
    sd = onnx_program.exported_program.state_dict
    for key, value in module.state_dict(keep_vars=True).items():
        assert sd[key] is value, key
    torch.testing.assert_close(onnx_program(*args)[0], module(*args), rtol=1e-5, atol=1e-6)


def test_onnx_export_seed_with_in_place_buffer_update():
    _, ep, args = models.export("seed")
    onnx_program = epass.onnx.export(ep, args, pipeline=[Decompose()], **_quiet())
    assert torch.equal(ep.state_dict["count"], torch.zeros(4))  # export ran nothing
    eager = models.fresh_eager("seed")
    want = eager(*args)
    torch.testing.assert_close(onnx_program(*args)[0], want)
    # The exporter's program updates the user's buffer, because it is the user's tensor.
    exported = onnx_program.exported_program
    torch.testing.assert_close(exported.module()(*args), want)
    assert ep.state_dict["count"] is exported.state_dict["count"]
    torch.testing.assert_close(ep.state_dict["count"], eager.count)


def test_onnx_export_rejects_the_torchscript_exporter():
    _, ep, args = models.export("seed")
    with pytest.raises(ValueError, match="dynamo"):
        epass.onnx.export(ep, args, dynamo=False)


def _targets(program: torch.export.ExportedProgram) -> set[object]:
    return {n.target for n in program.graph.nodes if n.op == "call_function"}


def test_a_handoffs_decompose_lowers_to_the_exporters_own_table():
    # The exporter translates aten.linear whole; a core-ATen pipeline would hand it
    # permute + addmm, and a larger ONNX graph. The pipeline runs at the exporter's
    # decomposition, its Decompose taking the exporter's table.
    _, ep, args = models.export("mlp")
    before = fingerprint(ep)
    with epass.fast_decompositions() as log:
        onnx_program = epass.onnx.export(ep, args, pipeline=presets.lower(), **_quiet())
    plain = torch.onnx.export(ep, args, dynamo=True, verbose=False)
    exported = onnx_program.exported_program
    assert aten.linear.default in _targets(exported)
    assert _targets(exported) == _targets(plain.exported_program)
    assert len(onnx_program.model.graph) == len(plain.model.graph)
    (entry,) = log.served
    assert (entry.how, entry.pipeline, entry.reason) == ("incremental", "lower", None)
    assert "(1x made by the pipeline 'lower')" in log.summary()
    assert entry.table != "default"
    _assert_shares(exported, ep)
    assert fingerprint(ep) == before
    torch.testing.assert_close(onnx_program(*args)[0], plain(*args)[0], rtol=0, atol=0)


def test_a_handoff_lowers_to_core_aten_where_told_to():
    # Opted out, or a Decompose given its table: the pipeline runs before the
    # exporter, as it is.
    _, ep, args = models.export("mlp")
    for pipeline, serve in (
        (presets.lower(), False),
        ([Decompose(table=torch.export.default_decompositions())], True),
        ([Decompose(keep=[aten.relu.default])], True),
    ):
        onnx_program = epass.onnx.export(
            ep, args, pipeline=pipeline, serve_decompositions=serve, **_quiet()
        )
        targets = _targets(onnx_program.exported_program)
        assert aten.linear.default not in targets and aten.addmm.default in targets
        _assert_shares(onnx_program.exported_program, ep)


def test_a_pass_failing_at_the_exporters_decomposition_is_named_and_loses_nothing():
    _, ep, args = models.export("mlp")
    before = fingerprint(ep)
    keys = (list(ep.state_dict), list(ep.constants))

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    pipeline = [FxPass(explode, name="explode"), Decompose()]  # run at the exporter's call
    with pytest.raises(PassError, match="explode") as caught:
        epass.onnx.export(ep, args, pipeline=pipeline, **_quiet())
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert fingerprint(ep) == before
    assert (list(ep.state_dict), list(ep.constants)) == keys


def test_a_deferred_pipeline_the_consumer_never_reached_is_an_error():
    _, ep, _ = models.export("mlp")
    hand_off = start({"forward": ep}, presets.lower(), "consumer", at_decomposition=True)
    assert hand_off.pipelines == {}
    with pytest.raises(EpassError, match="returned without decomposing forward"):
        hand_off.call(lambda program: program, hand_off.private["forward"])
    # a consumer that decomposes it gets the pipeline's program, with its table
    hand_off = start({"forward": ep}, presets.lower(), "consumer", at_decomposition=True)
    table: dict[object, object] = {}  # decomposes nothing, so linear stays
    out = hand_off.call(
        lambda program: program.run_decompositions(table), hand_off.private["forward"]
    )
    assert aten.linear.default in _targets(out)
    assert hand_off.pipelines["forward"].program.graph_module.code == out.graph_module.code


def test_a_deferred_pipelines_failure_a_consumer_swallowed_is_raised():
    _, ep, _ = models.export("mlp")

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    def forgiving(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        try:
            return program.run_decompositions({})
        except PassError:
            return program  # a consumer going on without the pipeline's program

    pipeline = [FxPass(explode, name="explode"), Decompose()]  # run at the exporter's call
    hand_off = start({"forward": ep}, pipeline, "consumer", at_decomposition=True)
    with pytest.raises(PassError, match="explode"):
        hand_off.call(forgiving, hand_off.private["forward"])


def _scribble(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    with torch.no_grad():
        next(iter(ep.state_dict.values())).mul_(1.0)  # a write that leaves the bytes
    return ep


def _twice_addmm(bias, x, weight):
    return aten.addmm.default(bias, x, weight) * 2


def test_a_pipeline_runs_at_the_exporters_decomposition_only_where_nothing_reads_core_aten():
    scaled = ReplaceOps({aten.addmm.default: _twice_addmm})
    deferrable = {
        "lower": presets.lower(),
        "decompose": [Decompose()],
        "a pass before": [_scribble, Decompose(), CSE()],
        "nested": [epass.PassManager([Decompose()]), CSE()],
        "repeated cleanup": epass.PassManager([Decompose(), CSE()], steps=2),
    }
    as_written = {
        "matches addmm after": [Decompose(), scaled],
        "a function after": [Decompose(), _scribble],
        "after a nested lower": [presets.lower(), scaled],
        "repeated with a pass": epass.PassManager([_scribble, Decompose()], steps=2),
        "a table given": [Decompose(table=torch.export.default_decompositions())],
        "no decompose": [CSE()],
    }
    for name, pipeline in (*deferrable.items(), *as_written.items()):
        manager = as_pipeline(pipeline)
        assert manager is not None
        assert _deferrable(manager) == (name in deferrable), name
    # what it means: a pass matching core ATen after Decompose still finds it
    module, ep, args = models.export("mlp")
    served = epass.onnx.export(ep, args, pipeline=[Decompose(), scaled], **_quiet())
    written = epass.onnx.export(
        ep, args, pipeline=[Decompose(), scaled], serve_decompositions=False, **_quiet()
    )
    assert aten.addmm.default in _targets(served.exported_program)
    assert not torch.allclose(served(*args)[0], module(*args))  # the replacement ran
    torch.testing.assert_close(served(*args)[0], written(*args)[0], rtol=0, atol=0)


def test_a_pass_writing_state_at_the_exporters_decomposition_is_the_one_named():
    _, ep, args = models.export("mlp")
    with pytest.raises(StateMutationError, match="_scribble") as caught:
        epass.onnx.export(ep, args, pipeline=[_scribble, Decompose()], **_quiet())
    assert "torch.onnx.export" not in str(caught.value)


def _writes_through_data(ep):
    # .data writes bump no version counter: the manager's default check misses them,
    # the hand-off's fingerprint of the span the pipeline shares with the exporter not
    ep.state_dict[next(iter(ep.state_dict))].data.mul_(2)
    return ep


def test_a_write_in_the_span_the_pipeline_shares_with_the_exporter_names_both():
    _, ep, args = models.export("mlp")
    with pytest.raises(StateMutationError, match="pipeline run in it") as caught:
        epass.onnx.export(ep, args, pipeline=[_writes_through_data, Decompose()], **_quiet())
    assert str(caught.value).startswith("torch.onnx.export, or the pipeline run in it,")


def _first_input_dims(onnx_program) -> list[object]:
    return [str(d) for d in onnx_program.model.graph.inputs[0].shape]


def test_an_axis_named_by_a_string_is_dynamic_and_named_as_torch_names_it():
    module, ep, args = models.export("mlp", dynamic=True)
    shapes = ({0: "batch"},)
    from_module = epass.onnx.export(module, args, dynamic_shapes=shapes, **_quiet())
    from_program = epass.onnx.export(ep, args, dynamic_shapes=shapes, **_quiet())
    plain = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=shapes, verbose=False)
    assert _first_input_dims(from_module) == _first_input_dims(plain)
    assert _first_input_dims(from_program) == _first_input_dims(plain)
    assert _first_input_dims(plain)[0] == "batch"
    other = (torch.randn(5, *args[0].shape[1:]),)
    torch.testing.assert_close(from_module(*other)[0], module(*other), rtol=1e-5, atol=1e-6)


def test_dynamic_axes_for_a_module_is_refused_not_made_static():
    module = models.build("mlp")
    args = models.CASES["mlp"].inputs()
    with pytest.raises(ValueError, match="dynamic_axes"):
        epass.onnx.export(module, args, input_names=["x"], dynamic_axes={"x": {0: "b"}}, **_quiet())


class _Promoting(torch.nn.Module):
    # The exporter inserts a type promotion into the graph it decomposed, in place.
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("idx", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.idx


def test_a_program_an_instrument_kept_from_the_deferred_pipeline_is_not_edited():
    args = (torch.randn(2, 4),)
    ep = torch.export.export(_Promoting(), args)
    kept: list[tuple[torch.export.ExportedProgram, str]] = []

    class Keep:
        def after_pipeline(self, manager, result, parent=None):
            kept.append((result.program, result.program.graph_module.code))

    with epass.fast_decompositions() as log:
        onnx_program = epass.onnx.export(
            ep, args, pipeline=presets.lower(instruments=[Keep()]), **_quiet()
        )
    assert [e.pipeline for e in log.served] == ["lower"]  # it ran at the exporter's call
    assert "convert_element_type" in onnx_program.exported_program.graph_module.code
    assert kept and all(p.graph_module.code == code for p, code in kept)


ONNX_ZOO = ["bert", "gpt2", "llama", "resnet", "cond", "running_mean"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ONNX_ZOO)
def test_onnx_zoo_onnxruntime_matches_eager(name: str):
    if hf_models.ZOO[name].transformers:
        pytest.importorskip("transformers")
    _, ep, args = hf_models.export(name, dynamic=True)
    before = fingerprint(ep)
    onnx_program = epass.onnx.export(ep, args, pipeline=[Decompose()], **_quiet())
    assert fingerprint(ep) == before
    _assert_shares(onnx_program.exported_program, ep)
    inputs = hf_models.other_inputs(name)
    want = hf_models.build(name)(*inputs)
    torch.testing.assert_close(onnx_program(*inputs)[0], want, rtol=1e-4, atol=1e-4)

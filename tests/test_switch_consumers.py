"""Consumers under ``epass.fast_decompositions()``: their own ``run_decompositions``
calls are served by epass, and what they make is what they make without it."""

from __future__ import annotations

from pathlib import Path

import models
import pytest
import torch
from fingerprint import fingerprint

import epass
from epass import _switch
from epass._decomp.check import first_difference
from epass.passes import Decompose, presets


def _keys(ep: torch.export.ExportedProgram) -> tuple[set[str], set[str], list[int]]:
    values = [*ep.state_dict.values(), *ep.constants.values()]
    return set(ep.state_dict), set(ep.constants), [id(v) for v in values]


def _count_serves(monkeypatch) -> list[object]:
    calls: list[object] = []
    serve = _switch._serve

    def spy(*args, **kwargs):
        calls.append(args[2])
        return serve(*args, **kwargs)

    monkeypatch.setattr(_switch, "_serve", spy)
    return calls


# --- ONNX --------------------------------------------------------------------------------


def _onnx_outputs(onnx_program, args) -> list[torch.Tensor]:
    return [torch.as_tensor(o) for o in onnx_program(*args)]


@pytest.mark.parametrize("name", ["mixed", pytest.param("transformer", marks=pytest.mark.slow)])
def test_torch_onnx_export_under_the_switch_matches_the_plain_export(name):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    _, ep, args = models.export(name)
    before, keys = fingerprint(ep), _keys(ep)
    plain = torch.onnx.export(ep, args, dynamo=True, verbose=False)
    with epass.fast_decompositions(check=True) as log:
        served = torch.onnx.export(ep, args, dynamo=True, verbose=False)
    assert log.counts["torch"] == 0 and len(log.served) == 1, log.summary()
    assert first_difference(served.exported_program, plain.exported_program) is None
    for ours, theirs in zip(_onnx_outputs(served, args), _onnx_outputs(plain, args), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert fingerprint(ep) == before and _keys(ep) == keys


def test_onnx_hand_off_serves_by_default_and_opts_out(monkeypatch):
    pytest.importorskip("onnxscript")
    calls = _count_serves(monkeypatch)
    _, ep, args = models.export("mlp")
    with epass.fast_decompositions() as log:
        epass.onnx.export(ep, args, verbose=False)
    assert log.counts["incremental"] == 1 and len(calls) == 1
    epass.onnx.export(ep, args, verbose=False, serve_decompositions=False)
    assert len(calls) == 1 and not _switch.installed()
    # the opt-out holds inside a block too: the caller chose for this export
    with epass.fast_decompositions() as log:
        epass.onnx.export(ep, args, verbose=False, serve_decompositions=False)
    assert len(calls) == 1 and not log.served


# --- ExecuTorch ----------------------------------------------------------------------------


def _run_pte(buffer: bytes, args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer)
    return list(program.load_method("forward").execute(list(args)))


def test_to_edge_under_the_switch_matches_the_plain_to_edge():
    exir = pytest.importorskip("executorch.exir")
    _, ep, args = models.export("mixed")
    before, keys = fingerprint(ep), _keys(ep)
    plain = exir.to_edge(ep)
    with epass.fast_decompositions(check=True) as log:
        served = exir.to_edge(ep)
    assert log.counts["torch"] == 0 and len(log.served) >= 1, log.summary()
    assert first_difference(served.exported_program(), plain.exported_program()) is None
    assert fingerprint(ep) == before and _keys(ep) == keys  # it lifted scalars elsewhere
    ours = _run_pte(served.to_executorch().buffer, args)
    theirs = _run_pte(plain.to_executorch().buffer, args)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert fingerprint(ep) == before and _keys(ep) == keys


def test_executorch_hand_off_says_what_it_served():
    pytest.importorskip("executorch.exir")
    _, ep, _ = models.export("mlp")
    result = epass.executorch.to_edge(ep)
    assert result.served is not None and result.served.counts["incremental"] == 1
    assert result.exported_program().state_dict is ep.state_dict
    lowered = epass.executorch.to_edge(ep, pipeline=presets.lower())
    assert lowered.served is not None and lowered.served.counts["incremental"] == 1
    assert [e.pipeline for e in lowered.served.served] == ["lower"]  # run at to_edge's call
    table = torch.export.default_decompositions()
    before = epass.executorch.to_edge(ep, pipeline=[Decompose(table=table)])  # run as written
    assert before.served is not None and before.served.counts["no-op"] == 1
    plain = epass.executorch.to_edge(ep, serve_decompositions=False)
    assert plain.served is None
    assert first_difference(result.exported_program(), plain.exported_program()) is None


def test_a_served_result_inside_a_hand_off_holds_its_private_dicts(monkeypatch):
    pytest.importorskip("executorch.exir")
    seen = []
    calls = _count_serves(monkeypatch)
    real = _switch._held

    def held(out, ep, scope):
        out = real(out, ep, scope)
        seen.append((out.state_dict is ep.state_dict, out.constants is ep.constants))
        return out

    monkeypatch.setattr(_switch, "_held", held)
    _, ep, _ = models.export("mixed")
    result = epass.executorch.to_edge(ep)
    assert len(calls) == 1 and calls[0] is not ep  # the hand-off's private program
    assert seen == [(True, True)]
    assert set(ep.constants) == set(result.programs["forward"].constants)


@pytest.mark.slow
def test_to_edge_transform_and_lower_hand_off_is_served():
    pytest.importorskip("executorch.exir")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    _, ep, _ = models.export("mlp")
    result = epass.executorch.to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    assert result.served is not None and result.served.counts["torch"] == 0
    assert len(result.served.served) >= 1


# --- TVM -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tvm_hand_off_serves_its_decomposition():
    pytest.importorskip("tvm")
    _, ep, _ = models.export("mlp")
    result = epass.tvm.from_exported_program(ep, run_ep_decomposition=True)
    assert result.served is not None and result.served.counts["incremental"] == 1


# --- OpenVINO (no hand-off: the switch alone) ------------------------------------------------


@pytest.mark.parametrize("loaded", [False, True], ids=["exported", "loaded"])
def test_openvino_convert_model_under_the_switch_matches_the_plain_one(
    loaded: bool, tmp_path: Path
) -> None:
    """OpenVINO reads the input types of a program's nodes from their ``tensor_meta``,
    which a program loaded from a file does not hold: the served program has it, as
    torch's retrace gives it."""
    ov = pytest.importorskip("openvino")
    _, ep, args = models.export("mixed")
    if loaded:
        torch.export.save(ep, tmp_path / "mixed.pt2")
        ep = torch.export.load(tmp_path / "mixed.pt2")
    before, keys = fingerprint(ep), _keys(ep)
    inputs = [a.numpy() for a in args]
    plain = ov.Core().compile_model(ov.convert_model(ep), "CPU")(inputs)[0]
    with epass.fast_decompositions(check=True) as log:
        model = ov.convert_model(ep)
    assert log.counts["torch"] == 0 and len(log.served) == 1, log.summary()
    served = ov.Core().compile_model(model, "CPU")(inputs)[0]
    torch.testing.assert_close(torch.as_tensor(served), torch.as_tensor(plain), atol=1e-5, rtol=0)
    assert fingerprint(ep) == before and _keys(ep) == keys

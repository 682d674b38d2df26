"""The Decompose pass: its methods and notes, the no-op skip, coalescing, explained
failures (the engine it drives is tested in tests/decomp/)."""

from __future__ import annotations

import collections

import models
import pytest
import torch
from fingerprint import fingerprint
from torch import nn

from epass import Decompose, PassError, PassManager
from epass.errors import EpassError, IncrementalDecompositionError
from epass.passes.decompose import DecompositionError

aten = torch.ops.aten


def _ops(ep: torch.export.ExportedProgram) -> collections.Counter[str]:
    return collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


def _mul_by_reciprocal(a, b):
    return aten.div.Tensor(a, aten.reciprocal.default(b))


def _relu_by_mask(x):
    return aten.mul.Tensor(x, aten.gt.Scalar(x, 0))


class Relu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + 1


def test_decompose_skips_program_already_in_aten_without_retrace(monkeypatch):
    _, ep, _ = models.export("mlp")
    aten_ep = ep.run_decompositions()
    calls = []
    monkeypatch.setattr(
        torch.export.ExportedProgram,
        "run_decompositions",
        lambda self, *a, **k: calls.append(1),
    )
    result = PassManager([Decompose()])(aten_ep)
    (record,) = result.records
    assert record.skipped
    assert record.skip_reason is not None and "already ATen" in record.skip_reason
    assert result.program is aten_ep
    assert calls == []


def test_decompose_does_not_skip_training_dialect():
    _, ep, _ = models.export("mlp")
    assert Decompose().skip_reason(ep) is None
    (record,) = PassManager([Decompose()])(ep).records
    assert not record.skipped and record.modified


def test_decompose_does_not_skip_when_a_kept_op_is_now_in_the_table():
    _, ep, _ = models.export("mlp")
    kept = PassManager([Decompose(keep=[aten.linear.default])]).run(ep)
    assert "aten.linear.default" in _ops(kept)
    assert Decompose(keep=[aten.linear.default]).skip_reason(kept) is not None
    assert Decompose().skip_reason(kept) is None
    out = PassManager([Decompose()]).run(kept)
    assert "aten.linear.default" not in _ops(out)


def test_decompose_with_explicit_table_skips_only_without_its_ops():
    ep = torch.export.export(Relu(), (torch.randn(3),)).run_decompositions()
    assert Decompose(table={}).skip_reason(ep) is not None
    assert Decompose(table={aten.relu.default: _relu_by_mask}).skip_reason(ep) is None


def test_manager_merges_identical_adjacent_decomposes():
    pm = PassManager([Decompose(), Decompose(), Decompose()])
    assert len(pm.passes) == 1


def test_manager_merges_nested_default_tables_into_the_larger_one():
    keep_linear = Decompose(keep=[aten.linear.default])
    full = Decompose()
    assert PassManager([keep_linear, full]).passes == [full]
    assert PassManager([full, keep_linear]).passes == [full]
    keep_two = Decompose(keep=[aten.linear.default, aten.layer_norm.default])
    keep_other = Decompose(keep=[aten.gelu.default])
    assert len(PassManager([keep_two, keep_other]).passes) == 2


def test_merged_decompose_equals_running_both_in_turn():
    _, ep, args = models.export("transformer")
    first = Decompose(keep=[aten.linear.default, aten.layer_norm.default])
    second = Decompose()
    merged = PassManager([first, second])
    assert len(merged.passes) == 1
    # Nested managers are not merged with each other: this runs two retraces.
    in_turn = PassManager([PassManager([first]), PassManager([second])])
    a, b = merged.run(ep), in_turn.run(ep)
    assert _ops(a) == _ops(b)
    torch.testing.assert_close(a.module()(*args), b.module()(*args))


def test_non_nested_tables_are_not_merged_because_the_result_differs():
    ep = torch.export.export(Relu(), (torch.randn(3),))
    t_mul = Decompose(table={aten.mul.Tensor: _mul_by_reciprocal})
    t_relu = Decompose(table={aten.relu.default: _relu_by_mask})
    pm = PassManager([t_mul, t_relu])
    assert len(pm.passes) == 2
    in_turn = pm.run(ep)
    assert "aten.mul.Tensor" in _ops(in_turn)  # relu's mask product appears after t_mul ran
    opted = PassManager(
        [
            Decompose(table={aten.mul.Tensor: _mul_by_reciprocal}, coalesce=True),
            Decompose(table={aten.relu.default: _relu_by_mask}, coalesce=True),
        ]
    )
    assert len(opted.passes) == 1
    union = opted.run(ep)
    assert "aten.mul.Tensor" not in _ops(union)
    assert "aten.reciprocal.default" in _ops(union)


def test_opt_in_needs_both_passes():
    one = Decompose(table={aten.mul.Tensor: _mul_by_reciprocal}, coalesce=True)
    other = Decompose(table={aten.relu.default: _relu_by_mask})
    assert len(PassManager([one, other]).passes) == 2


def test_default_next_to_explicit_table_is_not_merged():
    assert len(PassManager([Decompose(table={}), Decompose()]).passes) == 2


def test_decompose_failure_names_node_and_op():
    def boom(x):
        raise ValueError("boom")

    ep = torch.export.export(Relu(), (torch.randn(3),))
    before = fingerprint(ep)
    with pytest.raises(PassError) as info:
        PassManager([Decompose(table={aten.relu.default: boom})]).run(ep)
    cause = info.value.__cause__
    assert isinstance(cause, DecompositionError)
    assert cause.node == "relu" and cause.op == "aten.relu.default"
    assert cause.suggestion is None
    assert "at node 'relu' (aten.relu.default)" in str(info.value)
    assert fingerprint(ep) == before


def test_incremental_is_the_default_and_is_recorded():
    _, ep, _ = models.export("mlp")
    result = PassManager([Decompose()])(ep)
    (record,) = result.records
    assert record.notes["method"] == "incremental"
    assert record.notes["fallback"] is None
    assert record.notes["rewritten"] == 3
    assert record.as_dict()["notes"]["method"] == "incremental"


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


def test_only_a_retrace_the_incremental_path_could_not_avoid_is_a_fallback():
    from epass import Notice
    from epass.passes.decompose import DecomposeResult

    _, ep, _ = models.export("seed")  # writes into a buffer: the incremental path refuses it
    fell_back = Decompose()(ep)
    assert fell_back.fallback == "a write into input b_count (aten.add_.Tensor at add_)"
    assert fell_back.notices == (Notice("fallback", f"retraced: {fell_back.fallback}"),)
    assert Decompose(method="retrace")(ep).notices == ()  # asked for
    # Auto's choice of the cheaper path repeats its decision as the fallback: no notice.
    why = "retrace: 40 templates to trace against a retrace of 90 nodes"
    chosen = DecomposeResult(ep, True, method="retrace", fallback=why, decision=why)
    assert chosen.notices == ()
    kept = DecomposeResult(ep, True, method="incremental", cache="kept nowhere: f")
    assert kept.notices == (Notice("cache", "kept nowhere: f"),)


def test_templates_kept_nowhere_are_a_notice_of_the_pass_record():
    def my_silu(x):
        return aten.mul.Tensor(x, aten.sigmoid.default(x))

    ep = torch.export.export(nn.SiLU(), (torch.randn(2, 3),))
    (record,) = PassManager([Decompose(table={aten.silu.default: my_silu})])(ep).records
    (notice,) = record.notices
    assert notice.kind == "cache" and notice.text == record.notes["cache"]
    assert "my_silu (aten.silu.default) declares no cache identity" in notice.text
    assert not record.fell_back


def test_incremental_method_raises_naming_the_reason():
    _, ep, _ = models.export("seed")
    with pytest.raises(IncrementalDecompositionError, match="add_"):
        Decompose(method="incremental")(ep)
    assert issubclass(IncrementalDecompositionError, EpassError)


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="method"):
        Decompose(method="fast")  # type: ignore[arg-type]


def test_merge_carries_method_and_check():
    assert Decompose(method="retrace").merge(Decompose()).method == "retrace"
    assert Decompose().merge(Decompose(method="incremental")).method == "incremental"
    assert Decompose(method="retrace").merge(Decompose(method="incremental")) is None
    assert Decompose(check=True).merge(Decompose()).check is True
    plain = Decompose()
    assert plain.merge(Decompose()) is plain

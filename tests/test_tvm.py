"""The Apache TVM hand-off: Relax imports of epass's outputs match eager; TVM's own
second decomposition is skipped where the pipeline decomposed; the user's program and
dicts stay as they were."""

from __future__ import annotations

from typing import Any

import consumer_models as cm
import pytest
import torch
import upstream
from torch.export import ExportedProgram

import epass
from epass import FxPass

tvm = pytest.importorskip("tvm", reason="apache-tvm is not installed")
import epass.tvm  # noqa: E402

TVM_CUMSUM_BOOL = (
    "TVM 0.27: from_exported_program imports cumsum of a bool tensor (transformers' "
    "causal-mask code) with dtype bool instead of torch's int64, and LLVM codegen fails "
    "(Check failed: t.MatchesCode(kDLFloat)); the raw program fails the same way. "
    "Workaround: give the cumsum dtype=int64 (test_tvm_llama_with_cumsum_dtype_workaround)"
)


def _cells() -> list[Any]:
    cells = []
    for model in cm.MODELS:
        for pipeline in cm.PIPELINES:
            marks: list[Any] = []
            if model == "llama":
                marks = [
                    pytest.mark.slow,
                    upstream.upstream_bug(TVM_CUMSUM_BOOL, *upstream.TVM_CUMSUM_BOOL),
                ]
            cells.append(pytest.param(model, pipeline, marks=marks, id=f"{model}-{pipeline}"))
    return cells


@pytest.mark.parametrize(("model", "pipeline"), _cells())
def test_tvm_matches_eager_and_leaves_the_user_alone(model: str, pipeline: str) -> None:
    s = cm.subject(model)
    result = epass.tvm.from_exported_program(s.ep, pipeline=cm.PIPELINES[pipeline]())
    # TVM decomposes again only what is not decomposed yet.
    assert result.tvm_decomposed == (pipeline in ("raw", "cleanup"))
    if pipeline == "raw":
        assert result.program is s.ep and result.pipeline is None
    else:
        assert result.program.state_dict is s.ep.state_dict
    torch.testing.assert_close(cm.tvm_run(result.mod, s.args), s.expected, atol=1e-4, rtol=1e-4)
    if s.dynamic:
        other = s.other_args()
        with torch.no_grad():
            expected = s.module(*other)
        torch.testing.assert_close(cm.tvm_run(result.mod, other), expected, atol=1e-4, rtol=1e-4)
    s.check_untouched()


def test_tvm_folding_mlp_binds_only_what_the_program_references() -> None:
    # lower() folds state-only computations into new constants: the output owns a
    # constants dict of its own and the user's never gains them. TVM binds every
    # value of ``constants`` in order, so it must see the referenced ones only.
    s = cm.subject("folding")
    out = epass.PassManager([cm.PIPELINES["lower"]()]).run(s.ep)
    assert set(out.constants) - set(s.ep.constants)  # folding added constants
    result = epass.tvm.from_exported_program(out)
    torch.testing.assert_close(cm.tvm_run(result.mod, s.args), s.expected, atol=1e-4, rtol=1e-4)
    # the user's program, imported after a lower() ran on it
    raw = epass.tvm.from_exported_program(s.ep)
    torch.testing.assert_close(cm.tvm_run(raw.mod, s.args), s.expected, atol=1e-4, rtol=1e-4)
    s.check_untouched()


def test_tvm_second_decomposition_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    s = cm.subject("mlp_buffer")
    calls: list[int] = []
    original = ExportedProgram.run_decompositions

    def counting(self: ExportedProgram, *args: Any, **kwargs: Any) -> ExportedProgram:
        calls.append(1)
        return original(self, *args, **kwargs)

    lowered = epass.PassManager([cm.PIPELINES["lower"]()]).run(s.ep)
    monkeypatch.setattr(ExportedProgram, "run_decompositions", counting)
    result = epass.tvm.from_exported_program(lowered)
    assert not result.tvm_decomposed and calls == []
    assert result.served is not None and result.served.served == ()
    # the training IR: TVM decomposes it (torch's method, with the switch off)
    epass.tvm.from_exported_program(s.ep, serve_decompositions=False)
    assert calls == [1]
    forced = epass.tvm.from_exported_program(
        lowered, run_ep_decomposition=True, serve_decompositions=False
    )
    assert forced.tvm_decomposed and calls == [1, 1]
    # served by epass: TVM's call never reaches torch's method
    served = epass.tvm.from_exported_program(s.ep)
    assert served.tvm_decomposed and calls == [1, 1]
    assert served.served is not None and served.served.counts["incremental"] == 1


@pytest.mark.slow
def test_tvm_llama_with_cumsum_dtype_workaround() -> None:
    s = cm.subject("llama")
    pipeline = epass.PassManager([cm.PIPELINES["lower"](), FxPass(cm.cumsum_int64)])
    result = epass.tvm.from_exported_program(s.ep, pipeline=pipeline)
    assert not result.tvm_decomposed
    torch.testing.assert_close(cm.tvm_run(result.mod, s.args), s.expected, atol=1e-4, rtol=1e-4)
    s.check_untouched()

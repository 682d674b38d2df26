"""The backend matrix: epass pipelines' outputs go through real backends.

Models x pipelines x backends; each cell converts, runs where the backend runs
here and compares with eager, and checks that the user's program gained nothing
but store entries. Exports and pipeline outputs are shared between cells.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from typing import Any

import consumer_models
import hf_models
import models
import pytest
import torch
import upstream
from fingerprint import fingerprint

import epass
from epass.passes import Decompose, ReplaceOps, presets

pytestmark = pytest.mark.slow

aten = torch.ops.aten

MODELS = ["mlp", "convbn", "llama", "bert"]
PIPELINES: dict[str, Callable[[], epass.PassManager]] = {
    "decompose": lambda: epass.PassManager([Decompose()]),
    "lower": presets.lower,
    "cleanup": presets.cleanup,
}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if not _has(m)]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


class Subject:
    """One exported model: the eager module, the user's program, inputs, reference."""

    def __init__(self, name: str) -> None:
        zoo = models if name in models.CASES else hf_models
        self.module, self.ep, self.args = zoo.export(name)
        with torch.no_grad():
            self.expected = self.module(*self.args)
        self.pristine = fingerprint(self.ep)
        self.outputs: dict[str, torch.export.ExportedProgram] = {}

    def output(self, pipeline: str) -> torch.export.ExportedProgram:
        if pipeline not in self.outputs:
            self.outputs[pipeline] = PIPELINES[pipeline]().run(self.ep)
        return self.outputs[pipeline]

    def check_untouched(self) -> None:
        assert fingerprint(self.ep) == self.pristine, "the user's program changed"


@pytest.fixture(scope="module")
def subjects() -> dict[str, Subject]:
    return {}


def _subject(subjects: dict[str, Subject], name: str) -> Subject:
    if name not in subjects:
        subjects[name] = Subject(name)
    return subjects[name]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _run_pte(buffer: bytes, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(buffer)  # ``buffer`` stays alive meanwhile
    return program.load_method("forward").execute(list(args))[0]  # type: ignore[no-any-return]


def _assert_relinked(result: Any, ep: torch.export.ExportedProgram) -> None:
    """The edge program holds the user's tensor objects, and the user's state_dict
    itself unless ExecuTorch added entries (the scalars it lifts), which go into a
    state_dict of the edge program's own."""
    edge_program = result.exported_program()
    link = result.links["forward"]
    assert not link.changed, result.summary()
    for label in ("state_dict", "constants"):
        mine, user = getattr(edge_program, label), getattr(ep, label)
        assert all(mine[k] is v for k, v in user.items() if k in mine), label
    if not link.state_dict.added:
        assert edge_program.state_dict is ep.state_dict
    else:
        assert not set(link.state_dict.added) & set(ep.state_dict)


def executorch_portable(s: Subject, program: torch.export.ExportedProgram) -> None:
    import epass.executorch

    result = epass.executorch.to_edge(program)
    _assert_relinked(result, s.ep)
    _close(_run_pte(result.to_executorch().buffer, s.args), s.expected)


def executorch_xnnpack(s: Subject, program: torch.export.ExportedProgram) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    import epass.executorch

    result = epass.executorch.to_edge_transform_and_lower(
        program, partitioner=[XnnpackPartitioner()]
    )
    _assert_relinked(result, s.ep)
    _close(_run_pte(result.to_executorch().buffer, s.args), s.expected, tol=1e-3)


def openvino_f32(s: Subject, program: torch.export.ExportedProgram) -> None:
    import openvino as ov

    model = ov.convert_model(program, example_input=s.args)
    # OpenVINO runs in bf16 on CPUs with AMX unless asked for f32.
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    out = compiled([a.numpy() for a in s.args])[0]
    _close(torch.from_numpy(out), s.expected)


def onnx_runtime(s: Subject, program: torch.export.ExportedProgram) -> None:
    import epass.onnx

    onnx_program = epass.onnx.export(program, s.args, verbose=False)
    assert onnx_program.exported_program.state_dict is s.ep.state_dict
    _close(onnx_program(*s.args)[0], s.expected)


def coreml_convert(s: Subject, program: torch.export.ExportedProgram) -> None:
    import coremltools as ct

    # Core ML takes core ATen only, and has no converter for aten.alias.
    ready = epass.PassManager(
        [Decompose(), ReplaceOps({aten.alias.default: aten.clone.default})]
    ).run(program)
    # Conversion only: coremltools cannot load or run a model on Linux.
    mlmodel = ct.convert(ready, convert_to="mlprogram", skip_model_load=True)
    assert mlmodel.get_spec().WhichOneof("Type") == "mlProgram"


def tvm_relax(s: Subject, program: torch.export.ExportedProgram) -> None:
    import epass.tvm

    result = epass.tvm.from_exported_program(program)
    _close(consumer_models.tvm_run(result.mod, s.args), s.expected)


def iree_llvm_cpu(s: Subject, program: torch.export.ExportedProgram) -> None:
    import epass.iree

    output = epass.iree.export(program)
    _close(consumer_models.iree_run(output, s.args), s.expected)


def aot_inductor(s: Subject, program: torch.export.ExportedProgram) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=os.path.join(tmp, "model.pt2")
        )
        runner = torch._inductor.aoti_load_package(path)
        _close(runner(*s.args), s.expected)


BACKENDS: dict[str, tuple[Callable[[Subject, Any], None], tuple[str, ...]]] = {
    "executorch-portable": (executorch_portable, ("executorch",)),
    "executorch-xnnpack": (executorch_xnnpack, ("executorch",)),
    "openvino": (openvino_f32, ("openvino",)),
    "onnxruntime": (onnx_runtime, ("onnxscript", "onnxruntime")),
    "coreml": (coreml_convert, ("coremltools",)),
    "tvm": (tvm_relax, ("tvm",)),
    "iree": (iree_llvm_cpu, ("iree.turbine", "iree.runtime")),
    "aotinductor": (aot_inductor, ()),
}

# Cells that cannot pass because of a backend bug: (model, pipeline, backend) -> cause.
_BMM_LINEAR = (
    "executorch 1.5.1 XNNPACK ConvertToLinearPass: torch decomposes a linear on a "
    "non-contiguous 3-D input (attention's output projection) into expand + bmm, and "
    "the pass cannot rebuild it (RuntimeError: t() expects a tensor with <= 2 "
    "dimensions); torch's own run_decompositions() fails the same way. Workaround: "
    "Decompose(keep=[aten.linear.default]), see test_xnnpack_lowers_transformers_with_linear_kept"
)
_TVM_CUMSUM_BOOL = (
    "apache-tvm 0.27: from_exported_program imports cumsum of a bool tensor "
    "(transformers' causal-mask code) as bool instead of int64 and LLVM codegen fails "
    "(Check failed: t.MatchesCode(kDLFloat)); the raw program fails the same way "
    "(test_upstream_control[tvm-llama-raw]). Workaround: give the cumsum dtype=int64, "
    "see tests/test_tvm.py::test_tvm_llama_with_cumsum_dtype_workaround"
)
_IREE_BATCH_NORM = (
    "IREE 3.13: no lowering for aten._native_batch_norm_legit_no_training (decomposed "
    "eval BatchNorm); torch's own run_decompositions() output fails the same way "
    "(test_upstream_control[iree-convbn-retrace]). Workaround: FuseConvBN() first, see "
    "tests/test_iree.py::test_iree_conv_net_with_fuse_conv_bn_then_lower"
)
_IREE_DIFF = (
    "IREE 3.13: no lowering for aten.diff, which a transformers decoder's training IR "
    "keeps and iree-turbine does not decompose; the raw program fails the same way "
    "(test_upstream_control[iree-llama-raw]). Workaround: Decompose() or lower() first"
)
# Each with what the backend raises (tests/upstream.py): an xfail cell fails on
# any other error, an epass error included.
_BUGS = {
    _BMM_LINEAR: upstream.XNNPACK_BMM_LINEAR,
    _TVM_CUMSUM_BOOL: upstream.TVM_CUMSUM_BOOL,
    _IREE_BATCH_NORM: upstream.IREE_BATCH_NORM,
    _IREE_DIFF: upstream.IREE_DIFF,
}
UPSTREAM: dict[tuple[str, str, str], str] = {
    **{
        (model, pipeline, "executorch-xnnpack"): _BMM_LINEAR
        for model in ("llama", "bert")
        for pipeline in ("decompose", "lower")
    },
    **{("llama", pipeline, "tvm"): _TVM_CUMSUM_BOOL for pipeline in PIPELINES},
    **{("convbn", pipeline, "iree"): _IREE_BATCH_NORM for pipeline in ("decompose", "lower")},
    ("llama", "cleanup", "iree"): _IREE_DIFF,
}


def _upstream_bug(cause: str) -> Any:
    return upstream.upstream_bug(cause, *_BUGS[cause])


def _cells() -> list[Any]:
    cells = []
    for backend, (_, needs) in BACKENDS.items():
        for model in MODELS:
            for pipeline in PIPELINES:
                marks = [_needs(*needs)]
                cause = UPSTREAM.get((model, pipeline, backend))
                if cause:
                    marks.append(_upstream_bug(cause))
                cells.append(
                    pytest.param(
                        model, pipeline, backend, marks=marks, id=f"{backend}-{model}-{pipeline}"
                    )
                )
    return cells


@pytest.mark.parametrize(("model", "pipeline", "backend"), _cells())
def test_backend_matrix(
    subjects: dict[str, Subject], model: str, pipeline: str, backend: str
) -> None:
    s = _subject(subjects, model)
    program = s.output(pipeline)
    BACKENDS[backend][0](s, program)
    s.check_untouched()


# Each upstream cause above fails without epass too: on the user's raw program, or on
# torch's own run_decompositions() output.
CONTROLS = {
    "tvm-llama-raw": ("tvm", "llama", False, _TVM_CUMSUM_BOOL),
    "iree-convbn-retrace": ("iree", "convbn", True, _IREE_BATCH_NORM),
    "iree-llama-raw": ("iree", "llama", False, _IREE_DIFF),
}


@pytest.mark.parametrize(
    ("backend", "model", "retrace"),
    [
        pytest.param(
            backend,
            model,
            retrace,
            id=key,
            marks=[_needs(*BACKENDS[backend][1]), _upstream_bug(cause)],
        )
        for key, (backend, model, retrace, cause) in CONTROLS.items()
    ],
)
def test_upstream_control(
    subjects: dict[str, Subject], backend: str, model: str, retrace: bool
) -> None:
    s = _subject(subjects, model)
    program = s.ep.run_decompositions() if retrace else s.ep
    BACKENDS[backend][0](s, program)


@_needs("executorch")
@pytest.mark.parametrize("model", ["llama", "bert"])
def test_xnnpack_lowers_transformers_with_linear_kept(
    subjects: dict[str, Subject], model: str
) -> None:
    # The workaround docs/backends.md gives for the xfail cells above: keep
    # aten.linear whole, so XNNPACK takes it as it is.
    s = _subject(subjects, model)
    keep = epass.PassManager(
        [Decompose(keep=[aten.linear.default]), *presets.lower().passes[1:]]
    ).run(s.ep)
    assert any(n.target == aten.linear.default for n in keep.graph.nodes)
    executorch_xnnpack(s, keep)
    s.check_untouched()


# --- torchao PT2E: quantize first, then epass, then XNNPACK ---------------------


class Quantized:
    """A PT2E-quantized model (XNNPACK's symmetric config) and its program."""

    def __init__(self, name: str) -> None:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        module, ep, self.args = models.export(name)
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
        prepared = prepare_pt2e(ep.module(), quantizer)  # type: ignore[arg-type]
        prepared(*self.args)  # calibration
        self.reference = convert_pt2e(prepared)
        with torch.no_grad():
            self.expected = self.reference(*self.args)
            self.eager = module(*self.args)
        self.ep = torch.export.export(self.reference, self.args)
        self.pristine = fingerprint(self.ep)


@pytest.fixture(scope="module")
def quantized() -> dict[str, Quantized]:
    return {}


@_needs("torchao", "executorch")
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("model", ["mlp", "convbn"])
def test_pt2e_quantized_through_xnnpack(
    quantized: dict[str, Quantized], model: str, pipeline: str
) -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    import epass.executorch

    if model not in quantized:
        quantized[model] = Quantized(model)
    q = quantized[model]
    out = PIPELINES[pipeline]().run(q.ep)
    qdq = [n for n in out.graph.nodes if "quantize_per_tensor" in str(n.target)]
    assert qdq, "the pipeline dropped the q/dq nodes"
    torch.testing.assert_close(out.module()(*q.args), q.expected)  # numerics unchanged
    result = epass.executorch.to_edge_transform_and_lower(out, partitioner=[XnnpackPartitioner()])
    assert result.exported_program().state_dict is q.ep.state_dict
    actual = _run_pte(result.to_executorch().buffer, q.args)
    # XNNPACK's int8 kernels round differently from the reference's fp32 q/dq: one
    # quantization step of the output.
    torch.testing.assert_close(actual, q.expected, atol=5e-2, rtol=0)
    torch.testing.assert_close(actual, q.eager, atol=0.2, rtol=0)  # int8 vs fp32
    assert fingerprint(q.ep) == q.pristine


@_needs("torchao", "executorch")
def test_pt2e_quantize_after_lowering_quantizes_nothing() -> None:
    # Why docs/backends.md says to quantize first: the quantizer annotates the training
    # IR's linear and conv2d calls; a decomposed graph (epass's or torch's own) has
    # only addmm/convolution left, and the "quantized" model silently stays float.
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    _, ep, args = models.export("mlp")
    for lowered in (presets.lower().run(ep), ep.run_decompositions()):
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
        prepared = prepare_pt2e(lowered.module(), quantizer)  # type: ignore[arg-type]
        prepared(*args)
        converted = convert_pt2e(prepared)
        assert not [n for n in converted.graph.nodes if "quantize_per_tensor" in str(n.target)]

"""Each consumer's path from an ExportedProgram to a model ready to run, plain or
through epass's hand-off, for ``bench_handoff.py``: what the path made, how to run
it, and what epass recorded on the way.

Every function takes ``(ep, args, path, build)``: ``path`` is ``"plain"`` (the
consumer's own call) or ``"handoff"`` (epass's hand-off with
``pipeline=presets.lower()``); ``build=False`` stops after the converting call (the
template cache's fill).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["CONSUMERS", "Made", "explicit_cumsum_dtype"]


@dataclass
class Made:
    """What a path made: how to run it, and what epass recorded on the way."""

    run: Callable[[tuple[Any, ...]], Any]
    convert_s: float = 0.0  # the consumer's converting call (where it decomposes)
    log: Any = None  # the DecompositionLog of epass's paths
    pipeline_s: float | None = None  # the hand-off's presets.lower()


@contextlib.contextmanager
def _timed(made: dict[str, float]) -> Iterator[None]:
    began = time.perf_counter()
    yield
    made["convert"] = time.perf_counter() - began


def _lower() -> tuple[Any, Any]:
    import epass
    from epass.passes import presets

    timing = epass.Timing()
    return presets.lower(instruments=[timing]), timing


def onnx(ep: Any, args: tuple[Any, ...], path: str, build: bool) -> Made:
    import torch

    import epass.onnx

    seconds: dict[str, float] = {}
    log = timing = None
    with _timed(seconds):
        if path == "handoff":
            pipeline, timing = _lower()
            with epass.fast_decompositions() as log:  # records what the hand-off served
                program = epass.onnx.export(ep, args, pipeline=pipeline, verbose=False)
        else:
            program = torch.onnx.export(ep, args, dynamo=True, verbose=False)
    if build:
        program.initialize_inference_session()
    return Made(
        lambda x: program(*x)[0], seconds["convert"], log, timing and timing.pipeline_seconds
    )


def executorch(ep: Any, args: tuple[Any, ...], path: str, build: bool) -> Made:
    from executorch.exir import to_edge

    import epass.executorch

    seconds: dict[str, float] = {}
    log = timing = None
    with _timed(seconds):
        if path == "handoff":
            pipeline, timing = _lower()
            result = epass.executorch.to_edge(ep, pipeline=pipeline)
            edge, log = result.edge, result.served
        else:
            edge = to_edge(ep)
    buffer = edge.to_executorch().buffer if build else b""

    def run(x: tuple[Any, ...]) -> Any:
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(buffer)
        return program.load_method("forward").execute(list(x))[0]

    return Made(run, seconds["convert"], log, timing and timing.pipeline_seconds)


def tvm(ep: Any, args: tuple[Any, ...], path: str, build: bool) -> Made:
    import tvm as tvm_
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    import epass.tvm

    seconds: dict[str, float] = {}
    log = timing = None
    with _timed(seconds):
        if path == "handoff":
            pipeline, timing = _lower()
            result = epass.tvm.from_exported_program(ep, pipeline=pipeline)
            mod, log = result.mod, result.served
        else:
            mod = from_exported_program(ep)
    executable = tvm_.compile(mod, target="llvm") if build else None

    def run(x: tuple[Any, ...]) -> Any:
        import torch

        vm = relax.VirtualMachine(executable, tvm_.cpu())
        out = vm["main"](*[tvm_.runtime.tensor(a.numpy()) for a in x])
        return torch.from_numpy(out[0].numpy())

    return Made(run, seconds["convert"], log, timing and timing.pipeline_seconds)


def explicit_cumsum_dtype(ep: Any) -> None:
    """TVM 0.27 keeps ``cumsum`` of a bool tensor as bool, and its LLVM codegen then
    fails; transformers' causal mask has one. Its result dtype (int64, as torch's)
    is made explicit on the program itself, before every TVM path alike (as
    ``tests/consumer_models.cumsum_int64`` does for the tests)."""
    import torch

    gm = ep.graph_module
    for node in gm.graph.nodes:
        if (
            node.target is torch.ops.aten.cumsum.default
            and node.args[0].meta["val"].dtype == torch.bool
            and node.kwargs.get("dtype") is None
        ):
            node.kwargs = {**node.kwargs, "dtype": torch.int64}
    gm.recompile()


def openvino(ep: Any, args: tuple[Any, ...], path: str, build: bool) -> Made:
    import openvino as ov
    import torch

    seconds: dict[str, float] = {}
    with _timed(seconds):
        model = ov.convert_model(ep)
    # OpenVINO runs in bf16 on CPUs with AMX unless asked for f32.
    compiled = (
        ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        if build
        else None
    )
    return Made(lambda x: torch.from_numpy(compiled([a.numpy() for a in x])[0]), seconds["convert"])


CONSUMERS: dict[str, Callable[[Any, tuple[Any, ...], str, bool], Made]] = {
    "onnx": onnx,
    "executorch": executorch,
    "tvm": tvm,
    "openvino": openvino,
}

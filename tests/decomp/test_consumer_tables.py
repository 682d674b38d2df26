"""Each consumer's own decomposition table, caught where its own call hands it to
``run_decompositions``: check mode gives torch's program node for node on a small
GPT-2, Llama and CNN, and the table's templates are kept under a name."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_models
import pytest
import torch
from decomp_helpers import assert_same_as_torch, run_script
from torch.export import ExportedProgram

from epass._decomp import identity
from epass._decomp.table import split_table


def _onnx(ep: ExportedProgram, args: tuple[Any, ...]) -> None:
    pytest.importorskip("onnxscript")
    torch.onnx.export(ep, args, dynamo=True, verbose=False)


def _edge(ep: ExportedProgram, args: tuple[Any, ...]) -> None:
    exir = pytest.importorskip("executorch.exir")
    exir.to_edge(ep)


def _edge_preserving(ep: ExportedProgram, args: tuple[Any, ...]) -> None:
    exir = pytest.importorskip("executorch.exir")
    aten = torch.ops.aten
    preserved = [aten.linear.default, aten.gelu.default, aten.layer_norm.default]
    exir.to_edge(ep, compile_config=exir.EdgeCompileConfig(preserve_ops=preserved))


def _openvino(ep: ExportedProgram, args: tuple[Any, ...]) -> None:
    ov = pytest.importorskip("openvino")
    ov.convert_model(ep)


def _tvm(ep: ExportedProgram, args: tuple[Any, ...]) -> None:
    pytest.importorskip("tvm")
    from tvm.relax.frontend.torch import from_exported_program

    from_exported_program(ep, run_ep_decomposition=True)


CONSUMERS: dict[str, Callable[[ExportedProgram, tuple[Any, ...]], None]] = {
    "onnx": _onnx,
    "executorch": _edge,
    "executorch-preserve": _edge_preserving,
    "openvino": _openvino,
    "tvm": _tvm,
}


class _Caught(BaseException):
    """Raised in place of ``run_decompositions`` to stop the consumer there (a
    BaseException: none of them catches it)."""


def caught_table(consumer: str, ep: ExportedProgram, args: tuple[Any, ...]) -> Any:
    """The table ``consumer`` passes to its first ``run_decompositions`` call on ``ep``
    (None: torch's default table)."""

    def catch(self: ExportedProgram, decomp_table: Any = None, *more: Any, **kw: Any) -> Any:
        raise _Caught(decomp_table)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ExportedProgram, "run_decompositions", catch)
        try:
            CONSUMERS[consumer](ep, args)
        except _Caught as caught:
            return caught.args[0]
    raise AssertionError(f"{consumer} never called run_decompositions")


_PROGRAMS: dict[str, tuple[ExportedProgram, tuple[Any, ...]]] = {}


def _program(model: str) -> tuple[ExportedProgram, tuple[Any, ...]]:
    if model not in _PROGRAMS:
        _, ep, args = hf_models.export(model)
        _PROGRAMS[model] = (ep, args)
    return _PROGRAMS[model]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama", "resnet"])
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_check_mode_agrees_with_torch_on_each_consumers_own_table(consumer, model):
    if model != "resnet":
        pytest.importorskip("transformers")
    ep, args = _program(model)
    table = caught_table(consumer, ep, args)
    result = assert_same_as_torch(ep, table=table)
    assert result.notes.get("cache") is None
    name = identity.cache_name(split_table(table))
    assert name.table is not None, name.why_not


# One fresh process: a consumer's own call on the small GPT-2 under the switch, served
# incrementally; prints what the switch served and the disk cache's counters.
_SERVED = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = sys.argv[2:]
    import hf_models
    import torch
    import epass
    from epass._decomp import disk
    from test_consumer_tables import CONSUMERS

    _, ep, args = hf_models.export("gpt2")
    with epass.fast_decompositions() as log:
        CONSUMERS[sys.argv[1]](ep, args)
    print(json.dumps({"counts": log.counts, "disk": disk.info()}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("consumer", ["onnx", "executorch", "openvino", "tvm"])
def test_a_second_process_takes_every_template_of_a_consumers_table_from_disk(consumer, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip(
        {"onnx": "onnxscript", "executorch": "executorch.exir"}.get(consumer, consumer)
    )
    here = Path(__file__).resolve().parent
    paths = (str(here), str(here.parent))
    first, second = (run_script(_SERVED, tmp_path / "cache", consumer, *paths) for _ in "12")
    for run in (first, second):
        assert run["counts"]["incremental"] >= 1 and run["counts"]["torch"] == 0, run
    assert first["disk"]["writes"] >= 1 and first["disk"]["bypassed"] == 0
    assert second["disk"]["hits"] == first["disk"]["writes"]
    assert second["disk"]["misses"] == second["disk"]["writes"] == 0
    assert second["disk"]["bypassed"] == 0

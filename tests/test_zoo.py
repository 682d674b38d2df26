"""Real models through real pipelines: numerics, shared state, untouched input."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import hf_models
import pytest
import torch
from fingerprint import fingerprint

from epass import Decompose, PassError, PassManager
from epass.errors import IncrementalDecompositionError
from epass.passes.decompose import DecompositionError

pytestmark = pytest.mark.slow

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _lower() -> Any:
    from epass.passes import presets

    return presets.lower()


PIPELINES: dict[str, Callable[[], Any]] = {
    "decompose": lambda: PassManager([Decompose()]),
    "lower": _lower,
}


def _cases() -> list[Any]:
    out = []
    for name, case in hf_models.ZOO.items():
        marks = []
        if case.transformers and not HAS_TRANSFORMERS:
            marks.append(pytest.mark.skip(reason="transformers is not installed"))
        for dynamic in (False, True):
            label = f"{name}-{'dynamic' if dynamic else 'static'}"
            out.append(pytest.param(name, dynamic, id=label, marks=marks))
    return out


def _assert_close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@pytest.mark.parametrize(("name", "dynamic"), _cases())
def test_zoo_pipeline_matches_eager_and_shares_state(name: str, dynamic: bool, pipeline: str):
    _, ep, args = hf_models.export(name, dynamic=dynamic)
    manager = PIPELINES[pipeline]()
    before = fingerprint(ep)

    result = manager(ep)
    out = result.program

    assert fingerprint(ep) == before, "the pipeline changed the user's program"
    assert out.dialect == "ATEN"
    # Decompose adds, changes and removes no state: the output uses the user's dicts
    # and tensor objects. lower() may add folded constants, which give the output a
    # constants dict of its own holding the user's tensor objects.
    assert out.state_dict is ep.state_dict
    if out.constants is not ep.constants:
        assert pipeline != "decompose" and result.owners["constants"] == "own"
    assert all(out.constants[k] is v for k, v in ep.constants.items() if k in out.constants)
    if pipeline == "decompose":
        assert all(out.state_dict[k] is v for k, v in ep.state_dict.items())
    assert all(out.state_dict[k] is ep.state_dict[k] for k in out.state_dict)

    inputs = hf_models.other_inputs(name) if dynamic else args
    eager = hf_models.build(name)
    want = eager(*inputs)
    got = out.module()(*inputs)
    _assert_close(got, want)
    if hf_models.ZOO[name].mutates_buffers:
        # The program's buffers are the user's tensors: the update lands there.
        for key, value in eager.state_dict().items():
            if key in ep.state_dict and key not in dict(eager.named_parameters()):
                _assert_close(ep.state_dict[key], value)


@pytest.mark.parametrize(("name", "dynamic"), _cases())
def test_zoo_second_decompose_is_skipped_without_retrace(name: str, dynamic: bool):
    ep = hf_models.export(name, dynamic=dynamic)[1]
    result = PassManager([Decompose()], steps=1)(ep.run_decompositions())
    (record,) = result.records
    assert record.skipped
    assert "already ATen" in (record.skip_reason or "")
    assert not result.modified


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_gpt2_sdpa_decompose_error_names_node_and_suggests_keep():
    model = hf_models.gpt2("sdpa").eval()
    (ids,) = hf_models.ZOO["gpt2"].inputs()
    ep = torch.export.export(model, (ids,))
    before = fingerprint(ep)
    try:
        ep.run_decompositions()
    except Exception:
        torch_fails = True
    else:  # a torch that fixed it: Decompose must simply work
        torch_fails = False

    if torch_fails:
        with pytest.raises(PassError) as info:
            PassManager([Decompose()]).run(ep)
        cause = info.value.__cause__
        assert isinstance(cause, DecompositionError)
        assert cause.op == "aten.view.default"
        assert cause.node is not None and cause.node in str(info.value)
        assert "Cannot view a tensor" in str(info.value)
        assert "keep=[torch.ops.aten.scaled_dot_product_attention.default]" in str(info.value)
        assert fingerprint(ep) == before
        # The incremental path re-propagates values and meets the same view; it does
        # not rewrite it (that would give a program torch cannot), so auto retraces.
        with pytest.raises(IncrementalDecompositionError, match="Cannot view a tensor"):
            Decompose(method="incremental")(ep)
        assert fingerprint(ep) == before
    else:
        PassManager([Decompose()]).run(ep)

    # The suggested fix really avoids it, and the numbers match eager.
    keep = Decompose(keep=[torch.ops.aten.scaled_dot_product_attention.default])
    out = PassManager([keep]).run(ep)
    assert out.state_dict is ep.state_dict
    assert any(
        n.target is torch.ops.aten.scaled_dot_product_attention.default for n in out.graph.nodes
    )
    _assert_close(out.module()(ids), model(ids))
    assert fingerprint(ep) == before

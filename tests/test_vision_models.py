"""The fast path's coverage of the models users lower: real torchvision and timm
architectures (tests/vision_models.py), static and with a dynamic batch, each taken by
the incremental Decompose with torch's exact program (check mode retraces it too).

A program the incremental path cannot take is a failure, unless it is named in
KNOWN_GAPS with the reason Decompose gives; when the engine takes it, the test fails
until the entry goes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import vision_models
from fingerprint import fingerprint

from epass import Decompose, PassManager

# Each program exports and is decomposed twice (check mode): minutes of CPU in all.
pytestmark = pytest.mark.slow

# name -> the reason Decompose gives for retracing it (static and dynamic alike).
KNOWN_GAPS: dict[str, str] = {}


def _cases() -> list[Any]:
    out = []
    for name, case in vision_models.CORPUS.items():
        marks = []
        if importlib.util.find_spec(case.library) is None:
            marks.append(pytest.mark.skip(reason=f"{case.library} is not installed"))
        for dynamic in (False, True):
            out.append(
                pytest.param(name, dynamic, id=vision_models.label(name, dynamic), marks=marks)
            )
    return out


def _outputs(value: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def test_corpus_names_what_the_issue_asks_for():
    wanted = {
        "tv_resnet18", "tv_resnet50", "tv_mobilenet_v2", "tv_mobilenet_v3_small",
        "tv_efficientnet_b0", "tv_convnext_tiny", "tv_regnet_x_400mf", "tv_squeezenet1_0",
        "tv_densenet121", "tv_shufflenet_v2_x0_5", "tv_googlenet", "tv_mnasnet0_5",
        "tv_deeplabv3_mobilenet_v3_large", "tv_lraspp_mobilenet_v3_large", "tv_fcn_resnet50",
        "tv_swin_t", "timm_resnet18", "timm_efficientnet_b0", "timm_efficientnet_lite0",
        "timm_mobilevit_xxs", "timm_coatnet_nano_rw_224", "timm_regnetx_002",
        "timm_ghostnet_100", "timm_levit_128s", "timm_levit_128s_warm",
    }  # fmt: skip
    assert wanted <= set(vision_models.CORPUS)
    assert set(KNOWN_GAPS) <= set(vision_models.CORPUS)


@pytest.mark.parametrize(("name", "dynamic"), _cases())
def test_corpus_program_decomposes_to_torchs_program(name: str, dynamic: bool):
    module, ep, args = vision_models.export(name, dynamic=dynamic)
    before = fingerprint(ep)
    result = PassManager([Decompose(check=True)])(ep)
    (record,) = result.records
    notes = record.notes
    known = KNOWN_GAPS.get(name)
    if known is None:
        assert notes["method"] == "incremental", notes
        assert notes["fallback"] is None
        assert notes["checked"] is True  # the retrace ran too and gave the same program
    else:  # named above; when the engine takes it, the entry goes
        assert notes["method"] == "retrace", f"{name} takes the incremental path now: {notes}"
        assert known in (notes["fallback"] or ""), notes
    assert fingerprint(ep) == before
    inputs = vision_models.inputs(name, batch=3, seed=1) if dynamic else args
    with torch.no_grad():
        want = _outputs(module(*inputs))
    got = _outputs(result.program.module()(*inputs))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

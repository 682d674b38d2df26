"""A silent fallback is a failure: the zoo's fast-path programs take the incremental
Decompose on every tested torch, and check mode finds no difference from torch's retrace.

CI runs this file on every torch it tests (docs/compat.md): a torch release that
changes an internal the engine mirrors makes it fail here, not quietly retrace.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import hf_models
import pytest
import torch
from fingerprint import fingerprint

from epass import Decompose, PassManager

# Check mode retraces every program too: about a minute and a half of CPU in all.
pytestmark = pytest.mark.slow

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# The zoo's programs that the incremental path takes, static and dynamic.
FAST_PATH = ("bert", "gpt2", "llama", "resnet")

# Zoo programs that retrace by design (matching torch there is not promised), with
# the reason Decompose gives.
BY_DESIGN = {"cond": "get_attr", "running_mean": "a write into input"}

# A torch release that cannot take the fast path for a program class is named here:
# (torch "major.minor", zoo name, dynamic) -> the reason Decompose gives. Every tested
# release takes it for every class it can export, so this is empty.
TORCH_FALLBACKS: dict[tuple[str, str, bool], str] = {}

torch_release = hf_models.torch_release


def _cases(names: Any) -> list[Any]:
    out = []
    for name in names:
        marks = []
        if hf_models.ZOO[name].transformers and not HAS_TRANSFORMERS:
            marks.append(pytest.mark.skip(reason="transformers is not installed"))
        for dynamic in (False, True):
            label = f"{name}-{'dynamic' if dynamic else 'static'}"
            out.append(pytest.param(name, dynamic, id=label, marks=marks))
    return out


def _assert_close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "dynamic"), _cases(FAST_PATH))
def test_zoo_program_takes_the_incremental_path_and_matches_torch(name: str, dynamic: bool):
    unexportable = hf_models.TORCH_CANNOT_EXPORT.get((torch_release(), name, dynamic))
    if unexportable is not None:  # named above; when torch exports it, the entry goes
        with pytest.raises(torch._dynamo.exc.UserError, match=re.escape(unexportable)):
            hf_models.export(name, dynamic=dynamic)
        return
    _, ep, args = hf_models.export(name, dynamic=dynamic)
    before = fingerprint(ep)
    result = PassManager([Decompose(check=True)])(ep)
    (record,) = result.records
    notes = record.notes
    known = TORCH_FALLBACKS.get((torch_release(), name, dynamic))
    if known is None:
        assert notes["method"] == "incremental", f"torch {torch.__version__}: {notes}"
        assert notes["fallback"] is None
        assert notes["checked"] is True  # the retrace ran too and gave the same program
        assert notes["rewritten"] > 0
    else:  # named above; when torch takes the fast path again, the entry goes
        assert notes["method"] == "retrace", f"torch {torch.__version__} takes it now: {notes}"
        assert known in (notes["fallback"] or "")
    assert fingerprint(ep) == before
    inputs = hf_models.other_inputs(name) if dynamic else args
    _assert_close(result.program.module()(*inputs), hf_models.build(name)(*inputs))


@pytest.mark.parametrize(("name", "dynamic"), _cases(BY_DESIGN))
def test_zoo_program_outside_the_fast_path_retraces_and_says_why(name: str, dynamic: bool):
    _, ep, args = hf_models.export(name, dynamic=dynamic)
    before = fingerprint(ep)
    result = Decompose(check=True)(ep)
    assert result.notes["method"] == "retrace"
    assert BY_DESIGN[name] in (result.notes["fallback"] or "")
    assert fingerprint(ep) == before
    if not hf_models.ZOO[name].mutates_buffers:
        inputs = hf_models.other_inputs(name) if dynamic else args
        _assert_close(result.program.module()(*inputs), hf_models.build(name)(*inputs))

"""Shared tools for the pass tests: cached zoo programs, numerics, untouched-input checks."""

from __future__ import annotations

import copy
import functools
from typing import Any

import models
import pytest
import torch
from fingerprint import fingerprint
from torch.export import ExportedProgram

import epass

# (zoo name, dynamic batch)
ZOO = [
    ("mlp", False),
    ("convbn", False),
    ("transformer", False),
    ("seed", False),
    ("mixed", False),
    ("mlp", True),
    ("transformer", True),
]
FORMS = ["training", "decomposed"]
ZOO_IDS = [f"{n}-dynamic" if d else n for n, d in ZOO]


def zoo_params(exclude: tuple[str, ...] = ()) -> Any:
    """``(name, dynamic, form)`` for every zoo case (but those in ``exclude``) in both
    program forms; the transformer cases are marked slow."""
    cases = [(case, i) for case, i in zip(ZOO, ZOO_IDS, strict=True) if case[0] not in exclude]
    return pytest.mark.parametrize(
        ("name", "dynamic", "form"),
        [
            pytest.param(n, d, f, marks=[pytest.mark.slow] if n == "transformer" else [])
            for ((n, d), _) in cases
            for f in FORMS
        ],
        ids=[f"{i}-{f}" for (_, i) in cases for f in FORMS],
    )


@functools.cache
def _exported(name: str, dynamic: bool, form: str) -> tuple[ExportedProgram, tuple[Any, ...]]:
    _, ep, args = models.export(name, dynamic=dynamic)
    if form == "decomposed":
        ep = ep.run_decompositions()
    return ep, args


def program(name: str, dynamic: bool = False, form: str = "training") -> ExportedProgram:
    """A private copy (graph, dicts and tensors) of a cached zoo program."""
    return copy.deepcopy(_exported(name, dynamic, form)[0])


def inputs(name: str, dynamic: bool = False) -> tuple[Any, ...]:
    """Example inputs; with a dynamic batch, a batch size the export did not see."""
    args = models.CASES[name].inputs()
    if dynamic:
        args = tuple(torch.cat([a, a, a]) for a in args)
    return args


def assert_close(ep: ExportedProgram, name: str, dynamic: bool = False, tol: float = 1e-5) -> None:
    """``ep`` (fresh state) computes what a fresh eager module computes, first call."""
    args = inputs(name, dynamic)
    expected = models.fresh_eager(name)(*args)
    got = ep.module()(*args)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def assert_untouched(ep: ExportedProgram, before: dict[str, Any]) -> None:
    """``ep`` still has the fingerprint ``before``: same graph, signature, dict
    objects, keys, tensor objects, bytes and version counters."""
    assert fingerprint(ep) == before


def run_checked(p: Any, ep: ExportedProgram) -> epass.PipelineResult:
    """Run ``p`` directly and then through a PassManager; the input program must be
    bit-identical after each. Return the manager's result."""
    before = fingerprint(ep)
    direct = p(ep)
    assert_untouched(ep, before)
    if isinstance(direct, epass.PassResult) and not direct.modified:
        assert direct.program is ep
    result = epass.PassManager([p])(ep)
    assert_untouched(ep, before)
    return result


def node_count(ep: ExportedProgram, target: Any) -> int:
    return sum(1 for n in ep.graph.nodes if n.target == target)

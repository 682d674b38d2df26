"""The built-in graph passes give, node for node, what their plain forms give: each
pass copies its input graph without generating its Python code, CSE builds its
output from the input graph without copying it first, and under a pipeline's lease
(a graph the run made, which nobody else holds) each edits that graph in place; the
plain forms copy into a module that generates its code, as every pass did before."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import hf_models
import models
import pytest
import torch
from fingerprint import fingerprint
from torch.export import ExportedProgram

import epass
from epass import _graph, _lease, _program
from epass._decomp.check import first_difference
from epass.passes import (
    CSE,
    CastDtype,
    ConstantFold,
    DeadCodeElimination,
    FuseConvBN,
    LiftConstants,
    RemoveAssertions,
    ReplaceOps,
)
from epass.passes import cse as cse_module
from epass.passes.cse import CSEResult
from epass.protocol import RewriteCounter

aten = torch.ops.aten

PASSES: dict[str, Callable[[], Any]] = {
    "remove-asserts": RemoveAssertions,
    "fold-constants": ConstantFold,
    "cse": CSE,
    "cse-first-merges": lambda: CSE(max_rewrites=3),
    "dce": DeadCodeElimination,
    "fuse-conv-bn": FuseConvBN,
    "cast-dtype": lambda: CastDtype(torch.bfloat16),
    "replace-ops": lambda: ReplaceOps({aten.relu.default: aten.gelu.default}),
    "lift-constants": LiftConstants,
}

# (zoo, name, dynamic): tests/models.py and tests/hf_models.py programs; "cond"
# reads nested graphs through attributes, which every pass copies as it did.
PROGRAMS = [
    ("models", "seed", False),
    ("models", "mixed", False),
    ("models", "convbn", False),
    ("models", "mlp", True),
    ("models", "transformer", True),
    ("hf", "cond", False),
    ("hf", "running_mean", True),
    ("hf", "resnet", True),
    ("hf", "llama", True),
]


def _export(zoo: str, name: str, dynamic: bool) -> ExportedProgram:
    if zoo == "hf":
        return hf_models.export_or_skip(name, dynamic=dynamic)[1]
    return models.export(name, dynamic=dynamic)[1]


def _plain_copy_graph(ep: ExportedProgram) -> torch.fx.GraphModule:
    """``copy_graph`` as it was: a module that generates its code on creation."""
    gm = _program.copy_graph_module(ep.graph_module)
    for node, spec in zip(_graph.placeholders(gm), ep.graph_signature.input_specs, strict=True):
        node.meta["epass_input_spec"] = spec
    return gm


def _plain_cse(p: CSE, ep: ExportedProgram) -> CSEResult:
    """CSE as it was: copy the graph first, merge into a new graph from the copy."""
    gm = _plain_copy_graph(ep)
    counter = RewriteCounter(p.max_rewrites)
    graph = cse_module._merge(gm, cse_module._banned(gm), counter)
    if not counter.count:
        return CSEResult(ep, False, notes=counter.notes)
    new_gm = torch.fx.GraphModule(gm, graph)
    new_gm.graph.eliminate_dead_code()
    return CSEResult(_graph.build_program(ep, new_gm), True, notes=counter.notes)


def _plain(p: Any, ep: ExportedProgram, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(_graph, "copy_graph", _plain_copy_graph)
        return _plain_cse(p, ep) if isinstance(p, CSE) else p(ep)


def _program_of(out: Any) -> ExportedProgram:
    return out if isinstance(out, ExportedProgram) else out.program


def _meta_digest(ep: ExportedProgram) -> list[Any]:
    return [(n.name, sorted(n.meta), str(n.meta.get("val"))) for n in ep.graph.nodes]


def assert_same_program(fast: ExportedProgram, plain: ExportedProgram) -> None:
    assert first_difference(fast, plain) is None
    assert fast.graph_module.code == plain.graph_module.code
    assert str(fast.graph_signature) == str(plain.graph_signature)
    assert _meta_digest(fast) == _meta_digest(plain)
    assert str(fast.range_constraints) == str(plain.range_constraints)
    for field in ("state_dict", "constants"):
        a, b = getattr(fast, field), getattr(plain, field)
        assert list(a) == list(b)
        # the same tensors, or (folded, cast) equal ones
        assert all(a[k] is b[k] or torch.equal(a[k], b[k]) for k in a if k in b)


def _cases() -> Iterator[Any]:
    for zoo, name, dynamic in PROGRAMS:
        for form in ("training", "decomposed"):
            marks = [pytest.mark.slow] if name in ("transformer", "llama") else []
            label = f"{name}{'-dynamic' if dynamic else ''}-{form}"
            yield pytest.param(zoo, name, dynamic, form, marks=marks, id=label)


@pytest.mark.parametrize(("zoo", "name", "dynamic", "form"), _cases())
def test_each_pass_gives_what_its_plain_form_gives(
    zoo: str, name: str, dynamic: bool, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = _export(zoo, name, dynamic)
    if form == "decomposed":
        ep = ep.run_decompositions()
    before = fingerprint(ep)
    for key, make in PASSES.items():
        try:
            plain = _plain(make(), ep, monkeypatch)
        except epass.EpassError as exc:  # a program the pass refuses, refused alike
            with pytest.raises(type(exc), match=re.escape(str(exc))):
                make()(ep)
            continue
        fast = make()(ep)
        assert fingerprint(ep) == before, key
        assert getattr(fast, "modified", None) == getattr(plain, "modified", None), key
        assert_same_program(_program_of(fast), _program_of(plain))
        in_place, lease = _leased(make(), ep)
        assert fingerprint(ep) == before, key
        assert getattr(in_place, "modified", None) == getattr(plain, "modified", None), key
        if getattr(in_place, "modified", False) and getattr(make(), "_takes_lease", False):
            assert lease.used, key  # edited the leased graph, copied nothing
        assert_same_program(_program_of(in_place), _program_of(plain))


def _own_copy(ep: ExportedProgram) -> ExportedProgram:
    """A program equal to ``ep`` over a graph nobody else holds."""
    return _graph.build_program(ep, _graph.copy_graph(ep))


def _leased(p: Any, ep: ExportedProgram) -> tuple[Any, _lease.Lease]:
    """``p`` run as a pipeline runs it on a program the run made: with a lease on a
    copy of ``ep``'s graph."""
    own = _own_copy(ep)
    lease = _lease.Lease(own.graph_module)
    with _lease.granted(lease):
        return p(own), lease


def test_lowering_generates_python_code_for_no_intermediate_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Generating a graph's code costs more than copying it: the passes after
    # Decompose copy and rebuild without it, and the result makes its code when read.
    exported = hf_models.export_or_skip("llama", dynamic=True)[1]
    ep = exported.run_decompositions()
    generated: list[torch.fx.Graph] = []
    python_code = torch.fx.Graph.python_code

    def counted(graph: torch.fx.Graph, *args: Any, **kwargs: Any) -> Any:
        generated.append(graph)
        return python_code(graph, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Graph, "python_code", counted)
    passes = [RemoveAssertions(), ConstantFold(), CSE(), DeadCodeElimination()]
    result = epass.PassManager(passes)(ep)
    assert [r.modified for r in result.records] == [True, False, True, True]
    assert generated == []
    monkeypatch.undo()
    inputs = hf_models.other_inputs("llama")
    torch.testing.assert_close(result.program.module()(*inputs), ep.module()(*inputs))


def test_copied_graph_shares_no_meta_container_with_its_program() -> None:
    ep = models.export("transformer")[1]
    gm = _graph.copy_graph(ep)
    for old, new in zip(ep.graph.nodes, gm.graph.nodes, strict=True):
        assert old.name == new.name
        assert new.meta is not old.meta
        for key, value in old.meta.items():
            if isinstance(value, (dict, list, set)):
                assert new.meta[key] is not value, key

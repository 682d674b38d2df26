"""Property test: random passes that edit their view in place, edit nested meta,
return the caller's program, or fail, run as pipelines in 1-3 threads on one program.

After each round the user's program is unchanged except for store entries that
successful runs added, and every successful output runs and matches eager.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import models
import torch
from fingerprint import fingerprint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.export import ExportedProgram

from epass import PassManager, PassResult
from epass.errors import PassError
from epass.passes import CSE, ConstantFold, DeadCodeElimination

aten = torch.ops.aten


def clone_in_place(user: ExportedProgram, tag: int) -> Callable[[ExportedProgram], Any]:
    """Inserts a clone after one computation, editing the view's graph in place."""

    def p(view: ExportedProgram) -> ExportedProgram:
        nodes = [
            n
            for n in view.graph.nodes
            if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
        ]
        node = nodes[tag % len(nodes)]
        with view.graph.inserting_after(node):
            clone = view.graph.call_function(aten.clone.default, (node,))
        node.replace_all_uses_with(clone, delete_user_cb=lambda u: u is not clone)
        clone.meta["val"] = node.meta["val"]
        view.graph_module.recompile()
        return view

    return p


def edit_nested_meta(user: ExportedProgram, tag: int) -> Callable[[ExportedProgram], Any]:
    def p(view: ExportedProgram) -> ExportedProgram:
        for node in view.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack:
                stack.clear()
            node.meta.setdefault("custom", {})["tag"] = tag
        return view

    return p


def return_caller(user: ExportedProgram, tag: int) -> Callable[[ExportedProgram], Any]:
    return lambda view: user


def add_constant_in_place(user: ExportedProgram, tag: int) -> Callable[[ExportedProgram], Any]:
    def p(view: ExportedProgram) -> ExportedProgram:
        view.constants[f"extra_{tag}"] = torch.full((2,), float(tag))
        return view

    return p


def replace_parameters(user: ExportedProgram, tag: int) -> Callable[[ExportedProgram], Any]:
    """Replaces every parameter by an equal copy: the output diverges from the store."""

    def p(view: ExportedProgram) -> PassResult:
        for key, value in list(view.state_dict.items()):
            if isinstance(value, nn.Parameter):
                view.state_dict[key] = nn.Parameter(value.detach().clone())
        return PassResult(view, True)

    return p


def fail(user: ExportedProgram, tag: int) -> Callable[[ExportedProgram], Any]:
    def p(view: ExportedProgram) -> ExportedProgram:
        raise RuntimeError(f"failure {tag}")

    return p


MAKERS: dict[str, Callable[[ExportedProgram, int], Any]] = {
    "clone": clone_in_place,
    "meta": edit_nested_meta,
    "caller": return_caller,
    "constant": add_constant_in_place,
    "params": replace_parameters,
    "fail": fail,
    "fold": lambda user, tag: ConstantFold(fold_views=True),
    "cse": lambda user, tag: CSE(),
    "dce": lambda user, tag: DeadCodeElimination(),
}

pipelines = st.lists(
    st.tuples(st.sampled_from(sorted(MAKERS)), st.integers(0, 3)), min_size=1, max_size=4
)

_CACHE: dict[str, Any] = {}


def _program() -> tuple[nn.Module, ExportedProgram, tuple[Any, ...]]:
    if "case" not in _CACHE:
        _CACHE["case"] = models.export("mixed")
    return _CACHE["case"]  # type: ignore[no-any-return]


def _assert_fails_at_its_failing_pass(spec: list[tuple[str, int]], error: Exception | None) -> None:
    """A pipeline with a failing pass raises the PassError naming the first of them,
    caused by what it raised; every other pipeline raises nothing."""
    kinds = [kind for kind, _ in spec]
    if "fail" not in kinds:
        if error is not None:
            raise AssertionError(f"pipeline {spec} failed") from error
        return
    first = kinds.index("fail")
    assert isinstance(error, PassError), f"pipeline {spec} raised {error!r}"
    assert type(error) is PassError, f"pipeline {spec} raised {error!r}"
    assert error.index == first, f"{error} (expected position {first})"
    cause = error.__cause__
    assert type(cause) is RuntimeError and str(cause) == f"failure {spec[first][1]}", repr(cause)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(st.lists(pipelines, min_size=1, max_size=3))
def test_random_in_place_passes_in_threads_keep_the_users_program(drawn):
    eager, ep, args = _program()
    expected = eager(*args)
    before = fingerprint(ep)
    outputs: dict[int, ExportedProgram] = {}
    errors: dict[int, Exception] = {}

    def worker(i: int, spec: list[tuple[str, int]]) -> None:
        passes = [MAKERS[kind](ep, tag) for kind, tag in spec]
        try:
            outputs[i] = PassManager(passes).run(ep)
        except Exception as exc:  # checked below, in the main thread
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i, spec)) for i, spec in enumerate(drawn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    for i, spec in enumerate(drawn):
        _assert_fails_at_its_failing_pass(spec, errors.get(i))
    assert fingerprint(ep) == before
    for out in outputs.values():
        torch.testing.assert_close(out.module()(*args), expected)

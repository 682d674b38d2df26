"""epass.bisect: the shortest failing prefix of a pipeline, by binary or linear search."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fingerprint import fingerprint
from test_instruments import (
    _retarget,
    export_residual,
    five_pass_pipeline,
    neg_neg,
    relu_to_clamp,
    swap_add,
)

from epass import Decompose, FxPass, PassError, PassManager, PassResult, bisect

aten = torch.ops.aten


def close_to(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    expected = module(*args)

    def predicate(program: torch.export.ExportedProgram) -> bool:
        return torch.allclose(program.module()(*args), expected, rtol=1e-4, atol=1e-5)

    return predicate


@pytest.mark.parametrize("method", ["binary", "linear"])
@pytest.mark.parametrize("position", range(5))
def test_bisect_names_the_wrong_pass_at_every_position(position: int, method: str) -> None:
    module, ep, args = export_residual()
    before = fingerprint(ep)
    predicate = close_to(module, args)
    found = bisect(ep, five_pass_pipeline(position), predicate, method=method)
    assert found is not None
    assert (found.index, found.name, found.method) == (position, "swap-add", method)
    assert predicate(found.before) and found.after is not None and not predicate(found.after)
    assert found.error is None
    assert str(found) == f"culprit: pass 'swap-add' at position {position}"
    assert fingerprint(ep) == before


class Counted:
    """A pass that counts its calls and changes the graph (appends a clone)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.inner = FxPass(neg_neg, name=name)

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        self.calls += 1
        return self.inner(ep)


def test_binary_search_evaluates_few_prefixes_and_runs_each_pass_once() -> None:
    module, ep, args = export_residual()
    passes: list[Any] = [Counted(f"p{i}") for i in range(16)]
    passes[11] = FxPass(swap_add, name="swap-add")
    predicate = close_to(module, args)
    binary = bisect(ep, passes, predicate)
    assert binary is not None and (binary.index, binary.method) == (11, "binary")
    assert binary.evaluations <= 6  # input, full pipeline, log2(16) midpoints
    assert all(p.calls <= 1 for p in passes if isinstance(p, Counted))
    linear = bisect(ep, passes, predicate, method="linear")
    assert linear is not None and linear.index == 11
    assert linear.evaluations == 13  # input + prefixes 1..12
    assert binary.evaluations < linear.evaluations


def test_a_pass_that_raises_is_the_culprit() -> None:
    _, ep, _ = export_residual()

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    passes = [Decompose(), FxPass(neg_neg, name="neg-neg"), FxPass(explode, name="explode")]
    found = bisect(ep, passes, lambda program: True)
    assert found is not None and (found.index, found.name) == (2, "explode")
    assert found.after is None
    assert isinstance(found.error, PassError) and "boom" in str(found.error)
    assert "PassError" in str(found)


def test_a_predicate_that_raises_counts_as_failing() -> None:
    _, ep, _ = export_residual()

    def no_neg(program: torch.export.ExportedProgram) -> None:
        targets = {n.target for n in program.graph.nodes}
        assert aten.neg.default not in targets, "neg found"

    passes = [Decompose(), FxPass(relu_to_clamp, name="relu-to-clamp"), FxPass(neg_neg)]
    found = bisect(ep, passes, no_neg)
    assert found is not None and found.index == 2
    assert isinstance(found.error, AssertionError) and "neg found" in str(found.error)


def test_no_culprit_and_a_failing_input() -> None:
    module, ep, args = export_residual()
    assert bisect(ep, five_pass_pipeline(0)[1:], close_to(module, args)) is None
    with pytest.raises(ValueError, match="already fails on the input"):
        bisect(ep, [Decompose()], lambda program: False)


def test_auto_falls_back_to_linear_when_a_later_pass_hides_the_failure() -> None:
    module, ep, args = export_residual()
    unswap = FxPass(lambda gm: _retarget(gm, aten.sub.Tensor, aten.add.Tensor), name="unswap")
    passes = [Decompose(), FxPass(swap_add, name="swap-add"), unswap, FxPass(neg_neg)]
    predicate = close_to(module, args)
    assert bisect(ep, passes, predicate, method="binary") is None  # cannot see it
    found = bisect(ep, passes, predicate)
    assert found is not None and (found.index, found.method) == (1, "linear")


def test_non_monotonic_predicate_uses_linear_search() -> None:
    module, ep, args = export_residual()
    predicate = close_to(module, args)
    predicate.monotonic = False
    found = bisect(ep, five_pass_pipeline(3), predicate)
    assert found is not None and (found.index, found.method) == (3, "linear")


def test_bisect_descends_into_nested_pipelines() -> None:
    module, ep, args = export_residual()
    inner = PassManager(
        [FxPass(relu_to_clamp, name="relu-to-clamp"), FxPass(swap_add, name="swap-add")],
        name="inner",
    )
    found = bisect(ep, PassManager([Decompose(), inner]), close_to(module, args))
    assert found is not None and (found.index, found.name) == (1, "inner")
    assert found.inner is not None and (found.inner.index, found.inner.name) == (1, "swap-add")
    assert str(found) == (
        "culprit: pass 'inner' at position 1 -> culprit: pass 'swap-add' at position 1"
    )
    flat = bisect(ep, [Decompose(), inner], close_to(module, args), recursive=False)
    assert flat is not None and flat.inner is None


def test_bad_method_is_rejected() -> None:
    _, ep, _ = export_residual()
    with pytest.raises(ValueError, match="method"):
        bisect(ep, [Decompose()], lambda p: True, method="fast")


class WriteWeights:
    """Writes into every weight it is given, past ``_version`` and through it; then
    raises, or returns the program unchanged."""

    def __init__(self, name: str, raises: bool) -> None:
        self.name = name
        self.raises = raises

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        with torch.no_grad():
            for t in ep.state_dict.values():
                t.data.add_(7)
                if self.raises:
                    t.add_(1)
        if self.raises:
            raise RuntimeError("the backend gave up")
        return PassResult(ep, False)


@pytest.mark.parametrize("raises", [True, False], ids=["then-raises", "quietly"])
def test_a_pass_that_writes_into_the_weights_is_the_culprit_and_the_users_stay(
    raises: bool,
) -> None:
    ep = export_residual()[1]
    before = fingerprint(ep)
    weights = {k: v.clone() for k, v in ep.state_dict.items()}
    passes = [FxPass(neg_neg, name="neg-neg"), WriteWeights("writer", raises), "dce"]

    def weights_as_given(program: torch.export.ExportedProgram) -> bool:
        return all(torch.equal(program.state_dict[k], v) for k, v in weights.items())

    found = bisect(ep, passes, weights_as_given, method="linear")
    assert found is not None and (found.index, found.name) == (1, "writer")
    assert (found.error is not None) == raises
    assert fingerprint(ep) == before


@pytest.mark.parametrize("method", ["binary", "linear"])
@pytest.mark.parametrize("raises", [True, False], ids=["then-raises", "quietly"])
def test_a_pass_writing_into_the_weights_does_not_change_the_programs_before_it(
    raises: bool, method: str
) -> None:
    ep = export_residual()[1]
    weights = {k: v.clone() for k, v in ep.state_dict.items()}
    harmless = [FxPass(lambda gm: gm, name=f"same-{i}") for i in range(3)]
    passes = [*harmless, WriteWeights("writer", raises), "dce"]

    def weights_as_given(program: torch.export.ExportedProgram) -> bool:
        return all(torch.equal(program.state_dict[k], v) for k, v in weights.items())

    # Binary search judges the programs before the writer after the writer ran.
    found = bisect(ep, passes, weights_as_given, method=method)  # type: ignore[arg-type]
    assert found is not None and (found.index, found.name) == (3, "writer")
    assert weights_as_given(found.before)

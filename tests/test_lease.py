"""A pipeline's own programs: a built-in pass edits in place a graph this run made and
nobody else holds (a lease), copies every other graph, and its output is checked
against its input as the input was before the edit."""

from __future__ import annotations

from typing import Any

import hf_models
import models
import pytest
import torch
from fingerprint import fingerprint
from torch.export import ExportedProgram

import epass
from epass import _graph, _lease, _program, verification
from epass._torch import programs
from epass.passes import (
    CSE,
    DeadCodeElimination,
    Decompose,
    RemoveAssertions,
    ReplaceOps,
    presets,
)
from epass.protocol import PassResult

aten = torch.ops.aten


def _decoder() -> tuple[ExportedProgram, tuple[Any, ...]]:
    _, ep, args = models.export_dynamic("decoder")
    return ep, args


def _llama() -> tuple[ExportedProgram, tuple[Any, ...]]:
    """A program on which every pass of ``lower()`` but constant folding changes
    something (a dynamic sequence brings runtime assertions)."""
    _, ep, args = hf_models.export_or_skip("llama", dynamic=True)
    return ep, args


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the passes that copy a graph from now on."""
    copied: list[str] = []
    copy_graph = _graph.copy_graph

    def counted(ep: ExportedProgram) -> torch.fx.GraphModule:
        copied.append("copy")
        return copy_graph(ep)

    monkeypatch.setattr(_graph, "copy_graph", counted)
    return copied


class Keep(epass.Instrument):
    """Keeps every program it is shown, with its fingerprint when it was shown: each
    pass's input (``before``) and output (``kept``)."""

    def __init__(self) -> None:
        self.before: list[tuple[ExportedProgram, dict[str, Any]]] = []
        self.kept: list[tuple[ExportedProgram, dict[str, Any]]] = []

    def before_pass(self, info: Any, program: ExportedProgram) -> None:
        self.before.append((program, fingerprint(program)))

    def after_pass(self, info: Any, program: ExportedProgram, record: Any) -> None:
        self.kept.append((program, fingerprint(program)))


def _same(a: ExportedProgram, b: ExportedProgram) -> None:
    assert a.graph_module.code == b.graph_module.code
    assert str(a.graph_signature) == str(b.graph_signature)
    assert list(a.state_dict) == list(b.state_dict)
    assert list(a.constants) == list(b.constants)
    # A program rebuilt around its own graph (no constructor) holds what one the
    # constructor made holds.
    assert a.range_constraints == b.range_constraints
    assert programs.guards_code(a) == programs.guards_code(b)
    assert [e.fqn for e in a.module_call_graph] == [e.fqn for e in b.module_call_graph]
    assert a.verifiers == b.verifiers and sorted(vars(a)) == sorted(vars(b))


def test_lowering_copies_no_graph_and_gives_what_a_watched_run_gives(monkeypatch):
    ep, args = _llama()
    before = fingerprint(ep)
    copied = _copies(monkeypatch)
    result = presets.lower()(ep)
    assert [r.modified for r in result.records if r.name != "fold-constants"] == [True] * 4
    assert copied == []  # Decompose built its graph; every later pass edited it
    assert fingerprint(ep) == before
    # An instrument sees every program, so nothing is edited in place while it watches.
    keep = Keep()
    watched = presets.lower(instruments=[keep])(ep)
    assert copied  # remove-asserts and dce copied what they edit
    _same(result.program, watched.program)
    torch.testing.assert_close(result.program.module()(*args), ep.module()(*args))


def test_no_program_an_instrument_was_shown_changes_afterwards():
    ep, _ = _decoder()
    keep = Keep()
    presets.lower(instruments=[keep])(ep)
    assert len(keep.kept) == 5
    # Graph, meta, signature, dicts: not only the code, which an edit of the graph
    # without recompile() leaves as it was.
    for program, shown in keep.before + keep.kept:
        assert fingerprint(program) == shown


class Returns:
    """A pass that returns a program it holds (memoized, another run's output)."""

    name = "returns"

    def __init__(self, program: ExportedProgram) -> None:
        self.program = program

    def __call__(self, ep: ExportedProgram) -> PassResult:
        return PassResult(self.program, True)


def test_a_program_a_pass_holds_is_copied_by_the_passes_after_it():
    ep, _ = _decoder()
    held = Decompose()(ep).program
    code, nodes = held.graph_module.code, len(held.graph.nodes)
    out = epass.PassManager([Returns(held), RemoveAssertions(), CSE(), DeadCodeElimination()])(ep)
    assert out.program.graph is not held.graph
    assert len(out.program.graph.nodes) < nodes
    assert held.graph_module.code == code
    assert len(held.graph.nodes) == nodes


def test_a_built_in_pass_that_fails_half_way_loses_nothing(monkeypatch):
    ep, args = _llama()
    before = fingerprint(ep)

    def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("planted failure")

    # DCE has erased the dead nodes of the graph it was leased when this is called.
    monkeypatch.setattr(_graph, "remove_unused_state_placeholders", fails)
    pipeline = presets.lower()
    with pytest.raises(epass.PassError, match="planted failure") as info:
        pipeline(ep)
    assert info.value.pass_name == "dce"
    assert fingerprint(ep) == before
    monkeypatch.undo()
    out = pipeline(ep)
    torch.testing.assert_close(out.program.module()(*args), ep.module()(*args))


class EditsInPlace:
    """A pass that edits its input's graph in place (the manager hands it a private
    copy, or a graph this run made)."""

    changes_input = True

    def __init__(self, name: str, edit: Any) -> None:
        self.name = name
        self.edit = edit

    def __call__(self, ep: ExportedProgram) -> PassResult:
        self.edit(ep)
        return PassResult(ep, True)


def _relabel(ep: ExportedProgram) -> None:
    """A harmless edit: a meta entry on the first call."""
    next(n for n in ep.graph.nodes if n.op == "call_function").meta["label"] = "seen"


def _write_into_a_parameter(ep: ExportedProgram) -> None:
    """An undeclared in-place write into the first parameter."""
    name = ep.graph_signature.parameters[0]
    placeholder = next(
        n
        for n in ep.graph.nodes
        if n.op == "placeholder" and ep.graph_signature.inputs_to_parameters.get(n.name) == name
    )
    first_call = next(n for n in ep.graph.nodes if n.op == "call_function")
    with ep.graph.inserting_before(first_call):
        write = ep.graph.call_function(aten.mul_.Scalar, (placeholder, 2.0))
    write.meta["val"] = placeholder.meta["val"]


def _bad_argument(ep: ExportedProgram) -> None:
    """A call whose literal argument its schema does not take."""
    node = next(n for n in ep.graph.nodes if n.target is aten.linear.default)
    with ep.graph.inserting_after(node):
        bad = ep.graph.call_function(aten.mul.Scalar, (node, "two"))
    bad.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(bad, delete_user_cb=lambda user: user is not bad)


def _bad_literal_in_an_existing_call(ep: ExportedProgram) -> None:
    """A call the previous pass's check already walked, given an argument more."""
    node = next(n for n in ep.graph.nodes if n.target is aten.relu.default)
    node.args = (*node.args, 1)


def _renamed_bad_call(ep: ExportedProgram) -> None:
    """A bad literal argument, then its call renamed: the problem names the new name."""
    _bad_literal_in_an_existing_call(ep)
    node = next(n for n in ep.graph.nodes if n.target is aten.relu.default)
    node.name = "renamed_relu"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_write_into_a_parameter, "writes in place into state"),
        (_bad_argument, "arguments their schemas do not take"),
        (_bad_literal_in_an_existing_call, "gets 2 positional arguments"),
        (_renamed_bad_call, "'renamed_relu'"),
    ],
    ids=["undeclared state write", "bad literal argument", "existing call", "renamed call"],
)
def test_a_pass_editing_a_graph_this_run_made_is_checked_against_it_as_it_was(edit, message):
    # The first pass edits a private copy, which makes the graph this run's own; the
    # second gets that graph itself, so only what it was before tells the edit.
    ep = models.export("mlp")[1]
    before = fingerprint(ep)
    pipeline = epass.PassManager([EditsInPlace("relabel", _relabel), EditsInPlace("edit", edit)])
    with pytest.raises(epass.VerificationError, match=message) as info:
        pipeline(ep)
    assert info.value.pass_name == "edit"
    assert fingerprint(ep) == before


def _erase_a_dead_call(ep: ExportedProgram) -> None:
    node = next(n for n in ep.graph.nodes if n.target is aten.relu.default)
    with ep.graph.inserting_after(node):
        dead = ep.graph.call_function(aten.neg.default, (node,))
    ep.graph.erase_node(dead)


@pytest.mark.parametrize(
    "edit",
    [_bad_argument, _bad_literal_in_an_existing_call, _renamed_bad_call, _erase_a_dead_call],
    ids=["new call", "existing call", "renamed call", "erased call"],
)
def test_a_walk_reusing_the_previous_one_finds_what_a_fresh_walk_finds(edit):
    ep = models.export("mlp")[1]
    previous = verification._walk_calls(ep.graph_module)
    assert previous.calls  # what a next walk may reuse
    edit(ep)
    fresh = verification._walk_calls(ep.graph_module)
    reused = verification._walk_calls(ep.graph_module, previous)
    assert (reused.targets, reused.problems, reused.writes) == (
        fresh.targets,
        fresh.problems,
        fresh.writes,
    )
    assert fresh.problems or edit is _erase_a_dead_call


def test_before_reads_what_the_checks_compare_with():
    ep = models.export("seed")[1]
    facts = verification.before(ep)
    written, declared = verification.state_writes(ep)
    assert facts.writes == (written, declared)
    assert written | declared  # the seed model's buffer update
    assert facts.problems == frozenset(verification.argument_problems(ep))
    assert set(facts.state) == set(ep.state_dict) | {
        k for k in ep.constants if isinstance(ep.constants[k], torch.Tensor)
    }


def test_a_lease_is_good_for_one_call():
    ep = models.export("mlp")[1]
    own = _graph.build_program(ep, _graph.copy_graph(ep))
    lease = _lease.Lease(own.graph_module)
    with _lease.granted(lease):
        assert _lease.take_lease(ep) is None  # not the leased program's graph
        assert _lease.take_lease(own) is own.graph_module
        assert _lease.take_lease(own) is None
        assert _graph.editable_graph(own) is not own.graph_module
    assert _lease.take_lease(own) is None


@pytest.mark.parametrize("name", ["decoder", "cnn"])
def test_a_program_rebuilt_after_erasures_is_the_one_the_constructor_makes(name, monkeypatch):
    _, ep, args = models.export_dynamic(name)
    rebuilt: list[bool] = []
    after_erasure = _program.after_erasure

    def counted(*given: Any) -> ExportedProgram | None:
        out = after_erasure(*given)
        rebuilt.append(out is not None)
        return out

    monkeypatch.setattr(_program, "after_erasure", counted)
    result = presets.lower()(ep)
    assert rebuilt and all(rebuilt)  # DCE at least erased nodes of a leased graph
    rebuilt.clear()
    watched = presets.lower(instruments=[Keep()])(ep)
    assert not rebuilt  # watched: every pass copied what it edits
    _same(result.program, watched.program)
    torch.testing.assert_close(result.program.module()(*args), ep.module()(*args))


def _validated_copy(ep: ExportedProgram) -> ExportedProgram:
    """A program epass built over a private copy of ``ep``'s graph (validated)."""
    gm = _program.copy_graph_module(ep.graph_module)
    return _program.new_program(ep, gm, ep.graph_signature, ep.state_dict, ep.constants)


def test_a_repointed_input_defined_after_its_user_is_refused_after_erasures():
    own = _validated_copy(models.export("mlp")[1])
    calls = [n for n in own.graph.nodes if n.op == "call_function"]
    first, last = calls[0], calls[-1]
    assert not any(first in n.all_input_nodes for n in last.all_input_nodes)
    first.args = (last, *first.args[1:])  # now reads a node defined after it
    sig, sd, consts = own.graph_signature, own.state_dict, own.constants
    with pytest.raises(RuntimeError, match=rf"argument '{last.name}' of node '{first.name}'"):
        _program.after_erasure(own, sig, sd, consts, [first])
    with pytest.raises(RuntimeError, match="defined before it"):
        _graph.build_program(own, own.graph_module, erased_only=True, repointed=[first])


def test_cse_names_every_node_whose_input_it_repointed(monkeypatch):
    class Thrice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x).sin() + torch.relu(x).cos() * torch.relu(x)

    ep = torch.export.export(Thrice(), (torch.randn(3),)).run_decompositions()
    own = _validated_copy(ep)
    relus = [n for n in own.graph.nodes if n.target is aten.relu.default]
    users = {u for r in relus[1:] for u in r.users}
    assert len(relus) == 3 and len(users) == 2
    checked: list[torch.fx.Node] = []
    check_order = _program._check_order

    def seen(graph: torch.fx.Graph, nodes: Any) -> None:
        checked.extend(nodes)
        check_order(graph, nodes)

    monkeypatch.setattr(_program, "_check_order", seen)
    with _lease.granted(_lease.Lease(own.graph_module)):
        out = CSE()(own).program
    assert out.graph_module is own.graph_module  # merged in place, rebuilt after erasures
    assert set(checked) == users
    assert [n.target for n in out.graph.nodes].count(aten.relu.default) == 1


def test_replace_ops_edits_the_runs_own_graph_and_gives_what_a_watched_run_gives(monkeypatch):
    _, ep, args = models.export("mlp")
    before = fingerprint(ep)
    to_gelu = ReplaceOps(ops={aten.relu.default: aten.gelu.default})

    def pipeline(**options: Any) -> epass.PassManager:
        return epass.PassManager([Decompose(), to_gelu, DeadCodeElimination()], **options)

    copied = _copies(monkeypatch)
    result = pipeline()(ep)
    assert [r.modified for r in result.records][:2] == [True, True]
    assert copied == []  # retargeted where Decompose built the graph
    assert fingerprint(ep) == before
    watched = pipeline(instruments=[Keep()])(ep)
    assert copied  # watched: it edits a copy
    _same(result.program, watched.program)
    targets = {n.target for n in result.program.graph.nodes}
    assert aten.gelu.default in targets and aten.relu.default not in targets
    plain = ep.module()(*args)
    assert not torch.allclose(result.program.module()(*args), plain)  # relu became gelu
    torch.testing.assert_close(result.program.module()(*args), watched.program.module()(*args))


class _NestedCond(torch.nn.Module):
    """A ``torch.cond`` inside a branch of another: the inner branches are
    submodules of the outer branch's graph module, read by its own get_attr nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(2))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def inner_true(y: torch.Tensor) -> torch.Tensor:
            return y.sin()

        def inner_false(y: torch.Tensor) -> torch.Tensor:
            return y.cos()

        def outer_true(y: torch.Tensor) -> torch.Tensor:
            return torch.cond(y.sum() > 0, inner_true, inner_false, (y,))

        def outer_false(y: torch.Tensor) -> torch.Tensor:
            return y + 1

        x = self.lin(x).relu()
        return torch.cond(x.sum() > 0, outer_true, outer_false, (x,))


def _linear_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.sum.default(torch.ops.aten.linear.default(x, x))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@pytest.mark.parametrize(
    "passes",
    [
        # A pattern whose operators the graph has but that matches nothing: the
        # rewriter still deletes the submodules it counts as unused.
        lambda: [ReplaceOps(patterns=[(_linear_sum, _identity)])],
        lambda: [
            ReplaceOps(ops={aten.relu.default: aten.relu.default}),
            ReplaceOps(patterns=[(_linear_sum, _identity)]),
        ],
        # An unused parameter's input erased, on a copy and under the run's lease.
        lambda: [DeadCodeElimination()],
        lambda: [ReplaceOps(ops={aten.linear.default: aten.linear.default}), DeadCodeElimination()],
    ],
    ids=["pattern", "retarget-then-pattern", "dce", "retarget-then-dce"],
)
def test_a_cond_nested_in_a_branch_keeps_its_branches_through_rewrites_and_erasures(passes):
    torch.manual_seed(0)
    module = _NestedCond().eval()
    x = torch.randn(2, 3)
    ep = torch.export.export(module, (x,))
    names = [name for name, _ in ep.graph_module.named_modules()]
    before = fingerprint(ep)
    out = epass.PassManager(passes())(ep).program
    assert "true_graph_0.true_graph_0" in dict(out.graph_module.named_modules())
    out.validate()
    for y in (x, -x.abs() - 1, x.abs() + 1):
        torch.testing.assert_close(out.module()(y), module(y))
    assert [name for name, _ in ep.graph_module.named_modules()] == names
    assert fingerprint(ep) == before


class _TwoSplits(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.split(x, 2)
        b = torch.split(x, 2)
        return a[0] * b[0] + a[1] * b[1]


@pytest.mark.parametrize("limit", [1, None])
def test_a_leased_cse_that_leaves_two_items_of_one_call_gives_what_a_copying_one_gives(limit):
    # Merging the second split into the first points its items at the first split's,
    # which the constructor merges; with one rewrite allowed, CSE itself does not.
    ep = torch.export.export(_TwoSplits(), (torch.randn(4),)).run_decompositions()
    own = _validated_copy(ep)
    with _lease.granted(_lease.Lease(own.graph_module)):
        leased = CSE(max_rewrites=limit)(own).program
    copied = CSE(max_rewrites=limit)(_validated_copy(ep)).program
    _same(leased, copied)
    x = torch.randn(4)
    torch.testing.assert_close(leased.module()(x), _TwoSplits()(x))


class _DropsAValue:
    """A pass epass does not vouch for: it edits the graph it is given in place and
    leaves a node without the value torch's verifier requires."""

    name = "drops-a-value"
    changes_input = True

    def __call__(self, ep: ExportedProgram) -> ExportedProgram:
        add = next(n for n in ep.graph.nodes if n.target is aten.add.Tensor)
        del add.meta["val"]
        return ep


class _TwoReluSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        return a.relu() + a.relu()


def test_an_unverified_edit_in_place_is_not_taken_as_validated_by_a_pass_after_it():
    # The retarget makes the run own the graph, so the next pass edits it in place;
    # with verification off nothing checks that edit, and the CSE after it must not
    # rebuild on the mark the program had before.
    ep = torch.export.export(_TwoReluSum(), (torch.randn(2, 3),))
    before = fingerprint(ep)
    passes = [ReplaceOps(ops={aten.linear.default: aten.linear.default}), _DropsAValue(), CSE()]
    with pytest.raises(epass.PassError, match=r"(?s)'cse'.*missing val.*drops-a-value"):
        epass.PassManager(passes, verify=False).run(ep)
    assert fingerprint(ep) == before


# --- programs that left the run: a pass's memo, a nested pipeline's instrument ---


def _relu_to_sigmoid() -> ReplaceOps:
    return ReplaceOps(ops={aten.relu.default: aten.sigmoid.default})


def test_a_program_a_pass_memoized_is_never_edited_by_the_passes_after_it():
    # The memo returns the program it was first given, in this run and the next: a
    # program the run did not make, which the passes after it must copy.
    ep = torch.export.export(_TwoReluSum(), (torch.randn(2, 3),))
    x = torch.randn(2, 3)
    memo: dict[str, ExportedProgram] = {}

    def memoized(view: ExportedProgram) -> PassResult:
        memo.setdefault("program", view)
        return PassResult(memo["program"], True)

    epass.PassManager([Decompose(), memoized, _relu_to_sigmoid(), CSE()])(ep)
    shown = fingerprint(memo["program"])
    again = epass.PassManager([Decompose(), memoized]).run(ep)
    assert fingerprint(memo["program"]) == shown
    torch.testing.assert_close(again.module()(x), ep.module()(x))


def test_no_program_a_nested_pipelines_instrument_was_shown_changes_afterwards():
    # The inner pipeline's instrument sees the outer run's programs; the passes after
    # the inner pipeline must not edit them in place.
    ep = torch.export.export(_TwoReluSum(), (torch.randn(2, 3),))
    keep = Keep()

    def identity(view: ExportedProgram) -> ExportedProgram:
        return view

    inner = epass.PassManager([identity], instruments=[keep])
    epass.PassManager([Decompose(), inner, _relu_to_sigmoid(), CSE()])(ep)
    assert keep.before and keep.kept
    for program, shown in keep.before + keep.kept:
        assert fingerprint(program) == shown

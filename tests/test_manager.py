"""PassManager: state sharing, transactions, fx passes, nesting, steps, ordering, bad input."""

from __future__ import annotations

import copy

import models
import pytest
import torch
from fingerprint import fingerprint
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as FxPassResult

import epass
from epass import (
    Decompose,
    FxPass,
    OrderingError,
    Pass,
    PassError,
    PassManager,
    PassResult,
    StateConflictError,
    StateLinker,
    StateMutationError,
    VerificationError,
    _graph,
    _program,
)
from epass.errors import ArgumentTypeError

aten = torch.ops.aten


# --- small passes used across the tests ---


def add_to_sub(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.target is aten.add.Tensor:
            node.target = aten.sub.Tensor
    gm.recompile()
    return gm


def identity_pass(ep):
    return ep


def add_constant(ep):
    """Adds a constants entry (as a folding pass would), leaving the graph alone."""
    ep.constants["folded"] = torch.arange(3.0)
    return PassResult(ep, True)


def double_first_param(ep):
    """Replaces the first parameter's value: the canonical state-changing pass."""
    key = next(s.target for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER")
    ep.state_dict[key] = torch.nn.Parameter(ep.state_dict[key].detach() * 2)
    return PassResult(ep, True)


class Boom:
    name = "boom"

    def __call__(self, ep):
        raise RuntimeError("kaboom")


def graph_mutating_pass(ep):
    """Mutates the graph it is handed in place (declares nothing)."""
    for node in ep.graph.nodes:
        if node.target is aten.relu.default:
            node.target = aten.sigmoid.default
    ep.graph_module.recompile()
    return PassResult(ep, True)


# --- the seed ---


def test_decompose_keeps_state_dict_identity_on_the_seed():
    _eager, ep, args = models.export("seed")
    before = fingerprint(ep)
    assert ep.run_decompositions().state_dict is not ep.state_dict  # torch's behaviour
    out = PassManager([Decompose()]).run(ep)
    assert out is not ep
    assert out.state_dict is ep.state_dict
    assert out.constants is ep.constants
    assert all(out.state_dict[k] is v for k, v in ep.state_dict.items())
    assert all(out.constants[k] is v for k, v in ep.constants.items())
    assert fingerprint(ep) == before
    assert out.dialect == "ATEN"
    reference = models.fresh_eager("seed")
    torch.testing.assert_close(out.module()(*args), reference(*args))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_decompose_keeps_identity_with_every_kind_of_state(dynamic):
    eager, ep, _args = models.export("mixed", dynamic=dynamic)
    kinds = {s.kind.name for s in ep.graph_signature.input_specs}
    assert {"PARAMETER", "BUFFER", "CONSTANT_TENSOR", "USER_INPUT"} <= kinds
    assert any(not s.persistent for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER")
    assert ep.state_dict["head.weight"] is ep.state_dict["embed.weight"]  # tied
    before = fingerprint(ep)
    out = PassManager([Decompose()]).run(ep)
    assert out.state_dict is ep.state_dict
    assert out.constants is ep.constants
    assert all(out.state_dict[k] is v for k, v in ep.state_dict.items())
    assert all(out.constants[k] is v for k, v in ep.constants.items())
    assert fingerprint(ep) == before
    x = torch.randn(7 if dynamic else 2, 4)
    torch.testing.assert_close(out.module()(x), eager(x))


def test_empty_constants_dict_is_kept():
    _, ep, _args = models.export("no_constants")
    out = PassManager([Decompose()]).run(ep)
    assert out.constants is ep.constants
    assert out.state_dict is ep.state_dict


def test_record_describes_the_decompose_run():
    _, ep, _ = models.export("mlp")
    result = PassManager([Decompose()])(ep)
    (record,) = result.records
    assert record.name == "decompose" and record.index == 0 and record.step == 0
    assert record.modified and result.modified
    assert record.nodes_before == len(ep.graph.nodes)
    assert record.nodes_after == len(result.program.graph.nodes)
    assert record.op_delta["aten.linear.default"] == -3
    assert record.op_delta["aten.addmm.default"] == 3
    assert record.link is not None and record.link.shared
    assert record.seconds > 0
    assert "decompose" in result.summary()


def test_decompose_keep_preserves_ops():
    _, ep, _ = models.export("mlp")
    out = PassManager([Decompose(keep=[aten.linear.default])]).run(ep)
    targets = {n.target for n in out.graph.nodes}
    assert aten.linear.default in targets and aten.addmm.default not in targets


def test_decompose_with_empty_table_reports_unmodified_when_code_is_equal():
    _, ep, _ = models.export("mlp")
    aten_ep = PassManager([Decompose()]).run(ep)
    result = PassManager([Decompose(table={})])(aten_ep)
    assert result.program is aten_ep
    assert not result.modified


# --- transactions ---

PIPELINE = [Decompose(), FxPass(add_to_sub), add_constant, double_first_param, graph_mutating_pass]


@pytest.mark.parametrize("position", range(len(PIPELINE) + 1))
def test_a_failing_pass_leaves_the_users_program_bit_identical(position):
    _, ep, _args = models.export("mixed")
    before = fingerprint(ep)
    passes = [*PIPELINE]
    passes.insert(position, Boom())
    with pytest.raises(PassError) as info:
        PassManager(passes).run(ep)
    error = info.value
    assert error.pass_name == "boom"
    assert error.index == position
    assert error.step == 0
    assert list(error.previous) == [epass.protocol.pass_name(p) for p in passes[:position]]
    assert isinstance(error.__cause__, RuntimeError)
    assert "kaboom" in str(error) and "boom" in str(error) and f"position {position}" in str(error)
    assert fingerprint(ep) == before


def test_added_entries_are_rolled_back_when_a_later_pass_fails():
    _, ep, _ = models.export("mixed")
    keys = list(ep.constants)
    with pytest.raises(PassError):
        PassManager([add_constant, Boom()]).run(ep)
    assert list(ep.constants) == keys


def test_a_successful_pipeline_keeps_added_entries_in_its_own_constants():
    _, ep, _ = models.export("mixed")
    keys = list(ep.constants)
    result = PassManager([add_constant, Decompose()])(ep)
    out = result.program
    assert out.constants is not ep.constants and "folded" in out.constants
    assert list(ep.constants) == keys
    assert all(out.constants[k] is ep.constants[k] for k in keys)
    assert out.state_dict is ep.state_dict
    # The later pass shares the run's own dict rather than copying it again.
    assert result.records[1].link.constants.shared
    assert [r.link.owners["constants"] for r in result.records] == ["own", "own"]
    assert result.owners == {"state_dict": "user", "constants": "own"}


def test_graph_mutating_pass_gets_a_copy_of_the_users_graph():
    _, ep, _args = models.export("no_constants")
    before = fingerprint(ep)
    out = PassManager([graph_mutating_pass]).run(ep)
    assert fingerprint(ep) == before
    assert aten.sigmoid.default in {n.target for n in out.graph.nodes}
    assert out.state_dict is ep.state_dict


# --- state-changing passes under each policy ---


def test_state_changing_pass_diverges_and_leaves_the_user_alone():
    _eager, ep, _args = models.export("mlp")
    before = fingerprint(ep)
    result = PassManager([Decompose(), double_first_param])(ep)
    out = result.program
    assert fingerprint(ep) == before
    assert out.state_dict is not ep.state_dict
    changed = result.records[-1].link.state_dict.changed
    assert len(changed) == 1
    assert all(out.state_dict[k] is v for k, v in ep.state_dict.items() if k not in changed)
    assert out.constants is ep.constants
    assert not result.shared


def test_strict_policy_names_the_pass_and_keys():
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)
    with pytest.raises(StateConflictError) as info:
        PassManager([double_first_param], linker=StateLinker(policy="strict")).run(ep)
    assert info.value.pass_name == "double_first_param"
    assert info.value.keys == ("state_dict:net.0.weight",)
    assert fingerprint(ep) == before


def test_in_place_policy_writes_into_the_store():
    _, ep, _ = models.export("mlp")
    old = ep.state_dict["net.0.weight"]
    out = PassManager([double_first_param], linker=StateLinker(policy="in_place")).run(ep)
    assert out.state_dict is ep.state_dict
    assert ep.state_dict["net.0.weight"] is not old
    torch.testing.assert_close(ep.state_dict["net.0.weight"], old * 2)


# --- tensor mutation detection ---


def test_in_place_tensor_write_is_caught_and_named():
    _, ep, _ = models.export("seed")

    def bump(program):
        program.state_dict["count"].add_(1)
        return program

    with pytest.raises(StateMutationError) as info:
        PassManager([bump]).run(ep)
    assert info.value.keys == ("state_dict:count",)
    assert info.value.pass_name == "bump"


def test_data_writes_need_the_byte_fingerprint():
    def sneaky(program):
        program.state_dict["count"].data.fill_(5.0)
        return program

    _, ep, _ = models.export("seed")
    PassManager([sneaky]).run(ep)  # .data bypasses the version counter
    _, ep, _ = models.export("seed")
    with pytest.raises(StateMutationError) as info:
        PassManager([sneaky], fingerprint=True).run(ep)
    assert info.value.keys == ("state_dict:count",)


# --- fx passes ---


class AddToSub(PassBase):
    def call(self, graph_module):
        add_to_sub(graph_module)
        return FxPassResult(graph_module, True)


@pytest.mark.parametrize("fx_pass", [FxPass(add_to_sub), AddToSub()], ids=["function", "PassBase"])
def test_fx_passes_run_on_a_copy(fx_pass):
    _eager, ep, args = models.export("mixed")
    ep = PassManager([Decompose()]).run(ep)
    before = fingerprint(ep)
    result = PassManager([fx_pass])(ep)
    out = result.program
    assert fingerprint(ep) == before
    assert aten.sub.Tensor in {n.target for n in out.graph.nodes}
    assert aten.add.Tensor in {n.target for n in ep.graph.nodes}
    assert out.state_dict is ep.state_dict and out.constants is ep.constants
    assert result.records[0].op_delta["aten.sub.Tensor"] > 0
    assert not torch.allclose(out.module()(*args), ep.module()(*args))


def test_fx_pass_without_change_reports_unmodified():
    _, ep, _ = models.export("mlp")
    result = PassManager([FxPass(lambda gm: None, name="noop")])(ep)
    assert not result.modified and result.program is ep


def test_fx_pass_that_drops_an_input_updates_the_signature():
    _eager, ep, _args = models.export("mixed")

    def drop_scale(gm):
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.name == "b_scale":
                for user in list(node.users):
                    user.replace_all_uses_with(user.args[0])
                    gm.graph.erase_node(user)
                gm.graph.erase_node(node)
        gm.recompile()
        return gm

    result = PassManager([FxPass(drop_scale)])(ep)
    out = result.program
    assert "scale" not in {s.target for s in out.graph_signature.input_specs}
    assert out.state_dict is ep.state_dict  # the removed entry stays in the store
    assert result.records[0].link.state_dict.removed == ("scale",)


def test_fx_pass_adding_an_input_is_rejected():
    _, ep, _ = models.export("mlp")

    def add_input(gm):
        first = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(first):
            gm.graph.placeholder("surprise")
        gm.recompile()
        return gm

    with pytest.raises(PassError, match="surprise"):
        PassManager([FxPass(add_input)]).run(ep)


def test_fx_pass_changing_the_outputs_is_rejected():
    _, ep, _ = models.export("mlp")

    def double_output(gm):
        out = gm.graph.output_node()
        value = out.args[0][0]
        out.args = ((value, value),)
        gm.recompile()
        return gm

    with pytest.raises(PassError, match="number of outputs"):
        PassManager([FxPass(double_output)]).run(ep)


# --- nesting, steps, requires/ensures, skipping ---


def test_managers_nest_and_keep_sharing():
    _, ep, _ = models.export("mixed")
    inner = PassManager([Decompose(), FxPass(add_to_sub)], name="inner")
    assert isinstance(inner, Pass)
    result = PassManager([inner, add_constant])(ep)
    assert result.program.state_dict is ep.state_dict
    assert result.program.constants is not ep.constants
    children = result.records[0].children
    assert [c.link.owners for c in children if c.link is not None] == [
        {"state_dict": "user", "constants": "user"}
    ] * len([c for c in children if c.link is not None])
    assert result.records[1].link.owners == {"state_dict": "user", "constants": "own"}
    assert [r.name for r in result.records] == ["inner", "add_constant"]
    assert [c.name for c in result.records[0].children] == ["decompose", "add_to_sub"]
    assert result.records[0].children[0].depth == 1


def test_nested_failure_names_both_levels_and_rolls_back():
    _, ep, _ = models.export("mixed")
    before = fingerprint(ep)
    inner = PassManager([add_constant, Boom()], name="inner")
    with pytest.raises(PassError) as info:
        PassManager([add_constant, inner]).run(ep)
    assert info.value.pass_name == "inner" and info.value.index == 1
    assert "boom" in str(info.value)
    assert fingerprint(ep) == before


class CountDown:
    """Modifies the program until it has been called ``n`` times."""

    name = "countdown"
    changes_input = False

    def __init__(self, n):
        self.left = n

    def __call__(self, ep):
        if self.left == 0:
            return PassResult(ep, False)
        self.left -= 1
        clone = _program.shallow_clone(ep)
        return PassResult(clone, True)


def test_steps_stop_at_a_fixed_point():
    _, ep, _ = models.export("mlp")
    result = PassManager([CountDown(2)], steps=10)(ep)
    assert [r.modified for r in result.records] == [True, True, False]
    assert [r.step for r in result.records] == [0, 1, 2]


def test_steps_are_bounded():
    _, ep, _ = models.export("mlp")
    result = PassManager([CountDown(100)], steps=3)(ep)
    assert len(result.records) == 3


def test_ensures_sees_the_result_and_requires_the_input():
    _, ep, _ = models.export("mlp")
    seen = {}

    class Checked:
        name = "checked"

        def requires(self, program):
            seen["requires"] = program.dialect
            return True

        def __call__(self, program):
            return Decompose()(program)

        def ensures(self, program):
            seen["ensures"] = program.dialect
            return aten.linear.default not in {n.target for n in program.graph.nodes}

    PassManager([Checked()]).run(ep)
    assert seen == {"requires": "TRAINING", "ensures": "ATEN"}


def test_failed_precondition_names_the_pass():
    _, ep, _ = models.export("mlp")

    def picky(program):
        return program

    picky.requires = lambda program: False
    with pytest.raises(PassError, match=r"picky.*precondition"):
        PassManager([picky]).run(ep)


def test_skip_reason_skips_and_records_why():
    _, ep, _ = models.export("mlp")

    class Lazy:
        name = "lazy"

        def skip_reason(self, program):
            return "nothing to do"

        def __call__(self, program):
            raise AssertionError("must not run")

    result = PassManager([Lazy()])(ep)
    assert result.records[0].skipped and result.records[0].skip_reason == "nothing to do"
    assert result.program is ep


# --- verification ---


def test_verification_names_the_pass():
    _, ep, _ = models.export("mlp")

    def lose_weight(program):
        clone = _program.shallow_clone(program)
        sd = dict(program.state_dict)
        sd.pop("net.0.weight")
        _program.set_state(clone, sd, dict(program.constants))
        return PassResult(clone, True)

    with pytest.raises(VerificationError, match=r"lose_weight.*net\.0\.weight"):
        PassManager([lose_weight]).run(ep)
    PassManager([lose_weight], verify=False).run(ep)


# --- ordering ---


class First:
    name = "first"
    run_before = ("second",)

    def __call__(self, ep):
        return ep


class Second:
    name = "second"
    run_after = (First,)

    def __call__(self, ep):
        return ep


def test_ordering_constraints_are_checked_at_construction():
    PassManager([First(), Second()])
    with pytest.raises(
        OrderingError, match=r"'first' at position 1 must run before pass 'second' at position 0"
    ):
        PassManager([Second(), First()])


def test_ordering_cycles_are_reported():
    class A:
        name = "a"
        run_before = ("b",)

        def __call__(self, ep):
            return ep

    class B:
        name = "b"
        run_before = ("a",)

        def __call__(self, ep):
            return ep

    with pytest.raises(OrderingError, match="cycle"):
        PassManager([A(), B()])


# --- bad input ---


def test_non_passes_are_rejected_with_their_position():
    with pytest.raises(TypeError, match=r"pipeline position 1: 42 \(int\) is not a pass"):
        PassManager([Decompose(), 42])
    with pytest.raises(TypeError, match="list of passes"):
        PassManager(Decompose())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps"):
        PassManager([], steps=0)


@pytest.mark.parametrize(("returned", "shown"), [(None, "None"), (123, "123"), ("text", "'text'")])
def test_bad_return_values_name_the_pass(returned, shown):
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)

    def liar(program):
        return returned

    with pytest.raises(PassError) as info:
        PassManager([liar]).run(ep)
    assert "liar" in str(info.value) and shown in str(info.value)
    assert fingerprint(ep) == before


def test_the_manager_wants_an_exported_program():
    with pytest.raises(TypeError, match="ExportedProgram"):
        PassManager([Decompose()]).run(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_empty_pipeline_returns_the_input():
    _, ep, _ = models.export("mlp")
    result = PassManager([])(ep)
    assert result.program is ep and not result.modified and result.records == ()


def test_fx_pass_registering_a_tensor_gets_it_lifted_to_constants():
    eager, ep, args = models.export("mlp")
    ep = PassManager([Decompose()]).run(ep)

    def add_offset(gm):
        gm.register_buffer("offset", torch.full((4,), 0.25))
        out = gm.graph.output_node()
        value = out.args[0][0]
        with gm.graph.inserting_before(out):
            offset = gm.graph.get_attr("offset")
            shifted = gm.graph.call_function(aten.add.Tensor, (value, offset))
        out.args = ((shifted,),)
        gm.recompile()
        return gm

    result = PassManager([FxPass(add_offset)])(ep)
    out = result.program
    assert out.state_dict is ep.state_dict and "offset" not in ep.constants
    assert result.records[0].link.constants.added == ("offset",)
    torch.testing.assert_close(out.module()(*args), eager(*args) + 0.25)


class _CondModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(
            x.sum() > 0, lambda x: self.linear(x).relu(), lambda x: self.linear(x).sigmoid(), (x,)
        )


def test_graph_mutating_pass_gets_a_copy_when_submodules_are_shared_with_the_user():
    ep = torch.export.export(_CondModule(), (torch.randn(2, 4),))
    before = {name: sub.code for name, sub in ep.graph_module.named_children()}

    def new_top_level(ep):
        # A new top-level graph whose cond branches are the input's GraphModules.
        gm = torch.fx.GraphModule(ep.graph_module, copy.deepcopy(ep.graph_module.graph))
        return PassResult(_graph.build_program(ep, gm), True)

    new_top_level.changes_input = False

    def edit_branches(ep):
        for sub in ep.graph_module.children():
            for node in sub.graph.nodes:
                if node.target is aten.relu.default:
                    node.target = aten.tanh.default
            sub.recompile()
        return PassResult(ep, True)

    out = PassManager([new_top_level, edit_branches]).run(ep)
    assert {name: sub.code for name, sub in ep.graph_module.named_children()} == before
    assert "tanh" in out.graph_module.true_graph_0.code


def test_strict_policy_error_names_the_position_step_and_previous_passes():
    _, ep, _ = models.export("mlp")
    pm = PassManager([identity_pass, double_first_param], linker=StateLinker(policy="strict"))
    with pytest.raises(StateConflictError) as info:
        pm.run(ep)
    error = info.value
    assert (error.pass_name, error.index, error.step) == ("double_first_param", 1, 0)
    assert error.previous == ("identity_pass",)
    assert str(error).startswith("pass 'double_first_param' (position 1, step 0) failed: ")


def test_in_place_write_by_a_pass_that_then_raises_is_named():
    # The bytes cannot be restored, but the error must say the user's state was written.
    _, ep, _ = models.export("seed")

    def bump_then_fail(program):
        program.state_dict["count"].add_(1)
        raise RuntimeError("gave up half way")

    with pytest.raises(StateMutationError) as info:
        PassManager([bump_then_fail]).run(ep)
    assert info.value.keys == ("state_dict:count",)
    assert info.value.pass_name == "bump_then_fail"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_fx_pass_that_edits_only_a_cond_branch_is_applied():
    ep = torch.export.export(_CondModule(), (torch.randn(2, 4),))
    before = fingerprint(ep)

    def relu_to_tanh_in_branches(gm):
        for sub in gm.children():
            for node in sub.graph.nodes:
                if node.target is aten.relu.default:
                    node.target = aten.tanh.default
            sub.recompile()
        return gm

    result = PassManager([FxPass(relu_to_tanh_in_branches)])(ep)
    assert result.modified
    assert "tanh" in result.program.graph_module.true_graph_0.code
    x = torch.ones(2, 4)
    expected = torch.tanh(torch.nn.functional.linear(x, *ep.state_dict.values()))
    torch.testing.assert_close(result.program.module()(x), expected)
    assert fingerprint(ep) == before


def test_nested_strict_conflict_keeps_its_type_and_keys():
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)
    inner = PassManager([double_first_param], linker=StateLinker(policy="strict"), name="inner")
    with pytest.raises(StateConflictError) as info:
        PassManager([identity_pass, inner]).run(ep)
    assert (info.value.pass_name, info.value.index) == ("inner", 1)
    assert info.value.keys == ("state_dict:net.0.weight",)
    assert "double_first_param" in str(info.value)
    assert fingerprint(ep) == before


def test_nested_instrument_error_keeps_its_type():
    class Raises(epass.instruments.Instrument):
        def after_pass(self, info, program, record):
            raise RuntimeError("instrument broke")

    _, ep, _ = models.export("mlp")
    inner = PassManager([Decompose()], instruments=[Raises()], name="inner")
    with pytest.raises(epass.InstrumentError) as info:
        PassManager([inner]).run(ep)
    assert (info.value.instrument, info.value.hook) == ("Raises", "after_pass")
    assert info.value.pass_name == "inner"


class _TwoParams(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((2,), 2.0))
        self.b = torch.nn.Parameter(torch.full((2,), 10.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a - self.b


def test_fx_pass_that_reorders_placeholders_keeps_each_ones_spec():
    ep = torch.export.export(_TwoParams(), (torch.ones(2),))

    def swap(gm):
        first, second = [n for n in gm.graph.nodes if n.op == "placeholder"][:2]
        first.prepend(second)  # same placeholders, other order
        gm.recompile()
        return gm

    out = PassManager([FxPass(swap)]).run(ep)
    targets = {s.arg.name: s.target for s in out.graph_signature.input_specs}
    assert targets["p_a"] == "a" and targets["p_b"] == "b"
    torch.testing.assert_close(out.module()(torch.ones(2)), ep.module()(torch.ones(2)))


class _Hooked:
    """A duck-typed instrument: one known hook, no base class."""

    def after_pass(self, info, program, record):
        pass


@pytest.mark.parametrize(
    ("instruments", "message"),
    [
        ("abc", r"instruments must be a list of instruments, got str"),
        (b"abc", r"instruments must be a list of instruments, got bytes"),
        (5, r"instruments must be a list of instruments, got int"),
        ([_Hooked(), "abc"], r"instruments\[1\] \(str\) is not an instrument"),
        ([object()], r"instruments\[0\] \(object\) is not an instrument"),
        ([epass.Timing], r"instruments\[0\] is the class Timing; pass an instance"),
    ],
    ids=["str", "bytes", "int", "str-item", "object-item", "class-item"],
)
def test_instruments_that_are_not_instruments_are_a_type_error(instruments, message):
    with pytest.raises(ArgumentTypeError, match=message):
        PassManager([], instruments=instruments)


def test_duck_typed_instruments_are_accepted():
    pm = PassManager([], instruments=(i for i in [_Hooked(), epass.Timing()]))
    assert len(pm.instruments) == 2


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"aten.relu.default": abs}, r"keys must be operators .* got 'aten.relu.default' \(str\)"),
        ({5: abs}, r"keys must be operators .* got 5 \(int\)"),
        ({aten.relu.default: abs, None: abs}, r"got None \(NoneType\)"),
        ("aten.relu.default", r"'table' of pass 'decompose' takes dict.* got .* \(str\)"),
        ("", r"'table' of pass 'decompose' takes dict.* got \"\" \(str\)"),
        (5, r"'table' of pass 'decompose' takes dict.* got 5 \(int\)"),
        ({aten.relu.default: 5}, r"'table' of pass 'decompose' takes dict\[any, function\]"),
    ],
    ids=[
        "str-key",
        "int-key",
        "none-key",
        "str-table",
        "empty-str-table",
        "int-table",
        "int-entry",
    ],
)
def test_decompose_table_keys_must_be_operators(table, message):
    with pytest.raises(ArgumentTypeError, match=message):
        Decompose(table=table)


def test_decompose_table_takes_overloads_and_packets():
    assert Decompose(table={aten.relu.default: abs, aten.gelu: abs}).table is not None


@pytest.mark.parametrize("value", ["x", None, torch.nn.Linear(2, 2)])
def test_verify_program_wants_an_exported_program(value):
    with pytest.raises(ArgumentTypeError, match="verify_program takes an ExportedProgram"):
        epass.verify_program(value)

"""The user's program never sees an entry it did not have: copy on add."""

from __future__ import annotations

import io
import threading
import zipfile

import models
import pytest
import torch
from fingerprint import fingerprint
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import epass
from epass import PassManager, PassResult, StateLinker, registry
from epass.passes import ConstantFold, FuseConvBN, presets


class FoldsAndLifts(nn.Module):
    """A non-persistent buffer through ``exp`` (folds), a ``torch.tensor(...)``
    constant (lifted by export) and conv + BatchNorm (fuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("temperature", torch.linspace(-1, 1, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x)).mean(dim=(2, 3))
        bias = torch.tensor([0.5, -0.5, 1.0, 0.0])
        return y * torch.exp(self.temperature) + bias


def _export() -> tuple[nn.Module, torch.export.ExportedProgram, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    module = FoldsAndLifts().eval()
    module.bn.running_mean.uniform_(-0.5, 0.5)
    module.bn.running_var.uniform_(0.5, 1.5)
    args = (torch.randn(2, 3, 6, 6),)
    return module, torch.export.export(module, args), args


def _pipelines() -> dict[str, PassManager]:
    return {
        "lower": presets.lower(),
        "cleanup": presets.cleanup(),
        "fuse-conv-bn": PassManager([FuseConvBN()]),
        "lower+fuse": PassManager([presets.lower(), FuseConvBN()]),
    }


def _keys(ep: torch.export.ExportedProgram) -> tuple[list[str], list[str]]:
    return list(ep.state_dict), list(ep.constants)


def _members(ep: torch.export.ExportedProgram) -> list[str]:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return sorted(archive.namelist())


@pytest.mark.parametrize("name", list(_pipelines()))
def test_pipelines_that_fold_lift_and_fuse_leave_the_users_keys_as_they_were(name):
    module, ep, args = _export()
    before = fingerprint(ep)
    out = _pipelines()[name].run(ep)
    assert fingerprint(ep) == before
    assert out.state_dict is ep.state_dict
    added = {s.target for s in out.graph_signature.input_specs} - set(ep.state_dict)
    assert added - set(ep.constants), "the pipeline was meant to add entries"
    torch.testing.assert_close(out.module()(*args), module(*args))


@pytest.mark.parametrize("name", list(_pipelines()))
def test_unflatten_works_on_the_users_program_and_on_the_output(name):
    module, ep, args = _export()
    out = _pipelines()[name].run(ep)
    expected = module(*args)
    torch.testing.assert_close(torch.export.unflatten(ep)(*args), expected)
    torch.testing.assert_close(torch.export.unflatten(out)(*args), expected)


def test_saving_the_users_program_writes_the_same_archive_members_after_a_run():
    _, ep, _ = _export()
    before = _members(ep)
    for pipeline in _pipelines().values():
        pipeline.run(ep)
    assert _members(ep) == before


def test_five_lowerings_leave_the_users_dicts_unchanged():
    module, ep, args = _export()
    before = fingerprint(ep)
    outputs = [presets.lower().run(ep) for _ in range(5)]
    assert fingerprint(ep) == before
    for out in outputs:
        torch.testing.assert_close(out.module()(*args), module(*args))


@pytest.mark.parametrize("preset", ["lower", "cleanup"])
@pytest.mark.parametrize("case", ["mixed", "convbn", "mlp", "no_constants"])
def test_every_preset_output_shares_the_users_state_dict(preset, case):
    _, ep, _ = models.export(case)
    out = getattr(presets, preset)().run(ep)
    assert out.state_dict is ep.state_dict


def test_fused_conv_bn_values_are_constants_of_the_output():
    _, ep, _ = _export()
    result = PassManager([FuseConvBN()])(ep)
    out = result.program
    assert out.state_dict is ep.state_dict
    assert set(ep.constants) < set(out.constants) and out.constants is not ep.constants
    fused = set(out.constants) - set(ep.constants)
    assert fused == {"conv.weight_fused", "conv.bias_fused"}
    assert all(not isinstance(out.constants[k], nn.Parameter) for k in fused)
    kinds = {s.target: s.kind.name for s in out.graph_signature.input_specs}
    assert {kinds[k] for k in fused} == {"CONSTANT_TENSOR"}
    link = result.records[0].link
    assert link is not None and link.state_dict.owner == "user" and link.constants.owner == "own"


def test_an_output_that_adds_constants_owns_a_dict_of_the_users_tensor_objects():
    _, ep, _ = _export()
    out = presets.lower().run(ep)
    assert out.constants is not ep.constants
    shared = set(out.constants) & set(ep.constants)
    assert all(out.constants[k] is ep.constants[k] for k in shared)


def test_an_output_that_adds_no_constant_shares_the_users_constants():
    _, ep, _ = models.export("mixed")
    out = PassManager([epass.Decompose()]).run(ep)
    assert out.constants is ep.constants and out.state_dict is ep.state_dict


def test_an_empty_constants_dict_of_the_user_never_gains_a_key():
    _, ep, _ = models.export("convbn")
    assert ep.constants == {}
    empty = ep.constants
    out = PassManager([FuseConvBN()]).run(ep)
    assert ep.constants is empty and empty == {}
    assert out.constants and out.constants is not empty


def add_scale_parameter(ep):
    """A third-party pass that adds a parameter input the graph multiplies by."""
    from torch.export.graph_signature import InputKind

    from epass import _graph

    gm = _graph.copy_graph(ep)
    value = nn.Parameter(torch.full((4,), 3.0))
    kinds = _graph.input_kinds(ep)
    ph = _graph.new_state_placeholder(gm, kinds, "p_extra_scale", value, InputKind.PARAMETER)
    out = gm.graph.output_node()
    (result,) = out.args[0]
    with gm.graph.inserting_before(out):
        scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (result, ph))
    root = next(iter(result.meta["nn_module_stack"].items()))
    scaled.meta["nn_module_stack"] = dict([root])  # a root-level op, for unflatten
    out.args = ((scaled,),)
    _graph.fill_meta(gm)
    state_dict = {**ep.state_dict, "extra_scale": value}
    specs = {ph.name: _graph.parameter_spec(ph.name, "extra_scale")}
    return PassResult(_graph.build_program(ep, gm, new_specs=specs, state_dict=state_dict), True)


def test_a_third_party_pass_adding_a_parameter_gets_its_own_state_dict():
    module, ep, args = models.export("mlp")
    before = fingerprint(ep)
    result = PassManager([add_scale_parameter])(ep)
    out = result.program
    assert fingerprint(ep) == before
    assert out.state_dict is not ep.state_dict
    assert isinstance(out.state_dict["extra_scale"], nn.Parameter)
    assert all(out.state_dict[k] is v for k, v in ep.state_dict.items())
    link = result.records[0].link
    assert link is not None and link.state_dict.added == ("extra_scale",)
    assert link.owners == {"state_dict": "own", "constants": "user"}
    torch.testing.assert_close(out.module()(*args), module(*args) * 3.0)
    torch.testing.assert_close(torch.export.unflatten(out)(*args), module(*args) * 3.0)


@pytest.mark.parametrize("policy", ["share", "strict", "in_place"])
def test_no_linker_policy_inserts_an_added_key_into_the_users_dicts(policy):
    _, ep, _ = _export()
    state_dict, constants = map(set, _keys(ep))
    out = PassManager([ConstantFold()], linker=StateLinker(policy=policy)).run(ep)
    assert set(ep.state_dict) <= state_dict and set(ep.constants) <= constants
    assert set(out.constants) - constants
    if policy != "in_place":  # which deletes the entries its output dropped
        assert (set(ep.state_dict), set(ep.constants)) == (state_dict, constants)


def test_the_standalone_linker_gives_an_output_with_added_constants_its_own_dict():
    _, ep, _ = _export()
    before = _keys(ep)
    folded = ConstantFold()(ep).program
    linked = StateLinker().link(ep, folded)
    assert _keys(ep) == before
    assert linked.program.constants is not ep.constants
    assert linked.report.constants.added and linked.report.constants.owner == "own"
    assert linked.report.state_dict.owner == "user"


def test_threads_lowering_one_program_never_add_a_key_to_its_dicts():
    _, ep, _ = _export()
    before = fingerprint(ep)
    errors: list[BaseException] = []

    def lower() -> None:
        try:
            for _ in range(2):
                PassManager([ConstantFold(), FuseConvBN()]).run(ep)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=lower) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert fingerprint(ep) == before


def test_a_run_that_fails_or_is_interrupted_after_adding_leaves_the_users_dicts_alone():
    _, ep, _ = _export()
    before = fingerprint(ep)

    def interrupt(view):
        raise KeyboardInterrupt

    def fail(view):
        raise RuntimeError("boom")

    with pytest.raises(KeyboardInterrupt):
        PassManager([ConstantFold(), FuseConvBN(), interrupt]).run(ep)
    with pytest.raises(epass.PassError):
        PassManager([ConstantFold(), FuseConvBN(), fail]).run(ep)
    assert fingerprint(ep) == before


_BUILTIN_NAMES = sorted(registry.BUILTIN_TARGETS)


def _case(name: str) -> torch.export.ExportedProgram:
    return _export()[1] if name == "folds_and_lifts" else models.export(name)[1]


@settings(
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    case=st.sampled_from(["folds_and_lifts", "mixed", "convbn", "seed"]),
    names=st.lists(st.sampled_from(_BUILTIN_NAMES), min_size=1, max_size=4),
)
@example(case="convbn", names=["fuse-conv-bn"])
@example(case="folds_and_lifts", names=["decompose", "fold-constants", "dce"])
@example(case="mixed", names=["lift-constants", "cast-dtype"])
def test_no_pipeline_of_built_ins_adds_a_key_to_the_users_dicts(case, names):
    ep = _case(case)
    before = fingerprint(ep)
    out = PassManager(names).run(ep)
    assert fingerprint(ep) == before
    if "cast-dtype" not in names:  # the one built-in that changes values
        assert out.state_dict is ep.state_dict


def test_an_own_dict_is_copied_without_the_entries_a_later_pass_drops():
    _, ep, _ = models.export("mlp")
    seen: list[torch.export.ExportedProgram] = []

    class Keep:
        def after_pass(self, info, program, record):
            seen.append(program)

    def add(view):
        view.constants["extra"] = torch.ones(1)
        return PassResult(view, True)

    def drop(view):
        del view.constants["extra"]
        return PassResult(view, True)

    result = PassManager([add, drop], instruments=[Keep()])(ep)
    assert "extra" not in result.program.constants and "extra" not in ep.constants
    assert "extra" in seen[0].constants  # the earlier output keeps what it held
    assert result.records[1].link.constants.removed == ("extra",)
    assert result.owners == {"state_dict": "user", "constants": "own"}


def test_an_output_dropping_a_users_entry_still_shares_the_users_dict():
    _, ep, _ = models.export("mixed")

    def drop(view):
        view.state_dict.pop("scale")
        return PassResult(view, True)

    result = PassManager([drop], verify=False)(ep)
    assert result.program.state_dict is ep.state_dict and "scale" in ep.state_dict
    assert result.records[0].link.state_dict.removed == ("scale",)


def test_tvm_reads_the_users_program_and_the_output_right_after_a_lowering():
    # TVM's importer binds the constants values in order: an entry the program
    # does not reference shifts them and gives wrong numbers, silently.
    tvm = pytest.importorskip("tvm")
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    module, ep, args = _export()
    expected = module(*args).detach()
    out = presets.lower().run(ep)
    for program in (ep, out):
        mod = from_exported_program(program, keep_params_as_input=False)
        vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
        result = vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in args])
        got = torch.from_numpy(result[0].numpy())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

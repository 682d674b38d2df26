"""Loud failures when torch changes the private ExportedProgram API epass relies on."""

from __future__ import annotations

import copy
import inspect
import threading
import warnings

import models
import pytest
import torch
from torch.export import ExportedProgram
from torch.fx._lazy_graph_module import _LazyGraphModule

from epass import _graph, _operators, _program, _pt2, _tensors, _validated
from epass._torch import internals, programs
from epass.errors import ProgramError
from epass.verification import verify_program


def test_private_fields_exist_and_back_the_public_properties():
    _, ep, _ = models.export("mixed")
    fields = "torch.export.exported_program.ExportedProgram."
    for field in [p.removeprefix(fields) for p in internals.INTERNALS if p.startswith(fields)]:
        assert hasattr(ep, field), f"torch renamed ExportedProgram.{field}"
    assert ep._state_dict is ep.state_dict
    assert ep._constants is ep.constants
    assert ep._graph_module is ep.graph_module
    assert ep._graph_signature is ep.graph_signature
    assert ep._module_call_graph is ep.module_call_graph
    assert ep._range_constraints is ep.range_constraints
    assert ep._example_inputs is ep.example_inputs
    assert ep._verifiers[0] is ep.verifier


def test_set_state_swaps_dicts_without_copying():
    _, ep, _ = models.export("mixed")
    clone = _program.shallow_clone(ep)
    sd, consts = dict(ep.state_dict), dict(ep.constants)
    _program.set_state(clone, sd, consts)
    assert clone.state_dict is sd and clone.constants is consts
    assert ep.state_dict is not sd  # the original keeps its own
    clone.validate()


def test_set_signature_swaps_the_signature_without_validating():
    _, ep, _ = models.export("mixed")
    clone = _program.shallow_clone(ep)
    sig = type(ep.graph_signature)(
        input_specs=list(ep.graph_signature.input_specs),
        output_specs=list(ep.graph_signature.output_specs),
    )
    _program.set_signature(clone, sig)
    assert clone.graph_signature is sig and ep.graph_signature is not sig
    clone.validate()


def test_private_view_copies_dicts_and_optionally_the_graph():
    _, ep, _ = models.export("mixed")
    shallow = _program.private_view(ep, copy_graph=False)
    assert shallow.graph_module is ep.graph_module
    assert shallow.state_dict is not ep.state_dict and shallow.state_dict == ep.state_dict
    deep = _program.private_view(ep, copy_graph=True)
    assert deep.graph_module is not ep.graph_module
    assert deep.graph is not ep.graph
    assert deep.graph_module.code == ep.graph_module.code
    assert deep.graph_signature is not ep.graph_signature
    assert all(deep.state_dict[k] is v for k, v in ep.state_dict.items())


def test_copy_graph_module_copies_nested_graph_modules():
    class Cond(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    ep = torch.export.export(Cond(), (torch.randn(3),))
    gm = ep.graph_module
    copied = _program.copy_graph_module(gm)
    subs = [n for n, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert subs, "expected cond branches as submodules"
    for name in subs:
        assert getattr(copied, name) is not getattr(gm, name)
        assert getattr(copied, name).code == getattr(gm, name).code


def test_exported_program_constructor_keywords_are_unchanged():
    params = inspect.signature(ExportedProgram.__init__).parameters
    for name in (
        "root",
        "graph",
        "graph_signature",
        "state_dict",
        "range_constraints",
        "module_call_graph",
        "example_inputs",
        "constants",
        "verifiers",
    ):
        assert name in params, f"ExportedProgram.__init__ lost {name!r}"


def test_range_constraint_helper_exists():
    from torch.export.exported_program import _get_updated_range_constraints

    assert list(inspect.signature(_get_updated_range_constraints).parameters)[:2] == [
        "gm",
        "old_range_constraints",
    ]
    _, ep, _ = models.export("mlp", dynamic=True)
    assert _get_updated_range_constraints(ep.graph_module, ep.range_constraints)


def test_new_program_round_trips():
    _, ep, args = models.export("mixed")
    gm = _program.copy_graph_module(ep.graph_module)
    out = _program.new_program(ep, gm, ep.graph_signature, dict(ep.state_dict), dict(ep.constants))
    assert out.graph_signature == ep.graph_signature
    torch.testing.assert_close(out.module()(*args), ep.module()(*args))


def test_new_program_generates_its_code_when_first_read_or_called():
    # torch's constructor makes the module with
    # torch.export.exported_program._create_graph_module_for_export, pinned: replaced
    # for the one call, for the calling thread only, and put back.
    from torch.export import exported_program as module

    made_with = module._create_graph_module_for_export
    _, ep, args = models.export("mixed")
    gm = _program.copy_graph_module(ep.graph_module)
    seen: list[type] = []

    def other_thread() -> None:  # gets torch's function meanwhile
        seen.append(type(module._create_graph_module_for_export(torch.nn.Module(), gm.graph)))

    original_init = ExportedProgram.__init__

    def init(self: ExportedProgram, *a: object, **k: object) -> None:
        original_init(self, *a, **k)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()

    ExportedProgram.__init__ = init  # type: ignore[method-assign]
    try:
        out = _program.new_program(
            ep, gm, ep.graph_signature, dict(ep.state_dict), dict(ep.constants)
        )
    finally:
        ExportedProgram.__init__ = original_init  # type: ignore[method-assign]
    assert module._create_graph_module_for_export is made_with
    assert [issubclass(t, _LazyGraphModule) for t in seen] == [False]
    assert isinstance(out.graph_module, _LazyGraphModule)
    assert "_code" not in vars(out.graph_module)  # nothing generated yet
    assert out.graph_module.code == ep.graph_module.code
    flat = _program.flat_inputs(ep, args, {})
    torch.testing.assert_close(out.graph_module(*flat), ep.graph_module(*flat))
    torch.testing.assert_close(out.module()(*args), ep.module()(*args))


def test_build_program_round_trips_an_untagged_copy():
    _, ep, args = models.export("mixed")
    gm = _program.copy_graph_module(ep.graph_module)
    out = _graph.build_program(ep, gm)
    assert out.graph_signature == ep.graph_signature
    torch.testing.assert_close(out.module()(*args), ep.module()(*args))


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(2)
    v = _tensors.tensor_version(t)
    t.add_(1)
    assert _tensors.tensor_version(t) == v + 1
    assert _tensors.tensor_version("not a tensor") is None


def test_tensor_marks_read_each_version_and_requires_grad_flag():
    a, b = torch.zeros(2), torch.nn.Parameter(torch.zeros(2))
    with torch.inference_mode():
        c = torch.zeros(2)  # an inference tensor has no version counter
    before = _tensors.tensor_marks([a, b, c])
    assert before == [(_tensors.tensor_version(a), False), (_tensors.tensor_version(b), True),
                      (None, False)]  # fmt: skip
    a.add_(1)
    b.requires_grad_(False)
    assert _tensors.tensor_marks([a, b, c]) == [
        (before[0][0] + 1, False), (before[1][0], False), (None, False)
    ]  # fmt: skip


def test_same_view_reads_no_bytes_and_checks_layout():
    t = torch.randn(4, 4)
    assert _tensors.same_view(t, t.view(4, 4))
    assert not _tensors.same_view(t, t.t())
    assert not _tensors.same_view(t, t.clone())
    assert not _tensors.same_view(t, t[1:])
    assert not _tensors.same_view(t, t.view(torch.int32))
    p = torch.nn.Parameter(t)
    assert not _tensors.same_view(p, t)
    assert _tensors.same_view(p, torch.nn.Parameter(t))
    m1, m2 = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    assert not _tensors.same_view(m1, m2)
    assert _tensors.same_view(torch.empty(0), torch.empty(0))


def test_same_view_sees_lazy_conjugate_and_negative_views():
    # conj() and the imaginary part of a conjugate share memory, strides and offset
    # with the original but read different values (a lazy bit on the tensor).
    c = torch.randn(3, dtype=torch.complex64)
    assert not _tensors.same_view(c, c.conj())
    assert not _tensors.same_view(c.imag, c.conj().imag)
    assert _tensors.same_view(c.conj(), c.conj())


def test_copy_graph_module_keeps_names_that_shadow_builtins():
    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(3, 3)), (torch.randn(2, 3),))
    names = [n.name for n in ep.graph.nodes]
    assert "input" in names  # torch.export names nn.Sequential's argument `input`
    copied = _program.copy_graph_module(ep.graph_module)
    assert [n.name for n in copied.graph.nodes] == names
    assert "input" in copied.code
    # The namespace knows the name, so new nodes cannot collide with it.
    node = copied.graph.create_node("placeholder", "input")
    assert node.name != "input"


def test_fx_pass_keeps_the_user_input_name():
    from epass import FxPass, PassManager

    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(3, 3)), (torch.randn(2, 3),))

    def touch(gm):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.linear.default:
                node.target = torch.ops.aten.linear.default
        gm.recompile()
        return torch.fx.passes.infra.pass_base.PassResult(gm, True)

    out = PassManager([FxPass(touch)]).run(ep)
    assert out.graph_signature.user_inputs == ep.graph_signature.user_inputs


def test_operator_checks_know_aten_overloads():
    assert _operators.is_operator(torch.ops.aten.linear.default)
    assert _operators.is_op_overload(torch.ops.aten.linear.default)
    assert not _operators.is_op_overload(torch.ops.aten.linear)  # a packet, not an overload
    assert not _operators.is_operator("aten.linear.default")
    assert _operators.is_op_packet(torch.ops.aten.linear)
    assert not _operators.is_op_packet(torch.ops.aten.linear.default)
    assert not _operators.is_op_packet("aten.linear")
    schema = _operators.op_schema(torch.ops.aten.add_.Tensor)
    assert schema is not None and schema.is_mutable
    assert _operators.op_schema(len) is None


aten = torch.ops.aten


def test_op_overload_and_mutability():
    assert _operators.is_op_overload(aten.add.Tensor)
    assert not _operators.is_op_overload(aten.add)
    assert not _operators.is_op_overload(torch.ops.higher_order.cond)
    assert _operators.is_mutable_op(aten.add_.Tensor)
    assert not _operators.is_mutable_op(aten.add.Tensor)


def test_is_higher_order_knows_cond_and_not_aten_ops():
    assert _operators.is_higher_order(torch.ops.higher_order.cond)
    assert _operators.is_higher_order(torch.ops.higher_order.while_loop)
    assert not _operators.is_higher_order(aten.add.Tensor)
    assert not _operators.is_higher_order(len)


# --- same_view (the linker's per-entry check) -----------------------------------------


def test_same_view_relinks_new_objects_over_the_same_memory():
    base = torch.zeros(16)
    assert _tensors.same_view(base, base.detach())
    assert _tensors.same_view(torch.zeros(0), torch.zeros(0))
    p = torch.nn.Parameter(torch.zeros(3))
    assert _tensors.same_view(p, torch.nn.Parameter(p.detach()))


def test_same_view_rejects_any_other_geometry_dtype_or_kind():
    base = torch.zeros(16)
    assert not _tensors.same_view(base, base.view(torch.int32))
    assert not _tensors.same_view(base, base[1:])
    assert not _tensors.same_view(base, base.view(4, 4))
    assert not _tensors.same_view(base.view(4, 4), base.view(4, 4).t())
    assert not _tensors.same_view(base, torch.zeros(16))
    p = torch.nn.Parameter(torch.zeros(3))
    assert not _tensors.same_view(p, p.detach())
    meta = torch.empty(3, device="meta")
    assert not _tensors.same_view(meta, meta.detach())
    sparse = torch.eye(3).to_sparse()
    assert not _tensors.same_view(sparse, sparse.detach())
    assert not _tensors.same_view(1, 1.0)


def test_is_set_to_never_matches_lazy_views():
    # same_view's fast path relies on this: is_set_to resolves conj/neg views.
    c = torch.randn(3, dtype=torch.complex64)
    assert not c.is_set_to(c.conj()) and not c.conj().is_set_to(c)
    assert not c.conj().is_set_to(c.conj())
    negative = c.conj().imag
    assert negative.is_neg() and not c.imag.is_set_to(negative)
    assert c.is_set_to(c.view(3))


def test_tree_leaves_flattens_nested_outputs():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert _tensors.tree_leaves((a, [b, {"c": c}])) == [a, b, c]


def test_export_schema_is_the_dataclass_tree_behind_model_json() -> None:
    import dataclasses
    import typing

    root, version, union = _pt2.export_schema()
    assert dataclasses.is_dataclass(root) and root.__name__ == "ExportedProgram"
    assert {"graph_module", "schema_version", "guards_code"} <= {
        f.name for f in dataclasses.fields(root)
    }
    assert len(version) == 2 and all(isinstance(v, int) for v in version)
    graph_module = typing.get_type_hints(root)["graph_module"]
    graph = typing.get_type_hints(graph_module)["graph"]
    argument = typing.get_args(typing.get_type_hints(graph)["inputs"])[0]
    assert issubclass(argument, union)  # one key per JSON object


def test_serialized_builtin_targets_are_named_as_torch_writes_them() -> None:
    targets = _pt2.serialized_builtin_targets()
    assert {"_operator.getitem", "_operator.add", "torch.sym_max", "math.trunc"} <= targets
    assert not any(t.startswith("torch.ops.") for t in targets)


def test_pytree_type_names_include_the_builtin_containers() -> None:
    assert {"builtins.tuple", "builtins.list", "builtins.dict"} <= _pt2.pytree_type_names()


def test_the_verifier_reads_what_still_validated_compares():
    # _validated._verified_state lists what torch's base Verifier reads; a check
    # torch adds would read something the comparison may not cover.
    import inspect

    from torch._export.verifier import Verifier

    body = inspect.getsource(Verifier.check)
    calls = [line.strip() for line in body.splitlines() if line.strip()]
    calls = [c for c in calls if not c.startswith(("def ", "@"))]
    assert calls == [
        "self._check_graph_module(ep.graph_module)",
        "_verify_exported_program_module_call_graph(ep)",
        "_verify_exported_program_signature(ep)",
    ]
    init = inspect.getsource(torch.export.ExportedProgram.__init__)
    assert "self.validate()" in init


def test_a_program_new_program_built_counts_as_validated_until_it_changes():
    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    built = _program.new_program(
        ep, ep.graph_module, ep.graph_signature, ep.state_dict, ep.constants
    )
    assert _validated.still_validated(built)
    assert _validated.still_validated(_program.shallow_clone(built))
    assert not _validated.still_validated(ep)  # torch built it; epass never saw it validated
    node = next(n for n in built.graph.nodes if n.op == "call_function")
    node.meta["val"] = node.meta["val"].clone()
    assert not _validated.still_validated(built)


class _Split(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, 2)
        return a * b


def _edit_item_of_a_list_value(ep: ExportedProgram) -> None:
    split = next(n for n in ep.graph.nodes if isinstance(n.meta.get("val"), (list, tuple)))
    split.meta["val"][0] = split.meta["val"][1]  # an item of the list, in place


def _lengthen_a_list_value(ep: ExportedProgram) -> None:
    split = next(n for n in ep.graph.nodes if isinstance(n.meta.get("val"), (list, tuple)))
    split.meta["val"].append(split.meta["val"][0])


def _rename_a_node(ep: ExportedProgram) -> None:
    node = next(n for n in ep.graph.nodes if n.op == "call_function")
    node.name = node.name + "_renamed"


def _swap_arguments(ep: ExportedProgram) -> None:
    mul = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    mul.args = mul.args[::-1]


def _replace_a_torch_fn(ep: ExportedProgram) -> None:
    node = next(n for n in ep.graph.nodes if n.op == "call_function")
    node.meta["torch_fn"] = ("other", "other")


@pytest.mark.parametrize(
    "edit",
    [_edit_item_of_a_list_value, _lengthen_a_list_value, _rename_a_node, _swap_arguments,
     _replace_a_torch_fn],
)  # fmt: skip
def test_any_edit_the_verifier_would_read_ends_the_validated_mark(edit):
    ep = torch.export.export(_Split(), (torch.randn(4, 3),)).run_decompositions()
    gm = _program.copy_graph_module(ep.graph_module)
    for node in gm.graph.nodes:  # private value lists, so the edit reaches only this copy
        if isinstance(node.meta.get("val"), list):
            node.meta["val"] = list(node.meta["val"])
    built = _program.new_program(ep, gm, ep.graph_signature, ep.state_dict, ep.constants)
    assert _validated.still_validated(built)
    edit(built)
    assert not _validated.still_validated(built)


class _AddInPlace(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1)
        return y


def test_a_program_relabelled_to_another_dialect_is_validated_again():
    # The training IR may hold in-place calls; the ATEN dialect may not. A program
    # validated as the one and relabelled as the other is checked again.
    ep = torch.export.export(_AddInPlace(), (torch.randn(3),))
    assert any(n.target is torch.ops.aten.add_.Tensor for n in ep.graph.nodes)
    built = _program.new_program(
        ep, ep.graph_module, ep.graph_signature, ep.state_dict, ep.constants, keep_dialect=True
    )
    assert _validated.still_validated(built)
    programs.set_fields(built, verifiers=[programs.base_verifier()])
    assert not _validated.still_validated(built)
    with pytest.raises(ProgramError, match="add_"):
        verify_program(built)


def _leaf_spec_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "LeafSpec" in str(w.message)]


def test_epass_deep_copies_raise_no_leaf_spec_warning_and_leave_the_filters_alone():
    """torch 2.13 warns about LeafSpec whenever a deep copy rebuilds one; epass's own copies
    (a pass's view, a rebuilt program, both decomposition paths) show nothing, and a
    deep copy the user makes still warns: nothing is silenced beyond epass's calls."""
    import epass

    _, ep, _ = models.export("mlp")
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        copied = _program.copy_call_graph(ep.module_call_graph)
        _program.private_view(ep, copy_graph=True)
        epass.PassManager([epass.Decompose(method="incremental")]).run(ep)
        epass.PassManager([epass.Decompose(method="retrace")]).run(ep)
        assert _leaf_spec_warnings(record) == []
        copy.deepcopy(ep.module_call_graph)
        if torch.__version__.startswith("2.13."):  # the warning came in 2.13 and left in 2.15
            assert _leaf_spec_warnings(record), "torch 2.13 warns: the user's copy is heard"
    assert warnings.filters == filters
    assert copied is not ep.module_call_graph and copied[0] is not ep.module_call_graph[0]
    assert [(e.fqn, e.signature) for e in copied] == [
        (e.fqn, e.signature) for e in ep.module_call_graph
    ]


def test_a_graph_module_without_code_makes_it_when_read_or_called():
    # torch.fx._lazy_graph_module._LazyGraphModule, pinned: the decomposed graph's
    # module skips the code generation the program's constructor does again.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    gm = _program.graph_module_without_code(graph)
    assert isinstance(gm, torch.fx.GraphModule)
    assert gm.graph is graph
    assert "_code" not in vars(gm)  # nothing generated yet
    assert torch.equal(gm(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    assert "relu" in gm.code

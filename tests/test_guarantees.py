"""The guarantees at their edges: in-place passes, node meta, rollback, the caller's
program object, the mutation rule, value checks, fingerprints, threads, store growth."""

from __future__ import annotations

import threading
from collections import Counter

import models
import pytest
import torch
from fingerprint import fingerprint
from torch import nn
from torch.fx.passes.infra.pass_base import PassResult as FxPassResult

from epass import (
    Decompose,
    FxPass,
    PassError,
    PassManager,
    PassResult,
    StateLinker,
    StateMutationError,
    VerificationError,
    verify_program,
)
from epass.errors import ProgramError
from epass.passes import CSE, ConstantFold, DeadCodeElimination, ReplaceOps
from epass.records import op_delta, op_name

aten = torch.ops.aten


# --- 1. in-place passes on the view ---


def add_to_sub_in_place(ep):
    """Edits its view's graph in place and returns the view, as torch's passes do."""
    for node in ep.graph.nodes:
        if node.target is aten.add.Tensor:
            node.target = aten.sub.Tensor
    ep.graph_module.recompile()
    return ep


def test_pass_editing_its_view_in_place_is_taken():
    _, ep, args = models.export("mixed")
    before = fingerprint(ep)
    result = PassManager([add_to_sub_in_place])(ep)
    assert result.modified and result.records[0].modified
    assert aten.sub.Tensor in {n.target for n in result.program.graph.nodes}
    assert fingerprint(ep) == before
    assert not torch.allclose(result.program.module()(*args), ep.module()(*args))


def test_pass_adding_a_constant_to_its_view_in_place_is_taken():
    _, ep, _ = models.export("mlp")

    def add_constant(view):
        view.constants["extra"] = torch.ones(2)
        return view

    result = PassManager([add_constant])(ep)
    assert result.modified
    assert "extra" in result.program.constants and "extra" not in ep.constants
    assert result.program.state_dict is ep.state_dict


def test_pass_returning_its_view_unchanged_is_unmodified():
    _, ep, _ = models.export("mixed")
    result = PassManager([lambda view: view])(ep)
    assert not result.modified and result.program is ep


def test_pass_declaring_changes_input_false_that_edits_its_view_is_named():
    _, ep, _ = models.export("mixed")

    class Liar:
        changes_input = False

        def __call__(self, view):
            return add_to_sub_in_place(view)

    with pytest.raises(PassError, match="changes_input = False"):
        PassManager([Liar()]).run(ep)


def test_executorch_in_place_program_passes_take_effect():
    exir_passes = pytest.importorskip(
        "executorch.exir.passes.constant_prop_pass", reason="executorch is not installed"
    )
    from executorch.exir.passes.remove_unused_parameters_pass import (
        remove_unused_parameters_pass,
    )

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.used(x) + self.used.weight.t().sum()

    torch.manual_seed(0)
    module = Unused().eval()
    args = (torch.randn(2, 4),)
    ep = PassManager([Decompose()]).run(torch.export.export(module, args))
    before = fingerprint(ep)
    pruned = PassManager([remove_unused_parameters_pass])(ep)
    assert pruned.modified
    assert "unused" not in {s.target for s in pruned.program.graph_signature.input_specs}
    folded = PassManager([exir_passes.constant_prop_pass])(ep)
    assert folded.modified
    added = {s.target for s in folded.program.graph_signature.input_specs} - {None, *ep.state_dict}
    assert added and added <= set(folded.program.constants)  # the folded transpose and sum
    assert not added & set(ep.constants)
    assert fingerprint(ep) == before
    assert "unused" in ep.state_dict
    for out in (pruned.program, folded.program):
        torch.testing.assert_close(out.module()(*args), module(*args))


# --- 2. meta-only edits ---


def tag_relus(gm):
    for node in gm.graph.nodes:
        if node.target is aten.relu.default:
            node.meta["quantization_annotation"] = {"int8": True}
    return gm


def test_fx_function_editing_only_meta_counts_as_modified():
    _, ep, _ = models.export("no_constants")
    result = PassManager([FxPass(tag_relus)])(ep)
    assert result.modified
    tagged = [n for n in result.program.graph.nodes if "quantization_annotation" in n.meta]
    assert tagged
    assert not any("quantization_annotation" in n.meta for n in ep.graph.nodes)


def test_fx_pass_result_flag_is_checked_not_trusted():
    # modified=False over an edit is kept (and said); True is taken as said.
    _, ep, _ = models.export("no_constants")

    def claims_unmodified(gm):
        tag_relus(gm)
        return FxPassResult(gm, False)

    def truly_unmodified(gm):
        return FxPassResult(gm, False)

    def claims_modified(gm):
        return FxPassResult(gm, True)

    kept = PassManager([FxPass(claims_unmodified)])(ep)
    assert kept.modified
    assert [n.kind for n in kept.records[0].notices] == ["declaration"]
    assert any("quantization_annotation" in n.meta for n in kept.program.graph.nodes)
    assert not PassManager([FxPass(truly_unmodified)])(ep).modified
    assert PassManager([FxPass(claims_modified)])(ep).modified


def test_plain_pass_editing_only_meta_in_place_is_taken():
    _, ep, _ = models.export("no_constants")

    def tag(view):
        tag_relus(view.graph_module)
        return view

    out = PassManager([tag])(ep).program
    assert any("quantization_annotation" in n.meta for n in out.graph.nodes)


# --- 3. node meta isolation ---


def clear_module_stacks(gm):
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            stack.clear()
        if node.meta.get("source_fn_stack"):
            node.meta["source_fn_stack"].clear()
    return gm


@pytest.mark.parametrize("kind", ["program pass", "FxPass"])
def test_nested_meta_edits_do_not_reach_the_input(kind):
    _, ep, args = models.export("mlp")
    stacks = {n.name: dict(n.meta.get("nn_module_stack", {})) for n in ep.graph.nodes}
    if kind == "FxPass":
        p = FxPass(clear_module_stacks)
    else:

        def p(view):
            clear_module_stacks(view.graph_module)
            return view

    result = PassManager([p])(ep)
    assert result.modified
    assert {n.name: dict(n.meta.get("nn_module_stack", {})) for n in ep.graph.nodes} == stacks
    assert any(stacks.values())
    unflat = torch.export.unflatten(ep)
    torch.testing.assert_close(unflat(*args), ep.module()(*args))


def test_copy_graph_module_copies_nested_meta_and_shares_fake_values():
    from epass import _program

    _, ep, _ = models.export("mlp")
    copy = _program.copy_graph_module(ep.graph_module)
    for a, b in zip(ep.graph.nodes, copy.graph.nodes, strict=True):
        if "nn_module_stack" in a.meta:
            assert a.meta["nn_module_stack"] == b.meta["nn_module_stack"]
            assert a.meta["nn_module_stack"] is not b.meta["nn_module_stack"]
        if "val" in a.meta:
            assert a.meta["val"] is b.meta["val"]


# --- 4. rollback undoes this run's writes only ---


def test_a_failing_run_leaves_another_runs_output_whole():
    _, ep, args = models.export("mlp")
    ep = PassManager([Decompose()]).run(ep)
    before = fingerprint(ep)
    others = []

    def run_another_then_fail(view):
        others.append(PassManager([ConstantFold(fold_views=True)]).run(ep))
        raise RuntimeError("boom")

    with pytest.raises(PassError):
        PassManager([ConstantFold(fold_views=True), run_another_then_fail]).run(ep)
    assert fingerprint(ep) == before
    used = {s.target for s in others[0].graph_signature.input_specs}
    assert any(key.startswith("folded_") for key in used & set(others[0].constants))
    torch.testing.assert_close(others[0].module()(*args), ep.module()(*args))


# --- 5. the caller's program object is never re-pointed ---


def test_returning_the_callers_program_never_repoints_it():
    _, ep, args = models.export("mlp")
    before = fingerprint(ep)

    def double_weights(view):
        for key in view.state_dict:
            view.state_dict[key] = nn.Parameter(view.state_dict[key].detach() * 2)
        return PassResult(view, True)

    def revert(view):
        return ep  # the pipeline's original input, as a memoizing pass might

    result = PassManager([double_weights, revert])(ep)
    assert fingerprint(ep) == before
    assert result.program is not ep
    torch.testing.assert_close(result.program.module()(*args), ep.module()(*args))


# --- 6. the mutation rule for a shared store ---


class BufferRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.randn(4))

    def forward(self, x):
        return x + torch.relu(self.buf)


def test_pass_introducing_an_in_place_write_into_a_buffer_fails_verification():
    ep = torch.export.export(BufferRelu(), (torch.randn(4),))
    before = fingerprint(ep)
    with pytest.raises(VerificationError, match="writes in place into state"):
        PassManager([ReplaceOps({aten.relu.default: aten.relu_.default})]).run(ep)
    assert fingerprint(ep) == before


def test_training_ir_buffer_writes_present_in_the_input_pass():
    _, ep, _ = models.export("seed")  # holds an undeclared add_ on a buffer
    assert not ep.graph_signature.buffers_to_mutate
    out = PassManager([FxPass(lambda gm: tag_relus(gm) or gm), CSE(), Decompose()]).run(ep)
    verify_program(out)


# --- 7. state values agree with the graph ---


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w.double(),
        lambda w: w.reshape(-1),
        lambda w: w[:1],
    ],
    ids=["dtype", "rank", "size"],
)
def test_state_disagreeing_with_its_placeholder_fails_verification(change):
    _, ep, _ = models.export("no_constants")

    def swap(view):
        view.state_dict["linear.weight"] = nn.Parameter(change(view.state_dict["linear.weight"]))
        return PassResult(view, True)

    with pytest.raises(VerificationError, match=r"linear\.weight"):
        PassManager([swap]).run(ep)


def test_state_on_another_device_than_its_placeholder_fails_verification():
    _, ep, _ = models.export("no_constants")
    node = next(n for n in ep.graph.nodes if n.name == "p_linear_weight")
    mode = node.meta["val"].fake_mode
    with mode:
        node.meta["val"] = torch.empty(node.meta["val"].shape, device="cuda")
    with pytest.raises(ProgramError, match="the graph expects cuda"):
        verify_program(ep)


def test_a_new_placeholder_value_disagreeing_with_its_state_fails_verification():
    _, ep, _ = models.export("no_constants")

    def retype(view):
        node = next(n for n in view.graph.nodes if n.name == "p_linear_weight")
        val = node.meta["val"]
        with val.fake_mode:
            node.meta["val"] = torch.empty(val.shape, dtype=torch.float64)
        return PassResult(view, True)

    with pytest.raises(VerificationError, match=r"'linear\.weight'.*float64"):
        PassManager([retype]).run(ep)


def test_a_state_disagreement_the_input_had_is_not_the_passs():
    # The input already disagrees (a caller swapped the tensor); a pass that keeps
    # the entry and its placeholder as they were is not blamed for it, as calls
    # whose arguments were already wrong are not.
    _, ep, _ = models.export("no_constants")
    ep.state_dict["linear.weight"] = nn.Parameter(ep.state_dict["linear.weight"].double())
    with pytest.raises(ProgramError, match=r"linear\.weight"):
        verify_program(ep)
    out = PassManager([Decompose()]).run(ep)
    assert out.state_dict["linear.weight"] is ep.state_dict["linear.weight"]
    assert out.graph_module is not ep.graph_module


def test_verifying_an_output_counts_its_calls():
    _, ep, _ = models.export("transformer")
    result = PassManager([Decompose()])(ep)
    (record,) = result.records
    named = {
        label: Counter(op_name(n.target) for n in p.graph.nodes if n.op == "call_function")
        for label, p in (("before", ep), ("after", result.program))
    }
    assert dict(record.op_delta) == op_delta(named["before"], named["after"])
    assert record.op_delta  # the decomposition changed the program's ops


# --- 8, 9. fingerprints ---


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.reshape(2, 8),
        lambda t: t.view(torch.int32),
        lambda t: t.t(),
        lambda t: t.flatten()[1:].as_strided((3, 4), (4, 1)),
    ],
    ids=["shape", "dtype", "strides", "offset"],
)
def test_fingerprint_catches_layout_changes_through_data(edit):
    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.arange(16.0).reshape(4, 4))

        def forward(self, x):
            return x @ self.w

    ep = torch.export.export(Square(), (torch.randn(2, 4),))

    def sneaky(view):
        w = view.state_dict["w"]
        w.data = edit(w.data)
        return view

    with pytest.raises(StateMutationError) as info:
        PassManager([sneaky], fingerprint=True).run(ep)
    assert info.value.keys == ("state_dict:w",)


def test_fingerprint_reads_a_lazily_conjugated_complex_buffer():
    class Complex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("z", torch.randn(4, dtype=torch.complex64).conj())

        def forward(self, x):
            return x + self.z.real

    ep = torch.export.export(Complex(), (torch.randn(4),))
    assert ep.state_dict["z"].is_conj()
    result = PassManager([CSE(), lambda view: view], fingerprint=True)(ep)
    assert not result.modified


# --- 10, 11. concurrency ---


def test_a_run_inside_a_pass_adds_nothing_to_the_program_the_pass_reads():
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)
    inner = []

    def another_run_meanwhile(view):
        def add(v):
            v.constants["theirs"] = torch.ones(1)
            return PassResult(v, True)

        inner.append(PassManager([add]).run(ep))
        return view

    PassManager([another_run_meanwhile], fingerprint=True).run(ep)
    assert fingerprint(ep) == before
    assert "theirs" in inner[0].constants


def _own_fold_like(tag: str):
    def add_tagged(view):
        view.constants[f"const_{tag}"] = torch.full((1,), 1.0)
        return view

    add_tagged.__name__ = f"add_{tag}"
    return add_tagged


def _fail(view):
    raise RuntimeError("this thread fails")


def test_pipelines_in_threads_on_one_program():
    eager, ep, args = models.export("convbn")
    ep = PassManager([Decompose()]).run(ep)
    expected = eager(*args)
    before = fingerprint(ep)
    outputs: dict[int, torch.export.ExportedProgram] = {}
    failures: dict[int, BaseException] = {}
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        passes = [ConstantFold(), CSE(), _own_fold_like(str(i)), DeadCodeElimination()]
        if i == 3:
            passes.insert(3, _fail)
        barrier.wait()
        try:
            for _ in range(3):
                outputs[i] = PassManager(passes, fingerprint=True).run(ep)
        except BaseException as exc:
            failures[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(failures) == {3}, {i: repr(e) for i, e in failures.items()}
    assert isinstance(failures[3], PassError)
    assert set(outputs) == {0, 1, 2}
    assert fingerprint(ep) == before
    for i, out in outputs.items():
        assert f"const_{i}" in out.constants and out.state_dict is ep.state_dict
        torch.testing.assert_close(out.module()(*args), expected, rtol=1e-4, atol=1e-5)


# --- 12. repeated runs ---


def _lower_folding_views() -> PassManager:
    # lower() with the weight transposes folded too, so that every run adds entries.
    return PassManager(
        [Decompose(), ConstantFold(fold_views=True), CSE(), DeadCodeElimination()], name="lower"
    )


def test_repeated_lowerings_leave_the_users_dicts_as_they_were():
    _, ep, args = models.export("transformer")
    before = fingerprint(ep)
    first = _lower_folding_views().run(ep)
    second = _lower_folding_views().run(ep)
    assert fingerprint(ep) == before
    assert first.constants is not second.constants
    assert set(first.constants) == set(second.constants) > set(ep.constants)
    torch.testing.assert_close(second.module()(*args), first.module()(*args))


@pytest.mark.slow
def test_repeated_lowering_of_a_tiny_llama_leaves_its_dicts_as_they_were():
    import hf_models

    _, ep, args = hf_models.export("llama")
    before = fingerprint(ep)
    first = _lower_folding_views().run(ep)
    for _ in range(2):
        again = _lower_folding_views().run(ep)
    assert fingerprint(ep) == before
    torch.testing.assert_close(again.module()(*args), first.module()(*args))


# --- review: programs a pass did not get from the run, writes the rule missed, odd state ---


def test_in_place_pass_after_a_memoized_program_leaves_that_program_alone():
    _, ep, args = models.export("mixed")
    cached = PassManager([Decompose()]).run(ep)  # an earlier output the caller holds
    before = fingerprint(cached)

    def memoized(view):
        return cached

    out = PassManager([memoized, add_to_sub_in_place])(ep)
    assert out.records[1].modified
    assert aten.sub.Tensor in {n.target for n in out.program.graph.nodes}
    assert fingerprint(cached) == before
    torch.testing.assert_close(cached.module()(*args), ep.module()(*args))


class UnbindBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.randn(2, 4))

    def forward(self, x):
        a, b = torch.unbind(self.buf)
        return x + torch.relu(a) + b


class CondBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.randn(4))

    def forward(self, x):
        return torch.cond(
            x.sum() > 0, lambda x, b: x + torch.relu(b), lambda x, b: x - b, (x, self.buf)
        )


def relu_to_relu_everywhere(view):
    for _, module in view.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if node.target is aten.relu.default:
                    node.target = aten.relu_.default
            module.recompile()
    return view


@pytest.mark.parametrize("model", [UnbindBuffer, CondBuffer], ids=["unbind item", "cond body"])
def test_in_place_write_into_state_through_an_item_or_a_branch_fails_verification(model):
    ep = torch.export.export(model(), (torch.ones(4),))
    before = fingerprint(ep)
    with pytest.raises(VerificationError, match=r"writes in place into state \['buf'\]"):
        PassManager([relu_to_relu_everywhere]).run(ep)
    assert fingerprint(ep) == before


def test_cond_program_with_functional_branches_verifies():
    ep = torch.export.export(CondBuffer(), (torch.ones(4),))
    out = PassManager([FxPass(tag_relus), CSE()]).run(ep)
    verify_program(out)
    torch.testing.assert_close(out.module()(torch.ones(4)), ep.module()(torch.ones(4)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 3).to_sparse(),
        lambda: torch.randn(3, 3).to_sparse_csr(),
        lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        lambda: torch.empty(0, 3),
    ],
    ids=["sparse coo", "sparse csr", "nested", "quantized", "zero-size"],
)
def test_fingerprint_reads_odd_store_tensors(make):
    _, ep, _ = models.export("mlp")
    ep.state_dict["extra"] = make()  # an entry the graph does not use
    result = PassManager([CSE(), lambda view: view], fingerprint=True)(ep)
    assert not result.modified


def test_fingerprint_catches_a_write_into_a_sparse_store_tensor():
    _, ep, _ = models.export("mlp")
    ep.state_dict["extra"] = torch.randn(3, 3).to_sparse()

    def sneaky(view):
        view.state_dict["extra"].values().mul_(2)
        return view

    with pytest.raises(StateMutationError) as info:
        PassManager([sneaky], fingerprint=True).run(ep)
    assert info.value.keys == ("state_dict:extra",)


class KwargModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, *, y):
        return self.linear(x) + y


def _edit_example_kwargs(view):
    view.example_inputs[1]["z"] = torch.ones(4)
    return view


def _append_verifier(view):
    view.verifiers.append(view.verifiers[0])
    return view


@pytest.mark.parametrize(
    "edit", [_edit_example_kwargs, _append_verifier], ids=["example kwargs", "verifiers"]
)
def test_edits_of_the_views_small_containers_stay_in_the_view(edit):
    ep = torch.export.export(KwargModel(), (torch.randn(2, 4),), {"y": torch.randn(4)})
    kwargs, verifiers = dict(ep.example_inputs[1]), list(ep.verifiers)
    before = fingerprint(ep)
    result = PassManager([edit])(ep)
    assert result.modified  # the edit is the pass's work, not dropped
    assert ep.example_inputs[1] == kwargs and list(ep.verifiers) == verifiers
    assert fingerprint(ep) == before
    ep.module()(torch.randn(2, 4), y=torch.randn(4))


def test_a_pass_editing_only_the_module_call_graph_is_modified():
    _, ep, _ = models.export("mlp")
    entries = len(ep.module_call_graph)

    def keep_root_only(view):
        del view.module_call_graph[1:]
        return view

    result = PassManager([keep_root_only])(ep)
    assert result.modified
    assert len(result.program.module_call_graph) == 1 < entries == len(ep.module_call_graph)


def test_fingerprint_reads_a_tensor_subclass_and_catches_a_write_into_its_parts():
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    linear = nn.Linear(16, 16)
    quantization.quantize_(linear, quantization.Int8WeightOnlyConfig())
    weight = linear.weight.detach()
    assert type(weight) is not torch.Tensor
    _, ep, _ = models.export("mlp")
    ep.state_dict["quantized"] = weight  # an entry the graph does not use
    assert not PassManager([CSE(), lambda view: view], fingerprint=True)(ep).modified
    part = weight.__tensor_flatten__()[0][0]

    def sneaky(view):
        getattr(view.state_dict["quantized"], part).data.mul_(2)
        return view

    with pytest.raises(StateMutationError) as info:
        PassManager([sneaky], fingerprint=True).run(ep)
    assert info.value.keys == ("state_dict:quantized",)


def test_a_pass_failing_halfway_through_an_in_place_edit_leaves_its_input_whole():
    _, ep, _ = models.export("mixed")
    seen: dict[str, str] = {}

    class Spy:
        def before_pass(self, info, program):
            seen["before"] = program.graph_module.code

        def pass_failed(self, info, program, error):
            seen["failed"] = program.graph_module.code  # what a Reproducer saves

    def tag(view):
        for node in view.graph.nodes:
            node.meta["tag"] = True
        return view

    def half_then_fail(view):
        add_to_sub_in_place(view)
        raise RuntimeError("half done")

    before = fingerprint(ep)
    with pytest.raises(PassError, match="half done"):
        PassManager([tag, half_then_fail], instruments=[Spy()]).run(ep)
    assert seen["failed"] == seen["before"]
    assert "aten.sub" not in seen["failed"]
    assert fingerprint(ep) == before


@pytest.mark.parametrize("fingerprinted", [False, True])
def test_a_pass_flipping_requires_grad_of_a_store_tensor_is_named_and_undone(fingerprinted):
    _, ep, _ = models.export("mlp")
    key = next(iter(ep.state_dict))

    def freeze(view):
        view.state_dict[key].requires_grad_(False)
        return view

    before = fingerprint(ep)
    with pytest.raises(StateMutationError) as info:
        PassManager([freeze], fingerprint=fingerprinted).run(ep)
    assert info.value.keys == (f"state_dict:{key}",)
    assert ep.state_dict[key].requires_grad
    assert fingerprint(ep) == before


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, GeneratorExit])
def test_an_interrupt_three_levels_deep_rolls_back_every_level_and_leaves_as_it_is(interrupt):
    _, ep, _ = models.export("mixed")
    hooks: list[str] = []

    class Spy:
        def pass_failed(self, info, program, error):
            hooks.append("pass_failed")

        def after_pipeline(self, manager, result, parent=None):
            hooks.append("after_pipeline")

    def add(key):
        def add_entry(view):
            view.constants[key] = torch.ones(1)
            return view

        return add_entry

    def change(view):
        view.state_dict["scale"] = view.state_dict["scale"] * 2
        return view

    def interrupted(view):
        raise interrupt()

    inner = PassManager([add("a3"), change, interrupted], name="d3")
    middle = PassManager([add("a2"), inner], name="d2", linker=StateLinker(policy="in_place"))
    before = fingerprint(ep)
    with pytest.raises(interrupt):
        PassManager([add("a0"), change, PassManager([add("a1"), middle])], instruments=[Spy()]).run(
            ep
        )
    assert fingerprint(ep) == before
    assert hooks == []


class UnbindWrite(nn.Module):
    """torch's training IR keeps this in-place write through an unbind item."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(2, 4))

    def forward(self, x):
        a, _ = self.buf.unbind()
        a.add_(1)
        return x + self.buf.sum(0) * 2


def test_constant_fold_leaves_state_written_through_an_unbind_item_alone():
    ep = torch.export.export(UnbindWrite(), (torch.zeros(4),))
    out = PassManager([ConstantFold(), CSE()]).run(ep)
    module, eager = out.module(), UnbindWrite()
    for _ in range(3):
        torch.testing.assert_close(module(torch.zeros(4)), eager(torch.zeros(4)))


# --- marks and declarations: checked, or not used ---


class TwoRelus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.relu(self.b(x))


def relu_to_a_python_callable(ep):
    """Retargets every relu at ``torch.relu``, which torch's verifier refuses in an
    ATen program (not an operator), in place."""
    for node in ep.graph.nodes:
        if node.target is aten.relu.default:
            node.target = torch.relu
    ep.graph_module.recompile()


def test_a_program_edited_after_it_was_validated_is_validated_again():
    # epass keeps a mark on each program it built that passed validate(); an edit
    # made since (here by the caller) voids it, so verify_program runs validate().
    ep = torch.export.export(TwoRelus(), (torch.randn(2, 4),))
    out = PassManager([Decompose()]).run(ep)
    verify_program(out)
    relu_to_a_python_callable(out)
    with pytest.raises(ProgramError, match="relu"):
        verify_program(out)


def test_a_pass_that_edits_in_place_and_says_unmodified_is_verified():
    # A pass that is not epass's own edits the program it gets in place and returns
    # modified=False: the edit counts as a modification, is verified, and the
    # verifier's refusal names the pass; the user's program is as it was.
    ep = torch.export.export(TwoRelus(), (torch.randn(2, 4),))
    before = fingerprint(ep)

    def liar(view):
        relu_to_a_python_callable(view)
        return PassResult(view, False)

    passes = [Decompose(), liar, DeadCodeElimination()]
    with pytest.raises(VerificationError, match="'liar'"):
        PassManager(passes, verify=True).run(ep)
    assert fingerprint(ep) == before


def test_nested_meta_edits_after_an_incremental_decompose_do_not_reach_the_input():
    # The incremental path builds the decomposed graph from the user's nodes; the
    # pass after it edits the meta containers of the program it gets.
    _, ep, args = models.export("mlp")
    before = fingerprint(ep)

    def clear_stacks(view):
        clear_module_stacks(view.graph_module)
        return view

    result = PassManager([Decompose(), clear_stacks])(ep)
    assert result.records[0].notes["method"] == "incremental"
    assert fingerprint(ep) == before
    unflat = torch.export.unflatten(ep)
    torch.testing.assert_close(unflat(*args), ep.module()(*args))

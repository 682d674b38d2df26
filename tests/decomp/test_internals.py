"""Pins every torch internal the incremental decomposition engine mirrors: each test
fails loudly when torch renames, moves or reshapes one of them."""

from __future__ import annotations

import functools
import importlib.util
import inspect

import pytest
import torch
from torch import nn

from epass._decomp import identity, sizes, splice, state, templates, tracing
from epass._decomp.check import first_difference
from epass._decomp.table import DefaultSplit, split_table
from epass._torch import internals, operators

aten = torch.ops.aten


@pytest.mark.parametrize("path", internals.INTERNALS)
def test_every_listed_internal_exists(path):
    # internals.absent is what names a missing internal to the user: the same lookup
    # (an instance attribute on an example object, a class attribute on the class).
    assert internals.absent([path]) is None
    if path == "torch._ops.OpOverload._schema":
        assert aten.add_.Tensor._schema.is_mutable
        assert [a.kwarg_only for a in aten.add.Tensor._schema.arguments] == [False, False, True]
    if path in ("torch._ops.OpOverload._overloadpacket", "torch._ops.OpOverload._overloadname"):
        assert aten.add.Tensor._overloadpacket is aten.add
        assert aten.add.Tensor._overloadname == "Tensor"
        assert aten.add.default._overloadname == "default"


def test_absent_names_a_missing_function_module_and_method():
    assert internals.absent(["torch._export.utils._no_such_function"]) == (
        "torch._export.utils._no_such_function"
    )
    assert internals.absent(["torch._no_such_module.f"]) == "torch._no_such_module.f"
    # A method a class lacks, as OpOverloadPacket.op_overloads is lacking before 2.13.
    assert internals.absent(["torch._ops.OpOverloadPacket.no_such_method"]) == (
        "torch._ops.OpOverloadPacket.no_such_method"
    )
    assert internals.absent(["torch._ops.OpOverload._no_such_field"]) == (
        "torch._ops.OpOverload._no_such_field"
    )


def test_op_overloads_walks_every_overload_as_torch_does():
    overloads = operators.op_overloads(aten.add)
    assert aten.add.Tensor in overloads and aten.add.Scalar in overloads
    assert overloads == [getattr(aten.add, name) for name in aten.add.overloads()]
    if hasattr(torch._ops.OpOverloadPacket, "op_overloads"):  # torch 2.13 and later
        assert overloads == aten.add.op_overloads()


def test_a_walk_without_op_overloads_finds_the_same_operators(monkeypatch):
    # torch 2.11 and 2.12 have no OpOverloadPacket.op_overloads: the walk must not
    # call it (every Decompose once raised there, the retrace included).
    walked = state.patchable_ops()
    monkeypatch.delattr(torch._ops.OpOverloadPacket, "op_overloads", raising=False)
    assert state.patchable_ops() == walked


def test_a_missing_internal_steps_aside_for_the_retrace_and_names_it(monkeypatch):
    # An internal only the incremental path calls (torch's retrace has bound it at
    # import): without it, the user gets torch's program and a notice naming the
    # internal and the release.
    from torch.fx.experimental import proxy_tensor

    import epass
    from epass import Decompose
    from epass._decomp import templates

    class Net(nn.Module):
        def forward(self, x):
            return nn.functional.silu(x) * 2

    ep = torch.export.export(Net(), (torch.randn(3, 4),))
    templates.clear_cache()
    monkeypatch.delattr(proxy_tensor, "make_fx")
    ref = ep.run_decompositions()  # torch's public API does not need it
    (record,) = epass.PassManager([Decompose(method="auto")])(ep).records
    assert record.notes["method"] == "retrace"
    fallback = record.notes["fallback"]
    assert "torch.fx.experimental.proxy_tensor.make_fx" in fallback
    assert f"torch {internals.RELEASE}" in fallback
    assert any(n.fallback and "make_fx" in n.text for n in record.notices)
    out = epass.PassManager([Decompose(method="auto")]).run(ep)
    assert first_difference(out, ref) is None
    assert out.state_dict is ep.state_dict


def test_the_retrace_runs_bare_when_its_guard_cannot_be_set_up(monkeypatch):
    # Finding the operators torch's override patches leans on internals; the retrace
    # itself is public API and must not depend on them.
    import epass
    from epass import Decompose

    def broken():
        raise AttributeError("The underlying op has no overload name 'op_overloads'")

    ep = torch.export.export(nn.Linear(4, 2), (torch.randn(3, 4),))
    ref = ep.run_decompositions()
    monkeypatch.setattr(state, "patchable_ops", broken)
    (record,) = epass.PassManager([Decompose(method="retrace")])(ep).records
    (notice,) = record.notices
    assert notice.kind == "torch" and "op_overloads" in notice.text
    assert f"torch {internals.RELEASE}" in notice.text
    out = epass.PassManager([Decompose(method="retrace")]).run(ep)
    assert first_difference(out, ref) is None


def test_internals_are_listed_in_compat_docs():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "compat.md").read_text()
    missing = [p for p in internals.INTERNALS if p not in text]
    assert not missing, f"docs/compat.md does not list {missing}"


def test_split_table_returns_cia_and_python_parts():
    from torch.export.exported_program import (
        _special_op_to_preserve_cia,
        _split_decomp_table_to_cia_and_python_decomp,
    )

    table = dict(torch.export.default_decompositions().materialize())
    table.pop(aten.linear.default)
    cia, python = _split_decomp_table_to_cia_and_python_decomp(table)
    assert cia[aten.linear.default] is _special_op_to_preserve_cia
    assert aten.addmm.default not in cia
    assert aten.native_layer_norm.default not in python  # core ATen: kept


def test_override_cia_is_a_context_manager_taking_the_cia_table():
    from torch.export.exported_program import _override_composite_implicit_decomp

    params = list(inspect.signature(_override_composite_implicit_decomp).parameters)
    assert params == ["cia_ops_to_callable"]
    with _override_composite_implicit_decomp({}):
        pass


def test_cia_registrations_query_lists_operator_names():
    regs = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    assert "aten::linear" in regs


def test_is_cia_op_and_preserve_marker():
    from torch._export.utils import _is_cia_op

    assert _is_cia_op(aten.linear.default)
    assert not _is_cia_op(aten.addmm.default)


def test_functional_tensor_mode_takes_export_and_token_discovery():
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    params = inspect.signature(FunctionalTensorMode.__init__).parameters
    assert {"pre_dispatch", "export", "_allow_token_discovery"} <= set(params)


def test_functional_utils_signatures():
    from torch._functorch._aot_autograd import functional_utils as fu

    assert list(inspect.signature(fu.to_fun).parameters) == ["t"]
    assert list(inspect.signature(fu.from_fun).parameters) == ["t"]
    assert "check_only_storage_mutation" in inspect.signature(fu.has_metadata_mutation).parameters


def test_graph_capture_stacks_modes_as_mirrored():
    # AOTAutograd enters the python dispatcher and FunctionalTensorMode around make_fx,
    # with export=aot_config.is_export; the engine builds the same stack.
    from torch._functorch._aot_autograd import graph_capture

    source = inspect.getsource(graph_capture._create_graph)
    assert "enable_python_dispatcher()" in source
    assert "FunctionalTensorMode(" in source
    assert "record_module_stack=True" in source


def test_original_aten_is_recorded_under_preserve_node_meta():
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.fx.traceback.preserve_node_meta():
        gm = make_fx(lambda x: aten.relu.default(x))(torch.randn(2))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert str(node.meta["original_aten"]) == "aten.relu.default"


def test_updated_module_call_graph_helper_takes_five_arguments():
    # _get_updated_range_constraints, which the engine reaches through
    # _program.new_program, is pinned in tests/test_program.py.
    from torch.export.exported_program import _get_updated_module_call_graph

    assert len(inspect.signature(_get_updated_module_call_graph).parameters) == 5


def test_run_decompositions_functionalizes_without_export_flag():
    # With FunctionalTensorMode(export=True), one_hot gains an _assert_tensor_metadata;
    # torch's retrace must not show one, or the engine's export=False is stale.
    class OneHot(nn.Module):
        def forward(self, x):
            return nn.functional.one_hot(x, 4)

    ep = torch.export.export(OneHot(), (torch.tensor([0, 1, 3]),))
    out = ep.run_decompositions()
    fast, _ = splice.decompose(ep, split_table(None))
    assert first_difference(fast, out) is None


def test_make_fx_binds_placeholders_by_identity():
    # One shared fake tensor for two inputs would turn cat([a, b]) into cat([a, a]).
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(2)
    gm = make_fx(lambda a, b: torch.cat([a, b]))(x, x)
    (cat,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert cat.args[0][0] is cat.args[0][1]


def test_shape_env_counters_used_to_detect_new_symbols():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    assert isinstance(env.var_to_range, dict)
    assert isinstance(env.unbacked_symint_counter, int)


def test_shape_env_knowledge_the_snapshots_and_disk_keys_read():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    assert isinstance(env.guards, list) and isinstance(env.replacements, dict)
    assert isinstance(env.deferred_runtime_asserts, dict) and isinstance(env.divisible, set)
    assert isinstance(env.backed_var_to_val, dict)
    assert "specialize_zero_one=" in repr(env.settings)  # a dataclass: its repr is its value
    symbol = env.create_symbol(5, torch._dynamo.source.ConstantSource("x"))
    with env.suppress_guards():
        env.evaluate_expr(symbol < 16)
    assert env.guards == [] and str(env.var_to_range[symbol]) == "VR[2, int_oo]"
    env.evaluate_expr(symbol < 16)  # what a snapshot sees change
    assert [str(g.expr) for g in env.guards] == [f"{symbol} < 16"]
    assert str(env.var_to_range[symbol]) == "VR[2, 15]"
    assert env.backed_var_to_val[symbol] == 5


def test_exported_programs_carry_their_guards_as_code():
    ep = torch.export.export(nn.Linear(2, 2), (torch.randn(3, 2),))
    assert ep._guards_code == []


def test_placeholder_named_like_a_builtin_keeps_its_name():
    class Input(nn.Module):
        def forward(self, input):
            return nn.functional.gelu(input)

    ep = torch.export.export(Input(), (torch.randn(2),))
    fast, _ = splice.decompose(ep, split_table(None))
    assert first_difference(fast, ep.run_decompositions()) is None


def test_export_flags_are_set_while_templates_trace():
    # Decompositions wrapped by torch._disable_dynamo annotate `custom` meta only when
    # torch.compiler.is_exporting(); the retrace sets it through this context.
    from torch._export.utils import _compiling_state_context

    with _compiling_state_context():
        assert torch.compiler.is_exporting()
    assert not torch.compiler.is_exporting()
    ep = torch.export.export(nn.GELU(), (torch.randn(3),))
    table = torch._decomp.get_decompositions([aten.gelu.default])
    fast, _ = splice.decompose(ep, split_table(table))
    assert first_difference(fast, ep.run_decompositions(table)) is None
    assert any(n.meta.get("custom") for n in fast.graph.nodes if n.op == "call_function")


def _backend_switches():
    b = torch.backends  # set_flags() with no argument changes nothing, returns all
    return b.mkldnn.set_flags(), b.cudnn.set_flags(), torch._C._get_nnpack_enabled()


def test_template_traces_turn_off_the_backend_switches_the_retrace_turns_off():
    from torch.export._trace import _ignore_backend_decomps

    before = _backend_switches()
    with _ignore_backend_decomps():
        theirs = _backend_switches()
    assert _backend_switches() == before
    with state.backend_decomps_off():
        ours = _backend_switches()
    assert _backend_switches() == before
    assert ours == theirs and ours != before


def test_run_decompositions_rebinds_sizes_with_the_runtime_assert_pass():
    # The retrace runs this pass under this metadata hook with this stack trace; the
    # incremental path runs the same when a decomposition asks for a new size.
    from torch._export.passes._node_metadata_hook import (
        _node_metadata_hook,
        _set_node_metadata_hook,
    )
    from torch.export import exported_program
    from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

    source = inspect.getsource(exported_program)
    assert "insert_deferred_runtime_asserts(" in source
    assert sizes.RUNTIME_ASSERT_TRACE.split(", in ")[0] in source
    assert "in insert_deferred_runtime_asserts" in source
    assert list(inspect.signature(insert_deferred_runtime_asserts).parameters)[:4] == [
        "gm",
        "shape_env",
        "name",
        "export",
    ]
    assert "metadata" in inspect.signature(_node_metadata_hook).parameters
    assert list(inspect.signature(_set_node_metadata_hook).parameters)[:2] == ["gm", "f"]
    assert torch._dynamo.config.do_not_emit_runtime_asserts is False


def test_runtime_assert_pass_binds_a_new_size_after_the_placeholders():
    class Flat(nn.Module):
        def forward(self, x):
            return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)

    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(Flat(), (torch.randn(3, 4, 5, 5),), dynamic_shapes=({0: batch},))
    # export binds no size of x: nothing used it before the decomposition.
    assert not any(n.target is aten.sym_size.int for n in ep.graph.nodes)
    fast, _ = splice.decompose(ep, split_table(None))
    ref = ep.run_decompositions()
    assert first_difference(fast, ref) is None
    nodes = [n for n in fast.graph.nodes if n.op != "placeholder"]
    assert nodes[0].target is aten.sym_size.int
    assert nodes[0].args[0].op == "placeholder"


def test_tracer_copies_meta_fields_from_the_node_being_run():
    # The retrace runs each node under a copy of its meta; the tracer copies these
    # fields onto every node it creates, and resets original_aten to None after each
    # ATen call. A size computed before the first call keeps the node's value.
    from torch.fx.experimental.proxy_tensor import make_fx

    fields = torch.fx.proxy._COPY_META_FIELDS
    assert {"original_aten", "custom", "nn_module_stack", "from_node"} <= set(fields)
    assert set(tracing.INHERITED_META) <= set(fields)
    carrier = torch.fx.Graph().placeholder("carrier")
    carrier.meta["original_aten"] = "the node's own"

    def f(x):
        with torch.fx.traceback.set_current_meta(carrier):
            a = aten.view.default(x, [x.shape[0] * 2])
            return aten.view.default(a, [x.shape[0] * 3 - x.shape[0]])

    with torch.fx.traceback.preserve_node_meta():
        gm = make_fx(f, tracing_mode="symbolic")(torch.randn(4, 2))
    seen = [
        (str(n.target), str(n.meta.get("original_aten")))
        for n in gm.graph.nodes
        if n.op == "call_function"
    ]
    assert seen[1] == ("<built-in function mul>", "the node's own")
    assert seen[2] == ("aten.view.default", "aten.view.default")
    assert seen[3] == ("<built-in function mul>", "None")


def test_cia_override_patches_kernels_and_drops_fake_rules_that_torch_state_restores():
    # torch's override leaves the fake tensor rule of a CIA op that had one removed
    # (aten.item); torch_state puts it back, and the kernels it patched too.
    from torch._subclasses import fake_impls
    from torch.export.exported_program import _override_composite_implicit_decomp

    item = aten.item.default
    rules = fake_impls.op_implementations_dict
    tables = split_table(None)
    assert item in tables.cia
    # (a bare run_decompositions earlier in the process may have dropped torch's rule)
    saved = rules.get(item)

    def rule(fake_mode, func, *args, **kwargs):
        raise AssertionError("unreachable")

    rules[item] = rule
    try:
        kernels = dict(item.py_kernels)
        with state.torch_state(tables.cia):
            with _override_composite_implicit_decomp(tables.cia):
                assert item.py_kernels != kernels
            assert item not in rules  # torch's own restore drops it
        assert rules[item] is rule
        assert item.py_kernels == kernels
        assert isinstance(fake_impls.op_implementations_checks, list)
    finally:
        rules.pop(item, None)
        if saved is not None:
            rules[item] = saved


def test_torch_state_restores_kernels_when_the_override_fails_half_way():
    from torch.export.exported_program import _override_composite_implicit_decomp

    ops = [aten.linear.default, aten.dropout.default]
    before = [dict(op.py_kernels) for op in ops]

    def broken(*args, **kwargs):
        raise AssertionError("unreachable")

    class Boom(dict):
        def items(self):
            yield ops[0], broken
            raise RuntimeError("boom")  # after linear was patched, before the try

    with (
        pytest.raises(RuntimeError, match="boom"),
        state.torch_state(ops),
        _override_composite_implicit_decomp(Boom()),
    ):
        pass
    assert [dict(op.py_kernels) for op in ops] == before


def _torch_split(keep):
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp

    table = torch.export.default_decompositions()
    for op in keep:
        table.pop(op, None)
    return _split_decomp_table_to_cia_and_python_decomp(dict(table.materialize()))


def _loaded_overloads():
    for space_name in list(torch.ops):
        space = getattr(torch.ops, space_name)
        for packet_name in list(space):
            packet = getattr(space, packet_name)
            for overload_name in list(packet):
                yield getattr(packet, overload_name)


@pytest.fixture
def cia_op():
    """A custom CompositeImplicitAutograd operator (a non-ATen entry of the table)."""
    lib = torch.library.Library("epass_split_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    try:
        yield torch.ops.epass_split_test.twice.default
    finally:
        lib._destroy()


@pytest.mark.parametrize(
    "keep",
    [(), (aten.linear.default, aten.gelu.default, aten.addmm.default), ("custom",)],
    ids=["default", "keep-aten", "keep-custom"],
)
def test_the_default_table_answers_every_operator_as_torchs_split(keep, cia_op):

    keep = tuple(cia_op if op == "custom" else op for op in keep)
    # getattr(packet, "") makes a second object for the default overload, one torch's
    # walk never meets (some libraries make them: ExecuTorch's dim-order ops had one).
    twin = getattr(cia_op._overloadpacket, "")
    assert twin is not cia_op and twin._overloadname == "default"
    lazy = DefaultSplit(frozenset(keep))
    cia, python = _torch_split(keep)
    ops = {*cia, *python, *keep, cia_op, *_loaded_overloads()}
    assert len(ops) > len(cia) + len(python)  # operators outside the table are asked too
    disagree = []
    for op in ops:
        got = lazy.lookup(op)
        want = (cia.get(op), python.get(op))
        for side, g, w in zip(("cia", "python"), got, want, strict=True):
            same = g is w or (
                g is not None
                and w is not None
                and identity.name_of(g, op) == identity.name_of(w, op)
            )
            if not same:
                disagree.append(f"{op} ({side}): {g!r} vs torch's {w!r}")
    assert not disagree, disagree[:10]
    assert lazy.lookup(twin) == (None, None) and twin not in cia
    assert lazy.built is None  # answered without building the split
    assert all(isinstance(op, torch._ops.OpOverload) for op in python)  # has_packet_keys
    if cia_op in keep:
        assert cia[cia_op] is lazy.lookup(cia_op)[0]  # the preserve marker


@pytest.mark.parametrize(
    "keep", [(), (aten.hardswish.default, aten.linear.default), ("custom",)],
    ids=["default", "keep-aten", "keep-custom"],
)  # fmt: skip
def test_the_default_tables_sides_build_torchs_split_when_iterated(keep, cia_op):

    keep = tuple(cia_op if op == "custom" else op for op in keep)
    tables = split_table(None, keep=keep)
    split = tables.cia.split
    cia, python = _torch_split(keep)
    assert set(tables.cia) == set(cia) and len(tables.python) == len(python)
    assert split.built is not None
    assert dict(tables.python.items()).keys() == python.keys()
    assert cia_op in cia
    for ours, theirs in ((tables.cia, cia), (tables.python, python)):
        name = identity.name_of
        differ = [op for op in theirs if name(ours[op], op) != name(theirs[op], op)]
        assert not differ, differ[:5]


def test_a_core_entry_the_walk_does_not_find_builds_torchs_own_split(monkeypatch):
    # torch's split treats a preservable core entry outside its walk apart; the
    # one-walk build then hands over to torch's own split.
    from torch._export.utils import _is_preservable_cia_op

    split = DefaultSplit(frozenset())
    walked = state.patchable_ops()
    op = next(op for op in split.core if op in walked and _is_preservable_cia_op(op))
    monkeypatch.setattr(state, "patchable_ops", lambda: walked - {op})
    cia, python = split.materialize()
    theirs = _torch_split(())
    assert (cia.keys(), python.keys()) == (theirs[0].keys(), theirs[1].keys())
    assert op in cia


def _default_name(keep=()):
    templates.clear_memory()  # a table is named once per process; name it afresh
    return identity.cache_name(split_table(None, keep=keep))


def test_the_default_tables_name_follows_what_decides_its_contents(cia_op):
    first = _default_name()
    assert first.table is not None and first.why_not is None
    assert _default_name().table == first.table
    assert _default_name(keep=(aten.gelu.default,)).table != first.table
    # A Python CompositeImplicitAutograd kernel is what the op's own decomposition
    # runs: a user's takes part only through the identity it declares.
    key = torch._C.DispatchKey.CompositeImplicitAutograd

    def triple(x):
        return x * 3

    cia_op.py_impl(key)(triple)
    try:
        undeclared = _default_name()
        triple.cache_key = "v1"
        v1 = _default_name()
        triple.cache_key = "v2"
        v2 = _default_name()
    finally:
        del cia_op.py_kernels[key]
        cia_op._dispatch_cache.clear()
    assert undeclared.table is None and "triple" in undeclared.why_not
    assert None not in (v1.table, v2.table) and len({v1.table, v2.table, first.table}) == 3


@pytest.mark.parametrize("keep", [(), (aten.linear.default, aten.gelu.default)])
def test_the_ops_saved_around_a_retrace_cover_every_op_its_override_patches(keep, cia_op):
    from torch._export.utils import _collect_all_valid_cia_ops

    cia, _ = _torch_split((*keep, cia_op))
    assert set(cia) <= state.patchable_ops()
    assert state.patchable_ops() == _collect_all_valid_cia_ops()  # walked as torch walks
    assert cia_op in cia and aten.linear.default in cia


def test_the_proxy_mode_graph_grows_as_nodes_are_created():
    # A batched template trace tells which call created each node by the length of
    # the graph being traced before and after it.
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

    lengths = []

    def fn(x):
        graph = get_proxy_mode().tracer.graph
        lengths.append(len(graph.nodes))
        y = x.sin()
        lengths.append(len(graph.nodes))
        z = torch.zeros(3) + y
        lengths.append(len(graph.nodes))
        return z

    gm = make_fx(fn)(torch.randn(3))
    assert lengths == [1, 2, 4]
    assert [n.op for n in gm.graph.nodes] == ["placeholder", *["call_function"] * 3, "output"]


def test_disable_fake_tensor_cache_turns_the_mode_cache_off_and_back():
    from torch._subclasses.fake_tensor import FakeTensorMode, disable_fake_tensor_cache

    mode = FakeTensorMode()
    was = mode.cache_enabled
    with disable_fake_tensor_cache(mode):
        assert mode.cache_enabled is False
    assert mode.cache_enabled is was


def test_the_shape_environments_static_evaluation_cache_can_be_cleared():
    # shapes.forget_unknowns clears ShapeEnv._maybe_evaluate_static's cache, which a
    # guard added after an expression was found undecided may leave in place.
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    s = env.create_symbol(4, torch._dynamo.source.ConstantSource("n"))
    assert env._maybe_evaluate_static(sympy.Lt(s, 16)) is None  # undecided
    assert env._maybe_evaluate_static.cache_info().currsize > 0
    env._maybe_evaluate_static.cache_clear()
    assert env._maybe_evaluate_static.cache_info().currsize == 0


def _explicit_tables(cia_op):
    """Tables as callers hand them over: torch's default less a few (a custom
    operator deleted), a short one, one with a custom operator, a packet key and an
    operator object torch's walk never meets, an empty one and the ONNX exporter's."""
    full = dict(torch.export.default_decompositions().materialize())
    less = {k: v for k, v in full.items() if k not in (aten.linear.default, cia_op)}
    short = {op: full[op] for op in (aten.hardswish.default, aten.linear.default)}
    custom = {**short, cia_op: lambda x: x * 3, aten.silu: full[aten.silu.default]}
    custom[getattr(cia_op._overloadpacket, "")] = lambda x: x * 4  # the walk misses it
    yield "default less linear and the custom op", less
    yield "short", short
    yield "custom and a packet", custom
    yield "empty", {}
    if importlib.util.find_spec("onnxscript") is None:  # the onnx extra is not installed
        return
    from torch.onnx._internal.exporter import _decomp, _registration

    registry = _registration.ONNXRegistry.from_torchlib()
    yield "onnx", _decomp.create_onnx_friendly_decomposition_table(set(registry.functions))


def test_an_explicit_tables_split_is_torchs_split(cia_op):
    from epass._decomp.table import _split_explicit

    for label, table in _explicit_tables(cia_op):
        ours = _split_explicit(dict(table))
        theirs = operators.split_decomp_table(dict(table))
        for side, mine, torchs in zip(("cia", "python"), ours, theirs, strict=True):
            assert mine.keys() == torchs.keys(), (label, side, mine.keys() ^ torchs.keys())
            differ = [op for op in torchs if mine[op] is not torchs[op]]
            assert not differ, (label, side, differ[:5])


def test_an_aten_operator_one_walk_misses_hands_the_split_to_torch(monkeypatch):
    # Cannot happen while both walks agree (pinned above); torch's split then decides.
    from epass._decomp.table import _split_explicit

    table = {aten.linear.default: lambda *a: None}
    theirs = operators.split_decomp_table(dict(table))
    monkeypatch.setattr(state, "patchable_ops", lambda: frozenset())
    cia, python = _split_explicit(dict(table))
    assert (cia.keys(), python.keys()) == (theirs[0].keys(), theirs[1].keys())
    assert cia[aten.linear.default] is table[aten.linear.default]


def _same_entry(a, b):
    """One entry, or the same binding: torch binds each CIA decomposition anew, a
    partial of a new closure."""
    if a is b:
        return True
    return (
        isinstance(a, functools.partial)
        and isinstance(b, functools.partial)
        and a.func.__code__ is b.func.__code__ is operators.cia_binding_code()
        and (a.args, a.keywords) == (b.args, b.keywords)
    )


def _custom_tables(cia_op):
    """torch's CustomDecompTable as consumers hand it over: untouched (the custom
    operator gains its own decomposition on reading), with the custom operator deleted
    before reading, given a decomposition of the caller's, read once already, and
    deleted after reading."""
    yield "untouched", torch.export.default_decompositions()
    deleted = torch.export.default_decompositions()
    deleted.pop(cia_op)
    deleted.pop(aten.linear.default)
    yield "custom deleted", deleted
    given = torch.export.default_decompositions()
    given[cia_op] = lambda x: x * 3
    yield "custom given", given
    read = torch.export.default_decompositions()
    read.materialize()
    yield "read before", read
    later = torch.export.default_decompositions()
    later.materialize()
    later.pop(cia_op)
    yield "deleted after reading", later


def test_a_custom_tables_reading_is_torchs(cia_op):
    from epass._decomp.table import as_dict

    for label, table in _custom_tables(cia_op):
        twin = table.copy()
        ours, theirs = as_dict(table), dict(twin)
        assert type(theirs) is dict and ours.keys() == theirs.keys(), (
            label,
            ours.keys() ^ theirs.keys(),
        )
        differ = [op for op in theirs if not _same_entry(ours[op], theirs[op])]
        assert not differ, (label, differ[:5])
        assert (cia_op in ours) == (label in ("untouched", "custom given", "read before"))
        # left as reading leaves it: materialized, the same deletions pending
        assert table.has_materialized and twin.has_materialized, label
        assert table.deleted_custom_ops == twin.deleted_custom_ops, label
        assert table.decomp_table.keys() == twin.decomp_table.keys(), label
    assert as_dict({aten.linear.default: None}) == {aten.linear.default: None}

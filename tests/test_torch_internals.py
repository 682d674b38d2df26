"""Torch internals in one package: epass reaches a private torch name only in the
modules of ``epass/_torch/``, which list every internal epass touches (``INTERNALS``),
and each of them is called here as epass calls it, on whichever release runs the tests
(a name that resolves is not enough: a method can be missing from a class)."""

from __future__ import annotations

import ast
import collections
import functools
import gc
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export.graph_signature import InputKind

import epass
from epass import _operators, _program, _pt2, _tensors, _torch, _validated
from epass._decomp import identity, keys, shapes, sizes, state
from epass._decomp.tracing import INHERITED_META
from epass._torch import fakes, internals, operators, programs, tracing

PACKAGE = Path(epass.__file__).resolve().parent
# The adapter: the one package whose modules reach torch's internals.
ADAPTER = Path(_torch.__file__).resolve().parent
LISTED = frozenset(_torch.INTERNALS)
aten = torch.ops.aten


# --- the scan --------------------------------------------------------------------------


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split(".")[1:])


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _instance_attributes() -> frozenset[str]:
    """Attributes and methods of torch objects that INTERNALS names on a class
    (``torch._ops.OpOverload._schema``, ``torch._ops.OpOverloadPacket.overloads``): read
    on an instance, as ``op._schema`` or ``packet.overloads()``. An enum member
    (``DispatchKey.CompositeImplicitAutograd``) is a name, not something read on an
    object."""
    found = set()
    for path in LISTED:
        owner, _, name = path.rpartition(".")
        on_class = owner.rpartition(".")[2].lstrip("_")[:1].isupper()
        if on_class and (name.startswith("_") or name[:1].islower()):
            found.add(name)
    return frozenset(found)


ATTRIBUTES = _instance_attributes()


def _reached(full: str) -> bool:
    """A private torch name, or one INTERNALS lists (or something read from one).
    Operators (``torch.ops.aten._to_copy``) are not internals."""
    if full.startswith("torch.ops."):
        return False
    return _private(full) or any(full == e or full.startswith(f"{e}.") for e in LISTED)


def torch_internals(source: str) -> list[tuple[int, str]]:
    """Every place ``source`` reaches a torch internal, by line: an import of a private
    or listed torch name, an attribute path from ``torch`` (or a name imported from it)
    through one, or a listed private attribute read on an object (``op._schema``,
    ``getattr(m, "_buffers")``; ``self._x`` is the code's own)."""
    tree = ast.parse(source)
    names: dict[str, str] = {}  # local name -> the torch path it stands for
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names[alias.asname or alias.name] = full
                if _reached(full):
                    found.add((node.lineno, full))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    if _reached(alias.name):
                        found.add((node.lineno, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            receiver = node.value
            own = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            if node.attr in ATTRIBUTES and not own:
                found.add((node.lineno, f".{node.attr}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ATTRIBUTES
        ):
            found.add((node.lineno, f".{node.args[1].value}"))
        path = _dotted(node) if isinstance(node, (ast.Attribute, ast.Name)) else None
        if path is None:
            continue
        head, _, rest = path.partition(".")
        if head in names:
            full = names[head] + (f".{rest}" if rest else "")
            if _reached(full):
                found.add((node.lineno, full))
    return sorted(found)


def release_branches(source: str) -> list[tuple[int, str]]:
    """Places that branch on the torch release: ``torch.__version__`` compared or parsed
    (quoting it in a message is fine), ``EXACT_RELEASE`` or ``RELEASE`` read."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Attribute) and node.attr in ("split", "startswith"):
            parts = [node.value]
        elif isinstance(node, ast.Attribute) and node.attr in ("EXACT_RELEASE", "RELEASE"):
            found.append((node.lineno, node.attr))
            continue
        else:
            continue
        for part in parts:
            if _dotted(part) == "torch.__version__":
                found.append((node.lineno, "torch.__version__"))
    return sorted(found)


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if ADAPTER not in p.parents)


def _problems(scan: Callable[[str], list[tuple[int, str]]]) -> list[str]:
    return [
        f"epass/{path.relative_to(PACKAGE).as_posix()}:{line}: {name}"
        for path in SOURCES
        for line, name in scan(path.read_text())
    ]


def test_no_module_but_the_adapter_reaches_a_torch_internal():
    problems = _problems(torch_internals)
    assert not problems, "torch internals outside epass/_torch/:\n" + "\n".join(problems)


def test_no_module_but_the_adapter_branches_on_the_torch_release():
    problems = _problems(release_branches)
    assert not problems, "release branches outside epass/_torch/:\n" + "\n".join(problems)


def test_the_scans_find_what_they_must():
    # The scans are what make the tests above fail: each way of reaching one, by line.
    source = (
        "import torch\n"
        "import torch._dynamo.config\n"
        "from torch._export.utils import _is_cia_op\n"
        "from torch.export import exported_program as ep_module\n"
        "from torch.fx.experimental.proxy_tensor import make_fx\n"
        "def f(op, ep, self):\n"
        "    torch._C._get_tracing_state()\n"
        "    ep_module._secret(1)\n"
        "    torch.ops.aten._to_copy.default\n"
        "    torch.fx.traceback.preserve_node_meta()\n"
        "    op._schema, ep._state_dict, self._constants\n"
        "    getattr(m, '_buffers')\n"
        "    'default' in packet.overloads()\n"
    )
    assert torch_internals(source) == [
        (2, "torch._dynamo.config"),
        (3, "torch._export.utils._is_cia_op"),
        (5, "torch.fx.experimental.proxy_tensor.make_fx"),
        (7, "torch._C"),
        (7, "torch._C._get_tracing_state"),
        (8, "torch.export.exported_program._secret"),
        (10, "torch.fx.traceback.preserve_node_meta"),
        (11, "._schema"),
        (11, "._state_dict"),
        (12, "._buffers"),
        (13, ".overloads"),
    ]
    versions = (
        "import torch\n"
        "if torch.__version__.startswith('2.13.'): pass\n"
        "ok = internals.EXACT_RELEASE\n"
        "message = f'torch {torch.__version__}'\n"
    )
    assert release_branches(versions) == [(2, "torch.__version__"), (3, "EXACT_RELEASE")]


# --- every internal, called as epass calls it -----------------------------------------


@functools.cache
def _static() -> torch.export.ExportedProgram:
    return torch.export.export(nn.Linear(4, 2), (torch.randn(3, 4),))


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)


@functools.cache
def _dynamic() -> torch.export.ExportedProgram:
    batch = torch.export.Dim("batch", min=2)
    args = (torch.randn(3, 4, 5, 5),)
    return torch.export.export(_Flat(), args, dynamic_shapes=({0: batch},))


@functools.cache
def _archive() -> str:
    path = os.path.join(tempfile.mkdtemp(), "program.pt2")
    torch.export.save(_static(), path)
    return path


@functools.cache
def _traced() -> tuple[torch.fx.GraphModule, dict[str, object]]:
    """One template-style trace (fake inputs, make_fx under export's stack) that
    records what the stack set up while it ran."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: dict[str, object] = {}
    carrier = torch.fx.Graph().placeholder("carrier")
    carrier.meta["custom"] = {"from": "carrier"}

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen["exporting"] = torch.compiler.is_exporting()
        seen["grad"] = torch.is_grad_enabled()
        seen["node meta"] = torch.fx.traceback.has_preserved_node_meta()
        include = torch._C._dispatch_tls_local_include_set()
        seen["python dispatcher"] = include.has(torch._C.DispatchKey.PythonDispatcher)
        seen["nodes"] = len(tracing.traced_graph().nodes)
        f = tracing.to_fun(x)
        seen["unwritten"] = tracing.mutated(f, x, data=True)
        with tracing.current_meta(carrier):
            y = f.clone()
        y.add_(1)
        f.mul_(2)
        seen["written"] = (tracing.mutated(f, x, data=True), tracing.mutated(f, x, data=False))
        return tracing.from_fun(y)

    mode = FakeTensorMode()
    with mode:
        gm = tracing.make_fx_as_export(fn, [mode.from_tensor(torch.randn(2))], {}, frames=False)
    return gm, seen


def _trace_ran_under_export_stack() -> None:
    gm, seen = _traced()
    assert seen["exporting"] is True and seen["grad"] is False
    assert seen["node meta"] is True and seen["python dispatcher"] is True
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [aten.clone.default, aten.add.Tensor, aten.mul.Tensor]  # functional


def _trace_functionalized() -> None:
    _, seen = _traced()
    assert seen["unwritten"] is False and seen["written"] == (True, False)


def _trace_copied_the_carriers_meta() -> None:
    gm, _ = _traced()
    (clone,) = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert clone.meta.get("custom") == {"from": "carrier"}


def _trace_saw_its_graph() -> None:
    assert _traced()[1]["nodes"] == 1  # the placeholder, before any call


def _split_keeps_linear() -> None:
    table = dict(torch.export.default_decompositions().materialize())
    table.pop(aten.linear.default)
    cia, python = operators.split_decomp_table(table)
    assert cia[aten.linear.default] is operators.preserve_marker()
    assert aten.addmm.default not in cia and aten.hardswish.default in python


def _override_restores_kernels() -> None:
    ops = [aten.linear.default]
    before = [dict(operators.python_kernels(op)) for op in ops]
    with state.torch_state(ops), operators.override_cia({aten.linear.default: lambda *a: None}):
        assert operators.python_kernels(aten.linear.default) != before[0]
    assert [dict(operators.python_kernels(op)) for op in ops] == before


def _cia_binding() -> None:
    fn = operators.decomp_for_cia(aten.linear.default)
    assert isinstance(fn, functools.partial)
    assert fn.func.__code__ is operators.cia_binding_code()
    assert identity.torch_name(fn, aten.linear.default) == "torch:cia:aten.linear.default"


def _patchable_ops_walk_as_torch() -> None:
    from torch._export.utils import _collect_all_valid_cia_ops

    assert aten.linear.default in operators.aten_cia_ops()
    assert state.patchable_ops() == _collect_all_valid_cia_ops()


def _custom_table_read_as_torch_reads_it() -> None:
    table = torch.export.default_decompositions()
    table.pop(aten.linear.default)
    made = operators.materialized_table(table, state.patchable_ops)
    assert made is not None and aten.linear.default not in made
    assert table.has_materialized and table.deleted_custom_ops == set()
    assert made.keys() == dict(torch.export.default_decompositions()).keys() - {aten.linear.default}
    assert operators.materialized_table({}, state.patchable_ops) is None


def _library_registration_is_seen() -> None:
    lib = torch.library.Library("epass_internals", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    try:
        assert "epass_internals/twice/CompositeImplicitAutograd" in operators.library_impls()
        where = operators.registered_from("epass_internals/twice/CompositeImplicitAutograd")
        assert where == __file__, where
    finally:
        lib._destroy()
    assert isinstance(identity.library_kernels(), list)


def _library_key_sets_follow_libraries() -> None:
    before = operators.library_key_sets()
    lib = torch.library.Library("epass_internals", "FRAGMENT")
    lib.define("thrice(Tensor x) -> Tensor")
    try:
        (made,) = [s for s in operators.library_key_sets() if all(s is not b for b in before)]
        assert made == set()
        lib.impl("thrice", lambda x: x * 3, "CompositeImplicitAutograd")
        assert made == {"epass_internals/thrice/CompositeImplicitAutograd"}
    finally:
        lib._destroy()
    del lib
    gc.collect()  # the finalizer runs when the library is freed
    assert all(s is not made for s in operators.library_key_sets())


def _custom_op_functions_are_read() -> None:
    name = "epass_internals::cube"
    if operators.custom_op_functions(name) is None:

        @torch.library.custom_op(name, mutates_args=())
        def cube(x: torch.Tensor) -> torch.Tensor:
            return x**3

    parts = operators.custom_op_functions(name)
    assert parts is not None and getattr(parts[0], "__name__", None) == "cube"
    assert parts == operators.custom_op_functions(name)  # the same objects again
    assert operators.custom_op_functions("aten::silu") is None


def _dispatch_module_is_a_librarys_handle() -> None:
    lib = torch.library.Library("epass_internals_handle", "FRAGMENT")
    try:
        assert isinstance(lib.m, operators.DispatchModule)
    finally:
        lib._destroy()


def _fake_rules_are_put_back() -> None:
    rules, checks = operators.fake_rules()
    assert isinstance(rules, dict) and isinstance(checks, list)
    before = dict(rules)
    with state.torch_state([]):
        rules.pop(next(iter(rules)))
    assert rules == before


def _backend_switches_match() -> None:
    from torch.export._trace import _ignore_backend_decomps

    def switches() -> tuple[object, ...]:
        b = torch.backends
        return b.mkldnn.set_flags(), b.cudnn.set_flags(), torch._C._get_nnpack_enabled()

    with _ignore_backend_decomps():
        theirs = switches()
    with state.backend_decomps_off():
        assert switches() == theirs


def _fake_mode_found() -> None:
    mode = keys.detected_fake_mode(_dynamic())
    assert mode is not None and mode.shape_env is not None


def _fake_cache_off() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with fakes.fake_cache_off(mode):
        assert mode.cache_enabled is False


def _contiguity_without_a_guard() -> None:
    x = torch.randn(2, 3)
    assert fakes.is_contiguous_or_false(x) and not fakes.is_contiguous_or_false(x.t())
    last = torch.channels_last
    y = torch.randn(2, 3, 4, 5)
    assert fakes.is_contiguous_or_false(y.contiguous(memory_format=last), last)
    assert not fakes.is_contiguous_or_false(y, last)
    assert not fakes.is_contiguous_or_false(torch.randn(2, 3, 4, 5, 6), last)
    # A symbolic one, asked without a guard.
    ep = torch.export.export(
        torch.nn.Conv2d(3, 4, 3),
        (torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),),
        dynamic_shapes=({0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO},),
    )
    conv = next(n for n in ep.graph.nodes if n.op == "call_function")
    env = keys.detected_fake_mode(ep).shape_env
    guards = len(env.guards)
    assert fakes.is_contiguous_or_false(conv.meta["val"], last)
    assert len(env.guards) == guards


def _tensor_meta_as_the_tracer_makes_it() -> None:
    """The metadata a retrace gives a node, for a plain and a symbolic value, without
    a guard."""
    meta = fakes.tensor_metadata(torch.randn(2, 3).t())
    assert (tuple(meta.shape), meta.dtype, meta.stride, meta.memory_format) == (
        (3, 2), torch.float32, (1, 3), None,
    )  # fmt: skip
    ep = torch.export.export(
        torch.nn.Conv2d(3, 4, 3),
        (torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),),
        dynamic_shapes=({0: torch.export.Dim.AUTO},),
    )
    conv = next(n for n in ep.graph.nodes if n.op == "call_function")
    env = keys.detected_fake_mode(ep).shape_env
    guards = len(env.guards)
    meta = fakes.tensor_metadata(conv.meta["val"])
    assert meta.memory_format == torch.channels_last and len(env.guards) == guards
    retraced = ep.run_decompositions().graph.nodes
    assert meta == next(n for n in retraced if n.op == "call_function").meta["tensor_meta"]


def _shape_env_snapshot_and_forget() -> None:
    import sympy

    # A program of its own: its shape environment learns below.
    ep = _dynamic.__wrapped__()
    env = keys.detected_fake_mode(ep).shape_env
    batch = ep.graph.find_nodes(op="placeholder")[0].meta["val"].shape[0]
    # Each field of the environment the snapshot reads shows what it learnt, as the
    # check mode reports it (shapes.difference), one kind of knowledge at a time.
    lessons = [
        (lambda: bool(batch > 2), ["guards s", "range of s"]),
        (lambda: torch._check(batch % 3 == 0), ["divisible Mod("]),
        (lambda: env.create_unbacked_symint(), ["unbacked symbols 0 -> 1"]),
        (lambda: torch._check(env.create_unbacked_symint() != 5), ["runtime assertions Ne(u1, 5)"]),
        (lambda: bool(batch == 3), ["replacement of s"]),
    ]
    before = shapes.snapshot(env)
    assert shapes.difference(before, shapes.snapshot(env)) == "nothing"
    for learn, said in lessons:
        learn()
        after = shapes.snapshot(env)
        assert after != before
        learnt = shapes.difference(before, after)
        assert all(words in learnt for words in said), learnt
        before = after
    (symbol, *_) = env.var_to_range
    env._maybe_evaluate_static(sympy.Lt(symbol, 16))  # undecided: a cached None
    assert env._maybe_evaluate_static.cache_info().currsize > 0
    fakes.forget_static_evaluations(env)
    assert env._maybe_evaluate_static.cache_info().currsize == 0
    # A symbol made by a trace given up leaves nothing the retrace's range
    # constraints (every symbol of var_to_range without a replacement) would list.
    known = dict(env.var_to_range)
    made = env.create_unbacked_symint().node.expr
    checked = env.create_unbacked_symint()
    torch._check(checked != 5)
    made = [made, checked.node.expr]
    assert all(m in env.var_to_range and m in env.pending_fresh_unbacked_symbols for m in made)
    assert made[1] in env.deferred_runtime_asserts
    fakes.forget_symbols(env, known)
    assert env.var_to_range.keys() == known.keys()
    assert not set(made) & set(env.pending_fresh_unbacked_symbols)
    for field in fakes._BY_SYMBOL:
        assert not set(made) & set(getattr(env, field, {})), field


def _size_of_an_intermediate(ep: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """A copy of ``ep``'s graph whose output is viewed by the batch read from an
    intermediate (as a decomposition reads it): a size query the retrace binds to
    the input instead."""
    gm = _program.copy_graph_module(ep.graph_module)
    graph = gm.graph
    pool = next(n for n in graph.nodes if n.op == "call_function")
    output = graph.output_node()
    (flat,) = output.args[0]
    with graph.inserting_before(output):
        size = graph.call_function(aten.sym_size.int, (pool, 0))
        view = graph.call_function(aten.view.default, (flat, [size, -1]))
    size.meta["val"] = pool.meta["val"].shape[0]
    with keys.detected_fake_mode(ep):
        view.meta["val"] = flat.meta["val"].view(size.meta["val"], -1)
    output.args = ((view,),)
    gm.recompile()
    return gm


def _runtime_asserts_rebind_sizes() -> None:
    import torch._dynamo.config

    from epass._decomp.safety import Fallback

    ep = _dynamic()
    gm = _size_of_an_intermediate(ep)
    sizes.rebind_sizes(gm, keys.detected_fake_mode(ep))
    # The size is read from the input, right after it, with the retrace's stack trace
    # (set by the node metadata hook); the view reads that node.
    (size,) = [n for n in gm.graph.nodes if n.target is aten.sym_size.int]
    (x,) = gm.graph.find_nodes(op="placeholder")
    assert size.args == (x, 0) and size.prev is x
    assert size.meta["stack_trace"] == sizes.RUNTIME_ASSERT_TRACE
    assert str(size.meta["val"]) == str(x.meta["val"].shape[0])
    (view,) = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert view.args[1][0] is size
    # Where torch's switch turns the pass off, it runs nothing, and the engine steps aside.
    with torch._dynamo.config.patch(do_not_emit_runtime_asserts=True):
        off = _size_of_an_intermediate(ep)
        code = off.code
        with pytest.raises(Fallback, match="without a shape environment"):
            sizes.rebind_sizes(off, keys.detected_fake_mode(ep))
    assert off.code == code


def _private_field(name: str) -> Callable[[], None]:
    def check() -> None:
        ep = _static()
        clone = _program.shallow_clone(ep)
        value = getattr(ep, name)
        copy = type(value)(value) if isinstance(value, (dict, list)) else value
        programs.set_fields(clone, **{name: copy})
        assert getattr(clone, name) is copy and getattr(ep, name) is value

    return check


def _guards() -> None:
    assert programs.guards_code(_static()) == []
    assert callable(programs.guards_fn(_dynamic().module()))
    shapes.run_guards(_dynamic())


def _flat_inputs() -> None:
    ep = _static()
    x = torch.randn(3, 4)
    flat = _program.flat_inputs(ep, (x,), {})
    assert len(flat) == 3 and flat[-1] is x
    torch.testing.assert_close(ep.graph_module(*flat)[0], ep.module()(x))


def _new_program_without_code() -> None:
    from torch.export import exported_program as module

    ep = _dynamic()
    made_with = module._create_graph_module_for_export
    gm = _program.copy_graph_module(ep.graph_module)
    out = _program.new_program(ep, gm, ep.graph_signature, ep.state_dict, ep.constants)
    assert module._create_graph_module_for_export is made_with
    assert "_code" not in vars(out.graph_module)
    assert out.range_constraints == ep.range_constraints
    assert _validated.still_validated(out)


def _after_erasure() -> None:
    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(_Flat(), (torch.randn(3, 4, 5, 5),), dynamic_shapes=({0: batch},))
    gm = _program.copy_graph_module(ep.graph_module)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        dead = gm.graph.call_function(aten.neg.default, (x,))
    dead.meta["val"] = x.meta["val"]
    own = _program.new_program(ep, gm, ep.graph_signature, ep.state_dict, ep.constants)
    # The shape environment learns a guard after the program was made: the rebuilt
    # program must carry it, as a constructor's would.
    assert bool(x.meta["val"].shape[0] > 2)
    own.graph.erase_node(dead)
    out = _program.after_erasure(own, own.graph_signature, own.state_dict, own.constants)
    assert out is not None and out.graph_module is own.graph_module
    assert out.module_call_graph is own.module_call_graph  # consumed with its graph
    plain = _program.new_program(
        own, own.graph_module, own.graph_signature, own.state_dict, own.constants
    )
    assert sorted(vars(out)) == sorted(vars(plain))
    assert out.range_constraints == plain.range_constraints
    assert programs.guards_code(out) == programs.guards_code(plain) != programs.guards_code(own)
    assert _validated.still_validated(out)
    (first,) = programs.one_value_module(own.graph_module).graph.nodes
    assert isinstance(first.meta["val"], torch._subclasses.fake_tensor.FakeTensor)
    unvalidated = torch.export.export(nn.Linear(4, 2), (torch.randn(3, 4),))
    assert (
        _program.after_erasure(
            unvalidated, unvalidated.graph_signature, unvalidated.state_dict, unvalidated.constants
        )
        is None
    )


def _module_call_graph() -> None:
    ep = _static()
    graph = programs.updated_module_call_graph(ep, ep.graph_module, ep.graph_signature)
    assert [e.fqn for e in graph] == [e.fqn for e in ep.module_call_graph]


def _placeholder_names() -> None:
    names: dict[str, str] = {}
    taken: collections.defaultdict[str, int] = collections.defaultdict(int)
    used: set[str] = set()
    programs.rename_without_collisions(names, taken, used, "x", "x")
    prefix = programs.placeholder_prefixes()[InputKind.PARAMETER]
    programs.rename_without_collisions(names, taken, used, "w", f"{prefix}x")
    programs.rename_without_collisions(names, taken, used, "v", f"{prefix}x")
    assert names == {"x": "x", "w": "p_x", "v": "p_x_1"}


def _builtin_targets() -> None:
    targets = _pt2.serialized_builtin_targets()
    assert {"_operator.getitem", "torch.sym_max"} <= targets


def _lazy_module() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(aten.relu.default, (x,)))
    gm = _program.graph_module_without_code(graph)
    assert "_code" not in vars(gm) and "relu" in gm.code


def _kept_name() -> None:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    _program.keep_node_name(graph, node, "input")
    other = graph.placeholder("input")
    assert node.name == "input" and other.name != "input"


def _buffers() -> None:
    buffers = programs.module_buffers(nn.BatchNorm1d(2))
    assert set(buffers) == {"running_mean", "running_var", "num_batches_tracked"}


def _version() -> None:
    t = torch.zeros(2)
    before = _tensors.tensor_version(t)
    t.add_(1)
    assert _tensors.tensor_version(t) == before + 1
    assert _tensors.tensor_marks([t]) == [(before + 1, False)]


def _pytree() -> None:
    ep = _static()
    assert _tensors.tree_leaves((1, [2, {"a": 3}])) == [1, 2, 3]
    copied = _program.copy_call_graph(ep.module_call_graph)
    assert [e.signature for e in copied] == [e.signature for e in ep.module_call_graph]
    assert "builtins.tuple" in _pt2.pytree_type_names()


def _archive_read() -> None:
    records = _pt2.archive_records(_archive())
    assert any(name.endswith("models/model.json") for name in records)
    with open(_archive(), "rb") as f:
        data = f.read()
    assert all(size == len(_zip_member(data, name)) for name, (_, size) in records.items())
    assert type(_pt2.read_program(_archive())).__name__ == "ExportedProgram"


def _zip_member(data: bytes, name: str) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        (full,) = [n for n in z.namelist() if n.split("/", 1)[-1] == name]
        return z.read(full)


def _schema() -> None:
    root, version, union = _pt2.export_schema()
    assert root.__name__ == "ExportedProgram" and len(version) == 2
    assert isinstance(union, type)


_PROGRAM = "torch.export.exported_program"
_UTILS = "torch._export.utils"

CALLS: dict[str, Callable[[], None]] = {
    "torch._ops.HigherOrderOperator": lambda: _assert(
        _operators.is_higher_order(torch.ops.higher_order.cond)
        and not _operators.is_higher_order(aten.add.Tensor)
    ),
    "torch._ops.OperatorBase": lambda: _assert(
        _operators.is_operator(aten.add.Tensor)
        and _operators.is_operator(torch.ops.higher_order.cond)
        and not _operators.is_operator(len)
    ),
    "torch._ops.OpOverload": lambda: _assert(
        _operators.is_op_overload(aten.add.Tensor) and not _operators.is_op_overload(aten.add)
    ),
    "torch._ops.OpOverloadPacket": lambda: _assert(
        _operators.is_op_packet(aten.add) and _operators.overload_of(aten.relu) is aten.relu.default
    ),
    "torch._ops.OpOverloadPacket.overloads": lambda: _assert(
        aten.add.Tensor in operators.op_overloads(aten.add)
    ),
    "torch._ops.OpOverload._schema": lambda: _assert(
        operators.function_schema(aten.add_.Tensor).is_mutable
        and _operators.is_view_op(aten.t.default)
        and not _operators.is_mutable_op(aten.add.Tensor)
    ),
    "torch._ops.OpOverload._overloadpacket": lambda: _assert(
        operators.overload_key(aten.add.Tensor) == (aten.add, "Tensor")
    ),
    "torch._ops.OpOverload._overloadname": lambda: _assert(
        operators.overload_key(aten.add.default)[1] == "default"
    ),
    "torch._ops.OpOverload.py_kernels": lambda: _assert(
        isinstance(operators.python_kernels(aten.linear.default), dict)
    ),
    "torch._ops.OpOverload._dispatch_cache": lambda: (
        operators.clear_dispatch_cache(aten.add.Tensor),
        _assert(torch.equal(aten.add.Tensor(torch.ones(1), 1), torch.full((1,), 2.0))),
    ),
    "torch._ops._OpNamespace": lambda: _assert(isinstance(torch.ops.aten, operators.OpNamespace)),
    "torch._C.DispatchKey.CompositeImplicitAutograd": lambda: _assert(
        operators.CIA_KEY.name == "CompositeImplicitAutograd"
    ),
    "torch._C._dispatch_get_registrations_for_dispatch_key": lambda: _assert(
        "aten::linear" in operators.cia_registrations()
    ),
    f"{_PROGRAM}._split_decomp_table_to_cia_and_python_decomp": _split_keeps_linear,
    f"{_PROGRAM}._override_composite_implicit_decomp": _override_restores_kernels,
    f"{_PROGRAM}._special_op_to_preserve_cia": _split_keeps_linear,
    f"{_UTILS}._is_cia_op": lambda: _assert(
        operators.is_cia_op(aten.linear.default) and not operators.is_cia_op(aten.addmm.default)
    ),
    f"{_UTILS}._is_preservable_cia_op": lambda: _assert(
        operators.is_preservable_cia_op(aten.linear.default)
        and not operators.is_preservable_cia_op(aten.addmm.default)
    ),
    f"{_UTILS}._get_decomp_for_cia": _cia_binding,
    f"{_UTILS}._collect_all_valid_cia_ops": _patchable_ops_walk_as_torch,
    f"{_UTILS}._collect_all_valid_cia_ops_for_aten_namespace": _patchable_ops_walk_as_torch,
    f"{_UTILS}._materialize_cpp_cia_ops": _patchable_ops_walk_as_torch,
    "torch._decomp._core_aten_decompositions_post_autograd": lambda: _assert(
        aten.hardswish.default in operators.core_aten_decompositions()
    ),
    "torch.export.decomp_utils.PRESERVED_ATEN_CIA_OPS": lambda: _assert(
        aten.upsample_bilinear2d.vec in operators.preserved_aten_cia_ops()
    ),
    "torch._decomp.global_decomposition_table": lambda: _assert(
        "post_autograd" in operators.decomposition_registry()
    ),
    "torch.export.decomp_utils.CustomDecompTable": _custom_table_read_as_torch_reads_it,
    "torch.library._impls": _library_registration_is_seen,
    "torch._C._dispatch_dump": _library_registration_is_seen,
    "torch.library._del_library": _library_key_sets_follow_libraries,
    "torch._library.custom_ops.OPDEFS": _custom_op_functions_are_read,
    "torch._C._DispatchModule": _dispatch_module_is_a_librarys_handle,
    "torch._subclasses.fake_impls.op_implementations_dict": _fake_rules_are_put_back,
    "torch._subclasses.fake_impls.op_implementations_checks": _fake_rules_are_put_back,
    f"{_UTILS}._compiling_state_context": _trace_ran_under_export_stack,
    "torch.export._trace._ignore_backend_decomps": _backend_switches_match,
    "torch._subclasses.functional_tensor.FunctionalTensorMode": _trace_ran_under_export_stack,
    "torch._functorch._aot_autograd.functional_utils.to_fun": _trace_functionalized,
    "torch._functorch._aot_autograd.functional_utils.from_fun": _trace_functionalized,
    "torch._functorch._aot_autograd.functional_utils.has_data_mutation": _trace_functionalized,
    "torch._functorch._aot_autograd.functional_utils.has_metadata_mutation": (
        _trace_functionalized
    ),
    "torch.fx.experimental.proxy_tensor.make_fx": _trace_ran_under_export_stack,
    "torch.fx.experimental.proxy_tensor.get_proxy_mode": _trace_saw_its_graph,
    "torch._dispatch.python.enable_python_dispatcher": _trace_ran_under_export_stack,
    "torch.fx.traceback.preserve_node_meta": _trace_copied_the_carriers_meta,
    "torch.fx.traceback.set_current_meta": _trace_copied_the_carriers_meta,
    "torch.fx.proxy._COPY_META_FIELDS": lambda: _assert(
        set(INHERITED_META) < set(tracing.copied_meta_fields())
    ),
    "torch._guards.detect_fake_mode": _fake_mode_found,
    "torch._subclasses.fake_tensor.disable_fake_tensor_cache": _fake_cache_off,
    "torch._prims_common.is_contiguous_for_memory_format_or_false": _contiguity_without_a_guard,
    "torch.fx.passes.shape_prop._extract_tensor_metadata": _tensor_meta_as_the_tracer_makes_it,
    "torch.fx.experimental.symbolic_shapes.ShapeEnv": _shape_env_snapshot_and_forget,
    "torch.fx.experimental.symbolic_shapes.ShapeEnv._maybe_evaluate_static": (
        _shape_env_snapshot_and_forget
    ),
    "torch.fx.passes.runtime_assert.insert_deferred_runtime_asserts": (
        _runtime_asserts_rebind_sizes
    ),
    "torch._export.passes._node_metadata_hook._set_node_metadata_hook": (
        _runtime_asserts_rebind_sizes
    ),
    "torch._export.passes._node_metadata_hook._node_metadata_hook": (_runtime_asserts_rebind_sizes),
    "torch._dynamo.config.do_not_emit_runtime_asserts": _runtime_asserts_rebind_sizes,
    **{
        f"{_PROGRAM}.ExportedProgram._{name}": _private_field(name)
        for name in (
            "state_dict",
            "constants",
            "graph_module",
            "graph_signature",
            "module_call_graph",
            "range_constraints",
            "example_inputs",
            "verifiers",
        )
    },
    f"{_PROGRAM}.ExportedProgram._guards_code": _guards,
    f"{_PROGRAM}.ExportedProgram._graph_module_flat_inputs": _flat_inputs,
    "torch.export._unlift._unlift_exported_program_lifted_states": _guards,
    f"{_PROGRAM}._create_graph_module_for_export": _new_program_without_code,
    f"{_PROGRAM}._get_updated_range_constraints": _new_program_without_code,
    f"{_PROGRAM}._get_updated_module_call_graph": _module_call_graph,
    f"{_PROGRAM}._convert_guards_to_code": _after_erasure,
    f"{_PROGRAM}._get_shape_env": _after_erasure,
    "torch._export.verifier._verify_exported_program_signature": _after_erasure,
    "torch._export.verifier._verify_exported_program_module_call_graph": _after_erasure,
    "torch._subclasses.fake_tensor.FakeTensor": _after_erasure,
    f"{_UTILS}._rename_without_collisions": _placeholder_names,
    f"{_UTILS}.placeholder_prefixes": _placeholder_names,
    "torch._export.verifier.Verifier": lambda: (_builtin_targets(), _new_program_without_code()),
    "torch.fx._lazy_graph_module._LazyGraphModule": _lazy_module,
    "torch.fx.Graph._graph_namespace": _kept_name,
    "torch.fx.graph._Namespace._obj_to_name": _kept_name,
    "torch.fx.graph._Namespace._used_names": _kept_name,
    "torch.nn.Module._buffers": _buffers,
    "torch.Tensor._version": _version,
    "torch.utils._pytree": _pytree,
    "torch._C.PyTorchFileReader": _archive_read,
    "torch.export.pt2_archive._package.load_pt2": _archive_read,
    "torch._export.serde.schema": _schema,
    "torch._export.serde.serialize._SYM_OPS": _builtin_targets,
    "torch._export.serde.union._Union": _schema,
}


def _assert(condition: object) -> None:
    assert condition


def test_every_internal_has_a_call():
    assert set(CALLS) == LISTED, sorted(set(CALLS) ^ LISTED)


@pytest.mark.parametrize("path", _torch.INTERNALS)
def test_every_internal_resolves_and_is_called_as_epass_calls_it(path):
    # internals.absent is what names a missing internal to the user: the same lookup.
    assert internals.absent([path]) is None
    CALLS[path]()


def test_set_fields_sets_only_listed_fields():
    with pytest.raises(TypeError, match="no_such_field"):
        programs.set_fields(_program.shallow_clone(_static()), no_such_field=1)

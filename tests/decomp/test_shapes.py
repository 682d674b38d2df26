"""``epass._decomp.shapes``: no value epass computes teaches the program's shape
environment what the retrace would not; symbolic templates on disk, read by a new
process with the retrace's graph, range constraints and guards; check mode compares
the shape environment too."""

from __future__ import annotations

import hashlib
import io
import json
import re
import textwrap
import warnings

import models
import pytest
import sympy
import torch
from decomp_helpers import entry_paths, run_script
from torch import nn
from torch.export import Dim

from epass import Decompose
from epass._decomp import disk, keys, propagation, shapes, sizes, splice, state, templates
from epass._decomp.check import first_difference
from epass._decomp.table import split_table
from epass._torch import fakes, internals
from epass.errors import DecompositionMismatchError, IncrementalDecompositionError

aten = torch.ops.aten


class _KeptConv(nn.Module):
    """A convolution the table keeps, on a weight that requires no grad (a buffer, as
    a folded weight is), and a linear layer to decompose after it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(4, 3, 3, 3))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = aten.convolution.default(x, self.weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        return self.head(y)


def _loaded(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` saved and loaded, as the command line reads a program: a shape
    environment of its own, whose fake tensor cache holds no value yet."""
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def test_a_kept_convolution_on_a_weight_without_grad_teaches_the_shape_environment_nothing():
    # Fake convolution asks mkldnn and nnpack whether the batch is at least 16 when
    # neither input requires grad: outside the trace's context, that guards s < 16.
    batch = Dim("batch", min=2, max=64)
    exported = torch.export.export(
        _KeptConv(), (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: batch},)
    )
    ep = _loaded(exported)
    shape_env = keys.fake_mode_of(ep).shape_env
    before = shapes.snapshot(shape_env)
    ranges = {str(k): str(v) for k, v in ep.range_constraints.items()}
    result = Decompose(method="incremental")(ep)
    assert result.notes["method"] == "incremental"
    assert shapes.difference(before, shapes.snapshot(shape_env)) == "nothing"
    assert {str(k): str(v) for k, v in ep.range_constraints.items()} == ranges
    assert first_difference(result.program, state.run_decompositions(ep)[0]) is None


# Decomposes the dynamic programs named in argv[1] and prints, per program, the first
# difference from the retrace, what the decomposition taught the shape environment,
# the range constraints and guards of the input, the result and the retrace, and
# the result's code; plus this process's disk cache counters.
_DYNAMIC_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "tests")
    import models
    from epass import Decompose
    from epass._decomp import disk, keys, shapes, state
    from epass._decomp.check import first_difference
    import io, torch
    result = {}
    for name in sys.argv[1].split(","):
        _, ep, _ = models.export_dynamic(name)
        if sys.argv[2:] == ["from-file"]:  # as the command line reads a program
            buffer = io.BytesIO()
            torch.export.save(ep, buffer)
            buffer.seek(0)
            ep = torch.export.load(buffer)
        shape_env = keys.fake_mode_of(ep).shape_env
        before, guards = shapes.snapshot(shape_env), ep._guards_code
        out = Decompose(method="incremental")(ep)
        taught = shapes.difference(before, shapes.snapshot(shape_env))
        ref = state.run_decompositions(ep)[0]
        result[name] = {
            "difference": first_difference(out.program, ref),
            "taught": taught,
            "ranges": [str(dict(p.range_constraints)) for p in (ep, out.program, ref)],
            "guards": [guards, out.program._guards_code, ref._guards_code],
            "code": out.program.graph_module.code,
        }
    print(json.dumps({"programs": result, "disk": disk.info()}))
    """
)


@pytest.mark.parametrize("source", ["exported", "from-file"])
def test_symbolic_templates_from_disk_give_the_retrace_in_a_new_process(tmp_path, source):
    # A program read from a file has a shape environment of its own that knows no
    # guard yet: the decoder's values teach it some (a batch of 1 is not taken), as
    # the retrace's trace teaches them.
    cache = tmp_path / "cache"
    cold = run_script(_DYNAMIC_SCRIPT, cache, "cnn,decoder", source)
    symbolic = [p for p in entry_paths(cache) if "shapes" in json.loads(p.read_text())["key"]]
    assert cold["disk"]["writes"] > 0 and len(symbolic) > 5
    warm = run_script(_DYNAMIC_SCRIPT, cache, "cnn,decoder", source)
    # Every entry is read, none is rejected, and nothing was left to write.
    assert warm["disk"]["hits"] >= len(entry_paths(cache)) and warm["disk"]["rejected"] == 0
    assert warm["disk"]["writes"] == 0
    for name, program in warm["programs"].items():
        assert program["difference"] is None, name
        ranges, guards = program["ranges"], program["guards"]
        assert ranges[1] == ranges[2] and "64" in ranges[1], name
        assert guards[1] == guards[2], name
        assert program["code"] == cold["programs"][name]["code"], name
        # Templates read from disk teach the shape environment what their traces did.
        assert program["taught"] == cold["programs"][name]["taught"], name
        if source == "exported":  # export learnt it all already
            assert program["taught"] == "nothing", name
            assert ranges[0] == ranges[1] and guards == [[], [], []], name


def _key(ep: torch.export.ExportedProgram, op: object) -> keys.DiskKey | None:
    """The disk key of the first call of ``op`` in ``ep``."""
    node = next(n for n in ep.graph.nodes if n.target is op)
    args, kwargs = keys.normalize(op, node.args, dict(node.kwargs))
    spec, parts, _, _ = keys.template_key(op, args, kwargs, frozenset())
    session = templates.Session(split_table(None))
    return templates._disk_key(op, spec, parts, session.name, keys.fake_mode_of(ep))


def _linear_program(batch: Dim, example: int = 3) -> torch.export.ExportedProgram:
    return torch.export.export(
        nn.Linear(4, 4), (torch.randn(example, 4),), dynamic_shapes=({0: batch},)
    )


def test_a_symbolic_disk_key_names_symbols_by_position_and_what_the_program_knows(cache):
    one = _key(_linear_program(Dim("batch", min=2, max=64)), aten.linear.default)
    assert one is not None and one.names is not None
    assert "$0" in one.data["parts"] and not re.search(r"\bs[0-9]+\b", one.data["parts"])
    assert one.data["shapes"]["symbols"] == [["VR[2, 64]", 3]]
    same = _key(_linear_program(Dim("batch", min=2, max=64)), aten.linear.default)
    assert same is not None and same.data == one.data
    # Another range, or another hint: another key (a decomposition may branch on both).
    for other in (
        _linear_program(Dim("batch", min=2, max=32)),
        _linear_program(Dim("batch", min=2, max=64), example=5),
    ):
        key = _key(other, aten.linear.default)
        assert key is not None and key.data != one.data


def test_a_fact_about_a_symbol_outside_the_key_keeps_the_template_off_the_disk(cache):
    ep = torch.export.export(
        nn.Linear(4, 4),
        (torch.randn(3, 4),),
        dynamic_shapes=({0: Dim("batch", min=2, max=64)},),
    )
    shape_env = keys.fake_mode_of(ep).shape_env
    (symbol,) = shape_env.var_to_range
    before = _key(ep, aten.linear.default)
    assert before is not None
    shape_env.evaluate_expr(sympy.Lt(symbol, 16))  # a guard on the key's own symbol
    guarded = _key(ep, aten.linear.default)
    assert guarded is not None and guarded.data["shapes"]["known"] == ["guard $0 < 16"]
    other = shape_env.create_unbacked_symint().node.expr
    shape_env.guard_or_defer_runtime_assert(sympy.Ge(symbol + other, 0), "test")
    assert _key(ep, aten.linear.default) is None


def test_a_tampered_stored_value_is_rejected_and_the_template_traced_again(cache):
    batch = Dim("batch", min=2, max=64)
    ep = torch.export.export(
        models.build("convbn"), (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: batch},)
    )
    Decompose(method="incremental")(ep)
    symbolic = [p for p in entry_paths(cache) if "shapes" in json.loads(p.read_text())["key"]]
    assert symbolic
    path, entry, node = next(
        (p, e, n)
        for p in symbolic
        for e in [json.loads(p.read_text())]
        for n in e["template"]["nodes"]
        if "$0" in json.dumps(n["value"])
    )
    node["value"] = json.loads(json.dumps(node["value"]).replace("$0", "$1"))
    body = json.dumps(entry["template"], sort_keys=True, separators=(",", ":"))
    entry["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    path.write_text(json.dumps(entry))
    templates.clear_memory()
    before = disk.info()["rejected"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Decompose(method="incremental")(ep)
    assert [w for w in caught if "another value" in str(w.message)]
    assert disk.info()["rejected"] - before == 1
    assert first_difference(result.program, state.run_decompositions(ep)[0]) is None
    assert json.loads(path.read_text())["template"] != entry["template"]  # rebuilt


def test_a_template_whose_trace_taught_a_guard_is_stored_with_its_lesson(cache):
    # Read from a file, the program's shape environment knows no guard: the trace of
    # the convolution teaches it that the batch is not 1, as the retrace's does. The
    # entry carries that lesson; a process reading it learns the same, and a lesson
    # the program's example does not meet is refused before it is taught.
    batch = Dim("batch", min=1, max=64)
    exported = torch.export.export(
        models.build("convbn"), (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: batch},)
    )
    cold = _loaded(exported)
    cold_env = keys.fake_mode_of(cold).shape_env
    Decompose(method="incremental")(cold)
    taught = [g.expr for g in cold_env.guards]
    assert taught
    lessons = [
        (p, e)
        for p in entry_paths(cache)
        for e in [json.loads(p.read_text())]
        if "lesson" in e["template"]
    ]
    assert lessons
    templates.clear_memory()
    warm = _loaded(exported)
    hits = disk.info()["hits"]
    result = Decompose(method="incremental", check=True)(warm)
    assert result.notes["method"] == "incremental" and disk.info()["hits"] > hits
    assert [g.expr for g in keys.fake_mode_of(warm).shape_env.guards] == taught

    path, entry = lessons[0]
    entry["template"]["lesson"]["guards"] = ["Eq($0, 7)"]
    body = json.dumps(entry["template"], sort_keys=True, separators=(",", ":"))
    entry["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    path.write_text(json.dumps(entry))
    templates.clear_memory()
    tampered = _loaded(exported)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Decompose(method="incremental", check=True)(tampered)
    assert [w for w in caught if "does not meet" in str(w.message)]
    assert [g.expr for g in keys.fake_mode_of(tampered).shape_env.guards] == taught


def _guard_on_the_batch(ep: torch.export.ExportedProgram) -> None:
    """What fake convolution did outside a trace: guard that the batch is below 16."""
    shape_env = keys.fake_mode_of(ep).shape_env
    symbol = next(iter(shape_env.var_to_range))
    shape_env.evaluate_expr(sympy.Lt(symbol, 16))


def test_a_change_to_the_shape_environment_outside_a_trace_is_caught(monkeypatch):
    real = sizes.drop_dead
    programs = []

    def drop_dead_and_guard(graph, merged, copied):
        real(graph, merged, copied)
        _guard_on_the_batch(programs[-1])

    monkeypatch.setattr(sizes, "drop_dead", drop_dead_and_guard)
    programs.append(models.export("convbn", dynamic=True)[1])
    with pytest.raises(shapes.Changed) as caught:
        splice.decompose(programs[-1], split_table(None))
    assert caught.value.reason.startswith(
        "the decomposition changed the program's shape environment outside a trace (guards s"
    )
    assert "< 16" in caught.value.reason
    programs.append(models.export("convbn", dynamic=True)[1])
    with pytest.raises(DecompositionMismatchError, match="outside a trace"):
        Decompose(check=True)(programs[-1])


def test_check_mode_finds_what_only_the_retrace_taught_the_shape_environment(monkeypatch):
    real = state.run_decompositions

    def retrace_and_guard(ep, table=None):
        out = real(ep, table)
        _guard_on_the_batch(ep)
        return out

    monkeypatch.setattr(state, "run_decompositions", retrace_and_guard)
    _, ep, _ = models.export("convbn", dynamic=True)
    with pytest.raises(DecompositionMismatchError, match=r"the retrace taught .* guards s"):
        Decompose(check=True)(ep)


def test_first_difference_compares_the_guards_each_program_carries():
    _, ep, _ = models.export("mlp", dynamic=True)
    fast = Decompose(method="incremental")(ep).program
    ref = state.run_decompositions(ep)[0]
    assert first_difference(fast, ref) is None
    ref._guards_code = ["L['x'].size()[0] < 16"]
    assert first_difference(fast, ref) == "guards [] / torch: [\"L['x'].size()[0] < 16\"]"


class _Inception(nn.Module):
    """GoogLeNet's shape in small: a strided stem, then pools with ``ceil_mode`` and
    concatenated branches, four times over. Exported with ``Dim.AUTO`` height and
    width, its guards include some sympy cannot settle statically."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 7, 2, 3)
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.one = nn.Conv2d(4, 2, 1)
        self.three = nn.Conv2d(4, 2, 3, padding=1)
        self.head = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for _ in range(4):
            x = self.pool(x)
            x = torch.cat([self.one(x), self.three(x)], 1)
        return self.head(x)


def _inception(model: nn.Module) -> torch.export.ExportedProgram:
    auto = torch.export.Dim.AUTO
    x = torch.randn(1, 3, 96, 96)
    return torch.export.export(model, (x,), dynamic_shapes=({2: auto, 3: auto},))


def test_the_guards_the_retrace_runs_are_run_and_carried_as_the_retrace_carries_them():
    # The retrace traces ep.module(), whose first call checks the program's guards;
    # evaluating those sympy cannot settle adds guards to the shape environment, which
    # the decomposed program carries in its _guards_code.
    model = _Inception()
    ep = _inception(model)
    ref = state.run_decompositions(ep)[0]
    learnt = [g for g in ref._guards_code if g not in ep._guards_code]
    assert learnt, "the retrace learnt no guard here: the test shows nothing"
    fast = Decompose(method="incremental")(_inception(model)).program
    assert fast._guards_code == ref._guards_code
    result = Decompose(check=True)(_inception(model))
    assert result.notes["method"] == "incremental", result.notes
    assert result.notes["checked"] is True
    # Another size than the export's, one that its guards admit on every release
    # (torch 2.11's export also guards the parity of each pooled size).
    x = torch.randn(1, 3, 64, 64)
    ep.module()(x)
    torch.testing.assert_close(result.program.module()(x), model(x))


def _recomputations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the copied nodes whose values the engine recomputes, from now on."""
    names: list[str] = []
    real = splice._Builder._propagate

    def counting(self, node, old):
        names.append(node.name)
        return real(self, node, old)

    monkeypatch.setattr(splice._Builder, "_propagate", counting)
    return names


def test_values_a_decomposition_recomputed_and_learnt_nothing_from_are_not_recomputed_again(
    monkeypatch,
):
    _, ep, _ = models.export("convbn", dynamic=True)
    tables = split_table(None)
    names = _recomputations(monkeypatch)
    first, _ = splice.decompose(ep, tables)
    assert names  # the convolution and what follows it, all symbolic
    names.clear()
    again, _ = splice.decompose(ep, tables)
    assert names == []
    assert first_difference(again, first) is None
    assert first_difference(again, ep.run_decompositions()) is None


def _guard(ep: torch.export.ExportedProgram) -> None:
    _guard_on_the_batch(ep)  # a fact the last decomposition did not start from


def _drop_the_bias(ep: torch.export.ExportedProgram) -> None:
    conv = next(n for n in ep.graph.nodes if n.target is aten.conv2d.default)
    conv.args = (*conv.args[:2], None, *conv.args[3:])  # the graph changed in place


def _new_value(ep: torch.export.ExportedProgram) -> None:
    conv = next(n for n in ep.graph.nodes if n.target is aten.conv2d.default)
    conv.meta["val"] = conv.meta["val"].clone()  # an equal value, another object


@pytest.mark.parametrize("change", [_guard, _drop_the_bias, _new_value])
def test_what_changed_since_makes_the_values_recomputed(monkeypatch, change):
    _, ep, _ = models.export("convbn", dynamic=True)
    tables = split_table(None)
    names = _recomputations(monkeypatch)
    splice.decompose(ep, tables)
    recomputed = list(names)
    change(ep)
    names.clear()
    again, _ = splice.decompose(ep, tables)
    assert names == recomputed
    assert first_difference(again, ep.run_decompositions()) is None


def test_settled_values_stop_being_skipped_once_the_decomposition_learns_something():
    _, ep, _ = models.export("convbn", dynamic=True)
    shape_env = keys.fake_mode_of(ep).shape_env
    learnt = propagation.Settled(ep.graph, shape_env)
    learnt.taught_nothing("conv2d")
    learnt.finish()
    settled = propagation.Settled(ep.graph, shape_env)
    assert settled.skip("conv2d") and not settled.skip("relu")
    _guard_on_the_batch(ep)  # a template of another table taught a guard, say
    assert not settled.skip("conv2d")
    settled.finish()  # this decomposition learnt something: nothing is kept
    assert not propagation.Settled(ep.graph, shape_env).skip("conv2d")


class _Convs(nn.Module):
    """Convolutions whose output sizes a later decomposition reads: a strided 1-d
    stack as in speech encoders (dynamic audio length), and a 2-d one with dynamic
    height and width."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.c1 = nn.Conv1d(1, 8, 10, stride=5, bias=False)
        self.c2 = nn.Conv1d(8, 8, 3, stride=2, bias=False)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.c2d = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "1-d":
            h = nn.functional.gelu(self.c1(x[:, None]))
            return self.fc(self.norm(self.c2(h).transpose(1, 2)))
        return self.c2d(x).flatten(2).sum(-1)


@pytest.mark.skipif(
    not internals.EXACT_RELEASE,
    reason="size queries placed for torch 2.11 to 2.14 only; retraces elsewhere",
)
@pytest.mark.parametrize("kind", ["1-d", "2-d"])
def test_sizes_a_decompositions_convolution_computes_are_read_where_the_retrace_reads_them(kind):
    # The convolution conv1d and conv2d decompose into makes its sizes from the first
    # dimension on; asked whether it is contiguous without adding a guard.
    if kind == "1-d":
        x, dims = torch.randn(2, 1600), {0: Dim("b", max=8), 1: Dim("t", min=800, max=4000)}
    else:
        x = torch.randn(2, 3, 32, 32)
        dims = {0: Dim("b", max=8), 2: Dim("h", min=8, max=64), 3: Dim("w", min=8, max=64)}
    module = _Convs(kind).eval()
    ep = torch.export.export(module, (x,), dynamic_shapes=(dims,))
    result = Decompose(method="incremental", check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    y = torch.randn(3, 2000) if kind == "1-d" else torch.randn(3, 3, 40, 24)
    torch.testing.assert_close(result.program.module()(y), module(y))


def test_remembered_expression_texts_are_the_texts_sympy_prints():
    x, y = sympy.symbols("x y", integer=True, positive=True)
    nested = x
    for _ in range(6):  # as a size halved by every stride-2 layer of a network
        nested = sympy.floor((nested - 1) / 2) + 1
    for expr in (nested, x + 2, x + sympy.Float(2.0), x + sympy.Rational(1, 2)):
        assert shapes.expr_text(expr) == str(expr)
        assert shapes.expr_text(expr) == str(expr)  # remembered
        assert shapes.free_symbols(expr) == expr.free_symbols
    # Equal only by value (an integer and a float) is not the same expression.
    assert shapes.expr_text(x + 2) != shapes.expr_text(x + sympy.Float(2.0))
    # The renamed text depends on which symbols the key names, and in what order.
    first, second = shapes.Renaming([x, y]), shapes.Renaming([y, x])
    assert first.text(x + 2 * y) == "$0 + 2*$1"
    assert second.text(x + 2 * y) == "2*$0 + $1"
    with pytest.raises(ValueError, match="outside the key"):
        shapes.Renaming([x]).text(x + y)
    with pytest.raises(ValueError, match="outside the key"):  # after a text of x alone
        shapes.Renaming([x]).text(x + y)


class _ConvNeXtBlock(nn.Module):
    """ConvNeXt's stem and block: a convolution on a permuted (channels-last strided)
    input, whose result's sizes a linear layer's decomposition reads."""

    def __init__(self, groups: int, kernel: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 4, stride=4)
        self.norm0 = nn.LayerNorm(8)
        self.conv = nn.Conv2d(8, 8, kernel, padding=kernel // 2, groups=groups)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm0(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.fc(self.norm(self.conv(y).permute(0, 2, 3, 1)))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize(("groups", "kernel"), [(8, 7), (1, 3)], ids=["depthwise", "dense"])
def test_a_channels_last_result_makes_its_sizes_where_the_retrace_makes_them(
    groups, kernel, channels_last, monkeypatch
):
    module, x = _ConvNeXtBlock(groups, kernel).eval(), torch.randn(2, 3, 32, 32)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    ep = torch.export.export(
        module, (x,), dynamic_shapes=({0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO},)
    )
    made = sizes._made_at_once
    asked: list[bool] = []

    def spied(value: torch.Tensor) -> bool:
        asked.append(not fakes.is_contiguous_or_false(value) and made(value))
        return made(value)

    monkeypatch.setattr(sizes, "_made_at_once", spied)
    if not internals.EXACT_RELEASE:  # placing a size query is exact on 2.11 to 2.14 only
        # The incremental path steps aside (for that, or a reason met before it).
        with pytest.raises(IncrementalDecompositionError):
            Decompose(method="incremental")(ep)
        return
    # Check mode: both paths run, and the graphs, guards and outputs compared.
    result = Decompose(method="incremental", check=True)(ep)
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    assert any(asked)  # a channels-last result made the size the linear layer reads

"""Pass options are checked against their declared types when a pipeline is built,
and verification checks the operator arguments that passes write."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs
import pytest
import torch
from torch.export import ExportedProgram

import epass
from epass import (
    OptionError,
    PassManager,
    PassResult,
    PipelineError,
    VerificationError,
    options,
    registry,
)
from epass.passes import Decompose, ReplaceOps, presets
from epass.verification import argument_problems
from tests import models

aten = torch.ops.aten


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


def typed(
    *,
    floor: float = 0.0,
    count: int = 1,
    flag: bool = False,
    label: str = "x",
    dtype: torch.dtype = torch.float32,
    mode: Mode = Mode.FAST,
    style: Literal["plain", "fancy"] = "plain",
    ops: list[torch._ops.OpOverload] | None = None,
    op: torch._ops.OpOverload | None = None,
    table: dict[torch._ops.OpOverload, torch._ops.OpOverload] | None = None,
) -> Any:
    """A factory with one option of every declared kind; its pass keeps the options."""

    def typed_pass(ep: ExportedProgram) -> PassResult:
        return PassResult(ep, False)

    typed_pass.options = dict(  # type: ignore[attr-defined]
        floor=floor,
        count=count,
        flag=flag,
        label=label,
        dtype=dtype,
        mode=mode,
        style=style,
        ops=ops,
        op=op,
        table=table,
    )
    return typed_pass


@attrs.define(eq=False)
class TypedClass:
    """An attrs pass with declared field types."""

    name: ClassVar[str] = "typed-class"
    scale: float = 1.0
    sizes: tuple[int, ...] = ()

    def __call__(self, ep: ExportedProgram) -> PassResult:
        return PassResult(ep, False)


@pytest.fixture(autouse=True, scope="module")
def typed_passes() -> Iterator[None]:
    registry.register_pass("typed", typed)
    registry.register_pass("typed-class", TypedClass)
    yield
    registry.unregister_pass("typed")
    registry.unregister_pass("typed-class")


def options_of(text: str) -> dict[str, Any]:
    (p,) = PassManager.from_text(text).passes
    return p.options  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("text", "option", "expected"),
    [
        ("typed(floor=x)", "floor", "float"),
        ('typed(floor="1.5")', "floor", "float"),
        ("typed(count=1.5)", "count", "int"),
        ("typed(count=true)", "count", "int"),
        ("typed(flag=1)", "flag", "bool"),
        ("typed(label=3)", "label", "str"),
        ("typed(dtype=3)", "dtype", "dtype"),
        ("typed(mode=slow)", "mode", "Mode"),
        ("typed(style=bold)", "style", '"plain" | "fancy"'),
        ("typed(ops=[aten.relu.default, 3])", "ops", "list[operator] | none"),
        ('typed(op="aten.relu.default")', "op", "operator | none"),
        ("typed(table={aten.relu.default: 1})", "table", "dict[operator, operator] | none"),
        ("typed-class(scale=x)", "scale", "float"),
        ("typed-class(sizes=[1, x])", "sizes", "tuple[int, ...]"),
    ],
)
def test_a_wrong_option_type_is_an_option_error_with_a_caret_under_the_value(
    text: str, option: str, expected: str
) -> None:
    full = f"dce, {text}"
    with pytest.raises(OptionError) as info:
        PassManager.from_text(full)
    err = info.value
    assert isinstance(err, PipelineError) and isinstance(err, TypeError)
    assert (err.option, err.expected) == (option, expected)
    value_at = full.index(f"{option}=") + len(option) + 1
    assert err.pos == value_at
    assert err.context.splitlines()[1].index("^") == value_at + 2
    assert f"option {option!r} of pass" in err.reason


def test_python_keywords_get_the_same_check_and_name_pass_and_option() -> None:
    with pytest.raises(OptionError) as info:
        epass.create_pass("typed", floor="x")
    err = info.value
    assert isinstance(err, TypeError)
    assert err.pass_name == "typed" and err.option == "floor"
    assert err.text == 'typed(floor="x")'
    assert err.text[err.pos :] == '"x")'


def test_values_are_converted_to_the_declared_types() -> None:
    opts = options_of(
        "typed(floor=2, dtype=bfloat16, mode=exact, style=fancy, ops=aten.linear, "
        "op=aten.relu, table={aten.relu: aten.gelu.default})"
    )
    assert opts["floor"] == 2.0 and type(opts["floor"]) is float
    assert opts["dtype"] is torch.bfloat16
    assert opts["mode"] is Mode.EXACT
    assert opts["style"] == "fancy"
    assert opts["ops"] == [aten.linear.default]  # one operator stands for a list of one
    assert opts["op"] is aten.relu.default  # a packet becomes its default overload
    assert opts["table"] == {aten.relu.default: aten.gelu.default}
    assert epass.create_pass("typed", mode="FAST", dtype="float16").options["mode"] is Mode.FAST
    assert epass.create_pass("typed-class", sizes=[1, 2]).sizes == (1, 2)


@pytest.mark.parametrize(
    "keep",
    ["aten.linear.default", "aten.linear", "[aten.linear]", "[aten.linear.default]"],
)
def test_decompose_keep_takes_one_operator_or_a_packet(keep: str) -> None:
    (p,) = PassManager.from_text(f"decompose(keep={keep})").passes
    assert p.keep == (aten.linear.default,)
    assert PassManager.from_text(f"decompose(keep={keep})").to_text() == (
        "decompose(keep=[aten.linear.default])"
    )
    assert Decompose(keep=aten.linear).keep == (aten.linear.default,)


def test_decompose_keep_still_refuses_what_is_not_an_operator() -> None:
    with pytest.raises(TypeError, match="takes ATen operators"):
        Decompose(keep=["linear"])
    with pytest.raises(PipelineError, match="bad options for pass 'decompose'"):
        PassManager.from_text('decompose(keep=["linear"])')


def test_replace_ops_takes_a_mapping_from_text_and_runs_it() -> None:
    text = "replace-ops(ops={aten.relu.default: aten.gelu.default})"
    pm = PassManager.from_text(text)
    (p,) = pm.passes
    assert isinstance(p, ReplaceOps) and p.ops == {aten.relu.default: aten.gelu.default}
    assert pm.to_text() == text
    _, ep, _ = models.export("mlp")
    out = pm.run(Decompose()(ep).program)
    targets = {n.target for n in out.graph.nodes if n.op == "call_function"}
    assert aten.gelu.default in targets and aten.relu.default not in targets


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("typed(table={[1]: 2})", "a mapping key must be a single value"),
        ("typed(table={1: 2, 1: 3})", "key 1 given twice"),
        ("typed(table={1 2})", "':' after a mapping key"),
        ("typed(table={1: 2", "',' or '}' in a mapping"),
    ],
)
def test_mapping_literal_syntax_errors_name_the_column(text: str, message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        PassManager.from_text(text)


def test_options_of_unknown_or_any_type_pass_unchanged() -> None:
    def loose(*, anything: Any = None, untyped=None):  # type: ignore[no-untyped-def]
        return lambda ep: ep

    converted = options.convert("loose", loose, {"anything": "x", "untyped": [1]})
    assert converted == {"anything": "x", "untyped": [1]}


# --- verification of operator arguments ----------------------------------------


@attrs.define(eq=False)
class BadClamp:
    """Rewrites relu(x) as clamp_min(x, "x"): an argument its schema does not take."""

    name: ClassVar[str] = "bad-clamp"

    def __call__(self, ep: ExportedProgram) -> ExportedProgram:
        for node in ep.graph.nodes:
            if node.target is aten.relu.default:
                node.target = aten.clamp_min.default
                node.args = (node.args[0], "x")
        ep.graph_module.recompile()
        return ep


@attrs.define(eq=False)
class ExtraArgument:
    """Gives relu a second positional argument."""

    name: ClassVar[str] = "extra-argument"

    def __call__(self, ep: ExportedProgram) -> ExportedProgram:
        for node in ep.graph.nodes:
            if node.target is aten.relu.default:
                node.args = (*node.args, 1)
        ep.graph_module.recompile()
        return ep


def test_a_pass_writing_a_string_where_a_number_belongs_fails_at_that_pass() -> None:
    _, ep, _ = models.export("mlp")
    lowered = Decompose()(ep).program
    with pytest.raises(VerificationError) as info:
        PassManager(["dce", BadClamp()]).run(lowered)
    err = info.value
    assert err.pass_name == "bad-clamp" and err.index == 1
    assert "'min'" in str(err) and "'x'" in str(err) and "aten.clamp_min.default" in str(err)


def test_a_pass_giving_an_operator_too_many_arguments_fails_at_that_pass() -> None:
    _, ep, _ = models.export("mlp")
    with pytest.raises(VerificationError, match="positional arguments") as info:
        PassManager([ExtraArgument()]).run(Decompose()(ep).program)
    assert info.value.pass_name == "extra-argument"


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", sorted(models.CASES))
def test_exported_and_lowered_zoo_programs_have_no_argument_problems(
    name: str, dynamic: bool
) -> None:
    _, ep, _ = models.export(name, dynamic=dynamic)
    assert argument_problems(ep) == []
    assert argument_problems(presets.lower().run(ep)) == []


def _relu_node(ep: ExportedProgram) -> torch.fx.Node:
    return next(n for n in ep.graph.nodes if n.target is aten.relu.default)


def _retarget_relu(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def edit(ep: ExportedProgram) -> None:
        node = _relu_node(ep)
        node.target, node.args, node.kwargs = target, (node.args[0], *args), kwargs

    return edit


@pytest.mark.parametrize(
    ("edit", "line"),
    [
        (
            _retarget_relu(aten.relu.default, (1,), {}),
            "gets 2 positional arguments, its schema takes 1",
        ),
        (
            _retarget_relu(aten.relu.default, (), {"alpha": 1}),
            "gets an unknown keyword argument 'alpha'",
        ),
        (_retarget_relu(aten.clamp_min.default, (), {}), "is missing its argument 'min'"),
        (
            _retarget_relu(aten.clamp_min.default, (), {"min": "x"}),
            "passes 'x' (str) as 'min', which its schema types number",
        ),
        (
            _retarget_relu(aten.sum.dim_IntList, ([0, "y"],), {}),
            "passes [0, 'y'] (immutable_list) as 'dim', which its schema types Optional[List[int]]",
        ),
    ],
    ids=["too many", "unknown keyword", "missing", "keyword literal", "list literal"],
)
def test_each_kind_of_argument_problem_names_the_node_and_operator(edit: Any, line: str) -> None:
    _, ep, _ = models.export("mlp")
    lowered = Decompose()(ep).program
    assert argument_problems(lowered) == []
    edit(lowered)
    (problem,) = argument_problems(lowered)
    node = next(n for n in lowered.graph.nodes if n.name == problem.split("'")[1])
    assert problem == f"node {node.name!r} ({node.target}) {line}"


# --- one option model for every entry point --------------------------------------------


class Floor:
    """A plain class (no attrs): its ``__init__`` parameters are its options."""

    name = "floor"

    def __init__(self, floor: float = 0.0, *, mode: Literal["fast", "exact"] = "fast") -> None:
        self.floor = floor
        self.mode = mode

    def __call__(self, ep: ExportedProgram) -> PassResult:
        return PassResult(ep, False)


@pytest.fixture
def floor_pass() -> Iterator[None]:
    registry.register_pass("floor", Floor)
    yield
    registry.unregister_pass("floor")


@pytest.mark.parametrize(
    ("text", "option", "expected"),
    [
        ("floor(floor='x')", "floor", "float"),
        ("floor(floor=true)", "floor", "float"),
        ("floor(mode=slow)", "mode", '"fast" | "exact"'),
    ],
)
def test_a_plain_class_is_checked_by_its_init_parameters(
    floor_pass: None, text: str, option: str, expected: str
) -> None:
    with pytest.raises(OptionError) as info:
        PassManager.from_text(text)
    assert (info.value.pass_name, info.value.option, info.value.expected) == (
        "floor",
        option,
        expected,
    )
    assert info.value.pos == text.index("=") + 1  # the caret is under the value
    with pytest.raises(OptionError):
        epass.create_pass("floor", **{option: text[text.index("=") + 1 : -1].strip("'")})


def test_a_plain_class_gets_its_options_converted(floor_pass: None) -> None:
    (p,) = PassManager.from_text("floor(floor=2, mode=exact)").passes
    assert isinstance(p, Floor) and (p.floor, p.mode) == (2.0, "exact")
    assert type(p.floor) is float
    (info,) = [o for o in registry.describe_pass("floor").options if o.name == "floor"]
    assert (info.type, info.default) == ("float", 0.0)


def test_a_plain_class_is_checked_on_the_command_line(
    floor_pass: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from epass.cli import main

    program = tmp_path / "m.pt2"
    _, ep, _ = models.export("mlp")
    torch.export.save(ep, program)
    assert main(["--plain", "run", str(program), "-p", "floor(floor='x')"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert "option 'floor' of pass 'floor' takes float, got \"x\" (str)" in first


def _message(call: Any) -> str:
    with pytest.raises(OptionError) as info:
        call()
    return str(info.value.message)


def test_a_wrong_type_from_python_is_the_same_option_error_as_from_text() -> None:
    from epass.passes import CastDtype, ConstantFold

    from_python = _message(lambda: ConstantFold(max_growth="big"))
    assert from_python == _message(
        lambda: PassManager.from_text('fold-constants(max_growth="big")')
    )
    assert from_python == _message(lambda: epass.create_pass("fold-constants", max_growth="big"))
    assert (
        from_python == "option 'max_growth' of pass 'fold-constants' takes float, got \"big\" (str)"
    )
    with pytest.raises(OptionError) as info:
        ConstantFold("big")  # positional, too
    assert (info.value.pass_name, info.value.option) == ("fold-constants", "max_growth")
    assert ConstantFold(2).max_growth == 2.0 and type(ConstantFold(2).max_growth) is float
    assert CastDtype(dtype="float16").dtype is torch.float16
    with pytest.raises(OptionError, match="option 'fold_views' of pass 'fold-constants'"):
        ConstantFold(fold_views="yes")


@pytest.mark.parametrize(
    "table",
    ['"os.system"', "5", "{aten.relu.default: 5}", "{aten.relu.default: none}",
     '{aten.relu.default: "os.system"}', "[aten.relu.default]"],
)  # fmt: skip
def test_a_decompose_table_that_cannot_be_a_table_is_refused_when_the_pipeline_is_built(
    table: str,
) -> None:
    text = f"dce, decompose(table={table})"
    with pytest.raises(OptionError) as info:
        PassManager.from_text(text)
    err = info.value
    assert (err.pass_name, err.option) == ("decompose", "table")
    assert err.expected == "dict[any, function] | none"
    assert err.pos == text.index("table=") + len("table=")
    assert err.context.splitlines()[1].index("^") == err.pos + 2


def test_a_decompose_table_of_functions_and_the_default_table_build() -> None:
    (default,) = PassManager.from_text("decompose(table=none)").passes
    assert default.table is None  # none: torch's default table
    (own,) = PassManager.from_text("decompose(table={aten.relu.default: aten.gelu.default})").passes
    assert own.table == {aten.relu.default: aten.gelu.default}


def test_option_types_are_read_once_per_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    import typing

    import epass.protocol

    calls: list[Any] = []
    real = typing.get_type_hints

    def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counting)
    if hasattr(epass.protocol, "get_type_hints"):
        monkeypatch.setattr(epass.protocol, "get_type_hints", counting)
    text = ", ".join(["fold-constants(max_growth=2.0)", "cast-dtype(dtype=float16)", "dce"] * 200)
    PassManager.from_text(text)
    first = len(calls)
    PassManager.from_text(text)
    assert first <= 20  # a few per factory, not per pass (it was 4 per pass)
    assert len(calls) == first  # and none the second time

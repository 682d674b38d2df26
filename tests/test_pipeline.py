"""Textual pipelines: parsing, printing, errors, and the parse/print round trip."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epass
from epass import PassManager, PassResult, registry
from epass.passes import Decompose
from epass.pipeline import (
    MAX_NESTING,
    Group,
    PassSpec,
    PipelineError,
    format_pipeline,
    format_value,
    parse,
)

OPS = [torch.ops.aten.gelu.default, torch.ops.aten.relu.default, torch.ops.aten.add.Tensor]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool]


@attrs.define(eq=False)
class Knobs:
    """A do-nothing pass with one option of every kind the grammar has."""

    name: ClassVar[str] = "knobs"
    changes_input: ClassVar[bool] = False

    count: int = 1
    scale: float = 0.5
    flag: bool = False
    label: str = "x"
    dtype: torch.dtype = torch.float32
    op: Any = torch.ops.aten.relu.default
    sizes: list[Any] = attrs.field(factory=list)
    maybe: Any = None

    def __call__(self, ep: Any) -> PassResult:
        return PassResult(ep, False)


@attrs.define(eq=False)
class Plain:
    """A do-nothing pass without options."""

    name: ClassVar[str] = "plain"

    def __call__(self, ep: Any) -> PassResult:
        return PassResult(ep, False)


@pytest.fixture(autouse=True, scope="module")
def test_passes() -> Iterator[None]:
    registry.register_pass("knobs", Knobs)
    registry.register_pass("plain", Plain)
    yield
    registry.unregister_pass("knobs")
    registry.unregister_pass("plain")


def test_parse_every_value_kind() -> None:
    (spec,) = parse(
        "knobs(count=-3, scale=1e-3, flag=true, label='a b', dtype=bfloat16, "
        'op=aten.gelu.default, sizes=[1, [2.5, none], "q"], maybe=inf)'
    )
    assert isinstance(spec, PassSpec)
    assert dict(spec.options) == {
        "count": -3,
        "scale": 1e-3,
        "flag": True,
        "label": "a b",
        "dtype": torch.bfloat16,
        "op": torch.ops.aten.gelu.default,
        "sizes": [1, [2.5, None], "q"],
        "maybe": math.inf,
    }


def test_bare_words_dtypes_and_operator_packets() -> None:
    (spec,) = parse("knobs(label=strict, dtype=torch.float16, op=aten.gelu, maybe=False)")
    assert dict(spec.options) == {
        "label": "strict",
        "dtype": torch.float16,
        "op": torch.ops.aten.gelu,
        "maybe": False,
    }


def test_groups_nest_and_default_fixpoint_max() -> None:
    tree = parse("plain, repeat(3, [plain, fixpoint([knobs])]), fixpoint([plain], max=4)")
    assert tree == (
        PassSpec("plain"),
        Group("repeat", 3, (PassSpec("plain"), Group("fixpoint", 10, (PassSpec("knobs"),)))),
        Group("fixpoint", 4, (PassSpec("plain"),)),
    )


def test_whitespace_newlines_and_comments_are_ignored() -> None:
    text = """
    # lower, then clean up
    plain,
    knobs( count = 2 ),   # trailing comment
    """
    assert parse(text) == (PassSpec("plain"), PassSpec("knobs", (("count", 2),)))


def test_empty_pipeline_is_empty() -> None:
    assert parse("  ") == ()
    assert PassManager.from_text("").passes == []


def test_from_text_builds_managers_for_groups() -> None:
    pm = PassManager.from_text("decompose, repeat(2, [plain]), fixpoint([knobs(count=3)], max=5)")
    first, rep, fix = pm.passes
    assert isinstance(first, Decompose)
    assert isinstance(rep, PassManager) and rep.steps == 2 and rep.name == "repeat"
    assert isinstance(fix, PassManager) and fix.steps == 5 and fix.name == "fixpoint"
    assert isinstance(fix.passes[0], Knobs) and fix.passes[0].count == 3


def test_to_text_prints_only_non_default_options() -> None:
    pm = PassManager(
        [Knobs(count=4, dtype=torch.bfloat16, op=torch.ops.aten.gelu.default), Plain()]
    )
    assert pm.to_text() == "knobs(count=4, dtype=bfloat16, op=aten.gelu.default), plain"


def test_to_text_of_steps_wraps_in_repeat() -> None:
    text = PassManager([Plain()], steps=3).to_text()
    assert text == "repeat(3, [plain])"


def test_to_text_of_decompose_keep() -> None:
    pm = PassManager([Decompose(keep=[torch.ops.aten.linear.default])])
    assert pm.to_text() == "decompose(keep=[aten.linear.default])"
    (again,) = PassManager.from_text(pm.to_text()).passes
    assert again.keep == (torch.ops.aten.linear.default,)


def test_to_text_of_unregistered_pass_names_it() -> None:
    def private_pass(ep: Any) -> Any:
        return ep

    with pytest.raises(ValueError, match=r"'private_pass'.*not registered"):
        PassManager([private_pass]).to_text()


def test_to_text_of_option_without_text_form_names_the_option() -> None:
    pm = PassManager([Knobs(maybe=torch.zeros(2))])
    with pytest.raises(ValueError, match="option 'maybe' of pass 'knobs'"):
        pm.to_text()


def test_unknown_pass_error_has_column_caret_and_suggestion() -> None:
    with pytest.raises(PipelineError) as info:
        PassManager.from_text("decompose, dce2")
    err = info.value
    assert err.reason == "unknown pass 'dce2' at column 12; did you mean 'dce'?"
    assert err.column == 12
    assert str(err).splitlines() == [err.reason, "  decompose, dce2", "             ^"]


def test_unknown_option_points_at_the_option() -> None:
    with pytest.raises(PipelineError) as info:
        PassManager.from_text("plain, knobs(cuont=2)")
    assert info.value.column == 14
    assert "no option 'cuont'; did you mean 'count'?" in info.value.reason


@pytest.mark.parametrize(
    ("text", "column", "message"),
    [
        ("plain plain", 7, "expected ',' between passes"),
        ("plain,,", 7, "expected a pass name, found ','"),
        ("knobs(count)", 12, "expected '=' after option 'count'"),
        ("knobs(count=1 flag=true)", 15, "expected ',' or ')'"),
        ("knobs(label='abc)", 13, "unterminated string"),
        ("knobs(count=1, count=2)", 16, "option 'count' given twice"),
        ("repeat(0, [plain])", 8, "repeat's count must be a positive integer"),
        ("repeat(2, plain)", 11, "expected '[' opening"),
        ("fixpoint([plain], steps=3)", 19, "fixpoint takes only 'max=N'"),
        ("knobs(op=aten.no_such_op.default)", 10, "unknown operator or dtype"),
        ("plain; knobs", 6, "unexpected character ';'"),
        ("aten.relu", 1, "expected a pass name"),
    ],
)
def test_syntax_errors_name_the_column(text: str, column: int, message: str) -> None:
    with pytest.raises(PipelineError) as info:
        PassManager.from_text(text)
    assert info.value.column == column, str(info.value)
    assert message in info.value.reason
    caret = str(info.value).splitlines()[-1]
    assert caret.index("^") - 2 == column - 1


def test_errors_on_later_lines_give_line_and_column() -> None:
    with pytest.raises(PipelineError, match="unknown pass 'nope' at line 2, column 3"):
        PassManager.from_text("plain,\n  nope")


def test_parser_never_evaluates_python() -> None:
    for text in ["knobs(label=__import__('os').system('true'))", "knobs(count=1+1)"]:
        with pytest.raises(PipelineError):
            parse(text)


def test_bad_option_value_is_reported_with_the_pass() -> None:
    with pytest.raises(PipelineError, match=r"bad options for pass 'decompose'.*ATen operators"):
        PassManager.from_text("decompose(keep=[1])")


def test_string_passes_in_a_manager_use_the_registry() -> None:
    pm = PassManager(["plain", "knobs(dtype=bfloat16)", "decompose, plain"])
    assert isinstance(pm.passes[0], Plain)
    assert pm.passes[1].dtype is torch.bfloat16
    assert isinstance(pm.passes[2], PassManager)
    assert [type(p) for p in pm.passes[2].passes] == [Decompose, Plain]


# --- property: print, parse back, equal --------------------------------------

names = st.sampled_from(["plain", "knobs", "fold-constants", "a_b", "x-1"])
floats = st.floats(allow_nan=False)
scalars = st.one_of(
    st.integers(),
    floats,
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from(DTYPES),
    st.sampled_from(OPS),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
keys = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)


@st.composite
def pass_specs(draw: st.DrawFn) -> PassSpec:
    opts = draw(st.dictionaries(keys, values, max_size=3))
    return PassSpec(draw(names), tuple(opts.items()))


trees = st.recursive(
    pass_specs(),
    lambda inner: st.one_of(
        st.builds(
            Group,
            st.sampled_from(["repeat", "fixpoint"]),
            st.integers(1, 20),
            st.lists(inner, max_size=3).map(tuple),
        )
    ),
    max_leaves=8,
)
pipelines = st.lists(trees, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(pipelines)
def test_syntax_round_trip(tree: tuple[Any, ...]) -> None:
    text = format_pipeline(tree)
    assert parse(text) == tree
    assert format_pipeline(parse(text)) == text


@st.composite
def knob_specs(draw: st.DrawFn) -> PassSpec:
    options = {
        "count": st.integers(),
        "scale": floats,
        "flag": st.booleans(),
        "label": st.text(max_size=8),
        "dtype": st.sampled_from(DTYPES),
        "op": st.sampled_from(OPS),
        "sizes": st.lists(st.one_of(st.integers(), st.sampled_from(DTYPES)), max_size=3),
        "maybe": st.one_of(st.none(), st.integers(), st.sampled_from(OPS)),
    }
    chosen = draw(st.lists(st.sampled_from(sorted(options)), unique=True, max_size=4))
    return PassSpec("knobs", tuple((k, draw(options[k])) for k in chosen))


registered_trees = st.recursive(
    st.one_of(knob_specs(), st.just(PassSpec("plain")), st.just(PassSpec("decompose"))),
    lambda inner: st.builds(
        Group,
        st.sampled_from(["repeat", "fixpoint"]),
        st.integers(1, 5),
        st.lists(inner, min_size=1, max_size=3).map(tuple),
    ),
    max_leaves=6,
)


def _structure(passes: list[Any]) -> list[Any]:
    out: list[Any] = []
    for p in passes:
        if isinstance(p, PassManager):
            out.append((p.name, p.steps, _structure(p.passes)))
        else:
            fields = attrs.asdict(p, recurse=False) if attrs.has(type(p)) else {}
            out.append((type(p), {k: format_value(v) for k, v in fields.items()}))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(registered_trees, max_size=4).map(tuple))
def test_manager_round_trip(tree: tuple[Any, ...]) -> None:
    pm = PassManager.from_text(format_pipeline(tree))
    text = pm.to_text()
    again = PassManager.from_text(text)
    assert again.to_text() == text
    assert _structure(again.passes) == _structure(pm.passes)


# --- text cannot reach manager settings -----------------------------------------


@pytest.mark.parametrize(
    ("text", "column", "option"),
    [
        ("lower(verify=false)", 7, "verify"),
        ("cleanup(fingerprint=true)", 9, "fingerprint"),
        ('lower(instruments="abc")', 7, "instruments"),
        ("lower(steps=1000000)", 7, "steps"),
        ("dce, cleanup(linker=none)", 14, "linker"),
        ("repeat(2, [lower(name=x)])", 18, "name"),
    ],
)
def test_presets_take_no_manager_settings_from_text(text: str, column: int, option: str) -> None:
    with pytest.raises(PipelineError) as info:
        PassManager.from_text(text)
    assert info.value.column == column, str(info.value)
    assert f"no option {option!r}" in info.value.reason
    assert "takes no options in pipeline text" in info.value.reason
    assert str(info.value).splitlines()[-1].index("^") - 2 == column - 1


def test_presets_still_take_manager_settings_from_python() -> None:
    from epass.passes import presets

    assert presets.lower(verify=False).verify is False
    assert epass.create_pass("cleanup", fingerprint=True).fingerprint is True


def test_to_text_refuses_options_the_text_cannot_set() -> None:
    pm = PassManager([epass.create_pass("lower", verify=False)])
    with pytest.raises(ValueError, match="option 'verify' of pass 'lower'"):
        pm.to_text()


# --- text that used to escape the grammar's errors --------------------------------


def _error(text: str) -> PipelineError:
    before = set(sys.modules)
    with pytest.raises(PipelineError) as info:
        PassManager.from_text(text)
    assert set(sys.modules) == before
    lines = str(info.value).splitlines()
    assert lines[-1].strip() == "^" and f"column {info.value.column}" in info.value.reason
    return info.value


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 300, 3000])
def test_deeply_nested_groups_are_a_pipeline_error(depth: int) -> None:
    err = _error("repeat(1, [" * depth + "plain" + "])" * depth)
    assert "nest more than" in err.reason
    assert err.column == len("repeat(1, [") * (MAX_NESTING + 1)  # at the first '[' too many


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 3000, 100_000])
def test_deeply_nested_option_lists_are_a_pipeline_error(depth: int) -> None:
    err = _error("knobs(sizes=" + "[" * depth + "]" * depth + ")")
    assert "nest more than" in err.reason
    assert err.column == len("knobs(sizes=") + MAX_NESTING + 1


def test_nesting_up_to_the_limit_parses_prints_and_builds() -> None:
    half = MAX_NESTING // 2
    text = "repeat(1, [" * half + "knobs(sizes=" + "[" * half + "]" * half + ")" + "])" * half
    pm = PassManager.from_text(text)
    assert PassManager.from_text(pm.to_text()).to_text() == pm.to_text()
    groups = "repeat(1, [" * MAX_NESTING + "plain" + "])" * MAX_NESTING
    assert PassManager.from_text(groups).to_text() == groups


@pytest.mark.parametrize(
    "text",
    [
        "knobs(count=" + "9" * 5000 + ")",
        "knobs(count=-" + "1" * 4301 + ")",
        "knobs(sizes=[1, " + "9" * 5000 + "])",
        "repeat(" + "9" * 5000 + ", [plain])",
        "fixpoint([plain], max=" + "9" * 5000 + ")",
    ],
    ids=["option", "negative", "in-list", "repeat", "fixpoint"],
)
def test_numbers_too_long_for_int_are_a_pipeline_error(text: str) -> None:
    err = _error(text)
    assert "too long" in err.reason
    assert err.text[err.pos] in "-9"


_SUBMODULE_WORDS = [
    "_inductor",
    "onnx",
    "_dynamo",
    "torch._inductor",
    "_inductor.config",
    "torch.onnx.export",
    "_dynamo.config.x",
    "no_such_namespace.relu",
    "torch.ops.no_such_namespace.relu.default",
]
_IMPORT_PROBE = """
import json, sys
import torch
from epass.pipeline import PipelineError, parse
for word in json.loads(sys.argv[1]):
    before, namespaces = set(sys.modules), set(vars(torch.ops))
    try:
        result = [[item.name, item.options] for item in parse(f"knobs(label={word})")]
    except PipelineError as exc:
        result = exc.column
    new = sorted(set(sys.modules) - before) + sorted(set(vars(torch.ops)) - namespaces)
    print(json.dumps([word, result, new]))
"""


def test_option_values_import_nothing() -> None:
    # A fresh interpreter: in this one, other tests may have imported these already.
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(_SUBMODULE_WORDS)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    results = {word: (result, new) for word, result, new in map(json.loads, out)}
    assert list(results) == _SUBMODULE_WORDS
    for word, (result, new) in results.items():
        assert new == [], word  # no module imported, no torch.ops namespace made
        if "." in word:
            assert result == 13, word  # an unknown operator, at the value's column
        else:  # a bare word is a string
            assert result == [["knobs", [["label", word]]]], word


# --- property: any text either parses or is a PipelineError, importing nothing ------

# Words that mean something to the grammar or to torch (including names of torch
# submodules that attribute access would import), and numbers int() refuses.
_WORDS = st.sampled_from(
    [
        *("0", "-1", "+7", "2.5", "1e309", "-inf", "nan", "9" * 4400, "-" + "1" * 4301),
        *("true", "none", "max", "bfloat16", "torch.float16", "float", "x"),
        *('"a\\n"', "'q'", "'x", '"\\z"', "\\"),
        *("aten.relu", "aten.gelu.default", "torch.ops.aten.add.Tensor", "prims.add"),
        *("_inductor", "onnx", "_dynamo", "torch._inductor", "onnx.export", "x.y"),
        *("__class__", "aten.__class__", "higher_order.cond", "torch.ops.__dict__.x"),
    ]
)
_KEYS = st.sampled_from(["count", "sizes", "label", "op", "dtype", "verify", "steps", "max"])
_NAMES = st.sampled_from(["knobs", "plain", "lower", "cleanup", "dce", "nope", "repeat"])
_VALUES = st.recursive(
    _WORDS, lambda inner: st.lists(inner, max_size=3).map(lambda v: f"[{', '.join(v)}]")
)


@st.composite
def _deep_value(draw: st.DrawFn) -> str:
    depth = draw(st.integers(0, 4000))
    return "[" * depth + draw(_VALUES) + "]" * draw(st.sampled_from([depth, 0, depth // 2]))


@st.composite
def _pass_text(draw: st.DrawFn) -> str:
    options = draw(st.lists(st.tuples(_KEYS, st.one_of(_VALUES, _deep_value())), max_size=3))
    name = draw(_NAMES)
    return f"{name}({', '.join(f'{k}={v}' for k, v in options)})" if options else name


def _group(kind: str, count: str, body: list[str]) -> str:
    inner = ", ".join(body)
    return (
        f"repeat({count}, [{inner}])" if kind == "repeat" else f"fixpoint([{inner}], max={count})"
    )


_ITEMS = st.recursive(
    _pass_text(),
    lambda inner: st.builds(
        _group, st.sampled_from(["repeat", "fixpoint"]), _WORDS, st.lists(inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def _pipeline_text(draw: st.DrawFn) -> str:
    text = ", ".join(draw(st.lists(_ITEMS, max_size=3)))
    depth = draw(st.integers(0, 400))
    text = "repeat(1, [" * depth + text + "])" * depth
    # Then damage it: cut it, or splice in arbitrary characters.
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=3)) + text[at + draw(st.integers(0, 2)) :]
    return text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=40), _pipeline_text()))
def test_any_text_parses_or_is_a_pipeline_error(text: str) -> None:
    before = set(sys.modules)
    try:
        parse(text)
    except PipelineError as exc:
        assert exc.column >= 1 and str(exc).splitlines()[-1].strip() == "^"
    assert set(sys.modules) == before  # parsing imports nothing
    try:
        PassManager.from_text(text)
    except PipelineError as exc:
        assert exc.column >= 1 and str(exc).splitlines()[-1].strip() == "^"
    # Building loads the named passes' own modules (the registry is lazy), nothing else.
    assert {m for m in set(sys.modules) - before if not m.startswith("epass.")} == set()

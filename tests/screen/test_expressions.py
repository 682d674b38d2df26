"""``epass._screen.expressions``: shape expressions and guard code are bounded
arithmetic on shape symbols, refused quickly and by name when they are not."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import screen_helpers as h

import epass
from epass._screen import expressions
from epass.errors import UnsafeArchiveError


@pytest.mark.parametrize(
    "expression",
    ["9**9**9", "Pow(9, Pow(9, 9))", "Integer(9)**Integer(99999999)", "1 << 99999999999",
     "9" * 5000, "s0 + " + "9" * 21, "Float('1.0', 999999999)", "((s0**8)**8)**8",
     "Symbol('s0') * " * 2000 + "1", "Pow(Pow(99999999999999999999, 64), 64)",
     "*".join(["Pow(99999999999999999999, 64)"] * 300),
     "*".join(f"s{i}" for i in range(1400)), "Max(" + ", ".join(f"s{i}" for i in range(80)) + ")",
     " + ".join(f"Max(s{i}, s{i + 1})*Min(s{i + 2}, 3)" for i in range(250))],
)  # fmt: skip
def test_shape_expression_bombs_are_refused_quickly(
    expression: str, small: dict[str, bytes], tmp_path: Path
) -> None:
    program = h.program_of(small)
    text = json.dumps(program)
    start = text.index('"expr_str": "') + len('"expr_str": "')
    end = text.index('"', start)
    bomb = json.loads(text[:start] + expression.replace('"', '\\"') + text[end:])
    evil = h.write(small, tmp_path / "bomb.pt2", bomb)
    began = time.perf_counter()
    with pytest.raises(UnsafeArchiveError) as info:
        epass.load(evil)
    assert time.perf_counter() - began < 5.0
    assert "symbolic expression" in str(info.value) and ".expr_str" in str(info.value)


def test_guard_code_bombs_are_refused(small: dict[str, bytes], tmp_path: Path) -> None:
    for guard in ("L['x'].size()[0] <= 9**9**9", "(1, 2) * 99999999999 == L['x'].size()"):
        program = h.program_of(small)
        program["guards_code"] = [guard]
        with pytest.raises(UnsafeArchiveError, match="guard expression"):
            epass.load(h.write(small, tmp_path / "guard.pt2", program))


def test_shape_expressions_torch_writes_pass() -> None:
    for text in (
        "Symbol('s77', positive=True, integer=True)",
        "Pow(Symbol('s70', positive=True, integer=True), Integer(2))",
        "Mul(Float('1.5', precision=53), ToFloat(Symbol('u0', integer=True)))",
        "FloorDiv(s0 + 1, 2) * s1**2 - Mod(s0, 8)",
        "99999999999999999999 * s0",
    ):
        assert expressions.expression_problem(text, guard=False) is None, text
    for text in (
        "L['x'].size()[0] <= 64",
        "2 <= L['y'].size()[0] and L['x'].stride()[1] == 1",
        "math.floor(L['x'].size()[0] / 2) >= max(1, L['y'].size()[0])",
    ):
        assert expressions.expression_problem(text, guard=True) is None, text


@pytest.mark.parametrize(
    ("text", "guard", "why"),
    [
        ("s0 + " * 2500 + "1", False, "longer than 10000 characters"),
        ("s0 + 1  # note", False, "a backslash, comment or control character"),
        ("s0 +\n1", True, "a backslash, comment or control character"),
        ("s0 +", False, "does not parse"),
        ("*".join(f"s{i}" for i in range(200)), False, "399 terms (at most 128)"),
        ("Max(" + ", ".join(f"s{i}" for i in range(9)) + ")", False, "Max/Min over 9 arguments"),
        ("((s0**2)**2)**2", False, "powers nested 3 deep (at most 2)"),
        ("*".join(["Pow(99999999999999999999, 64)"] * 8), False, "arithmetic on numbers of up to"),
        ("s0 ** 65", False, "an exponent or shift that is not a number up to 64: 's0 ** 65'"),
        ("s0 << s0 + 1", True, "an exponent or shift that is not a number up to 64"),
        ("s0 + " + "9" * 21, False, "an integer of more than 20 digits"),
        ("(1, 2) * s0", False, "code in an expression: '(1, 2) * s0'"),
        ("s0.real", False, "code in an expression: 's0.real'"),
        ("L['x'].size()[0]", False, "code in an expression"),
        ("Symbol('s0', _cls=True)", False, "code in an expression: '_cls'"),
        ("Float('1.0', 99)", False, "code in an expression: \"Float('1.0', 99)\""),
        ("Float('1.0', precision=2048)", False, "code in an expression: 'precision'"),
        ("Symbol('s0 s1')", False, "code in an expression: \"'s0 s1'\""),
        ("L['x\"'].size()[0] == 1", True, "code in an expression"),
        ("L['x'].__class__", True, "code in an expression: \"L['x'].__class__\""),
        ("os.system(1)", True, "code in an expression"),
        ("Symbol('s0', positive=True)", True, "code in an expression: \"'s0'\""),
    ],
)
def test_each_bound_refuses_with_its_reason(text: str, guard: bool, why: str) -> None:
    problem = expressions.expression_problem(text, guard=guard)
    assert problem is not None and problem.startswith(why), problem


def test_allowed_shape_functions_cover_torchs_deserializer() -> None:
    """Every sympy function torch's deserializer knows must pass the screen."""
    from torch._export.serde import serialize

    source = Path(serialize.__file__).read_text()
    known = set(re.findall(r'"(\w+)": torch\.utils\._sympy\.functions\.\w+', source))
    assert len(known) > 10, "torch's deserializer no longer lists its sympy functions"
    assert known <= expressions.SYMPY_CALLS, sorted(known - expressions.SYMPY_CALLS)

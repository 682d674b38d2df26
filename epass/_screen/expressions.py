"""The bounds on shape expressions (sympy text) and guard code (Python): what they may
name and call, and how much work parsing and evaluating them may cost."""

from __future__ import annotations

import ast
import functools
import re

import attrs

from epass._screen.text import is_plain

__all__ = [
    "EXPR_CHARS",
    "EXPR_TERMS",
    "INT_DIGITS",
    "MAX_DIGITS",
    "MAX_EXPONENT",
    "MIN_MAX_ARGS",
    "POWER_DEPTH",
    "PROGRAM_EXPR_CHARS",
    "PROGRAM_MIN_MAX_ARGS",
    "PROGRAM_TERMS",
    "SYMPY_CALLS",
    "expression_cost",
    "expression_problem",
]

# Bounds that keep an expression cheap to parse and to evaluate: sympy and Python both
# compute integer arithmetic exactly, so ``9**9**9`` or ``1 << 10**12`` never finishes.
EXPR_CHARS = 10_000
INT_DIGITS = 20
MAX_EXPONENT = 64
POWER_DEPTH = 2
MAX_DIGITS = 10_000
# sympy's time grows faster than linearly with the terms of one expression (a product
# of 1,400 symbols takes 30 s, a Max of 80 symbols as long); these bound one
# expression, and the budget below all of a program's distinct expressions together.
EXPR_TERMS = 128
MIN_MAX_ARGS = 8
PROGRAM_TERMS = 10_000
PROGRAM_MIN_MAX_ARGS = 128
PROGRAM_EXPR_CHARS = 1_000_000  # every occurrence: torch parses each one again

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_SYMBOL = re.compile(r"[a-z]{1,4}\d+")
# sympy's and torch's shape functions, as torch's deserializer names them.
SYMPY_CALLS = frozenset(
    """
    Symbol Integer Float Rational Add Mul Pow Mod Max Min Abs LessThan StrictLessThan
    GreaterThan StrictGreaterThan Equality Unequality Eq Ne Lt Le Gt Ge And Or Not Xor
    Piecewise ExprCondPair ITE floor ceiling sqrt BooleanTrue BooleanFalse FloorDiv
    ModularIndexing Where PythonMod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift
    PowByNatural FloatPow FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator
    TruncToFloat TruncToInt RoundToInt RoundDecimal ToFloat Identity
    """.split()  # noqa: SIM905
)
_SYMPY_NAMES = frozenset(
    """
    oo zoo nan true false pi E S Half One Zero NegativeOne
    """.split()  # noqa: SIM905
)
_GUARD_CALLS = frozenset(["max", "min", "abs", "int", "float", "round"]) | SYMPY_CALLS
_GUARD_METHODS = frozenset(["size", "stride", "storage_offset", "dim", "numel"])
_MATH = frozenset(["floor", "ceil", "trunc", "sqrt", "log", "exp", "pow", "isnan", "isinf"])
_ARITHMETIC = (
    ast.Expression,
    ast.Load,
    ast.Constant,
    ast.UnaryOp,
    ast.BinOp,
    ast.Compare,
    ast.BoolOp,
    ast.Tuple,
    ast.USub,
    ast.UAdd,
    ast.Not,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Eq,
    ast.NotEq,
    ast.And,
    ast.Or,
    ast.LShift,
    ast.RShift,
    ast.BitAnd,
    ast.BitOr,
    ast.BitXor,
)
_POWER_CALLS = frozenset(["Pow", "PowByNatural", "FloatPow", "pow", "LShift", "RShift"])
_FLOAT_TEXT = re.compile(r"[+-]?\d{1,20}(\.\d{0,20})?([eE][+-]?\d{1,3})?|[+-]?(inf|nan)")


# --- the cost of an expression -------------------------------------------------------


def _power(node: ast.AST) -> tuple[ast.AST, ast.AST] | None:
    """(base, exponent) of ``a ** b``, ``a << b`` or ``Pow(a, b)``-like calls."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift, ast.RShift)):
        return node.left, node.right
    if isinstance(node, ast.Call) and len(node.args) == 2:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in _POWER_CALLS:
            return node.args[0], node.args[1]
    return None


def _post_order(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree``, children before their parent (no recursion: a product of
    thousands of factors is one long chain)."""
    pre, stack = [], [tree]
    while stack:
        node = stack.pop()
        pre.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return pre[::-1]


def _size(tree: ast.AST) -> tuple[int, int]:
    """(how many powers nest at most, how many digits the largest number sympy or
    Python may compute has at most), a symbol counted as one digit.

    Integer arithmetic is exact in both, so the digits bound the time: ``a * b``
    has the digits of both, ``a ** n`` n times those of ``a``, ``a << n`` n bits
    more than ``a``, anything else one more than its largest operand.
    """
    depth: dict[int, int] = {}
    digits: dict[int, int] = {}
    for node in _post_order(tree):
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr)]
        depth[id(node)] = max((depth[id(c)] for c in children), default=0)
        operands = node.args if isinstance(node, ast.Call) else children
        sizes = [digits[id(c)] for c in operands if id(c) in digits]
        name = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
        power = _power(node)
        if power is not None:
            depth[id(node)] += 1
            exponent = power[1]
            if isinstance(exponent, ast.UnaryOp):
                exponent = exponent.operand
            value = exponent.value if isinstance(exponent, ast.Constant) else 1
            n = int(abs(value)) if isinstance(value, (int, float)) else 1
            base = digits.get(id(power[0]), 1)
            shift = name == "LShift" or (
                isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift)
            )
            digits[id(node)] = base + n // 3 + 1 if shift else base * max(1, n)
        elif isinstance(node, ast.Constant):
            value = node.value
            digits[id(node)] = len(str(abs(value))) if type(value) is int else 1
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)) or name == "Mul":
            digits[id(node)] = max(1, sum(sizes))
        else:
            digits[id(node)] = max(sizes, default=0) + 1
    return depth[id(tree)], max(digits.values())


def _expression_cost(tree: ast.AST) -> tuple[int, int]:
    """(terms, arguments of Max and Min) of a parsed expression: what sympy's time
    grows with (it compares every pair of Max/Min arguments, and flattens nested
    ones into one call)."""
    terms = min_max = 0
    for node in ast.walk(tree):
        terms += isinstance(node, ast.expr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            min_max += len(node.args) if node.func.id in ("Max", "Min", "max", "min") else 0
    return terms, min_max


@functools.lru_cache(maxsize=1 << 14)
def expression_cost(text: str) -> tuple[int, int]:
    """:func:`_expression_cost` of an expression that passed its role's check."""
    return _expression_cost(ast.parse(text, mode="eval"))


def _cost_problem(tree: ast.AST) -> str | None:
    """Why parsing or evaluating ``tree`` may take too long, or None."""
    terms, min_max = _expression_cost(tree)
    if terms > EXPR_TERMS:
        return f"{terms} terms (at most {EXPR_TERMS})"
    if min_max > MIN_MAX_ARGS:
        return f"Max/Min over {min_max} arguments (at most {MIN_MAX_ARGS})"
    depth, digits = _size(tree)
    if depth > POWER_DEPTH:
        return f"powers nested {depth} deep (at most {POWER_DEPTH})"
    if digits > MAX_DIGITS:
        return f"arithmetic on numbers of up to {digits} digits (at most {MAX_DIGITS})"
    return None


# --- what an expression may name and call --------------------------------------------


def _small_number(node: ast.AST) -> bool:
    """A numeric literal (optionally signed) of at most :data:`MAX_EXPONENT` in size."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if (  # sympy's spelling: Integer(2), Rational(1, 2)
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("Integer", "Rational")
        and node.args
        and not node.keywords
    ):
        return all(_small_number(arg) for arg in node.args)
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
        and abs(node.value) <= MAX_EXPONENT
    )


def _is_symbol(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return _SYMBOL.fullmatch(node.id) is not None
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Symbol"
    )


@attrs.frozen
class _Context:
    """Where the nodes of one expression sit: which call takes each as which argument,
    and which are subscripts' keys; ``guard`` selects Python guard code."""

    guard: bool
    call_args: dict[int, tuple[ast.AST, int]]  # id(argument) -> (the call's func, position)
    slices: frozenset[int]  # id(subscript key)

    @classmethod
    def of(cls, tree: ast.AST, *, guard: bool) -> _Context:
        call_args: dict[int, tuple[ast.AST, int]] = {}
        slices: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for i, arg in enumerate(node.args):
                    call_args[id(arg)] = (node.func, i)
            if isinstance(node, ast.Subscript):
                slices.add(id(node.slice))
        return cls(guard, call_args, frozenset(slices))


def _constant_allowed(node: ast.Constant, where: _Context) -> bool:
    if isinstance(node.value, str):
        # a guard's subscript key (L['x']), or sympy's Symbol('s0') and Float('1.5')
        func, position = where.call_args.get(id(node), (None, -1))
        name = func.id if isinstance(func, ast.Name) else ""
        return (where.guard and id(node) in where.slices and is_plain(node.value)) or (
            not where.guard
            and position == 0
            and (
                (name == "Symbol" and _NAME.fullmatch(node.value) is not None)
                or (name == "Float" and _FLOAT_TEXT.fullmatch(node.value) is not None)
            )
        )
    if isinstance(node.value, int):  # its digits are bounded by _node_problem
        return True
    return isinstance(node.value, (float, bool)) or node.value is None


def _name_allowed(node: ast.Name, where: _Context) -> bool:
    return (
        node.id in (_GUARD_CALLS if where.guard else SYMPY_CALLS)
        or node.id in _SYMPY_NAMES
        or (where.guard and node.id in ("L", "math"))
        or _SYMBOL.fullmatch(node.id) is not None
    )


def _call_allowed(node: ast.Call, where: _Context) -> bool:
    f = node.func
    calls = _GUARD_CALLS if where.guard else SYMPY_CALLS
    # Float's second argument is a precision in digits: Float('1', 10**9).
    if isinstance(f, ast.Name) and f.id == "Float" and len(node.args) > 1:
        return False
    return (isinstance(f, ast.Name) and f.id in calls) or (
        where.guard and isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS | _MATH
    )


def _keyword_allowed(node: ast.keyword, where: _Context) -> bool:
    # Symbol('s0', positive=True); Float('1.5', precision=53), in bits
    value = node.value.value if isinstance(node.value, ast.Constant) else None
    return not where.guard and (
        (
            node.arg is not None
            and node.arg.isidentifier()
            and not node.arg.startswith("_")
            and isinstance(value, bool)
        )
        or (node.arg == "precision" and type(value) is int and 0 < value <= 1024)
    )


def _attribute_allowed(node: ast.Attribute, where: _Context) -> bool:
    # L['x'].size(), math.floor(...)
    return where.guard and (
        node.attr in _GUARD_METHODS
        or (isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _MATH)
    )


def _allowed(node: ast.AST, where: _Context) -> bool:
    if isinstance(node, ast.BinOp):  # (1, 2) * n repeats a tuple n times
        return not (isinstance(node.left, ast.Tuple) or isinstance(node.right, ast.Tuple))
    if isinstance(node, ast.Constant):
        return _constant_allowed(node, where)
    if isinstance(node, ast.Name):
        return _name_allowed(node, where)
    if isinstance(node, ast.Call):
        return _call_allowed(node, where)
    if isinstance(node, ast.keyword):
        return _keyword_allowed(node, where)
    if isinstance(node, ast.Attribute):
        return _attribute_allowed(node, where)
    if isinstance(node, ast.Subscript):
        return where.guard
    return isinstance(node, _ARITHMETIC)


def _node_problem(node: ast.AST, where: _Context) -> str | None:
    """Why one node of an expression is not bounded arithmetic, or None."""
    power = _power(node)
    if power is not None and not (_small_number(power[1]) or _is_symbol(power[1])):
        return f"an exponent or shift that is not a number up to {MAX_EXPONENT}: " + repr(
            ast.unparse(node)[:60]
        )
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and len(str(abs(node.value))) > INT_DIGITS
    ):
        return f"an integer of more than {INT_DIGITS} digits"
    if _allowed(node, where):
        return None
    shown = ast.unparse(node)[:60] if not isinstance(node, ast.keyword) else node.arg
    return f"code in an expression: {shown!r}"


# --- the check ------------------------------------------------------------------------


def _parse(text: str) -> ast.Expression | str:
    """The parsed expression, or why ``text`` cannot be parsed as the text run later."""
    if len(text) > EXPR_CHARS:
        return f"longer than {EXPR_CHARS} characters"
    # sympy strips newlines before it parses, and torch pastes guard code into the
    # source of a function: a backslash, comment or line break would let the text
    # they run differ from the text parsed here.
    if not text.isprintable() or "\\" in text or "#" in text:
        return "a backslash, comment or control character"
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "does not parse"


def expression_problem(text: str, *, guard: bool) -> str | None:
    """Why ``text`` is not bounded arithmetic on shape symbols, or None when it is.

    ``guard`` selects Python guard code (``L['x'].size()[0] <= 8``) over sympy text
    (``Symbol('s0', positive=True) + 1``).
    """
    tree = _parse(text)
    if isinstance(tree, str):
        return tree
    why = _cost_problem(tree)
    if why is not None:
        return why
    where = _Context.of(tree, guard=guard)
    for node in ast.walk(tree):
        why = _node_problem(node, where)
        if why is not None:
            return why
    return None

"""The screen of untrusted ``.pt2`` archives: members against :data:`ALLOWLIST`, and
every string of ``models/model.json`` by the role of its field in torch's schema."""

from __future__ import annotations

import ast
import bisect
import contextlib
import dataclasses
import enum
import errno
import functools
import io
import json
import keyword
import os
import re
import shutil
import stat
import struct
import tempfile
import types
import typing
import unicodedata
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import attrs
import torch

from epass import _program
from epass.errors import EpassError, LoadError, UnsafeArchiveError

__all__ = [
    "ALLOWLIST",
    "INPUT_ROLES",
    "KEY_ROLES",
    "ROLES",
    "Role",
    "TRUST_ONLY",
    "ReadOnce",
    "first_line",
    "private_copy",
    "readers_agree",
    "screen",
    "screen_program",
]

# (pattern, kind, why it is safe). Patterns match a member's name below the archive's
# root folder, case-insensitively, because torch's zip reader looks names up that way.
ALLOWLIST: tuple[tuple[str, str, str], ...] = (
    (r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id",
     "text", "a short UTF-8 tag torch compares with a constant"),
    (r"models/model\.json", "program",
     "JSON walked with torch's schema: no field the schema lacks, and every string "
     "checked by the role of its field (identifier, operator, bounded shape "
     "expression, text): see ROLES"),
    (r"data/weights/model_weights_config\.json|data/constants/model_constants_config\.json",
     "config", "JSON; each entry must name a weight_N / tensor_N member of this archive"),
    (r"data/weights/weight_\d+|data/constants/tensor_\d+", "tensor",
     "raw tensor bytes, viewed with a dtype; a tensor the config marks as pickled must "
     "be a torch.save archive the weights-only unpickler accepts"),
    (r"data/sample_inputs/model\.pt", "pickle",
     "a torch.save archive whose pickle holds only what the weights-only unpickler "
     "accepts (checked statically, then unpickled by that unpickler), and whose "
     "text holds no quotes or backslashes"),
    (r"extra/[^/]+", "text", "extra files, read as strings and never interpreted"),
)  # fmt: skip

# Members torch.export.save writes that only run with trust: their loaders unpickle
# arbitrary objects (pickle.loads, TorchScript's unpickler).
TRUST_ONLY = (r"data/constants/opaque_obj_\d+", r"data/constants/custom_obj_\d+")


# The archive's own version tags: a version this torch does not write is refused.
# (torch.export.pt2_archive pulls in torch._dynamo, seconds of import: it is imported
# when an archive is screened, not with this module.)
def _archive_tags() -> dict[str, str]:
    from torch.export.pt2_archive import constants

    return {
        constants.ARCHIVE_FORMAT_PATH: constants.ARCHIVE_FORMAT_VALUE,
        constants.ARCHIVE_VERSION_PATH: constants.ARCHIVE_VERSION_VALUE,
    }


_TEXT_LIMIT = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_SYMBOL = re.compile(r"[a-z]{1,4}\d+")
# sympy's and torch's shape functions, as torch's deserializer names them.
_SYMPY_CALLS = frozenset(
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
_GUARD_CALLS = frozenset(["max", "min", "abs", "int", "float", "round"]) | _SYMPY_CALLS
_GUARD_METHODS = frozenset(["size", "stride", "storage_offset", "dim", "numel"])
_MATH = frozenset(["floor", "ceil", "trunc", "sqrt", "log", "exp", "pow", "isnan", "isinf"])
_ARITHMETIC = (
    ast.Expression, ast.Load, ast.Constant, ast.UnaryOp, ast.BinOp, ast.Compare, ast.BoolOp,
    ast.Tuple, ast.USub, ast.UAdd, ast.Not, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv,
    ast.Mod, ast.Pow, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq, ast.And, ast.Or,
    ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor,
)  # fmt: skip


# --- screening ---------------------------------------------------------------------


class _Refuse(Exception):
    def __init__(self, member: str, why: str) -> None:
        super().__init__(why)
        self.member = member
        self.why = why


# --- expressions: symbolic shapes (sympy text) and guard code (Python) --------------

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
_POWER_CALLS = frozenset(["Pow", "PowByNatural", "FloatPow", "pow", "LShift", "RShift"])
_FLOAT_TEXT = re.compile(r"[+-]?\d{1,20}(\.\d{0,20})?([eE][+-]?\d{1,3})?|[+-]?(inf|nan)")


def _is_plain(text: str) -> bool:
    """Text torch may paste between quotes in generated code without escaping it."""
    return text.isprintable() and not any(c in text for c in "'\"\\")


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


def _expression_problem(text: str, *, guard: bool) -> str | None:
    """Why ``text`` is not bounded arithmetic on shape symbols, or None when it is.

    ``guard`` selects Python guard code (``L['x'].size()[0] <= 8``) over sympy text
    (``Symbol('s0', positive=True) + 1``).
    """
    if len(text) > EXPR_CHARS:
        return f"longer than {EXPR_CHARS} characters"
    # sympy strips newlines before it parses, and torch pastes guard code into the
    # source of a function: a backslash, comment or line break would let the text
    # they run differ from the text parsed here.
    if not text.isprintable() or "\\" in text or "#" in text:
        return "a backslash, comment or control character"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "does not parse"
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
    calls = _GUARD_CALLS if guard else _SYMPY_CALLS
    call_args: dict[int, tuple[ast.AST, int]] = {}
    slices: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for i, arg in enumerate(node.args):
                call_args[id(arg)] = (node.func, i)
        if isinstance(node, ast.Subscript):
            slices.add(id(node.slice))
    for node in ast.walk(tree):
        ok = isinstance(node, _ARITHMETIC)
        power = _power(node)
        if power is not None and not (_small_number(power[1]) or _is_symbol(power[1])):
            return f"an exponent or shift that is not a number up to {MAX_EXPONENT}: " + repr(
                ast.unparse(node)[:60]
            )
        if isinstance(node, ast.BinOp) and (
            isinstance(node.left, ast.Tuple) or isinstance(node.right, ast.Tuple)
        ):
            ok = False  # (1, 2) * n repeats a tuple n times
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            func, position = call_args.get(id(node), (None, -1))
            name = func.id if isinstance(func, ast.Name) else ""
            ok = (guard and id(node) in slices and _is_plain(node.value)) or (
                not guard
                and position == 0
                and (
                    (name == "Symbol" and _NAME.fullmatch(node.value) is not None)
                    or (name == "Float" and _FLOAT_TEXT.fullmatch(node.value) is not None)
                )
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, int):
            if len(str(abs(node.value))) > INT_DIGITS:
                return f"an integer of more than {INT_DIGITS} digits"
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (float, bool)) or node.value is None
        elif isinstance(node, ast.Name):
            ok = (
                node.id in calls
                or node.id in _SYMPY_NAMES
                or (guard and node.id in ("L", "math"))
                or _SYMBOL.fullmatch(node.id) is not None
            )
        elif isinstance(node, ast.Call):
            f = node.func
            ok = (isinstance(f, ast.Name) and f.id in calls) or (
                guard and isinstance(f, ast.Attribute) and f.attr in _GUARD_METHODS | _MATH
            )
            # Float's second argument is a precision in digits: Float('1', 10**9).
            if isinstance(f, ast.Name) and f.id == "Float" and len(node.args) > 1:
                ok = False
        elif isinstance(node, ast.keyword):
            # Symbol('s0', positive=True); Float('1.5', precision=53), in bits
            value = node.value.value if isinstance(node.value, ast.Constant) else None
            ok = not guard and (
                (
                    node.arg is not None
                    and node.arg.isidentifier()
                    and not node.arg.startswith("_")
                    and isinstance(value, bool)
                )
                or (node.arg == "precision" and type(value) is int and 0 < value <= 1024)
            )
        elif isinstance(node, ast.Attribute):
            ok = guard and (
                node.attr in _GUARD_METHODS
                or (
                    (isinstance(node.value, ast.Name) and node.value.id == "math")
                    and node.attr in _MATH
                )
            )
        elif isinstance(node, ast.Subscript):
            ok = guard
        if not ok:
            shown = ast.unparse(node)[:60] if not isinstance(node, ast.keyword) else node.arg
            return f"code in an expression: {shown!r}"
    return None


# --- roles: what a string of the program schema may hold -----------------------------


@attrs.frozen
class Role:
    """What one kind of string field holds, and the check it must pass.

    ``check`` returns why a value does not fit, or None when it does.
    """

    name: str
    check: Callable[[str], str | None]


def _identifier(text: str) -> str | None:
    # Value and node names become Python names in code torch generates at load time
    # (``def forward(self, x)``). NFKC folding would let two names that differ here
    # be one name in that code.
    if not text.isidentifier():
        return "not a Python identifier"
    if keyword.iskeyword(text) or (text.startswith("__") and text.endswith("__")):
        return "a Python keyword or dunder name"
    if unicodedata.normalize("NFKC", text) != text:
        return "an identifier Python would fold into another (NFKC)"
    return None


def _fqn(text: str) -> str | None:
    # Parameter names and type names: ``layers.0.weight``, ``blocks.conv-1.bias`` (a
    # ModuleDict key), ``__main__.Point``. fx writes a segment that is not an
    # identifier as getattr(obj, "segment"), between quotes.
    if not text:
        return "empty"
    for part in text.split("."):
        if not (re.fullmatch(r"[A-Za-z0-9_\-]+", part) or part.isidentifier()):
            return f"segment {part[:40]!r} is not an identifier, index or plain key"
        if unicodedata.normalize("NFKC", part) != part:
            return f"segment {part[:40]!r} would be folded into another name (NFKC)"
    return None


def _module_path(text: str) -> str | None:
    # the root module is ""; a module called more than once is "path@2"
    path, at, count = text.partition("@")
    if at and not count.isdigit():
        return "a call count that is not a number"
    return None if path == "" else _fqn(path)


def _argument_name(text: str) -> str | None:
    # an operator schema's argument name, "" for a positional-only one; keywords such
    # as ``from`` occur in ATen's schemas
    return None if text == "" or text.isidentifier() else "not an argument name"


def _device(text: str) -> str | None:
    return None if re.fullmatch(r"[a-z_][a-z0-9_]{0,31}", text) else "not a device type"


def _plain(text: str) -> str | None:
    if len(text) > _TEXT_LIMIT:
        return "longer than 1 MiB"
    return None if _is_plain(text) else "quotes, backslashes or control characters"


def _text(text: str) -> str | None:
    # free text: kept as data (meta), shown by print_readable in comments, one per line
    if len(text) > _TEXT_LIMIT:
        return "longer than 1 MiB"
    if not text.replace("\n", " ").replace("\t", " ").isprintable():
        return "control characters other than newline and tab"
    return None


def _line(text: str) -> str | None:
    return "a line break" if "\n" in text or "\t" in text else _text(text)


@functools.lru_cache(maxsize=4096)
def _operator(text: str) -> str | None:
    """Resolve ``text`` as torch's deserializer does; it must name an operator.

    ``torch.ops.<ns>.<op>.<overload>`` (or ``torch.ops.higher_order.<op>``) must be
    an operator; one that is not registered in this process is left to torch, which
    refuses it with its own message (a custom op whose library was not imported).
    The other targets are the builtins torch serializes and its verifier allows.
    """
    if text in _program.serialized_builtin_targets():
        return None
    if re.fullmatch(r"#\w+:[\w.]+", text):  # an extension's operator, by its handler
        return None
    parts = text.split(".")
    if parts[:2] != ["torch", "ops"] or len(parts) not in (4, 5):
        return "neither a torch.ops operator nor an allowed builtin"
    # ATen has dunder operators (aten.__and__.Tensor); a namespace or overload never is
    if any(not p.isidentifier() for p in parts[2:]) or any(
        p.startswith("__") for p in (parts[2], *parts[4:])
    ):
        return "not an operator name"
    if hasattr(type(torch.ops), parts[2]):  # torch.ops.load_library and such
        return "not an operator namespace"
    try:
        target: Any = functools.reduce(getattr, parts[1:], torch)
    except Exception:  # AttributeError, or the dispatcher's RuntimeError
        return None  # not registered: torch refuses it and names it
    return None if _program.is_operator(target) else "not an operator"


def _json_values(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _json_data(text: str) -> str | None:
    # ``custom`` and ``from_node`` meta: JSON kept as data
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return "not JSON"
    for item in _json_values(value):
        if isinstance(item, str) and _line(item) is not None:
            return f"a JSON string with control characters or line breaks: {item[:40]!r}"
    return None


def _treespec(text: str) -> str | None:
    """A pytree spec: data naming registered types, never a module to import.

    torch resolves ``{"__enum__": ..., "fqn": "module:Class"}`` and a defaultdict's
    factory by importing the module they name; dict keys of the inputs are pasted
    between quotes into the ``forward`` that ``ExportedProgram.module()`` generates.
    """
    try:
        protocol, spec = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return "not a serialized pytree spec"
    if protocol != 1:
        return f"pytree protocol {protocol!r}, expected 1"
    types = _program.pytree_type_names()
    stack = [spec]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or set(node) != {"type", "context", "children_spec"}:
            return "not a pytree spec node"
        if node["type"] is not None and node["type"] not in types:
            return f"pytree type {str(node['type'])[:60]!r} is not registered"
        context = node["context"]
        if isinstance(context, str):
            with contextlib.suppress(ValueError, RecursionError):
                context = json.loads(context)
        for item in _json_values(context):
            if isinstance(item, dict) and ("__enum__" in item or "default_factory_module" in item):
                return "a pytree context that names a module to import"
            if isinstance(item, str) and not _is_plain(item):
                return f"a pytree key with quotes, backslashes or control characters: {item[:40]!r}"
        if not isinstance(node["children_spec"], list):
            return "not a pytree spec node"
        stack.extend(node["children_spec"])
    return None


def _split_outside_brackets(entry: str) -> list[str]:
    """Split at commas outside () and [], as torch's deserializer splits meta entries."""
    out, start, depth = [], 0, 0
    for i, c in enumerate(entry):
        if c in "[(":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(entry[start:i])
            start = i + 1
    return [*out, entry[start:]]


def _nn_module_stack(text: str) -> str | None:
    # "key,path,type;...": the paths name the submodules torch.export.unflatten builds
    for entry in text.split(";"):
        parts = _split_outside_brackets(entry)
        if len(parts) != 3:
            return "an entry that is not key,path,type"
        key, path, kind = parts
        if _plain(key) is not None or _plain(kind) is not None:
            return "a key or type with quotes, backslashes or control characters"
        why = _module_path(path)
        if why is not None:
            return f"module path {path[:60]!r}: {why}"
    return None


def _source_fn_stack(text: str) -> str | None:
    # "name,target;...": torch resolves each target with getattr from torch or operator
    for entry in text.split(";"):
        name, _, target = entry.partition(",")
        if _line(name) is not None or "," in target:
            return "an entry that is not name,target"
        if _fqn(target) is not None:
            return f"target {target[:60]!r} is not a dotted name"
    return None


IDENTIFIER = Role("identifier", _identifier)
FQN = Role("dotted name", _fqn)
MODULE_PATH = Role("module path", _module_path)
ARGUMENT_NAME = Role("argument name", _argument_name)
OPERATOR = Role("operator target", _operator)
SYMBOLIC = Role("symbolic expression", lambda t: _expression_problem(t, guard=False))
GUARD = Role("guard expression", lambda t: _expression_problem(t, guard=True))
PROGRAM_INPUT = Role("string input of the program", _plain)
DEVICE = Role("device type", _device)
TREESPEC = Role("pytree spec", _treespec)
TEXT = Role("free text", _text)
LINE = Role("one line of text", _line)
JSON_DATA = Role("JSON data", _json_data)
NN_MODULE_STACK = Role("nn_module_stack", _nn_module_stack)
SOURCE_FN_STACK = Role("source_fn_stack", _source_fn_stack)

# Node meta, as torch's serializer writes it (a dict of str in the schema); no other key
NODE_METADATA: dict[str, Role] = {
    "stack_trace": TEXT,
    "nn_module_stack": NN_MODULE_STACK,
    "source_fn_stack": SOURCE_FN_STACK,
    "torch_fn": LINE,
    "custom": JSON_DATA,
    "from_node": JSON_DATA,
}

# The role of every string in torch's schema, by (dataclass, field). A field holding
# a list or dict of strings gives its items this role; a dict's keys get KEY_ROLES.
# A string at a (dataclass, field) missing here is refused: a new schema field
# stays closed until someone gives it a role.
ROLES: dict[tuple[str, str], Role | dict[str, Role]] = {
    ("Device", "type"): DEVICE,
    ("SymExpr", "expr_str"): SYMBOLIC,
    ("SymIntArgument", "as_name"): IDENTIFIER,
    ("SymFloatArgument", "as_name"): IDENTIFIER,
    ("SymBoolArgument", "as_name"): IDENTIFIER,
    ("TensorArgument", "name"): IDENTIFIER,
    ("TokenArgument", "name"): IDENTIFIER,
    ("GraphArgument", "name"): IDENTIFIER,
    ("CustomObjArgument", "name"): IDENTIFIER,
    ("CustomObjArgument", "class_fqn"): FQN,
    ("Argument", "as_string"): LINE,
    ("Argument", "as_strings"): LINE,
    ("Argument", "as_operator"): OPERATOR,
    ("NamedArgument", "name"): ARGUMENT_NAME,
    ("Node", "target"): OPERATOR,
    ("Node", "metadata"): NODE_METADATA,
    ("Node", "name"): IDENTIFIER,
    ("ConstantValue", "as_string"): PROGRAM_INPUT,
    ("InputToConstantInputSpec", "name"): IDENTIFIER,
    ("InputToParameterSpec", "parameter_name"): FQN,
    ("InputToBufferSpec", "buffer_name"): FQN,
    ("InputToTensorConstantSpec", "tensor_constant_name"): FQN,
    ("InputToCustomObjSpec", "custom_obj_name"): FQN,
    ("BufferMutationSpec", "buffer_name"): FQN,
    ("ParameterMutationSpec", "parameter_name"): FQN,
    ("GradientToParameterSpec", "parameter_name"): FQN,
    ("GradientToUserInputSpec", "user_input_name"): IDENTIFIER,
    ("UserInputMutationSpec", "user_input_name"): IDENTIFIER,
    ("ModuleCallSignature", "in_spec"): TREESPEC,
    ("ModuleCallSignature", "out_spec"): TREESPEC,
    ("ModuleCallSignature", "forward_arg_names"): IDENTIFIER,
    ("ModuleCallEntry", "fqn"): MODULE_PATH,
    ("NamedTupleDef", "field_names"): IDENTIFIER,
    ("GraphModule", "metadata"): {"custom": JSON_DATA},
    ("ExportedProgram", "verifiers"): IDENTIFIER,
    ("ExportedProgram", "torch_version"): LINE,
    ("ExportedProgram", "guards_code"): GUARD,
}
# fx writes a node's string arguments with repr(); a string *input* of the program is
# pasted between quotes into the checks ExportedProgram.module() generates.
INPUT_ROLES: dict[tuple[tuple[str, str], tuple[str, str]], Role] = {
    (("Graph", "inputs"), ("Argument", "as_string")): PROGRAM_INPUT,
    (("UserInputSpec", "arg"), ("Argument", "as_string")): PROGRAM_INPUT,
    (("ModuleCallSignature", "inputs"), ("Argument", "as_string")): PROGRAM_INPUT,
}
KEY_ROLES: dict[tuple[str, str], Role] = {
    ("Graph", "tensor_values"): IDENTIFIER,
    ("Graph", "sym_int_values"): IDENTIFIER,
    ("Graph", "sym_bool_values"): IDENTIFIER,
    ("Graph", "sym_float_values"): IDENTIFIER,
    ("Graph", "custom_obj_values"): IDENTIFIER,
    ("Argument", "as_string_to_argument"): IDENTIFIER,
    ("GraphModule", "treespec_namedtuple_fields"): FQN,
    ("ExportedProgram", "opset_version"): IDENTIFIER,
    ("ExportedProgram", "range_constraints"): SYMBOLIC,
}


# --- walking model.json with the schema ---------------------------------------------


_FIELDS: dict[type, dict[str, Any]] = {}


def _fields(cls: type) -> dict[str, Any]:
    """A schema dataclass's field types (``Annotated`` stripped, forward refs resolved)."""
    if cls not in _FIELDS:
        _FIELDS[cls] = typing.get_type_hints(cls)
    return _FIELDS[cls]


def _string_positions(root: type) -> Iterator[tuple[str, str, str]]:
    """Every place the schema holds a string: (dataclass, field, "value" or "key")."""
    seen: set[type] = set()

    def visit(tp: Any, owner: tuple[str, str]) -> Iterator[tuple[str, str, str]]:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is str:
            yield (*owner, "value")
        elif origin is dict:
            if args[0] is str:
                yield (*owner, "key")
            yield from visit(args[1], owner)
        elif origin in (list, typing.Union, types.UnionType):
            for arg in args:
                yield from visit(arg, owner)
        elif dataclasses.is_dataclass(tp) and isinstance(tp, type) and tp not in seen:
            seen.add(tp)
            for name, field_type in _fields(tp).items():
                yield from visit(field_type, (tp.__name__, name))

    yield from visit(root, ("", ""))


class _ProgramWalk:
    """Checks one model.json against the schema; counts the strings it checked."""

    def __init__(self, member: str) -> None:
        self.member = member
        self.strings = 0
        self.union: type = _program.export_schema()[2]
        self.checked: dict[tuple[str, str], str | None] = {}  # (role, text): why
        self.terms = self.min_max = self.expression_chars = 0

    def refuse(self, path: str, why: str) -> _Refuse:
        return _Refuse(self.member, f"field {path or '<root>'}: {why}")

    def string(self, value: Any, role: Role | None, path: str) -> None:
        if not isinstance(value, str):
            raise self.refuse(path, f"{type(value).__name__} where the schema has a string")
        if role is None:
            raise self.refuse(path, "a string field the screen has no role for")
        self.strings += 1
        key = (role.name, value)
        seen = key in self.checked
        if not seen:  # a program repeats its shape expressions and names
            self.checked[key] = role.check(value)
        why = self.checked[key]
        if why is not None:
            raise self.refuse(path, f"not a valid {role.name} ({why}): {value[:80]!r}")
        if role is SYMBOLIC or role is GUARD:
            self.budget(value, seen, path)

    def budget(self, expression: str, seen: bool, path: str) -> None:
        """Bound the time torch spends on all of the program's expressions together."""
        self.expression_chars += len(expression)
        if not seen:
            terms, min_max = expression_cost(expression)
            self.terms += terms
            self.min_max += min_max
        for total, limit, what in (
            (self.expression_chars, PROGRAM_EXPR_CHARS, "characters"),
            (self.terms, PROGRAM_TERMS, "terms in distinct expressions"),
            (self.min_max, PROGRAM_MIN_MAX_ARGS, "Max/Min arguments in distinct expressions"),
        ):
            if total > limit:
                raise self.refuse(
                    path, f"the program's shape expressions exceed {limit} {what} here"
                )

    def walk(
        self, value: Any, tp: Any, owner: tuple[str, str], path: str, outer: tuple[str, str]
    ) -> None:
        """Check ``value`` against the schema type ``tp``, found in field ``owner`` of a
        dataclass that itself sits in field ``outer``."""
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is str:
            role = INPUT_ROLES.get((outer, owner)) or ROLES.get(owner)
            self.string(value, role if isinstance(role, Role) else None, path)
        elif tp is bool:
            if not isinstance(value, bool):
                raise self.refuse(path, f"{type(value).__name__} where the schema has a bool")
        elif tp is int or (isinstance(tp, type) and issubclass(tp, enum.IntEnum)):
            if type(value) is not int or abs(value) >= 1 << 64:
                raise self.refuse(path, "not a 64-bit integer")
            members: Any = getattr(tp, "_value2member_map_", None)
            if members is not None and value not in members:
                raise self.refuse(path, f"{value} is not a {tp.__name__}")
        elif tp is float:
            if not (type(value) in (int, float) or value in ("Infinity", "-Infinity", "NaN")):
                raise self.refuse(path, f"{type(value).__name__} where the schema has a float")
        elif origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return
            (inner,) = [a for a in args if a is not type(None)]
            self.walk(value, inner, owner, path, outer)
        elif origin is list:
            if not isinstance(value, list):
                raise self.refuse(path, f"{type(value).__name__} where the schema has a list")
            for i, item in enumerate(value):
                self.walk(item, args[0], owner, f"{path}[{i}]", outer)
        elif origin is dict:
            self.mapping(value, args[1], owner, path, outer)
        elif isinstance(tp, type) and issubclass(tp, self.union):
            fields = _fields(tp)
            if not isinstance(value, dict) or len(value) != 1:
                raise self.refuse(path, f"not one {tp.__name__} (an object with one key)")
            ((key, item),) = value.items()
            if key not in fields:
                raise self.refuse(
                    path, f"{str(key)[:60]!r} is not a {tp.__name__} the schema knows"
                )
            self.walk(item, fields[key], (tp.__name__, key), f"{path}.{key}", owner)
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            fields = _fields(tp)
            if not isinstance(value, dict):
                raise self.refuse(
                    path, f"{type(value).__name__} where the schema has {tp.__name__}"
                )
            for key, item in value.items():
                if key not in fields:
                    raise self.refuse(
                        path, f"{str(key)[:60]!r}, a field {tp.__name__} does not have"
                    )
                where = f"{path}.{key}".lstrip(".")
                self.walk(item, fields[key], (tp.__name__, key), where, owner)
        else:
            raise self.refuse(path, f"a schema type the screen does not know ({tp!r})")

    def mapping(
        self, value: Any, item_type: Any, owner: tuple[str, str], path: str, outer: tuple[str, str]
    ) -> None:
        if not isinstance(value, dict):
            raise self.refuse(path, f"{type(value).__name__} where the schema has a dict")
        roles = ROLES.get(owner)
        for key, item in value.items():
            where = f"{path}[{key[:40]!r}]"
            if isinstance(roles, dict):  # meta: the key decides what the value holds
                if key not in roles:
                    raise self.refuse(where, "a metadata key the screen does not know")
                self.string(item, roles[key], where)
                continue
            self.string(key, KEY_ROLES.get(owner), f"{path} (key {key[:40]!r})")
            self.walk(item, item_type, owner, where, outer)


def _check_version(member: str, program: dict[str, Any]) -> None:
    _, (major, minor), _ = _program.export_schema()
    version = program.get("schema_version")
    if not isinstance(version, dict) or set(version) != {"major", "minor"}:
        raise _Refuse(member, "no schema_version")
    theirs = (version["major"], version["minor"])
    if not all(type(v) is int for v in theirs) or theirs[0] != major or theirs[1] > minor:
        raise _Refuse(
            member,
            f"schema version {theirs[0]}.{theirs[1]}, which torch {torch.__version__} "
            f"(schema {major}.{minor}) does not know: its fields cannot be screened",
        )


def screen_program(member: str, data: bytes) -> int:
    """Check ``models/model.json`` field by field; returns how many strings it checked.

    Raises:
        _Refuse: a value the schema does not allow, naming its JSON path and role.
    """
    try:
        program = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _Refuse(member, f"not valid JSON ({exc})") from exc
    if not isinstance(program, dict):
        raise _Refuse(member, "not a serialized program")
    _check_version(member, program)
    walk = _ProgramWalk(member)
    try:
        walk.walk(program, _program.export_schema()[0], ("", ""), "", ("", ""))
    except RecursionError:
        raise _Refuse(member, "a program nested too deeply to screen") from None
    return walk.strings


# --- members ----------------------------------------------------------------------


def _kind(name: str) -> str | None:
    low = name.lower()
    for pattern, kind, _ in ALLOWLIST:
        if re.fullmatch(pattern, low):
            return kind
    return None


def _check_zip_entries(infos: Sequence[zipfile.ZipInfo], size: int, where: str) -> str:
    """Common checks on a zip's entries; returns the one root folder they share."""
    if not infos:
        raise _Refuse(where, "the archive is empty")
    roots, folded, total = set(), set(), 0
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if (
            name.startswith("/")
            or "\\" in name
            or "\0" in name
            or any(p in ("", ".", "..") for p in parts)
            or re.match(r"[A-Za-z]:", name)
        ):
            raise _Refuse(name, "unsafe member name (absolute path or '..')")
        if info.is_dir() or len(parts) < 2:
            raise _Refuse(name, "a member outside the archive's root folder")
        if info.flag_bits & 0x1:
            raise _Refuse(name, "an encrypted member")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise _Refuse(name, "a compressed member (torch.export.save stores members as is)")
        if name.lower() in folded:
            raise _Refuse(name, "two members whose names differ only in case")
        folded.add(name.lower())
        roots.add(parts[0])
        total += info.file_size
    if len(roots) != 1:
        raise _Refuse(where, f"members under {len(roots)} root folders, expected one")
    if total > size:  # entries overlapping one another: a zip bomb
        raise _Refuse(where, f"members add up to {total} bytes in a {size}-byte archive")
    return roots.pop()


def _screen_pickle(member: str, data: bytes) -> None:
    """Refuse a torch.save archive whose pickle the weights-only unpickler would reject.

    ``torch.serialization.get_unsafe_globals_in_checkpoint`` disassembles the pickle
    with the weights-only unpickler's own opcode table, without executing it: an
    opcode that unpickler does not support raises, and every global it would not
    allow is listed.
    """
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        raise _Refuse(member, "a pickle that is not a torch.save archive")
    try:
        with zipfile.ZipFile(buffer) as inner:
            infos = inner.infolist()
            _check_zip_entries(infos, len(data), member)
            names = [i.filename.split("/", 1)[1] for i in infos]
    except zipfile.BadZipFile as exc:
        raise _Refuse(member, f"a corrupt torch.save archive ({exc})") from exc
    if "data.pkl" not in names:
        raise _Refuse(member, "a torch.save archive without data.pkl")
    for name in names:
        if not re.fullmatch(
            r"data\.pkl|data/\d+|version|\.data/version|byteorder|"
            r"\.data/serialization_id|\.format_version|\.storage_alignment",
            name,
        ):
            raise _Refuse(member, f"a torch.save archive holding {name!r}")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception as exc:  # an opcode the weights-only unpickler does not support
        raise _Refuse(member, f"a pickle the weights-only unpickler refuses ({exc})") from exc
    if unsafe:
        listed = ", ".join(sorted(unsafe)[:3])
        raise _Refuse(member, f"a pickle naming {listed}, which the weights-only unpickler refuses")


def _screen_config(
    member: str, data: bytes, folder: str, names: dict[str, str], pickles: set[str]
) -> None:
    try:
        config = json.loads(data).get("config")
    except (ValueError, AttributeError) as exc:
        raise _Refuse(member, "not a payload config") from exc
    if not isinstance(config, dict):
        raise _Refuse(member, "not a payload config")
    allowed = r"weight_\d+" if folder == "data/weights/" else r"tensor_\d+"
    for key, entry in config.items():
        path_name = entry.get("path_name") if isinstance(entry, dict) else None
        if not isinstance(path_name, str):
            raise _Refuse(member, f"entry {key!r} has no path_name")
        target = folder + path_name
        if any(re.fullmatch(p, target.lower()) for p in TRUST_ONLY):
            # torch finds the member case-insensitively: name the one it would read.
            actual = next((v for k, v in names.items() if k.lower() == target.lower()), target)
            raise _Refuse(actual, "a pickled object that loading would execute")
        if not re.fullmatch(allowed, path_name) or target not in names:
            raise _Refuse(member, f"entry {key!r} points at {path_name!r}, not a tensor member")
        if entry.get("use_pickle"):
            pickles.add(names[target])


def _zip_size(file: IO[bytes], name: str) -> int:
    """The size of ``file``, rewound; LoadError when it is not a zip archive."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(0)
    if not zipfile.is_zipfile(file):
        raise LoadError(
            f"{name}: not a .pt2 archive (torch.export.save writes a zip file)", path=name
        )
    return size


def screen(file: IO[bytes], *, name: str = "<archive>") -> None:
    """Check every member of a .pt2 archive against :data:`ALLOWLIST` without loading it.

    ``models/model.json`` is walked with torch's schema (:func:`screen_program`):
    every string is checked by the role of its field (:data:`ROLES`).

    This checks the members as Python's zip reader finds them, and that torch's
    reader finds the same ones in the same places. A file can change between two
    reads, so ``epass.load`` screens and loads one :class:`ReadOnce` view (or a
    private copy): screen a file only to report on it, and load it with ``load``.

    Args:
        file: the archive, open for reading in binary mode (seekable).
        name: the file's name, for messages.

    Raises:
        UnsafeArchiveError: a member that is not allowed, with one line naming it.
        LoadError: the file is not a zip archive or not a saved program.
    """
    size = _zip_size(file, name)
    try:
        with zipfile.ZipFile(file) as archive:
            _screen_members(archive, size, name)
    except _Refuse as refused:
        raise _unsafe(name, refused) from None
    except zipfile.BadZipFile as exc:
        raise LoadError(f"{name}: not a .pt2 archive ({exc})", path=name) from exc
    # torch's own zip reader must find exactly the members screened above, each at
    # the place Python's reader found it: then every byte torch reads of a member is
    # a byte screened as that member.
    try:
        odd = _disagreement(file, name)
    except _Refuse as refused:
        raise _unsafe(name, refused) from None
    if odd is not None:
        raise UnsafeArchiveError(
            f"{name}: refused member {odd!r}: torch's zip reader and Python's disagree",
            path=name,
            member=odd,
        )


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then name and extra lengths


def _data_span(file: IO[bytes], info: zipfile.ZipInfo) -> tuple[int, int]:
    """Where Python's zip reader reads ``info``'s data: (offset, size), after the
    member's local header, as ``ZipFile.open`` finds it."""
    file.seek(info.header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(
        file.read(_LOCAL_HEADER.size).ljust(_LOCAL_HEADER.size, b"\0")
    )
    if signature != b"PK\x03\x04":
        raise _Refuse(info.filename, "no local header where the central directory says")
    offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    return offset, info.file_size


def _disagreement(file: IO[bytes], name: str) -> str | None:
    """The first member torch's zip reader and Python's find differently (a name only
    one finds, or data at another place or of another size), or None.

    Raises:
        LoadError: torch's reader cannot read the archive.
        _Refuse: a member has no local header.
    """
    file.seek(0)
    try:
        theirs = _program.archive_records(file)
    except Exception as exc:
        raise LoadError(f"{name}: torch cannot read the archive ({first_line(exc)})") from exc
    finally:
        file.seek(0)
    with zipfile.ZipFile(file) as archive:
        ours = {i.filename.split("/", 1)[1]: _data_span(file, i) for i in archive.infolist()}
    file.seek(0)
    odd = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    return odd[0] if odd else None


def readers_agree(file: IO[bytes]) -> bool:
    """Whether torch's zip reader and Python's find the same members at the same
    places in ``file``, whose members pass the checks all members must pass (so
    that torch's reader only ever parses an archive Python's reader accepted)."""
    try:
        size = _zip_size(file, "<archive>")
        with zipfile.ZipFile(file) as archive:
            _check_zip_entries(archive.infolist(), size, "<archive>")
        return _disagreement(file, "<archive>") is None
    except (EpassError, _Refuse, zipfile.BadZipFile, OSError, EOFError):
        return False
    finally:
        file.seek(0)


class ReadOnce(io.RawIOBase):
    """A read-only view of an open regular file in which each byte, once read, stays
    what it was: a later read of it returns the bytes already read, whatever the file
    holds by then.

    Screening a view and then loading the same view gives torch a file the screen
    accepted, without a copy: the screen's verdict rests only on the bytes it read
    (the zip directories, local headers, and every member but raw tensor data), and
    torch's reads of those bytes return what the screen read. After :meth:`seal`,
    bytes no read has touched yet inside the data of a raw tensor member
    (``weight_N`` / ``tensor_N``) are read straight into torch's buffer and not kept:
    torch views them as numbers with a dtype, whatever they hold. Every other byte
    read is kept, so the view costs the memory of what was screened, not of the file.
    """

    def __init__(self, file: IO[bytes], name: str = "<archive>") -> None:
        super().__init__()
        self._file = file  # holds the descriptor open
        self._fd = file.fileno()
        self._size = os.fstat(self._fd).st_size
        self._pos = 0
        self._starts: list[int] = []  # kept bytes: sorted, disjoint chunks
        self._chunks: list[bytes] = []
        self._raw: list[tuple[int, int]] = []  # sorted (start, end) of raw tensor data
        self.name = name  # for messages

    @staticmethod
    def usable(file: IO[bytes]) -> bool:
        """Whether ``file`` is a regular file that positioned reads work on."""
        try:
            return hasattr(os, "preadv") and stat.S_ISREG(os.fstat(file.fileno()).st_mode)
        except (OSError, AttributeError, io.UnsupportedOperation):
            return False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:  # as a file says it (zipfile probes with such seeks)
            raise OSError(errno.EINVAL, f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readall(self) -> bytes:
        return self.read(max(0, self._size - self._pos))

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self._size - self._pos))
        self._fill(self._pos, out[:n])
        self._pos += n
        return n

    def seal(self) -> None:
        """Mark the screen done: raw tensor data is read straight through from now on."""
        raw = []
        file = typing.cast(IO[bytes], self)
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if _kind(info.filename.split("/", 1)[1]) == "tensor" and info.file_size:
                    start, size = _data_span(file, info)
                    raw.append((start, start + size))
        self._raw = sorted(raw)
        self.seek(0)

    def _is_raw(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._raw, (start, float("inf"))) - 1
        return i >= 0 and self._raw[i][0] <= start and end <= self._raw[i][1]

    def _fill(self, start: int, out: memoryview) -> None:
        end = start + len(out)
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        pos, kept = start, []
        while pos < end:
            if i < len(self._starts) and self._starts[i] + len(self._chunks[i]) <= pos:
                i += 1  # a chunk wholly before pos
                continue
            if i < len(self._starts) and self._starts[i] <= pos:
                chunk, first = self._chunks[i], self._starts[i]
                stop = min(end, first + len(chunk))
                out[pos - start : stop - start] = chunk[pos - first : stop - first]
                pos, i = stop, i + 1
                continue
            stop = min(end, self._starts[i]) if i < len(self._starts) else end
            self._pread(pos, out[pos - start : stop - start])
            if not self._is_raw(pos, stop):
                kept.append((pos, bytes(out[pos - start : stop - start])))
            pos = stop
        for first, chunk in kept:
            at = bisect.bisect_left(self._starts, first)
            self._starts.insert(at, first)
            self._chunks.insert(at, chunk)

    def _pread(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n == 0:
                raise OSError(f"the file got shorter while it was read ({self.name})")
            done += n


def _check_program_archive(infos: Sequence[zipfile.ZipInfo], name: str) -> None:
    if not any(i.filename.lower().endswith("models/model.json") for i in infos):
        raise LoadError(
            f"{name}: a zip file, but not an exported program (no models/model.json inside)",
            path=name,
        )


@contextlib.contextmanager
def private_copy(file: IO[bytes], name: str) -> Iterator[IO[bytes]]:
    """The archive rewritten by Python's zipfile, each member read once, into a
    temporary file that has no name (nothing to leave behind, nothing to swap).

    torch's zip reader and Python's can find different members in one file (a
    central directory stored elsewhere than its end record says: Python reads the
    one before the end record, torch the one at the stated offset), and a file can
    change on disk, or a network file system answer differently, between two
    reads. Screening and loading this copy makes what torch loads what was screened.
    """
    size = _zip_size(file, name)
    with tempfile.TemporaryFile() as copy:
        try:
            with zipfile.ZipFile(file) as archive:
                infos = archive.infolist()
                _check_program_archive(infos, name)
                _check_zip_entries(infos, size, name)
                with zipfile.ZipFile(copy, "w") as out:
                    for info in infos:
                        entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                        entry.file_size = info.file_size  # zip64 when needed
                        with archive.open(info) as src, out.open(entry, "w") as dst:
                            shutil.copyfileobj(src, dst, 1 << 20)
        except _Refuse as refused:
            raise _unsafe(name, refused) from None
        except (zipfile.BadZipFile, EOFError) as exc:
            raise LoadError(f"{name}: not a .pt2 archive ({exc})", path=name) from exc
        copy.seek(0)
        yield copy


def _unsafe(name: str, refused: _Refuse) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"{name}: refused member {refused.member!r}: {refused.why}; nothing was loaded "
        "(rerun with --trust only if you trust where the file came from)",
        path=name,
        member=refused.member,
    )


def _screen_members(archive: zipfile.ZipFile, size: int, name: str) -> None:
    infos = archive.infolist()
    _check_program_archive(infos, name)
    root = _check_zip_entries(infos, size, name)
    names = {i.filename[len(root) + 1 :]: i.filename for i in infos}
    pickles: set[str] = set()
    for short, full in names.items():
        if any(re.fullmatch(p, short.lower()) for p in TRUST_ONLY):
            raise _Refuse(full, "a pickled object that loading would execute")
        kind = _kind(short)
        if kind is None:
            what = "a shared library" if re.search(r"\.(so|dll|dylib)$", short.lower()) else ""
            if short.lower().startswith("data/aotinductor/"):
                what = "an AOTInductor package"
            raise _Refuse(full, (what or "a member") + " that torch.export.save does not write")
        if short != short.lower() and not short.startswith("extra/"):
            raise _Refuse(full, "a member name in the wrong case")
        if kind == "text":
            if archive.getinfo(full).file_size > _TEXT_LIMIT:
                raise _Refuse(full, "a text member over 1 MiB")
            try:
                text = archive.read(full).decode()
            except UnicodeDecodeError as exc:
                raise _Refuse(full, "a text member that is not UTF-8") from exc
            tags = _archive_tags()
            if short in tags and text != tags[short]:
                raise _Refuse(
                    full,
                    f"{short} {text[:20]!r}, which torch {torch.__version__} does not read "
                    f"(it reads {tags[short]!r})",
                )
        elif kind == "program":
            screen_program(full, archive.read(full))
        elif kind == "config":
            folder = short.rsplit("/", 1)[0] + "/"
            _screen_config(full, archive.read(full), folder, names, pickles)
        elif kind == "pickle" and archive.getinfo(full).file_size:
            pickles.add(full)
    for full in sorted(pickles):
        _screen_pickle(full, archive.read(full))
        if _kind(full[len(root) + 1 :]) == "pickle":
            _screen_sample_inputs(full, archive.read(full))


def _screen_sample_inputs(member: str, data: bytes) -> None:
    """Unpickle the sample inputs with the weights-only unpickler and check their text.

    torch retries sample inputs with ``weights_only=False`` when the weights-only
    unpickler fails on them, and ExportedProgram.module() pastes their dict keys
    into the source of its input checks, between quotes.
    """
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise _Refuse(
            member, f"sample inputs the weights-only unpickler refuses ({first_line(exc)})"
        ) from exc
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, (str, bytes)):
            text = item if isinstance(item, str) else item.decode("latin-1")
            if not _is_plain(text):
                raise _Refuse(
                    member,
                    f"sample inputs holding the text {text[:60]!r}, with quotes, "
                    "backslashes or control characters",
                )


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an error, cut to its first sentence when long."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > limit and ". " in line:
        line = line[: line.index(". ") + 1]
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__

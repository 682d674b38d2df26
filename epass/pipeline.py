"""The pipeline grammar: text to a tree of pass specs and back, with the value grammar.

This module is data only: it parses and prints, and never makes a pass. The
registry turns one :class:`PassSpec` into one pass, and :mod:`epass.building` a
whole tree into passes (``PassManager.from_text``). torch is imported only to read
a dtype or operator word, or to print one.

Grammar (whitespace and ``# comments`` are ignored between tokens)::

    pipeline := [item ("," item)* [","]]
    item     := "repeat" "(" INT "," "[" pipeline "]" ")"
              | "fixpoint" "(" "[" pipeline "]" ["," "max" "=" INT] ")"
              | NAME ["(" [option ("," option)*] ")"]
    option   := IDENT "=" value
    value    := INT | FLOAT | STRING | "true" | "false" | "none"
              | "[" [value ("," value)*] "]"
              | "{" [value ":" value ("," value ":" value)*] "}"
              | dtype      (bfloat16, float32, torch.float16, ...)
              | operator   (aten.gelu.default, aten.relu, ...)
              | WORD       (any other bare word is a string)

``repeat(N, [...])`` and ``fixpoint([...], max=N)`` are nested
:class:`~epass.PassManager` groups with ``steps=N``: both stop early after a
round in which no pass changed the program.

Example::

    tree = parse("decompose, repeat(3, [fold-constants(max_growth=2.0), dce])")
    assert format_pipeline(tree) == "decompose, repeat(3, [fold-constants(max_growth=2.0), dce])"

One concept: the pipeline language, parsed and printed here together so that the two
stay each other's inverse.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import attrs

from epass.errors import ArgumentTypeError, ArgumentValueError, PipelineError

__all__ = [
    "FIXPOINT_DEFAULT_MAX",
    "MAX_NESTING",
    "NAME_PATTERN",
    "RESERVED",
    "Group",
    "Item",
    "PassSpec",
    "PipelineError",
    "Symbol",
    "format_item",
    "format_pipeline",
    "format_value",
    "lookup_operator",
    "operator_text",
    "parse",
    "walk",
]

# A pass name: words of letters, digits and '_' joined by single '-'.
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*")
# Words the grammar gives a meaning of its own (inf and nan are numbers).
RESERVED = frozenset({"repeat", "fixpoint", "true", "false", "none", "inf", "nan"})
FIXPOINT_DEFAULT_MAX = 10
# Groups and lists may nest this deep (together). The parser, the printer and nested
# managers recurse once per level, so text must not be able to exhaust the stack.
MAX_NESTING = 32


# --- syntax tree --------------------------------------------------------------


@attrs.frozen
class PassSpec:
    """One pass: a registry name and its options (as Python values)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    pos: int = attrs.field(default=0, eq=False)
    option_pos: tuple[int, ...] = attrs.field(default=(), eq=False)
    value_pos: tuple[int, ...] = attrs.field(default=(), eq=False)

    def option_at(self, option: str | None, *, value: bool = True) -> int:
        """Where ``option``'s value (or, with ``value=False``, its name) starts in the
        text this spec was parsed from; the pass name's position when unknown."""
        keys = [key for key, _ in self.options]
        positions = self.value_pos if value else self.option_pos
        if option in keys and keys.index(option) < len(positions):
            return positions[keys.index(option)]
        return self.pos


@attrs.frozen
class Symbol:
    """A bare word that names a dtype, an operator or a string, read without torch
    (``parse(text, resolve=False)``): which one it is waits until torch is loaded."""

    text: str

    @property
    def dotted(self) -> bool:
        """True for ``aten.relu``-like words, which can only be operators."""
        return "." in self.text


@attrs.frozen
class Group:
    """``repeat(N, [...])`` (kind "repeat") or ``fixpoint([...], max=N)``."""

    kind: str
    count: int
    items: tuple[PassSpec | Group, ...]
    pos: int = attrs.field(default=0, eq=False)


Item = PassSpec | Group

# --- tokens -------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<number>[-+]?(?:(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|inf(?![\w.-])|nan(?![\w.-])))
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<punct>[(),=\[\]{}:])
  | (?P<bad>.)
    """,
    re.X | re.S,
)


class _Tok(NamedTuple):
    kind: str
    text: str
    pos: int


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup or ""
        if kind == "ws":
            continue
        pos = m.start()
        if kind == "bad":
            if text[pos] in "\"'":
                raise PipelineError("unterminated string", text, pos)
            raise PipelineError(f"unexpected character {text[pos]!r}", text, pos)
        out.append(_Tok(kind, m.group(), pos))
    out.append(_Tok("end", "", len(text)))
    return out


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}


def _unquote(tok: _Tok, text: str) -> str:
    body = tok.text[1:-1]
    out = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            nxt = body[i + 1]
            if nxt not in _ESCAPES:
                raise PipelineError(f"unknown escape '\\{nxt}'", text, tok.pos + 1 + i)
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


# --- parser -------------------------------------------------------------------


class _Parser:
    def __init__(self, text: str, *, resolve: bool = True) -> None:
        self.text = text
        self.resolve = resolve
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0  # open groups and lists

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def error(self, message: str, tok: _Tok | None = None, hint: str = "") -> PipelineError:
        tok = tok or self.tok
        return PipelineError(message, self.text, tok.pos, hint)

    def describe(self, tok: _Tok) -> str:
        return "end of text" if tok.kind == "end" else repr(tok.text)

    def expect(self, punct: str, what: str = "") -> _Tok:
        tok = self.tok
        if tok.kind != "punct" or tok.text != punct:
            raise self.error(f"expected {what or repr(punct)}, found {self.describe(tok)}")
        self.i += 1
        return tok

    def at(self, punct: str) -> bool:
        return self.tok.kind == "punct" and self.tok.text == punct

    def enter(self, tok: _Tok) -> None:
        """Open one level of nesting at ``tok`` (a group's or a list's '[')."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"groups and lists nest more than {MAX_NESTING} levels deep", tok)

    def integer(self, tok: _Tok) -> int:
        try:
            return int(tok.text)
        except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
            raise self.error(f"integer with {len(tok.text)} characters is too long", tok) from None

    def pipeline(self, closing: str | None) -> tuple[Item, ...]:
        items: list[Item] = []
        if (closing is None and self.tok.kind == "end") or (closing and self.at(closing)):
            return ()
        while True:
            items.append(self.item())
            if self.at(","):
                self.i += 1
                # A trailing comma is fine (handy in multi-line config files).
                if (closing is None and self.tok.kind == "end") or (closing and self.at(closing)):
                    return tuple(items)
                continue
            if closing is None and self.tok.kind != "end":
                raise self.error(f"expected ',' between passes, found {self.describe(self.tok)}")
            return tuple(items)

    def item(self) -> Item:
        tok = self.tok
        if tok.kind != "word" or "." in tok.text:
            raise self.error(f"expected a pass name, found {self.describe(tok)}")
        self.i += 1
        if tok.text == "repeat":
            return self.repeat(tok)
        if tok.text == "fixpoint":
            return self.fixpoint(tok)
        options: list[tuple[str, Any]] = []
        positions: list[int] = []
        value_positions: list[int] = []
        if self.at("("):
            self.i += 1
            seen: set[str] = set()
            while not self.at(")"):
                key = self.tok
                if key.kind != "word" or not key.text.isidentifier():
                    raise self.error(
                        f"expected an option name, found {self.describe(key)}",
                        hint=f" (options are written {tok.text}(key=value, ...))",
                    )
                if key.text in seen:
                    raise self.error(f"option {key.text!r} given twice", key)
                seen.add(key.text)
                self.i += 1
                self.expect("=", f"'=' after option {key.text!r}")
                value_positions.append(self.tok.pos)
                options.append((key.text, self.value()))
                positions.append(key.pos)
                if not self.at(")"):
                    self.expect(",", "',' or ')'")
            self.i += 1
        return PassSpec(tok.text, tuple(options), tok.pos, tuple(positions), tuple(value_positions))

    def count(self, what: str) -> int:
        tok = self.tok
        if tok.kind != "number" or not re.fullmatch(r"\+?\d+", tok.text):
            raise self.error(f"{what} must be a positive integer, found {self.describe(tok)}")
        value = self.integer(tok)
        if value < 1:
            raise self.error(f"{what} must be a positive integer, found {self.describe(tok)}")
        self.i += 1
        return value

    def group_items(self) -> tuple[Item, ...]:
        self.enter(self.expect("[", "'[' opening the group's pass list"))
        items = self.pipeline("]")
        self.expect("]", "']' closing the group's pass list")
        self.depth -= 1
        return items

    def repeat(self, head: _Tok) -> Group:
        self.expect("(", "'(' after 'repeat' (repeat(N, [passes]))")
        n = self.count("repeat's count")
        self.expect(",", "',' after repeat's count")
        items = self.group_items()
        self.expect(")", "')' closing repeat(...)")
        return Group("repeat", n, items, head.pos)

    def fixpoint(self, head: _Tok) -> Group:
        self.expect("(", "'(' after 'fixpoint' (fixpoint([passes], max=N))")
        items = self.group_items()
        n = FIXPOINT_DEFAULT_MAX
        if self.at(","):
            self.i += 1
            key = self.tok
            if key.kind != "word" or key.text != "max":
                raise self.error(f"fixpoint takes only 'max=N', found {self.describe(key)}")
            self.i += 1
            self.expect("=", "'=' after 'max'")
            n = self.count("fixpoint's max")
        self.expect(")", "')' closing fixpoint(...)")
        return Group("fixpoint", n, items, head.pos)

    def value(self) -> Any:
        tok = self.tok
        self.i += 1
        if tok.kind == "number":
            if re.fullmatch(r"[-+]?\d+", tok.text):
                return self.integer(tok)
            return float(tok.text)
        if tok.kind == "string":
            return _unquote(tok, self.text)
        if tok.kind == "punct" and tok.text == "[":
            self.enter(tok)
            items: list[Any] = []
            while not self.at("]"):
                items.append(self.value())
                if not self.at("]"):
                    self.expect(",", "',' or ']' in a list")
            self.i += 1
            self.depth -= 1
            return items
        if tok.kind == "punct" and tok.text == "{":
            self.enter(tok)
            mapping: dict[Any, Any] = {}
            while not self.at("}"):
                key_tok = self.tok
                key = self.value()
                try:
                    hash(key)
                except TypeError:
                    raise self.error("a mapping key must be a single value", key_tok) from None
                if key in mapping:
                    raise self.error(f"key {format_value(key)} given twice", key_tok)
                self.expect(":", "':' after a mapping key")
                mapping[key] = self.value()
                if not self.at("}"):
                    self.expect(",", "',' or '}' in a mapping")
            self.i += 1
            self.depth -= 1
            return mapping
        if tok.kind == "word":
            return self.word(tok)
        raise self.error(f"expected a value, found {self.describe(tok)}", tok)

    def word(self, tok: _Tok) -> Any:
        text = tok.text
        lowered = text.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered == "none":
            return None
        if not self.resolve:
            return Symbol(text)
        dtype = _dtype(text)
        if dtype is not None:
            return dtype
        if "." in text:
            op = _operator(text)
            if op is None:
                raise self.error(
                    f"unknown operator or dtype {text!r}", tok, hint=" (quote it for a string)"
                )
            return op
        return text


def _dtype(text: str) -> Any:
    """The torch dtype a word names (``bfloat16``, ``torch.int64``), or None."""
    name = text.removeprefix("torch.")
    if "." in name:
        return None
    import torch

    # vars(), not getattr(): torch imports submodules (_inductor, onnx) on attribute access.
    value = vars(torch).get(name)
    return value if isinstance(value, torch.dtype) else None


def _operator(text: str) -> Any:
    """Resolve ``ns.op`` or ``ns.op.overload`` through ``torch.ops``, or return None."""
    parts = text.split(".")
    if parts[0] == "torch" and len(parts) > 1 and parts[1] == "ops":
        parts = parts[2:]
    if len(parts) not in (2, 3):
        return None
    obj = lookup_operator(parts)
    return obj if obj is not None and operator_text(obj) is not None else None


def parse(text: str, *, resolve: bool = True) -> tuple[Item, ...]:
    """Parse pipeline text into its syntax tree (pass names are not looked up).

    With ``resolve=False`` torch is not imported: every bare word other than
    ``true``, ``false`` and ``none`` is kept as a :class:`Symbol`, so that a
    command can check its pipeline text before it pays for torch.
    """
    if not isinstance(text, str):
        raise ArgumentTypeError(f"pipeline text must be a str, got {type(text).__name__}")
    parser = _Parser(text, resolve=resolve)
    return parser.pipeline(None)


def walk(items: Iterable[Item]) -> Iterator[PassSpec]:
    """Every pass spec of a tree, groups opened, in order."""
    for item in items:
        if isinstance(item, Group):
            yield from walk(item.items)
        else:
            yield item


# --- printing -----------------------------------------------------------------


def format_item(item: Item) -> str:
    """One item as canonical pipeline text."""
    if isinstance(item, Group):
        inner = format_pipeline(item.items)
        if item.kind == "fixpoint":
            return f"fixpoint([{inner}], max={item.count})"
        return f"repeat({item.count}, [{inner}])"
    if not item.options:
        return item.name
    opts = ", ".join(f"{k}={format_value(v)}" for k, v in item.options)
    return f"{item.name}({opts})"


def format_pipeline(items: Iterable[Item]) -> str:
    """Print a syntax tree as canonical pipeline text."""
    return ", ".join(format_item(i) for i in items)


_RAW_ESCAPES = (("\n", "\\n"), ("\t", "\\t"), ("\r", "\\r"), ("\0", "\\0"))


def format_value(value: Any) -> str:
    """The pipeline-text form of an option value; raises ValueError if it has none."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        for raw, esc in _RAW_ESCAPES:
            escaped = escaped.replace(raw, esc)
        return f'"{escaped}"'
    if isinstance(value, Symbol):
        return value.text
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return (
            "{" + ", ".join(f"{format_value(k)}: {format_value(v)}" for k, v in value.items()) + "}"
        )
    text = _dtype_text(value) or operator_text(value)
    if text is not None:
        return text
    raise ArgumentValueError(f"{value!r} ({type(value).__name__}) has no textual form")


def _dtype_text(value: Any) -> str | None:
    import sys

    torch = sys.modules.get("torch")  # a dtype exists only once torch is loaded
    if torch is not None and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return None


def lookup_operator(parts: list[str]) -> Any:
    """``torch.ops.<parts...>``, or None when any part is missing.

    Only namespaces that already exist are searched: ``getattr(torch.ops, ns)``
    would create (and keep) a namespace for any word. Operator and overload
    lookups below a namespace ask torch's C++ registry and import nothing.
    """
    import torch

    obj: Any = vars(torch.ops).get(parts[0])
    if not isinstance(obj, types.ModuleType):
        return None
    try:
        for part in parts[1:]:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


def operator_text(value: Any) -> str | None:
    """``aten.gelu.default`` for a torch operator (overload or packet), else None."""
    if isinstance(value, (str, bytes, int, float, type)) or not callable(value):
        return None
    text = str(value)
    if not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", text):
        return None
    return text if lookup_operator(text.split(".")) is value else None

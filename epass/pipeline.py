"""Textual pipelines: a parser (never ``eval``) and a printer for pass lists.

Grammar (whitespace and ``# comments`` are ignored between tokens)::

    pipeline := [item ("," item)* [","]]
    item     := "repeat" "(" INT "," "[" pipeline "]" ")"
              | "fixpoint" "(" "[" pipeline "]" ["," "max" "=" INT] ")"
              | NAME ["(" [option ("," option)*] ")"]
    option   := IDENT "=" value
    value    := INT | FLOAT | STRING | "true" | "false" | "none"
              | "[" [value ("," value)*] "]"
              | dtype      (bfloat16, float32, torch.float16, ...)
              | operator   (aten.gelu.default, aten.relu, ...)
              | WORD       (any other bare word is a string)

``repeat(N, [...])`` and ``fixpoint([...], max=N)`` are nested
:class:`~epass.PassManager` groups with ``steps=N``: both stop early after a
round in which no pass changed the program.

Example::

    pm = PassManager.from_text("decompose, repeat(3, [fold-constants, dce])")
    assert pm.to_text() == "decompose, repeat(3, [fold-constants, dce])"
"""

from __future__ import annotations

import difflib
import math
import re
import types
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from epass.errors import EpassError

__all__ = [
    "FIXPOINT_DEFAULT_MAX",
    "MAX_NESTING",
    "Group",
    "PassSpec",
    "PipelineError",
    "build",
    "format_pipeline",
    "format_value",
    "parse",
    "parse_pipeline",
    "to_text",
]

FIXPOINT_DEFAULT_MAX = 10
# Groups and lists may nest this deep (together). The parser, the printer and nested
# managers recurse once per level, so text must not be able to exhaust the stack.
MAX_NESTING = 32


class PipelineError(EpassError, ValueError):
    """Pipeline text that does not parse or names something unknown.

    ``str(error)`` is the one-line reason followed by the text and a caret line
    under the offending column.

    Attributes:
        reason: the one-line reason (with the column).
        text: the pipeline text.
        column: 1-based column of the problem.
    """

    def __init__(self, message: str, text: str, pos: int, hint: str = "") -> None:
        self.text = text
        self.pos = pos
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line_end = len(text) if line_end < 0 else line_end
        self.line = text.count("\n", 0, pos) + 1
        self.column = pos - line_start + 1
        where = f"column {self.column}"
        if self.line > 1:
            where = f"line {self.line}, {where}"
        self.reason = f"{message} at {where}{hint}"
        self.context = f"  {text[line_start:line_end]}\n  {' ' * (pos - line_start)}^"
        super().__init__(f"{self.reason}\n{self.context}")


# --- syntax tree --------------------------------------------------------------


@attrs.frozen
class PassSpec:
    """One pass: a registry name and its options (as Python values)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    pos: int = attrs.field(default=0, eq=False)
    option_pos: tuple[int, ...] = attrs.field(default=(), eq=False)


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
  | (?P<punct>[(),=\[\]])
    """,
    re.X,
)


@attrs.frozen
class _Tok:
    kind: str
    text: str
    pos: int


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos] in "\"'":
                raise PipelineError("unterminated string", text, pos)
            raise PipelineError(f"unexpected character {text[pos]!r}", text, pos)
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append(_Tok(kind, m.group(), pos))
        pos = m.end()
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
    def __init__(self, text: str) -> None:
        self.text = text
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
                options.append((key.text, self.value()))
                positions.append(key.pos)
                if not self.at(")"):
                    self.expect(",", "',' or ')'")
            self.i += 1
        return PassSpec(tok.text, tuple(options), tok.pos, tuple(positions))

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


def _dtype(text: str) -> torch.dtype | None:
    name = text.removeprefix("torch.")
    if "." in name:
        return None
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
    obj = _lookup(parts)
    return obj if obj is not None and _operator_text(obj) is not None else None


def _lookup(parts: list[str]) -> Any:
    """``torch.ops.<parts...>``, or None when any part is missing.

    Only namespaces that already exist are searched: ``getattr(torch.ops, ns)``
    would create (and keep) a namespace for any word. Operator and overload
    lookups below a namespace ask torch's C++ registry and import nothing.
    """
    obj: Any = vars(torch.ops).get(parts[0])
    if not isinstance(obj, types.ModuleType):
        return None
    try:
        for part in parts[1:]:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


def _operator_text(value: Any) -> str | None:
    """``aten.gelu.default`` for a torch operator (overload or packet), else None."""
    if isinstance(value, (str, bytes, int, float, type)) or not callable(value):
        return None
    text = str(value)
    if not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", text):
        return None
    return text if _lookup(text.split(".")) is value else None


def parse(text: str) -> tuple[Item, ...]:
    """Parse pipeline text into its syntax tree (names are not resolved)."""
    if not isinstance(text, str):
        raise TypeError(f"pipeline text must be a str, got {type(text).__name__}")
    parser = _Parser(text)
    return parser.pipeline(None)


# --- building passes ------------------------------------------------------------


def build(items: Sequence[Item], text: str) -> list[Any]:
    """Turn a syntax tree into pass objects through the registry."""
    from epass import registry
    from epass.manager import PassManager

    out: list[Any] = []
    for item in items:
        if isinstance(item, Group):
            out.append(PassManager(build(item.items, text), steps=item.count, name=item.kind))
            continue
        try:
            out.append(registry.instantiate(item.name, dict(item.options), declared_only=True))
        except registry.UnknownPassError as exc:
            hint = f"; did you mean {exc.suggestions[0]!r}?" if exc.suggestions else ""
            raise PipelineError(f"unknown pass {item.name!r}", text, item.pos, hint) from None
        except registry.RegistryError as exc:
            raise PipelineError(
                f"cannot load pass {item.name!r}", text, item.pos, f": {exc}"
            ) from exc
        except (TypeError, ValueError) as exc:
            pos = item.pos
            message = registry.reason(exc)
            for (key, _), kpos in zip(item.options, item.option_pos, strict=False):
                if f"option {key!r}" in message:
                    pos = kpos
            raise PipelineError(
                f"bad options for pass {item.name!r}", text, pos, f": {message}"
            ) from exc
    return out


def parse_pipeline(text: str) -> list[Any]:
    """Parse pipeline text and create its passes (nested groups become PassManagers)."""
    return build(parse(text), text)


# --- printing -----------------------------------------------------------------

_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
        for raw, esc in (("\n", "\\n"), ("\t", "\\t"), ("\r", "\\r"), ("\0", "\\0")):
            escaped = escaped.replace(raw, esc)
        return f'"{escaped}"'
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    op = _operator_text(value)
    if op is not None:
        return op
    raise ValueError(f"{value!r} ({type(value).__name__}) has no textual form")


def format_item(item: Item) -> str:
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


def spec_tree(passes: Iterable[Any]) -> tuple[Item, ...]:
    """The syntax tree that recreates these pass objects; ValueError if one has no name."""
    from epass import registry
    from epass.manager import PassManager
    from epass.protocol import pass_name

    out: list[Item] = []
    for p in passes:
        spec = registry.spec_of(p)
        if spec is not None:
            name, options = spec
            out.append(PassSpec(name, tuple(options.items())))
        elif isinstance(p, PassManager):
            kind = "fixpoint" if p.name == "fixpoint" else "repeat"
            out.append(Group(kind, p.steps, spec_tree(p.passes)))
        else:
            raise ValueError(
                f"pass {pass_name(p)!r} ({type(p).__name__}) is not registered, so it has no "
                "textual form; register it with epass.register_pass"
            )
    return tuple(out)


def to_text(passes: Iterable[Any]) -> str:
    """Print pass objects as pipeline text that :func:`parse_pipeline` reads back."""
    from epass import registry

    tree = spec_tree(passes)
    for item in _walk(tree):
        declared = {o.name for o in registry.option_infos(registry.get_factory(item.name))}
        for key, value in item.options:
            if key not in declared:
                raise ValueError(
                    f"option {key!r} of pass {item.name!r} is a keyword argument that "
                    "pipeline text cannot set"
                )
            try:
                format_value(value)
            except ValueError as exc:
                raise ValueError(f"option {key!r} of pass {item.name!r}: {exc}") from None
    return format_pipeline(tree)


def _walk(items: Iterable[Item]) -> Iterable[PassSpec]:
    for item in items:
        if isinstance(item, Group):
            yield from _walk(item.items)
        else:
            yield item


def suggest(name: str, names: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(names), n=1)
    return close[0] if close else None

"""Textual pipelines: a parser (never ``eval``) and a printer for pass lists.

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

    pm = PassManager.from_text("decompose, repeat(3, [fold-constants, dce])")
    assert pm.to_text() == "decompose, repeat(3, [fold-constants, dce])"
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from epass import registry
from epass.errors import ArgumentTypeError, ArgumentValueError, OptionError, PipelineError
from epass.manager import PassManager
from epass.protocol import PassModel, adapt, label
from epass.registry import format_value

__all__ = [
    "FIXPOINT_DEFAULT_MAX",
    "create_pass",
    "from_text",
    "manager_text",
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


# --- syntax tree --------------------------------------------------------------


@attrs.frozen
class PassSpec:
    """One pass: a registry name and its options (as Python values)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    pos: int = attrs.field(default=0, eq=False)
    option_pos: tuple[int, ...] = attrs.field(default=(), eq=False)
    value_pos: tuple[int, ...] = attrs.field(default=(), eq=False)


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
    obj = registry.lookup_operator(parts)
    return obj if obj is not None and registry.operator_text(obj) is not None else None


def parse(text: str) -> tuple[Item, ...]:
    """Parse pipeline text into its syntax tree (names are not resolved)."""
    if not isinstance(text, str):
        raise ArgumentTypeError(f"pipeline text must be a str, got {type(text).__name__}")
    parser = _Parser(text)
    return parser.pipeline(None)


# --- building passes ------------------------------------------------------------


def build(items: Sequence[Item], text: str) -> list[Any]:
    """Turn a syntax tree into pass objects through the registry."""
    return [p for p, _ in _build(items, text)]


def _build(items: Sequence[Item], text: str) -> list[tuple[Any, tuple[str, dict[str, Any]] | None]]:
    """:func:`build`, each pass with the registry name and options it was made from."""
    out: list[tuple[Any, tuple[str, dict[str, Any]] | None]] = []
    for item in items:
        if isinstance(item, Group):
            group = PassManager(build(item.items, text), steps=item.count, name=item.kind)
            out.append((group, None))
            continue
        try:
            obj, options = registry.instantiate(item.name, dict(item.options), declared_only=True)
        except registry.UnknownPassError as exc:
            hint = f"; did you mean {exc.suggestions[0]!r}?" if exc.suggestions else ""
            raise PipelineError(f"unknown pass {item.name!r}", text, item.pos, hint) from None
        except registry.RegistryError as exc:
            raise PipelineError(
                f"cannot load pass {item.name!r}", text, item.pos, f": {exc}"
            ) from exc
        except OptionError as exc:
            keys = [key for key, _ in item.options]
            pos = item.value_pos[keys.index(exc.option)] if exc.option in keys else item.pos
            raise OptionError(
                exc.message,
                text,
                pos,
                pass_name=exc.pass_name,
                option=exc.option,
                expected=exc.expected,
            ) from None
        except (TypeError, ValueError) as exc:
            pos = item.pos
            message = registry.reason(exc)
            for (key, _), kpos in zip(item.options, item.option_pos, strict=False):
                if f"option {key!r}" in message:
                    pos = kpos
            raise PipelineError(
                f"bad options for pass {item.name!r}", text, pos, f": {message}"
            ) from exc
        # Outside the try: a pass whose name raises is not a matter of options.
        out.append((label(obj, item.name, options), (item.name, options)))
    return out


def parse_pipeline(text: str) -> list[Any]:
    """Parse pipeline text and create its passes (nested groups become PassManagers)."""
    return build(parse(text), text)


# --- printing -----------------------------------------------------------------


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


def pass_spec(p: Any) -> tuple[str, dict[str, Any]] | None:
    """The registry name and options that recreate a pass (an object or its model):
    an attrs pass's fields, else the ``origin`` it was made from; None if unknown."""
    model = p if isinstance(p, PassModel) else adapt(p)
    spec = registry.spec_of(model.pass_, model.name)
    if spec is None and model.origin is not None:
        spec = model.origin[0], dict(model.origin[1])
    return spec


def spec_tree(passes: Iterable[Any]) -> tuple[Item, ...]:
    """The syntax tree that recreates these passes (objects or their models);
    ValueError if one has no name."""
    out: list[Item] = []
    for p in passes:
        model = p if isinstance(p, PassModel) else adapt(p)
        spec = pass_spec(model)
        if spec is not None:
            name, options = spec
            out.append(PassSpec(name, tuple(options.items())))
        elif isinstance(model.pass_, PassManager):
            kind = "fixpoint" if model.pass_.name == "fixpoint" else "repeat"
            out.append(Group(kind, model.pass_.steps, spec_tree(model.children)))
        else:
            raise ArgumentValueError(
                f"pass {model.name!r} ({type(model.pass_).__name__}) is not registered, so it "
                "has no textual form; register it with epass.register_pass"
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
                raise ArgumentValueError(f"option {key!r} of pass {item.name!r}: {exc}") from None
    return format_pipeline(tree)


def _walk(items: Iterable[Item]) -> Iterable[PassSpec]:
    for item in items:
        if isinstance(item, Group):
            yield from _walk(item.items)
        else:
            yield item


def create_pass(spec: str, /, **options: Any) -> Any:
    """Make a pass from a registered name and options, or from pipeline text.

    ``create_pass("cast-dtype", dtype=torch.bfloat16)`` and
    ``create_pass("cast-dtype(dtype=bfloat16)")`` give the same pass. Text holding
    several passes (``"decompose, dce"``) gives a nested :class:`~epass.PassManager`.
    """
    return resolve(spec, **options)[0]


def resolve(spec: str, /, **options: Any) -> tuple[Any, tuple[str, dict[str, Any]] | None]:
    """:func:`create_pass`, and the registry name and options the pass was made
    from (None for text holding several passes): what the engine puts in the pass's
    :class:`~epass.protocol.PassModel`."""
    if not isinstance(spec, str):
        raise ArgumentTypeError(
            f"create_pass takes a name or pipeline text, got {type(spec).__name__}"
        )
    if not spec.strip():
        raise ArgumentValueError("create_pass: spec is empty; give a pass name or pipeline text")
    if registry.NAME_PATTERN.fullmatch(spec.strip()):
        try:
            obj, converted = registry.instantiate(spec.strip(), options)
        except OptionError:
            raise
        except (TypeError, ValueError) as exc:
            error = ArgumentTypeError if isinstance(exc, TypeError) else ArgumentValueError
            raise error(f"bad options for pass {spec.strip()!r}: {registry.reason(exc)}") from exc
        return label(obj, spec.strip(), converted), (spec.strip(), converted)
    if options:
        raise ArgumentTypeError("pass options either in the text or as keywords, not both")
    made = _build(parse(spec), spec)
    if not made:
        raise ArgumentValueError(f"create_pass: spec {spec!r} holds no pass")
    if len(made) == 1:
        return made[0]
    return PassManager([p for p, _ in made], name=spec.strip()), None


def from_text(text: str, **kwargs: Any) -> PassManager:
    """A :class:`~epass.PassManager` for pipeline text; keywords go to its constructor."""
    return PassManager(parse_pipeline(text), **kwargs)


def manager_text(pm: PassManager) -> str:
    """The pipeline text that :func:`from_text` reads back into ``pm``'s pipeline.

    Raises ValueError when a pass is not registered or has an option with no
    textual form. ``steps > 1`` prints as ``repeat(steps, [...])``.
    """
    text = to_text(pm.models)
    return f"repeat({pm.steps}, [{text}])" if pm.steps > 1 else text

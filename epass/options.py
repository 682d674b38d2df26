"""Pass options: what each option of a factory takes, read once, and the one check.

An option's type is read from what a user calls: a plain class's ``__init__``
parameters, an attrs class's fields (a field's converter's parameter type where it
has a converter), a function's parameters. It is read once per factory and kept.
Every way of giving options (Python keywords, pipeline text, the command line)
converts and checks them here, so a wrong value is the same :class:`OptionError`,
naming pass and option, wherever it comes from.

Example::

    def floor_at(*, floor: float = 0.0): ...

    convert("floor-at", floor_at, {"floor": 1})  # {"floor": 1.0}
    convert("floor-at", floor_at, {"floor": "x"})  # OptionError: takes float

One concept: an option's type, read once from a factory and used by every check.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import functools
import inspect
import sys
import types
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import attrs

from epass.errors import ArgumentTypeError, OptionError
from epass.pipeline import Symbol, format_value

__all__ = [
    "Option",
    "OptionInfo",
    "OptionModel",
    "OptionType",
    "check_names",
    "checked",
    "convert",
    "convert_value",
    "model_of",
    "parse_type",
    "type_of",
]

C = TypeVar("C", bound=type)

# --- option types ------------------------------------------------------------------

# The kinds of option type with no parts (a list or a union has parts); "other" (a
# protocol, a generic this does not model, a class named in text) accepts anything,
# and the pass's own converter has the last word.
_ATOMIC_KINDS = ("any", "none", "bool", "int", "float", "str", "dtype", "operator", "function")
_COLLECTIONS = ("list", "set", "frozenset", "tuple")


@attrs.frozen
class OptionType:
    """One option's type as the model understands it: plain data, so that it can be
    written as text (:attr:`text`, what errors and ``epass passes`` show) and read
    back from it (:func:`parse_type`) without importing the pass or torch.

    Attributes:
        kind: ``any``, ``none``, ``bool``, ``int``, ``float``, ``str``, ``dtype``,
            ``operator``, ``function``, ``literal``, ``union``, ``list``, ``set``,
            ``frozenset``, ``tuple`` (any length), ``fixed`` (a tuple of given
            length), ``map``, ``enum``, ``instance`` or ``other``.
        args: the item types of a container, the arms of a union.
        values: the values of a literal.
        cls: the enum or class (None when read from text).
        name: the class's name, for ``enum``, ``instance`` and ``other``.
    """

    kind: str
    args: tuple[OptionType, ...] = ()
    values: tuple[Any, ...] = ()
    cls: Any = attrs.field(default=None, eq=False)
    name: str = ""

    @property
    def text(self) -> str:
        """The type as a reader writes it: ``float``, ``list[operator] | none``,
        ``"fast" | "exact"``, ``dict[operator, function]``."""
        if self.kind in _ATOMIC_KINDS:
            return self.kind
        if self.kind == "literal":
            return " | ".join(format_value(v) for v in self.values)
        if self.kind == "union":
            return " | ".join(a.text for a in self.args)
        if self.kind in _COLLECTIONS:
            return f"{self.kind}[{self.args[0].text}{', ...' if self.kind == 'tuple' else ''}]"
        if self.kind == "fixed":
            return f"tuple[{', '.join(a.text for a in self.args)}]"
        if self.kind == "map":
            return f"dict[{self.args[0].text}, {self.args[1].text}]"
        return self.name


_ANY = OptionType("any")
_NONE_TYPE = type(None)
_PRIMITIVES = {bool: "bool", int: "int", float: "float", str: "str"}
_SEQUENCES = {
    list: "list",
    set: "set",
    frozenset: "frozenset",
    Sequence: "list",
    Iterable: "list",
    typing.Collection: "list",
}


def type_of(annotation: Any) -> OptionType:
    """The :class:`OptionType` of a resolved annotation."""
    if annotation is Any or annotation is object:
        return _ANY
    if annotation is None or annotation is _NONE_TYPE:
        return OptionType("none")
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Union or origin is types.UnionType:
        return OptionType("union", tuple(type_of(a) for a in args))
    if origin is Literal:
        return OptionType("literal", values=args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return OptionType("tuple", (type_of(args[0]),))
        return OptionType("fixed", tuple(type_of(a) for a in args)) if args else _list("tuple")
    if origin in _SEQUENCES:
        return OptionType(_SEQUENCES[origin], (type_of(args[0]) if args else _ANY,))
    if origin in (dict, Mapping):
        key, value = (type_of(a) for a in args) if len(args) == 2 else (_ANY, _ANY)
        return OptionType("map", (key, value))
    if _is_callable(origin or annotation):
        return OptionType("function")
    if origin is not None:
        return OptionType("other", name=str(annotation).replace("typing.", ""))
    return _named_type(annotation)


def _list(kind: str) -> OptionType:
    return OptionType(kind, (_ANY,))


def _named_type(annotation: Any) -> OptionType:
    if annotation in _PRIMITIVES:
        return OptionType(_PRIMITIVES[annotation])
    if annotation in _SEQUENCES or annotation is tuple:
        return _list(_SEQUENCES.get(annotation, "tuple"))
    if annotation in (dict, Mapping):
        return OptionType("map", (_ANY, _ANY))
    torch = sys.modules.get("torch")  # a torch annotation exists only once torch is loaded
    if torch is not None and annotation is torch.dtype:
        return OptionType("dtype")
    if torch is not None and annotation is _operators().OpOverload:
        return OptionType("operator")
    name = str(getattr(annotation, "__name__", annotation)).replace("typing.", "")
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return OptionType("enum", cls=annotation, name=name)
    if isinstance(annotation, type) and not getattr(annotation, "_is_protocol", False):
        return OptionType("instance", cls=annotation, name=name)
    return OptionType("other", name=name)


def _is_callable(tp: Any) -> bool:
    return tp is Callable or (
        getattr(tp, "__module__", None) == "collections.abc"
        and getattr(tp, "__name__", None) == "Callable"
    )


def _operators() -> Any:
    from epass import _operators

    return _operators


# --- reading a type back from its text ------------------------------------------------


def parse_type(text: str) -> OptionType:
    """The :class:`OptionType` whose :attr:`~OptionType.text` is ``text``. Classes
    come back by name only (kind ``other``), which accept anything."""
    arms = _split(text.strip(), "|")
    if len(arms) > 1:
        parsed = [parse_type(a) for a in arms]
        if all(a.kind == "literal" for a in parsed):
            return OptionType("literal", values=tuple(v for a in parsed for v in a.values))
        return OptionType("union", tuple(parsed))
    word = arms[0]
    if word in _ATOMIC_KINDS:
        return OptionType(word)
    literal = _literal(word)
    if literal is not None:
        return OptionType("literal", values=(literal[0],))
    head, _, rest = word.partition("[")
    if not rest.endswith("]"):
        return OptionType("other", name=word)
    args = [parse_type(a) for a in _split(rest[:-1], ",")]
    if head == "dict" and len(args) == 2:
        return OptionType("map", tuple(args))
    if head == "tuple" and args and rest[:-1].rstrip().endswith("..."):
        return OptionType("tuple", (parse_type(_split(rest[:-1], ",")[0]),))
    if head == "tuple":
        return OptionType("fixed", tuple(args))
    if head in _COLLECTIONS and len(args) == 1:
        return OptionType(head, tuple(args))
    return OptionType("other", name=word)


def _literal(word: str) -> tuple[Any] | None:
    if word in ("true", "false"):
        return (word == "true",)
    if len(word) >= 2 and word[0] == word[-1] == '"':
        import ast

        return (ast.literal_eval(word),)  # format_value's escapes are Python's
    with contextlib.suppress(ValueError):
        return (int(word),)
    return None


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets and quotes, each part stripped."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, c in enumerate(text):
        if c == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and c == "[":
            depth += 1
        elif not quoted and c == "]":
            depth -= 1
        elif not quoted and depth == 0 and c == sep:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


# --- converting a value ----------------------------------------------------------------


class _Mismatch(Exception):
    """A value does not fit its type (internal to the conversion)."""


def _convert(value: Any, t: OptionType) -> Any:
    """``value`` as type ``t``, or raise :class:`_Mismatch`. A :class:`Symbol` (text
    read without torch) is checked as far as it can be without knowing whether it
    names a string, a dtype or an operator."""
    kind = t.kind
    if kind in ("any", "other") or (kind in ("enum", "instance") and t.cls is None):
        return value
    if isinstance(value, Symbol):
        return _convert_symbol(value, t)
    convert = _CONVERTERS.get(kind)
    if convert is None:
        raise _Mismatch
    return convert(value, t)


def _convert_symbol(value: Symbol, t: OptionType) -> Any:
    kind = t.kind
    if kind in ("dtype", "operator", "function") or (kind == "str" and not value.dotted):
        return value
    if kind == "literal" and value.text in t.values:
        return value
    if kind == "union":
        return _convert_union(value, t)
    if kind in _COLLECTIONS:
        return [_convert(value, t.args[0])]
    raise _Mismatch


def _convert_none(value: Any, t: OptionType) -> Any:
    if value is None:
        return None
    raise _Mismatch


def _convert_union(value: Any, t: OptionType) -> Any:
    if value is None and any(a.kind == "none" for a in t.args):
        return None
    for arm in t.args:  # an exact fit first: 1 stays an int in ``int | float``
        if arm.kind in ("bool", "int", "float", "str") and type(value).__name__ == arm.kind:
            return value
    for arm in t.args:
        if arm.kind == "none":
            continue
        try:
            return _convert(value, arm)
        except _Mismatch:
            continue
    raise _Mismatch


def _convert_literal(value: Any, t: OptionType) -> Any:
    for allowed in t.values:
        if type(allowed) is type(value) and allowed == value:
            return allowed
    raise _Mismatch


def _convert_scalar(value: Any, t: OptionType) -> Any:
    kind = t.kind
    if isinstance(value, bool) and kind != "bool":
        raise _Mismatch
    if kind == "float" and isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, {"bool": bool, "int": int, "str": str}.get(kind, ())):
        return value
    raise _Mismatch


def _convert_dtype(value: Any, t: OptionType) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:  # text checked before torch loads: the build checks it again
        return value
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = vars(torch).get(value.removeprefix("torch."))
        if isinstance(found, torch.dtype):
            return found
    raise _Mismatch


def _convert_operator(value: Any, t: OptionType) -> Any:
    if "torch" not in sys.modules:  # as for dtypes: checked again when the pass is built
        return value
    overload = _operators().overload_of(value)
    if overload is None:
        raise _Mismatch
    return overload


def _convert_function(value: Any, t: OptionType) -> Any:
    if callable(value):
        return value
    raise _Mismatch


def _convert_enum(value: Any, t: OptionType) -> Any:
    if isinstance(value, t.cls):
        return value
    if isinstance(value, str):
        for member in t.cls:
            if value in (member.name, member.name.lower()) or member.value == value:
                return member
    with contextlib.suppress(ValueError, TypeError):
        return t.cls(value)
    raise _Mismatch


def _convert_instance(value: Any, t: OptionType) -> Any:
    if isinstance(value, t.cls):
        return value
    raise _Mismatch


def _convert_fixed(value: Any, t: OptionType) -> Any:
    if not isinstance(value, (list, tuple)) or len(value) != len(t.args):
        raise _Mismatch
    return tuple(_convert(v, a) for v, a in zip(value, t.args, strict=True))


def _convert_collection(value: Any, t: OptionType) -> Any:
    item = t.args[0]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_convert(v, item) for v in value]
    elif isinstance(value, (str, bytes, Mapping)) and item.kind not in ("str", "any"):
        raise _Mismatch
    else:
        items = [_convert(value, item)]  # one value where a list is declared
    if t.kind == "tuple":
        return tuple(items)
    if t.kind in ("set", "frozenset"):
        return {"set": set, "frozenset": frozenset}[t.kind](items)
    return items


def _convert_map(value: Any, t: OptionType) -> Any:
    if not isinstance(value, Mapping):
        raise _Mismatch
    key, item = t.args
    return {_convert(k, key): _convert(v, item) for k, v in value.items()}


_CONVERTERS: dict[str, Callable[[Any, OptionType], Any]] = {
    "none": _convert_none,
    "union": _convert_union,
    "literal": _convert_literal,
    "bool": _convert_scalar,
    "int": _convert_scalar,
    "float": _convert_scalar,
    "str": _convert_scalar,
    "dtype": _convert_dtype,
    "operator": _convert_operator,
    "function": _convert_function,
    "enum": _convert_enum,
    "instance": _convert_instance,
    "fixed": _convert_fixed,
    "list": _convert_collection,
    "set": _convert_collection,
    "frozenset": _convert_collection,
    "tuple": _convert_collection,
    "map": _convert_map,
}


# --- one factory's options -------------------------------------------------------------


@attrs.frozen
class OptionInfo:
    """One option a pass takes: its name, type (as text) and default.

    ``as_dict()`` gives the default in pipeline-text form (``"bfloat16"``,
    ``"none"``, ``"aten.relu.default"``), ready to paste into a pipeline.
    """

    name: str
    type: str
    default: Any
    required: bool = False

    def as_dict(self) -> dict[str, Any]:
        try:
            default = None if self.required else format_value(self.default)
        except ValueError:
            default = repr(self.default)
        return {"name": self.name, "type": self.type, "default": default, "required": self.required}


@attrs.frozen
class Option:
    """One option of a factory: its name, its type (None when not declared), its default."""

    name: str
    type: OptionType | None
    default: Any
    required: bool

    @property
    def info(self) -> OptionInfo:
        """What ``epass passes`` and :func:`epass.list_passes` show of it."""
        text = self.type.text if self.type is not None else ""
        return OptionInfo(self.name, text, None if self.required else self.default, self.required)


@attrs.frozen
class OptionModel:
    """The options one factory takes, read once (:func:`model_of`).

    Attributes:
        options: each named option, in the order the factory takes them.
        var_keywords: the factory also takes other keywords (``**kwargs``), which
            only Python reaches: pipeline text sets named options only.
    """

    options: tuple[Option, ...] = ()
    var_keywords: bool = False
    by_name: Mapping[str, Option] = attrs.field(init=False, eq=False, repr=False)
    names: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "by_name", {o.name: o for o in self.options})
        object.__setattr__(self, "names", tuple(self.by_name))


_models: weakref.WeakKeyDictionary[Any, OptionModel] = weakref.WeakKeyDictionary()


def model_of(factory: Any) -> OptionModel:
    """The :class:`OptionModel` of a factory (a class or a function), read the first
    time it is asked for and kept for as long as the factory lives."""
    try:
        return _models[factory]
    except (KeyError, TypeError):
        pass
    model = _read_model(factory)
    with contextlib.suppress(TypeError):  # not weakly referable: read again next time
        _models[factory] = model
    return model


def _read_model(factory: Any) -> OptionModel:
    target = factory
    if isinstance(target, type) and attrs.has(target):
        return _attrs_model(target)
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return OptionModel(var_keywords=True)
    owner = typing.cast(Any, target).__init__ if isinstance(target, type) else target
    hints = _hints(owner)
    options = tuple(
        Option(
            p.name,
            type_of(hints[p.name]) if p.name in hints else None,
            None if p.default is p.empty else p.default,
            p.default is p.empty,
        )
        for p in signature.parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    )
    var = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    return OptionModel(options, var)


def _attrs_model(cls: type) -> OptionModel:
    hints = _hints(cls)
    options = []
    for f in attrs.fields(cls):
        if not f.init:
            continue
        if f.converter is not None:
            tp = _converter_type(f.converter)
        else:
            tp = type_of(hints[f.name]) if f.name in hints else None
        default = f.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory(None) if default.takes_self else default.factory()
        required = default is attrs.NOTHING
        name = getattr(f, "alias", None) or f.name.lstrip("_")
        options.append(Option(name, tp, None if required else default, required))
    return OptionModel(tuple(options))


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # names that do not resolve: the options go unchecked
        return {}


def _converter_type(converter: Any) -> OptionType | None:
    fn = getattr(converter, "converter", converter)  # attrs.Converter wraps the callable
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    hints = _hints(fn)
    if not params or params[0].name not in hints:
        return None
    return type_of(hints[params[0].name])


# --- the one check ---------------------------------------------------------------------


def check_names(
    name: str, declared: Sequence[str], given: Iterable[str], *, text_only: bool
) -> None:
    """Raise ArgumentTypeError for a given option the factory does not declare
    (``text_only``: pipeline text, which reaches declared options only)."""
    for key in given:
        if key in declared:
            continue
        close = difflib.get_close_matches(key, declared, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        valid = f" (options: {', '.join(declared)})" if declared and not close else ""
        if not declared and text_only:
            valid = f" ({name!r} takes no options in pipeline text)"
        raise ArgumentTypeError(f"no option {key!r}{hint}{valid}")


def convert_value(name: str, option: str, value: Any, t: OptionType) -> Any:
    """``value`` converted to ``t``, or :class:`OptionError` naming pass ``name`` and
    the option; its text is the call written out, with the caret under the value."""
    try:
        return _convert(value, t)
    except _Mismatch:
        pass
    expected = t.text
    try:
        shown = format_value(value)
    except ValueError:
        shown = repr(value)
    kind = "" if isinstance(value, Symbol) else f" ({type(value).__name__})"
    raise OptionError(
        f"option {option!r} of pass {name!r} takes {expected}, got {shown}{kind}",
        f"{name}({option}={shown})",
        len(name) + len(option) + 2,
        pass_name=name,
        option=option,
        expected=expected,
    )


def convert(
    name: str, factory: Any, options: Mapping[str, Any], *, text_only: bool = False
) -> dict[str, Any]:
    """``options`` for ``factory`` (registered as ``name``), checked and converted.

    Conversions: an int where a float is declared becomes a float; an operator
    packet becomes its ``default`` overload where an overload is declared; a
    single value where a list is declared becomes a one-item list; a dtype or
    enum member may be given by name.

    Raises:
        ArgumentTypeError: an option the factory does not take.
        OptionError: a value does not fit its option's declared type.
    """
    model = model_of(factory)
    if text_only or not model.var_keywords:
        check_names(name, model.names, options, text_only=text_only)
    out = dict(options)
    for key, value in options.items():
        option = model.by_name.get(key)
        if option is not None and option.type is not None:
            out[key] = convert_value(name, key, value, option.type)
    return out


def checked(cls: C) -> C:
    """Check and convert the options of every construction of ``cls`` (a pass class)
    through its :class:`OptionModel`: ``ConstantFold(max_growth="big")`` is the
    same :class:`OptionError` from Python as from pipeline text."""
    init = typing.cast(Any, cls).__init__
    signature = inspect.signature(init)
    name = cls.__dict__.get("name")
    name = name if isinstance(name, str) else cls.__name__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            bound = signature.bind(self, *args, **kwargs)
            kwargs = dict(bound.arguments)
            del kwargs[next(iter(signature.parameters))]
        init(self, **convert(name, cls, kwargs))

    cls.__init__ = __init__  # type: ignore[misc]
    return cls

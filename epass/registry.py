"""The pass registry: names to factories, built-ins by module path, plugins by entry point.

A name maps to a *factory*: a class or a function called with the pass's options as
keyword arguments, returning a pass. A function with a required positional
parameter cannot be a factory (options are keywords), so it is registered as the
pass itself, taking no options.

Built-ins are registered lazily by ``"module:attribute"``; third-party passes come
from the entry-point group ``epass.passes``. Nothing is imported until a pass is
used (or :func:`list_passes` is asked for its options), so a missing or broken
module only fails the name that needs it. :func:`pass_table` describes the built-ins
from :data:`BUILTIN_CATALOG` without importing them, or torch: ``epass passes``
starts at once.

Example::

    @register_pass("double-relu", description="Replace relu with relu twice")
    @attrs.define(eq=False)
    class DoubleRelu: ...

    pm = PassManager(["decompose", "double-relu"])
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import importlib
import importlib.metadata
import inspect
import math
import pkgutil
import re
import threading
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union, overload

import attrs

from epass.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    OptionError,
    PluginError,
    RegistryError,
    UnknownPassError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "OptionInfo",
    "PassEntry",
    "PluginError",
    "RegistryError",
    "UnknownPassError",
    "describe_pass",
    "format_value",
    "get_factory",
    "list_passes",
    "pass_names",
    "pass_table",
    "refresh_plugins",
    "register_pass",
    "unregister_pass",
]

ENTRY_POINT_GROUP = "epass.passes"
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*")
# Words the pipeline grammar gives a meaning of its own (inf and nan are numbers).
RESERVED = frozenset({"repeat", "fixpoint", "true", "false", "none", "inf", "nan"})

F = TypeVar("F", bound=Callable[..., Any])


BUILTINS: dict[str, str] = {
    "decompose": "epass.passes.decompose:Decompose",
    "lift-constants": "epass.passes.lift_constants:LiftConstants",
    "fold-constants": "epass.passes.constant_fold:ConstantFold",
    "dce": "epass.passes.dce:DeadCodeElimination",
    "cse": "epass.passes.cse:CSE",
    "remove-asserts": "epass.passes.remove_assertions:RemoveAssertions",
    "replace-ops": "epass.passes.replace_ops:ReplaceOps",
    "cast-dtype": "epass.passes.cast_dtype:CastDtype",
    "fuse-conv-bn": "epass.passes.fuse_conv_bn:FuseConvBN",
    "lower": "epass.passes.presets:lower",
    "cleanup": "epass.passes.presets:cleanup",
}
BUILTIN_DESCRIPTIONS = {
    "lower": "Preset: decompose, remove-asserts, fold-constants, cse, dce",
    "cleanup": "Preset: clean a program up without lowering it",
}
# What list_passes() reports for each built-in once loaded, so that `epass passes`
# imports neither the passes nor torch: (description, options as (name, type,
# default in pipeline text, required)). The passes stay the source of truth:
# tests/test_layers.py checks this table against them, and prints the table to
# paste here when a docstring or an option changes.
BUILTIN_CATALOG: dict[str, tuple[str, tuple[tuple[str, str, str | None, bool], ...]]] = {
    "cast-dtype": (
        "Convert floating parameters, buffers and constants to ``dtype`` (bf16 or fp16), "
        "so that the program computes in that dtype.",
        (
            ("dtype", "torch.dtype", "bfloat16", False),
            ("keep_io", "bool", "true", False),
        ),
    ),
    "cleanup": (
        "Preset: clean a program up without lowering it",
        (),
    ),
    "cse": (
        "Merge nodes that compute the same operator on the same inputs.",
        (("max_rewrites", "int | None", "none", False),),
    ),
    "dce": (
        "Remove nodes whose results are never used, and state inputs nothing reads.",
        (),
    ),
    "decompose": (
        "Lower the program with a decomposition table: the program "
        "``ExportedProgram.run_decompositions`` returns, usually much faster.",
        (
            ("table", "dict[Any, Callable[..., Any]] | None", "none", False),
            ("keep", "tuple[Any, ...]", "[]", False),
            ("coalesce", "bool", "false", False),
            ("method", "Method", '"auto"', False),
            ("check", "bool | None", "none", False),
            ("max_rewrites", "int | None", "none", False),
        ),
    ),
    "fold-constants": (
        "Evaluate every subgraph whose inputs are only parameters, buffers or constants "
        "and replace it with a new lifted constant.",
        (
            ("max_growth", "float", "1.0", False),
            ("fold_views", "bool", "false", False),
            ("max_rewrites", "int | None", "none", False),
        ),
    ),
    "fuse-conv-bn": (
        "Fold eval-mode BatchNorm into the convolution that feeds it.",
        (("max_rewrites", "int | None", "none", False),),
    ),
    "lift-constants": (
        "Lift tensor ``get_attr`` nodes to placeholders with ``CONSTANT_TENSOR`` specs.",
        (("fx", "Callable[[torch.fx.GraphModule], Any] | None", "none", False),),
    ),
    "lower": (
        "Preset: decompose, remove-asserts, fold-constants, cse, dce",
        (),
    ),
    "remove-asserts": (
        "Remove runtime assertion nodes (``aten._assert_scalar``, "
        "``aten._assert_tensor_metadata``, ``sym_constrain_range*``, the functional "
        "``_assert_async`` variants and their kin; see :data:`ASSERTION_OPS`).",
        (),
    ),
    "replace-ops": (
        "Replace operators by other operators or by traced Python functions, and rewrite "
        "subgraph patterns.",
        (
            ("ops", "dict[Any, Callable[..., Any]]", "{}", False),
            ("patterns", "tuple[tuple[Callable[..., Any], Callable[..., Any]], ...]", "[]", False),
            ("max_rewrites", "int | None", "none", False),
        ),
    ),
}


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
class PassEntry:
    """What :func:`list_passes` reports about one registered name.

    Attributes:
        name: the registry name.
        description: the first line of the factory's docstring, or the one given.
        source: the distribution that provides it (``"epass"`` for built-ins; the
            registering module for passes registered at run time).
        kind: ``"builtin"``, ``"plugin"`` or ``"user"``.
        target: ``"module:attribute"`` for lazy entries, else the factory's path.
        options: the options, when the factory could be inspected.
        error: why the entry cannot be loaded, or None.
    """

    name: str
    description: str
    source: str
    kind: str
    target: str
    options: tuple[OptionInfo, ...] = ()
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "kind": self.kind,
            "target": self.target,
            "options": [o.as_dict() for o in self.options],
            "error": self.error,
        }


@attrs.define
class _Entry:
    name: str
    source: str
    kind: str
    target: str
    description: str | None = None
    factory: Any = None  # loaded lazily from ``target`` when None
    is_pass: bool = False
    error: str | None = None  # a load error, kept so it is reported the same way each time
    conflict: tuple[str, ...] = ()  # other providers of this name


_lock = threading.RLock()
_entries: dict[str, _Entry] = {}
_plugins_loaded = False


def _init_builtins() -> None:
    for name, target in BUILTINS.items():
        _entries[name] = _Entry(
            name, "epass", "builtin", target, description=BUILTIN_DESCRIPTIONS.get(name)
        )


_init_builtins()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise RegistryError(
            f"invalid pass name {name!r}: use letters, digits and '_' in words joined by "
            "single '-' (kebab-case, such as 'fold-constants')"
        )
    if name in RESERVED:
        raise RegistryError(f"{name!r} is a reserved word of the pipeline grammar")


def _target_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}:{qualname}"


def _takes_ep(obj: Any) -> bool:
    """True when ``obj`` is a function pass (a required positional parameter), not a factory."""
    if isinstance(obj, type):
        return False
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        for p in sig.parameters.values()
    )


@overload
def register_pass(
    name: str, factory: None = None, *, description: str | None = None, replace: bool = False
) -> Callable[[F], F]: ...
@overload
def register_pass(
    name: str, factory: F, *, description: str | None = None, replace: bool = False
) -> F: ...
def register_pass(
    name: str,
    factory: Any = None,
    *,
    description: str | None = None,
    replace: bool = False,
) -> Any:
    """Register ``factory`` under ``name``; usable as a decorator.

    Args:
        name: a kebab-case name, such as ``"fold-constants"``.
        factory: a class or function called with the pass options as keyword
            arguments and returning a pass; or a function pass itself (one with a
            required positional parameter, the program), which takes no options.
        description: one line for ``epass passes`` (default: the docstring's first line).
        replace: allow replacing an existing registration of that name.

    Raises:
        RegistryError: the name is invalid, or already registered by another
            provider (the message names both).
    """
    if factory is None:

        def decorate(obj: F) -> F:
            register_pass(name, obj, description=description, replace=replace)
            return obj

        return decorate
    _check_name(name)
    if not callable(factory):
        raise RegistryError(f"cannot register {factory!r} as {name!r}: it is not callable")
    target = _target_of(factory)
    with _lock:
        _load_plugins()
        old = _entries.get(name)
        if old is not None and not replace and old.target != target:
            raise RegistryError(
                f"pass {name!r} is already registered by {old.source} ({old.target}); "
                f"cannot register {target} under the same name (pass replace=True to override)"
            )
        module = getattr(factory, "__module__", None) or "?"
        _entries[name] = _Entry(
            name,
            source=_distribution_of(module) or module,
            kind="user",
            target=target,
            description=description,
            factory=factory,
            is_pass=_takes_ep(factory),
        )
    return factory


def unregister_pass(name: str) -> None:
    """Remove a registration (built-in names come back with :func:`refresh_plugins`)."""
    with _lock:
        if _entries.pop(name, None) is None:
            raise _unknown(name)


def _distribution_of(module: str) -> str | None:
    top = module.split(".")[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top)
    except Exception:
        return None
    return dists[0] if dists else None


def refresh_plugins() -> None:
    """Forget loaded plugins and read the ``epass.passes`` entry points again.

    Call it after installing a plugin into a running interpreter. Passes
    registered with :func:`register_pass` at run time are kept.
    """
    global _plugins_loaded
    with _lock:
        for name in [n for n, e in _entries.items() if e.kind in ("plugin", "builtin")]:
            del _entries[name]
        for entry in _entries.values():
            entry.conflict = ()
        _init_builtins()
        _plugins_loaded = False
        importlib.invalidate_caches()
        _load_plugins()


def _load_plugins() -> None:
    """Read entry-point metadata (cheap: nothing is imported here)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken metadata directory must not break epass
        return
    for ep in eps:
        dist = ep.dist.name if ep.dist is not None else "?"
        entry = _Entry(ep.name, dist, "plugin", ep.value)
        try:
            _check_name(ep.name)
        except RegistryError as exc:
            entry.error = str(exc)
        old = _entries.get(ep.name)
        if old is not None:
            if (old.source, old.target) == (dist, ep.value):
                continue  # the same distribution seen twice on sys.path
            old.conflict = (*old.conflict, f"{dist} ({ep.value})")
            continue
        _entries[ep.name] = entry


def _unknown(name: str) -> UnknownPassError:
    return UnknownPassError(name, tuple(difflib.get_close_matches(name, _entries, n=3)))


def _lookup(name: str) -> _Entry:
    with _lock:
        _load_plugins()
        entry = _entries.get(name)
        if entry is None:
            raise _unknown(name)
        if entry.conflict:
            providers = [f"{entry.source} ({entry.target})", *entry.conflict]
            raise PluginError(
                f"pass {name!r} is provided by more than one package: "
                f"{' and '.join(providers)}; uninstall one of them"
            )
        if entry.error is not None:
            raise PluginError(entry.error)
        if entry.factory is None:
            try:
                entry.factory = _import(entry.target)
            except Exception as exc:
                what = "plugin" if entry.kind == "plugin" else "pass"
                provider = f" from {entry.source}" if entry.kind == "plugin" else ""
                entry.error = (
                    f"{what} {name!r}{provider} ({entry.target}) failed to load: "
                    f"{type(exc).__name__}: {exc}"
                )
                raise PluginError(entry.error) from exc
            entry.is_pass = _takes_ep(entry.factory)
        return entry


def _import(target: str) -> Any:
    obj = pkgutil.resolve_name(target.strip())
    if not callable(obj):
        raise ArgumentTypeError(f"{target} is {type(obj).__name__}, not a pass factory")
    return obj


def pass_names() -> list[str]:
    """Every registered name, sorted (nothing is imported)."""
    with _lock:
        _load_plugins()
        return sorted(_entries)


def get_factory(name: str) -> Any:
    """The loaded factory (or function pass) registered under ``name``."""
    return _lookup(name).factory


def option_infos(factory: Any) -> tuple[OptionInfo, ...]:
    """The options a factory takes: attrs fields with ``init``, or keyword parameters."""
    if isinstance(factory, type) and attrs.has(factory):
        out = []
        for f in attrs.fields(factory):
            if not f.init:
                continue
            default = f.default
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory(None) if default.takes_self else default.factory()
            required = default is attrs.NOTHING
            out.append(
                OptionInfo(
                    getattr(f, "alias", None) or f.name.lstrip("_"),
                    _type_text(f.type),
                    None if required else default,
                    required,
                )
            )
        return tuple(out)
    if _takes_ep(factory):
        return ()
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return ()
    return tuple(
        OptionInfo(
            p.name,
            _type_text(p.annotation) if p.annotation is not p.empty else "",
            None if p.default is p.empty else p.default,
            p.default is p.empty,
        )
        for p in sig.parameters.values()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def _type_text(t: Any) -> str:
    if t is None:
        return ""
    if isinstance(t, str):
        return t
    return str(getattr(t, "__name__", t)).replace("typing.", "")


def _description(entry: _Entry) -> str:
    if entry.description:
        return entry.description
    doc = inspect.getdoc(entry.factory) if entry.factory is not None else None
    if not doc:
        return ""
    # The first paragraph, on one line (summaries often wrap).
    return " ".join(doc.strip().split("\n\n")[0].split())


def describe_pass(name: str) -> PassEntry:
    """The :class:`PassEntry` for one name; load errors are reported in ``error``."""
    error = None
    try:
        entry = _lookup(name)
    except UnknownPassError:
        raise
    except RegistryError as exc:
        error = str(exc)
        entry = _entries[name]
    options = option_infos(entry.factory) if entry.factory is not None else ()
    return PassEntry(
        name=entry.name,
        description=_description(entry),
        source=entry.source,
        kind=entry.kind,
        target=entry.target,
        options=options,
        error=error,
    )


def pass_table() -> list[dict[str, Any]]:
    """Every registered pass as ``PassEntry.as_dict()`` describes it, sorted by name.

    Built-ins come from :data:`BUILTIN_CATALOG` without being imported; other
    entries are loaded as :func:`list_passes` loads them.
    """
    rows = []
    for name in pass_names():
        with _lock:
            entry = _entries.get(name)
        known = BUILTIN_CATALOG.get(name)
        if entry is None or entry.kind != "builtin" or known is None:
            rows.append(describe_pass(name).as_dict())
            continue
        description, options = known
        rows.append(
            {
                "name": name,
                "description": description,
                "source": entry.source,
                "kind": entry.kind,
                "target": entry.target,
                "options": [
                    {"name": n, "type": t, "default": d, "required": r} for n, t, d, r in options
                ],
                "error": entry.error,
            }
        )
    return rows


def list_passes() -> list[PassEntry]:
    """Every registered pass with its description, source distribution and options.

    Loads each factory to read its options; one that fails to load is listed
    with ``error`` set, and the others are unaffected.
    """
    return [describe_pass(name) for name in pass_names()]


def reason(exc: BaseException) -> str:
    """An exception's message: its first argument when that is the message of a
    multi-argument error (attrs validators raise ``ValueError(message, attribute,
    options, value)``, whose ``str`` is the repr of the whole tuple)."""
    if len(exc.args) > 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def instantiate(
    name: str, options: Mapping[str, Any], *, declared_only: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Call the factory registered as ``name`` with ``options``; return what it
    made (the registered function itself for a function pass) and the options as
    converted (:func:`convert_options`), which recreate it.

    With ``declared_only`` (pipeline text), only the options the factory names
    (:func:`option_infos`) are accepted: a ``**kwargs`` catch-all, such as the
    manager settings a preset forwards, is out of the text's reach.

    Raises:
        UnknownPassError / PluginError: the name does not resolve.
        TypeError / ValueError: the options do not fit the factory.
    """
    entry = _lookup(name)
    options = dict(options)
    if entry.is_pass:
        if options:
            raise ArgumentTypeError(f"pass {name!r} takes no options, got {sorted(options)}")
        obj = entry.factory
    else:
        known = option_infos(entry.factory)
        names = [o.name for o in known]
        takes_any = _takes_var_keywords(entry.factory) and not declared_only
        for key in options:
            if not takes_any and key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                valid = f" (options: {', '.join(names)})" if names and not close else ""
                if not names and declared_only:
                    valid = f" ({name!r} takes no options in pipeline text)"
                raise ArgumentTypeError(f"no option {key!r}{hint}{valid}")
        options = convert_options(name, entry.factory, options)
        obj = entry.factory(**options)
    return obj, options


# --- option types ------------------------------------------------------------------
# A factory's annotations say what each option takes. Values are checked and
# converted before the factory is called, so a wrong type is refused when the
# pipeline is built, naming the option, and never reaches a program.


class _Mismatch(Exception):
    """``value`` does not fit the annotation (internal to the option conversion)."""


_NONE_TYPE = type(None)


def option_types(factory: Any) -> dict[str, Any]:
    """Each option's declared type, resolved; options without one are left out.

    For an attrs class this is what its ``__init__`` takes: a field's converter's
    parameter type when it has a converter, else the field's type.
    """
    out: dict[str, Any] = {}
    if isinstance(factory, type) and attrs.has(factory):
        try:
            hints = typing.get_type_hints(factory)
        except Exception:
            hints = {}
        for f in attrs.fields(factory):
            if not f.init:
                continue
            name = getattr(f, "alias", None) or f.name.lstrip("_")
            converter = f.converter
            if converter is not None:
                out[name] = _first_parameter_type(converter)
            elif f.name in hints:
                out[name] = hints[f.name]
        return {k: v for k, v in out.items() if v is not None}
    try:
        hints = typing.get_type_hints(factory)
    except Exception:
        return {}
    return {k: v for k, v in hints.items() if k != "return"}


def _first_parameter_type(converter: Any) -> Any:
    fn = getattr(converter, "converter", converter)  # attrs.Converter wraps the callable
    try:
        params = list(inspect.signature(fn).parameters.values())
        hints = typing.get_type_hints(fn)
    except Exception:
        return None
    return hints.get(params[0].name) if params else None


def convert_options(name: str, factory: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked against ``factory``'s annotations and converted.

    Conversions: an int where a float is declared becomes a float; an operator
    packet becomes its ``default`` overload where an overload is declared; a
    single value where a list is declared becomes a one-item list; a dtype or
    enum member may be given by name.

    Raises:
        OptionError: a value does not fit its option's declared type.
    """
    types_ = option_types(factory)
    out = dict(options)
    for key, value in options.items():
        tp = types_.get(key)
        if tp is None:
            continue
        try:
            out[key] = _convert(value, tp)
        except _Mismatch:
            expected = annotation_text(tp)
            try:
                shown = format_value(value)
            except ValueError:
                shown = repr(value)
            text = f"{name}({key}={shown})"
            raise OptionError(
                f"option {key!r} of pass {name!r} takes {expected}, "
                f"got {shown} ({type(value).__name__})",
                text,
                len(name) + len(key) + 2,
                pass_name=name,
                option=key,
                expected=expected,
            ) from None
    return out


def _convert(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, or raise :class:`_Mismatch`. Unknown annotations
    (``Any``, protocols, generics this does not understand) accept anything."""
    # Imported here: the registry answers ``epass passes`` and --help without torch.
    import torch

    from epass import _program

    if tp is Any or tp is object:
        return value
    if tp is None or tp is _NONE_TYPE:
        if value is None:
            return None
        raise _Mismatch
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or origin is types.UnionType:
        if value is None and _NONE_TYPE in args:
            return None
        for arm in args:  # an exact fit first: 1 stays an int in ``int | float``
            if isinstance(arm, type) and type(value) is arm:
                return value
        for arm in args:
            if arm is _NONE_TYPE:
                continue
            try:
                return _convert(value, arm)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        for allowed in args:
            if type(allowed) is type(value) and allowed == value:
                return allowed
        raise _Mismatch
    if origin in (list, tuple, set, frozenset, Sequence, Iterable, typing.Collection):
        return _convert_collection(value, origin, args)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch
        key_tp, value_tp = args if len(args) == 2 else (Any, Any)
        return {_convert(k, key_tp): _convert(v, value_tp) for k, v in value.items()}
    if origin is not None:
        if _is_abc(origin, "Callable") and not callable(value):
            raise _Mismatch
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if tp is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str):
            found = vars(torch).get(value.removeprefix("torch."))
            if isinstance(found, torch.dtype):
                return found
        raise _Mismatch
    if tp is _program.OpOverload:
        overload = _program.overload_of(value)
        if overload is None:
            raise _Mismatch
        return overload
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, str):
            for member in tp:
                if value in (member.name, member.name.lower()) or member.value == value:
                    return member
        with contextlib.suppress(ValueError, TypeError):
            return tp(value)
        raise _Mismatch
    if tp is Callable or _is_abc(tp, "Callable"):
        if callable(value):
            return value
        raise _Mismatch
    if isinstance(tp, type) and not getattr(tp, "_is_protocol", False):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    return value


def annotation_text(tp: Any) -> str:
    """A declared option type as a reader would write it: ``float``,
    ``list[operator]``, ``"fast" | "exact"``, ``dtype | none``."""
    import torch

    from epass import _program

    if tp is None or tp is _NONE_TYPE:
        return "none"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return " | ".join(format_value(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(annotation_text(a) for a in args)
    if tp is _program.OpOverload:
        return "operator"
    if tp is torch.dtype:
        return "dtype"
    if _is_abc(origin or tp, "Callable"):
        return "function"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else annotation_text(a) for a in args)
        return f"{name}[{inner}]" if args else name
    return str(getattr(tp, "__name__", tp)).replace("typing.", "")


def _is_abc(tp: Any, name: str) -> bool:
    return getattr(tp, "__module__", None) == "collections.abc" and (
        getattr(tp, "__name__", None) == name
    )


def _convert_collection(value: Any, origin: Any, args: tuple[Any, ...]) -> Any:
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _Mismatch
        return tuple(_convert(v, t) for v, t in zip(value, args, strict=True))
    item_tp = args[0] if args else Any
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_convert(v, item_tp) for v in value]
    elif isinstance(value, (str, bytes, Mapping)) and item_tp not in (str, Any):
        raise _Mismatch
    else:
        items = [_convert(value, item_tp)]  # one value where a list is declared
    if origin is tuple:
        return tuple(items)
    if origin in (set, frozenset):
        return origin(items)
    return items


def _takes_var_keywords(factory: Any) -> bool:
    if isinstance(factory, type) and attrs.has(factory):
        return False
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def spec_of(p: Any, name: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """The registry name and options that recreate the attrs pass ``p`` from its
    fields (only options that differ from the default are kept), or None when ``p``
    is not an instance of a registered attrs class. ``name``, the pass's own name,
    is tried first when its class is registered under several names.

    How other passes were made is their :class:`~epass.protocol.PassModel`'s
    ``origin``.
    """
    cls = type(p)
    if attrs.has(cls) and not isinstance(p, type):
        name = _registered_name_of_class(cls, name)
        if name is not None:
            options: dict[str, Any] = {}
            fields = [f for f in attrs.fields(cls) if f.init]
            for info, field in zip(option_infos(cls), fields, strict=True):
                value = getattr(p, field.name)
                if not info.required and _same(value, info.default):
                    continue
                options[info.name] = value
            return name, options
    return None


def _registered_name_of_class(cls: type, name: str | None) -> str | None:
    target = _target_of(cls)
    with _lock:
        _load_plugins()
        candidates = [name, *list(_entries)]
        for name in candidates:
            entry = _entries.get(name) if isinstance(name, str) else None
            if entry is None:
                continue
            if entry.factory is cls or (entry.factory is None and entry.target == target):
                return name
    return None


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b) or (
            isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and list(a) == list(b)
        )
    except Exception:
        return False


# --- option values as pipeline text ----------------------------------------------
# The printing half of the pipeline grammar's values: option defaults are described
# in this form, and epass.pipeline prints pipelines with it.


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
    # torch is imported where it is needed: `epass passes` reads the registry without it.
    import torch

    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return (
            "{" + ", ".join(f"{format_value(k)}: {format_value(v)}" for k, v in value.items()) + "}"
        )
    op = operator_text(value)
    if op is not None:
        return op
    raise ArgumentValueError(f"{value!r} ({type(value).__name__}) has no textual form")


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

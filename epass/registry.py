"""The pass registry: names to factories, built-ins by module path, plugins by entry point.

A name maps to a *factory*: a class or a function called with the pass's options as
keyword arguments, returning a pass. A function with a required positional
parameter cannot be a factory (options are keywords), so it is registered as the
pass itself, taking no options.

Built-ins are registered lazily by ``"module:attribute"`` (:data:`BUILTIN_TARGETS`, read
from ``epass._catalog``, which ``python -m epass.passes`` writes from the one table
of built-ins, :data:`epass.passes.BUILTINS`); third-party passes come from the
entry-point group ``epass.passes``. Nothing is imported until a pass is used (or
:func:`list_passes` is asked for its options), so a missing or broken module only
fails the name that needs it. :func:`pass_table` describes the built-ins from the
catalog without importing them, or torch: ``epass passes`` starts at once, and
:func:`check` reads pipeline text against it before torch loads.

The registry turns one :class:`~epass.pipeline.PassSpec` into one pass
(:func:`create`) and one pass back into a spec (:func:`spec_of`); whole pipelines
are built and printed by :mod:`epass.building`, option types and their checks are
:mod:`epass.options`.

One concept: a name and the pass it stands for, both ways: names to factories (the
built-ins, plugins and passes registered at run time), one spec to one pass, one
pass back to its spec.

Example::

    @register_pass("double-relu", description="Replace relu with relu twice")
    @attrs.define(eq=False)
    class DoubleRelu: ...

    pm = PassManager(["decompose", "double-relu"])
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
import pkgutil
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

import attrs

from epass import options as _options
from epass._catalog import BUILTIN_CATALOG, BUILTIN_TARGETS
from epass.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    OptionError,
    PipelineError,
    PluginError,
    RegistryError,
    UnknownPassError,
)
from epass.options import OptionInfo
from epass.pipeline import NAME_PATTERN, RESERVED, PassSpec, parse, walk

__all__ = [
    "BUILTIN_CATALOG",
    "BUILTIN_TARGETS",
    "ENTRY_POINT_GROUP",
    "OptionInfo",
    "PassEntry",
    "PluginError",
    "RegistryError",
    "UnknownPassError",
    "check",
    "check_text",
    "create",
    "describe_pass",
    "description_of",
    "get_factory",
    "list_passes",
    "option_infos",
    "pass_names",
    "pass_table",
    "refresh_plugins",
    "register_pass",
    "spec_of",
    "unregister_pass",
]

ENTRY_POINT_GROUP = "epass.passes"

F = TypeVar("F", bound=Callable[..., Any])


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
    for name, target in BUILTIN_TARGETS.items():
        _entries[name] = _Entry(name, "epass", "builtin", target)


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
    """The options a factory takes (:func:`epass.options.model_of`); none for a
    function pass."""
    if _takes_ep(factory):
        return ()
    return tuple(o.info for o in _options.model_of(factory).options)


def description_of(factory: Any) -> str:
    """A factory's line in ``epass passes``: its docstring's first paragraph, on one line."""
    doc = inspect.getdoc(factory)
    if not doc:
        return ""
    # The whole paragraph: first lines often wrap.
    return " ".join(doc.strip().split("\n\n")[0].split())


def _description(entry: _Entry) -> str:
    if entry.description:
        return entry.description
    return description_of(entry.factory) if entry.factory is not None else ""


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


# --- one spec, one pass -------------------------------------------------------------


def create(spec: PassSpec, *, text: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The pass ``spec`` names, made by its factory with its options checked and
    converted (:func:`epass.options.convert`) and labelled with its name and
    origin; and those options, which make it again.

    With ``text``, the pipeline text ``spec`` was parsed from, only the options the
    factory names are taken, and every error is a :class:`~epass.PipelineError`
    (an :class:`~epass.OptionError` for a value of the wrong type) pointing into
    ``text``. Without it (Python keywords) a factory's ``**kwargs`` takes any
    keyword, and errors are ``TypeError`` / ``ValueError`` naming the pass.

    Raises:
        UnknownPassError / PluginError: the name does not resolve (without ``text``).
    """
    from epass.protocol import label  # torch: the registry itself starts without it

    try:
        obj, converted = _make(spec.name, dict(spec.options), text_only=text is not None)
    except RegistryError as exc:
        if text is None:
            raise
        cause = None if isinstance(exc, UnknownPassError) else exc
        raise _located(exc, spec, text) from cause
    except OptionError as exc:
        if text is None:
            raise
        raise _located(exc, spec, text) from None
    except (TypeError, ValueError) as exc:
        if text is not None:
            raise _located(exc, spec, text) from exc
        error = ArgumentTypeError if isinstance(exc, TypeError) else ArgumentValueError
        raise error(f"bad options for pass {spec.name!r}: {reason(exc)}") from exc
    # Outside the try: a pass whose name raises is not a matter of options.
    return label(obj, spec.name, converted), converted


def _make(name: str, given: dict[str, Any], *, text_only: bool) -> tuple[Any, dict[str, Any]]:
    entry = _lookup(name)
    if entry.is_pass:
        if given:
            raise ArgumentTypeError(f"pass {name!r} takes no options, got {sorted(given)}")
        return entry.factory, given
    converted = _options.convert(name, entry.factory, given, text_only=text_only)
    return entry.factory(**converted), converted


def _located(exc: Exception, spec: PassSpec, text: str) -> PipelineError:
    """``exc``, raised making ``spec``, as an error pointing into ``text``."""
    if isinstance(exc, UnknownPassError):
        hint = f"; did you mean {exc.suggestions[0]!r}?" if exc.suggestions else ""
        return PipelineError(f"unknown pass {spec.name!r}", text, spec.pos, hint)
    if isinstance(exc, RegistryError):
        return PipelineError(f"cannot load pass {spec.name!r}", text, spec.pos, f": {exc}")
    if isinstance(exc, OptionError):
        return OptionError(
            exc.message,
            text,
            spec.option_at(exc.option),
            pass_name=exc.pass_name,
            option=exc.option,
            expected=exc.expected,
        )
    message = reason(exc)
    pos = spec.pos
    for key, _ in spec.options:
        if f"option {key!r}" in message:
            pos = spec.option_at(key, value=False)
    return PipelineError(f"bad options for pass {spec.name!r}", text, pos, f": {message}")


def check_text(text: str) -> None:
    """Check pipeline text as far as can be done without importing a pass or torch:
    its syntax, that every name is registered, and that a built-in's options are
    ones it takes, of the types :data:`BUILTIN_CATALOG` gives. The errors are the
    :class:`~epass.PipelineError` s building the pipeline would raise; what needs
    torch (dtype and operator words) or a plugin's code is checked when it is built.
    """
    for spec in walk(parse(text, resolve=False)):
        check(spec, text)


def check(spec: PassSpec, text: str) -> None:
    """:func:`check_text` for one spec of ``text`` (parsed with ``resolve=False``)."""
    with _lock:
        _load_plugins()
        entry = _entries.get(spec.name)
    if entry is None:
        raise _located(_unknown(spec.name), spec, text)
    known = BUILTIN_CATALOG.get(spec.name)
    if entry.kind != "builtin" or known is None:
        return
    declared = {row[0]: row[1] for row in known[1]}
    try:
        _options.check_names(spec.name, list(declared), dict(spec.options), text_only=True)
        for key, value in spec.options:
            if declared[key]:
                _options.convert_value(spec.name, key, value, _catalog_type(declared[key]))
    except (TypeError, ValueError) as exc:
        raise _located(exc, spec, text) from None


@functools.cache
def _catalog_type(text: str) -> _options.OptionType:
    return _options.parse_type(text)


def spec_of(
    p: Any, name: str | None = None, origin: tuple[str, Mapping[str, Any]] | None = None
) -> PassSpec | None:
    """The :class:`~epass.pipeline.PassSpec` that makes ``p`` again: an instance of a
    registered attrs class from its fields (options at their defaults left out;
    ``name``, the pass's own, is tried first when its class is registered under
    several names), else ``origin``, the name and options it was made from; None
    when neither is known."""
    cls = type(p)
    if attrs.has(cls) and not isinstance(p, type):
        registered = _registered_name_of_class(cls, name)
        if registered is not None:
            options: dict[str, Any] = {}
            fields = [f for f in attrs.fields(cls) if f.init]
            for info, field in zip(option_infos(cls), fields, strict=True):
                value = getattr(p, field.name)
                if not info.required and _same(value, info.default):
                    continue
                options[info.name] = value
            return PassSpec(registered, tuple(options.items()))
    if origin is not None:
        return PassSpec(origin[0], tuple(dict(origin[1]).items()))
    return None


def declared_options(name: str) -> list[str]:
    """The options pipeline text can set on the pass registered as ``name``."""
    return [o.name for o in option_infos(get_factory(name))]


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

"""Arguments as the dispatcher hands them to Python, the keys of templates, and the
fresh fake inputs a template is traced on (built from what its key names)."""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch.export import ExportedProgram

from epass import _operators
from epass._decomp import identity, shapes
from epass._decomp.safety import Fallback
from epass._torch import fakes
from epass._torch.programs import pytree

__all__ = [
    "DiskKey",
    "const_key",
    "describe_val",
    "detected_fake_mode",
    "fake_mode_of",
    "fresh_fake",
    "fresh_fakes",
    "memory_key",
    "normalize",
    "sym_key",
    "template_key",
    "tensor_key",
    "values_of",
]


def _is_default(value: Any, arg: Any) -> bool:
    if not arg.has_default_value():
        return False
    default = arg.default_value
    if isinstance(value, (torch.fx.Node, torch.SymInt, torch.SymFloat)):
        return False
    if type(value) is not type(default) and not (
        isinstance(value, (list, tuple)) and isinstance(default, (list, tuple))
    ):
        if not (value is None or default is None) and isinstance(value, (int, float)):
            return False
        if value is None or default is None:
            return value is default
    try:
        return (
            bool(value == default)
            if not isinstance(value, (list, tuple))
            else list(value) == list(default)
        )
    except Exception:
        return False


def normalize(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``(args, kwargs)`` the way the dispatcher passes them to a Python mode:
    positional arguments up to the last one that is not its default, keyword-only
    arguments only where they are not their default."""
    schema = _operators.op_schema(op)
    assert schema is not None  # only operator overloads are normalized
    bound: list[Any] = []
    params = schema.arguments
    _check_binds(op, params, args, kwargs)
    missing = object()
    for i, param in enumerate(params):
        if i < len(args):
            bound.append(args[i])
        elif param.name in kwargs:
            bound.append(kwargs[param.name])
        elif param.has_default_value():
            bound.append(param.default_value)
        else:
            bound.append(missing)
    if any(b is missing for b in bound):
        raise Fallback(f"cannot bind the arguments of {op}")
    positional = [i for i, p in enumerate(params) if not p.kwarg_only]
    last = -1
    for i in positional:
        if not _is_default(bound[i], params[i]):
            last = i
    new_args = tuple(bound[i] for i in positional if i <= last)
    new_kwargs = {
        p.name: bound[i]
        for i, p in enumerate(params)
        if p.kwarg_only and not _is_default(bound[i], p)
    }
    return new_args, new_kwargs


def _check_binds(op: Any, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`Fallback` where the node's arguments do not bind to the schema (the
    retrace, calling the operator, raises the dispatcher's error)."""
    positional = [p.name for p in params if not p.kwarg_only]
    if len(args) > len(positional):
        raise Fallback(
            f"a call of {op} with {len(args)} positional arguments, where it takes "
            f"{len(positional)}"
        )
    names = {p.name for p in params}
    for name in kwargs:
        if name not in names or name in positional[: len(args)]:
            raise Fallback(f"a call of {op} with an argument {name!r} it does not take there")


def sym_key(value: Any) -> Any:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", type(value).__name__, shapes.expr_text(value.node.expr))
    return value


# Constants are keyed by exact type and, for floats, by bit pattern: ``True == 1 == 1.0``
# hash alike, ``-0.0 == 0.0``, and NaN equals nothing (each NaN payload is its own key).
_BY_VALUE = (bool, int, str, type(None))
_BY_NAME = (torch.dtype, torch.layout, torch.memory_format)


def const_key(value: Any) -> Any:
    """The template key of a constant argument (or a size); equal keys are the same
    constant to every decomposition.

    Raises:
        Fallback: for a constant of a type the key cannot tell apart.
    """
    kind = type(value)
    if kind in _BY_VALUE:
        return (kind.__name__, value)
    if kind is float:
        return ("float", struct.pack("<d", value))
    if kind is complex:
        return ("complex", struct.pack("<dd", value.real, value.imag))
    if kind in _BY_NAME:
        return (kind.__name__, str(value))
    if kind is torch.device:
        return ("device", value.type, value.index)
    if kind in (torch.SymInt, torch.SymFloat, torch.SymBool):
        return sym_key(value)
    raise Fallback(f"a constant argument of type {kind.__name__}")


def tensor_key(t: torch.Tensor, requires_grad: bool) -> Any:
    """The key of a tensor input as a decomposition sees it in the retrace: every
    property :func:`fresh_fake` gives the input a template is traced on (and a test
    checks that it gives them all)."""
    return (
        "tensor",
        type(t).__name__,
        tuple(const_key(s) for s in t.shape),
        tuple(const_key(s) for s in t.stride()),
        const_key(t.storage_offset()),
        const_key(t.dtype),
        const_key(t.device),
        const_key(t.layout),
        requires_grad,
        t.is_conj(),
        t.is_neg(),
    )


def fresh_fake(fake_mode: Any, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new fake tensor with the properties :func:`tensor_key` names.

    make_fx maps tensors to placeholders by identity: each input its own object."""
    if t.layout != torch.strided or t.is_conj() or t.is_neg():
        raise Fallback(f"an input of layout {t.layout} or with a conjugate or negative bit")
    with fake_mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        if t.storage_offset() != 0:
            base = torch.empty(
                t.storage_offset() + out.untyped_storage().nbytes() // t.element_size(),
                dtype=t.dtype,
                device=t.device,
            )
            out = base.as_strided(t.shape, t.stride(), t.storage_offset())
        if requires_grad:
            # A leaf that requires grad, as the retrace's fake parameters are (torch's
            # matmul, for one, takes another path for them).
            out = out.detach().requires_grad_(True)
    return out


def fresh_fakes(fake_mode: Any, values: Iterable[Any], grads: Iterable[bool]) -> list[Any]:
    return [
        fresh_fake(fake_mode, v, g) if isinstance(v, torch.Tensor) else v
        for v, g in zip(values, grads, strict=True)
    ]


def requires_grad(node: torch.fx.Node, grads: frozenset[str]) -> bool:
    """Whether ``node``'s value requires grad in the retrace, which computes under
    ``no_grad`` from the placeholders ``grads`` names: a view of such a placeholder
    (through any chain of views, items of a split included) still does, every other
    computed value does not (``detach`` made a view that does not)."""
    while node.op == "call_function":
        target = node.target
        if target is operator.getitem or (
            target is not torch.ops.aten.detach.default and _operators.is_view_op(target)
        ):
            source = node.args[0] if node.args else None
            if not isinstance(source, torch.fx.Node):
                return False
            node = source
            continue
        return False
    return node.op == "placeholder" and node.name in grads


def template_key(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], grads: frozenset[str]
) -> tuple[str, tuple[Any, ...], list[torch.fx.Node], list[bool]]:
    """The key of a call's template (its argument structure and each argument's key),
    its input nodes, and whether each input requires grad in the retrace."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    inputs: list[torch.fx.Node] = []
    flags: list[bool] = []
    key_parts: list[Any] = []
    for a in flat:
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            grad = requires_grad(a, grads)
            inputs.append(a)
            flags.append(grad)
            key_parts.append(tensor_key(v, grad) if isinstance(v, torch.Tensor) else const_key(v))
        else:
            key_parts.append(const_key(a))
    return str(spec), tuple(key_parts), inputs, flags


def memory_key(
    op: Any, spec: str, parts: tuple[Any, ...], name: identity.CacheName, fake_mode: Any
) -> Any:
    # Template values are fake tensors of one program's fake mode (and its symbols):
    # the mode is part of the key (last), and the cache keeps it alive while the
    # entry lives.
    return (op, spec, parts, name.table, name.settings, fake_mode)


@attrs.frozen(eq=False)
class DiskKey:
    """A template's key on disk (JSON data) and, for a symbolic template, its symbols
    by position, which its stored values are written in."""

    data: dict[str, Any]
    names: shapes.Renaming | None = None


def values_of(arg: Any) -> Any:
    return torch.fx.node.map_arg(arg, lambda n: n.meta["val"])


def detected_fake_mode(ep: ExportedProgram) -> Any:
    """The fake mode of the program's tensor inputs (None: it has none)."""
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
    return fakes.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def fake_mode_of(ep: ExportedProgram) -> Any:
    mode = detected_fake_mode(ep)
    if mode is None:
        raise Fallback("no fake tensor mode on the inputs")
    return mode


def describe_val(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(v).__name__, shapes.expr_text(v.node.expr))
    if isinstance(v, (list, tuple)):
        return tuple(describe_val(x) for x in v)
    return (type(v).__name__, v if isinstance(v, (int, float, bool, str, type(None))) else "?")

"""Operator predicates: what kind of operator a node's target is, and what its schema
says (a view, a write into an argument)."""

from __future__ import annotations

from typing import Any

import torch

from epass._torch import operators

__all__ = [
    "OpOverload",
    "is_higher_order",
    "is_mutable_op",
    "is_op_overload",
    "is_op_packet",
    "is_operator",
    "is_view_op",
    "op_schema",
    "overload_of",
]

# The type of an operator overload, for annotations such as a pass option's.
OpOverload = operators.OpOverload


def op_schema(target: Any) -> torch.FunctionSchema | None:
    """The schema of an ATen operator overload (``OpOverload._schema``), or None for
    other call targets (Python functions, higher-order operators, packets)."""
    if not isinstance(target, OpOverload):
        return None
    return operators.function_schema(target)


def is_op_overload(value: Any) -> bool:
    """True for an ATen-style operator overload (``torch._ops.OpOverload``), such as
    ``torch.ops.aten.relu.default``."""
    return isinstance(value, OpOverload)


def is_op_packet(value: Any) -> bool:
    """True for an operator packet (``torch._ops.OpOverloadPacket``), such as
    ``torch.ops.aten.relu``."""
    return isinstance(value, operators.OpOverloadPacket)


def overload_of(value: Any) -> Any:
    """``value`` as an operator overload: an overload itself, a packet's ``default``
    overload (``aten.relu`` -> ``aten.relu.default``), or None."""
    if isinstance(value, OpOverload):
        return value
    if isinstance(value, operators.OpOverloadPacket) and "default" in operators.op_overloads(
        value, names=True
    ):
        return value.default
    return None


def is_higher_order(value: Any) -> bool:
    """True for a higher-order operator (``torch._ops.HigherOrderOperator``), such as
    ``torch.ops.higher_order.cond``."""
    return isinstance(value, operators.HigherOrderOperator)


def is_operator(value: Any) -> bool:
    """True for any torch operator object (``torch._ops.OperatorBase``): ATen
    overloads and higher-order operators, the keys of a decomposition table."""
    return isinstance(value, operators.OperatorBase)


def is_view_op(target: Any) -> bool:
    """Whether ``target`` is a view operator: an operator overload that writes nothing
    and returns an alias of an argument (``view``, ``t``, ``split``...)."""
    schema = op_schema(target)
    return (
        schema is not None
        and not schema.is_mutable
        and any(r.alias_info is not None for r in schema.returns)
    )


def is_mutable_op(op: Any) -> bool:
    """Whether the operator's schema writes into one of its arguments."""
    return bool(operators.function_schema(op).is_mutable)

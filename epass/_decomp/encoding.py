"""A template graph as JSON data and back, for the disk cache.

Stdlib only at import, like the disk cache. Operators are written and looked up by name
among ``torch.ops.aten`` / ``torch.ops.prims`` only, plain functions among a fixed
list, values by tag. Nothing in an entry is ever imported, unpickled or evaluated.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["Unrepresentable", "decode", "encode", "resolve_op"]


# Plain functions a template may call, by name. Each is pure arithmetic on sizes or
# indexing; anything else (builtins.getattr, operator.call, ...) is refused.
_OPERATOR_NAMES = frozenset(
    [
        "abs",
        "add",
        "and_",
        "eq",
        "floordiv",
        "ge",
        "getitem",
        "gt",
        "invert",
        "le",
        "lshift",
        "lt",
        "mod",
        "mul",
        "ne",
        "neg",
        "not_",
        "or_",
        "pos",
        "pow",
        "rshift",
        "sub",
        "truediv",
        "truth",
        "xor",
    ]
)
_MATH_NAMES = frozenset(
    [
        "ceil",
        "floor",
        "trunc",
        "sqrt",
        "exp",
        "log",
        "log2",
        "log10",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "tanh",
        "sinh",
        "cosh",
        "fabs",
        "isnan",
        "isinf",
        "isfinite",
    ]
)
_TORCH_SYM_NAMES = frozenset(
    ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OP_NAMESPACES = ("aten", "prims")


class Unrepresentable(Exception):
    """A template (or a table) that cannot be written as data; it stays in memory."""


def _function_name(target: Any) -> str:
    import math
    import operator

    import torch

    for module, names, label in (
        (operator, _OPERATOR_NAMES, "operator"),
        (math, _MATH_NAMES, "math"),
        (torch, _TORCH_SYM_NAMES, "torch"),
    ):
        name = getattr(target, "__name__", None)
        if name in names and getattr(module, name, None) is target:
            return f"{label}.{name}"
    raise Unrepresentable(f"call target {target!r}")


def _op_name(op: Any) -> str:
    from epass._torch import operators

    if not isinstance(op, operators.OpOverload) or op.namespace not in _OP_NAMESPACES:
        raise Unrepresentable(f"operator {op!r}")
    name = str(op)  # "aten.add.Tensor"; resolve_op reads it back
    if name.count(".") != 2:
        raise Unrepresentable(f"operator {op!r}")
    return name


def resolve_op(name: Any) -> Any:
    """The ATen or prims operator ``ns.op.overload``, found by attribute lookup only."""
    import torch

    from epass._torch import operators

    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or parts[0] not in _OP_NAMESPACES or not all(map(_NAME.match, parts)):
        raise ValueError(f"names no ATen operator ({name!r:.80})")
    packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
    op = getattr(packet, parts[2], None) if packet is not None else None
    if not isinstance(op, operators.OpOverload):
        raise ValueError(f"names an unknown operator {name!r:.80}")
    schema = operators.function_schema(op)
    if schema.is_mutable:
        raise ValueError(f"names a mutating operator {name!r:.80}")
    if not schema.returns:
        # aten.save, aten._print, the assertions: called for their effect, never in a
        # template (a trace records no node for them)
        raise ValueError(f"names an operator without results {name!r:.80}")
    return op


def _resolve_target(name: Any) -> Any:
    import math
    import operator

    import torch

    if not isinstance(name, str):
        raise ValueError("has a call target that is not a name")
    label, _, attr = name.partition(".")
    allowed = {"operator": (operator, _OPERATOR_NAMES), "math": (math, _MATH_NAMES)}
    allowed["torch"] = (torch, _TORCH_SYM_NAMES)
    if label in allowed and attr in allowed[label][1] and hasattr(allowed[label][0], attr):
        return getattr(allowed[label][0], attr)
    return resolve_op(name)


# What JSON holds as it is (a float is written as hex, to keep every bit).
_JSON_AS_IS = (bool, int, str, type(None))


def _encode_value(value: Any, index: dict[Any, int]) -> Any:
    import torch

    from epass._torch import operators

    kind = type(value)
    if kind in _JSON_AS_IS:
        return value
    if kind is float:
        return {"float": value.hex()}
    if kind is list:
        return {"list": [_encode_value(v, index) for v in value]}
    if kind is tuple:
        return {"tuple": [_encode_value(v, index) for v in value]}
    if isinstance(value, torch.fx.Node):
        return {"ref": index[value]}
    if kind is torch.fx.immutable_collections.immutable_list:
        return {"list": [_encode_value(v, index) for v in value]}
    if kind is torch.dtype:
        return {"dtype": str(value).removeprefix("torch.")}
    if kind is torch.layout:
        return {"layout": str(value).removeprefix("torch.")}
    if kind is torch.memory_format:
        return {"memory_format": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {"device": str(value)}
    if kind is operators.OpOverload:
        return {"op": _op_name(value)}
    raise Unrepresentable(f"a value of type {kind.__name__}")


def _decode_value(data: Any, nodes: list[Any], depth: int = 0) -> Any:
    import torch

    if depth > 32:
        raise ValueError("nests too deep")
    if data is None or type(data) in (bool, int, str):
        return data
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError("has a malformed value")
    ((tag, inner),) = data.items()
    if tag in ("list", "tuple") and isinstance(inner, list):
        items = [_decode_value(v, nodes, depth + 1) for v in inner]
        return items if tag == "list" else tuple(items)
    if tag == "ref" and type(inner) is int and 0 <= inner < len(nodes):
        return nodes[inner]
    if tag == "float" and isinstance(inner, str):
        return float.fromhex(inner)
    if tag in ("dtype", "layout", "memory_format") and isinstance(inner, str):
        value = getattr(torch, inner, None) if _NAME.match(inner) else None
        wanted = {"dtype": torch.dtype, "layout": torch.layout}
        wanted["memory_format"] = torch.memory_format
        if type(value) is not wanted[tag]:
            raise ValueError(f"names no {tag} {inner!r:.40}")
        return value
    if tag == "device" and isinstance(inner, str) and re.match(r"^[a-z]+(:\d+)?$", inner):
        return torch.device(inner)
    if tag == "op":
        return resolve_op(inner)
    raise ValueError(f"has a value tagged {tag!r:.40}")


def encode(graph: Any, inherited: Any, own: Any, values: Any) -> dict[str, Any]:
    """A template graph as JSON data; ``values`` holds each node's value as JSON data
    (a description: :func:`decode` recomputes the value and hands the description back
    for the caller to compare).

    Raises:
        Unrepresentable: for a target or value that data cannot name exactly.
    """
    from epass._torch import operators

    index: dict[Any, int] = {}
    inputs: list[str] = []
    nodes: list[dict[str, Any]] = []
    output: Any = None
    for node in graph.nodes:
        if node.op == "placeholder":
            index[node] = len(index)
            inputs.append(node.name)
        elif node.op == "output":
            output = _encode_value(node.args[0], index)
        elif node.op == "call_function":
            target = node.target
            name = (
                _op_name(target)
                if isinstance(target, operators.OpOverload)
                else _function_name(target)
            )
            custom = node.meta.get("custom")
            nodes.append(
                {
                    "name": node.name,
                    "target": name,
                    "args": _encode_value(tuple(node.args), index),
                    # pairs: JSON objects are written with sorted keys, and the
                    # order of keyword arguments shows in the graph
                    "kwargs": [[k, _encode_value(v, index)] for k, v in node.kwargs.items()],
                    "inherited": list(inherited[node]),
                    "own": {k: _encode_value(v, index) for k, v in own[node].items()},
                    "custom": (
                        {k: _encode_value(v, index) for k, v in custom.items()} if custom else None
                    ),
                    "value": values[node],
                }
            )
            index[node] = len(index)
        else:
            raise Unrepresentable(f"a {node.op} node")
    return {"inputs": inputs, "nodes": nodes, "output": output}


def decode(
    body: Any, input_values: list[Any], fake_mode: Any, inherited_fields: tuple[str, ...]
) -> tuple[Any, dict[Any, tuple[str, ...]], dict[Any, dict[str, Any]], dict[Any, Any]]:
    """The template graph ``body`` describes, its values recomputed from fresh fake
    inputs under ``fake_mode`` (the values of the program being rewritten), and each
    node's stored value description (data, for the caller to compare with the value).

    Raises:
        ValueError: for anything that is not a template this module wrote.
    """
    import torch

    if not isinstance(body, dict) or set(body) != {"inputs", "nodes", "output"}:
        raise ValueError("is not a template")
    names, entries = body["inputs"], body["nodes"]
    if not (isinstance(names, list) and isinstance(entries, list)):
        raise ValueError("is not a template")
    if len(names) != len(input_values):
        raise ValueError("has another number of inputs")
    graph = torch.fx.Graph()
    nodes = _decode_inputs(graph, names, input_values)
    inherited: dict[Any, tuple[str, ...]] = {}
    own: dict[Any, dict[str, Any]] = {}
    stored: dict[Any, Any] = {}
    for entry in entries:
        node, inherited[node], own[node] = _decode_node(
            graph, entry, nodes, fake_mode, inherited_fields
        )
        stored[node] = entry["value"]
        nodes.append(node)
    graph.output(_decode_value(body["output"], nodes))
    return graph, inherited, own, stored


def _decode_inputs(graph: Any, names: list[Any], input_values: list[Any]) -> list[Any]:
    """The template's placeholders, each holding its input's value."""
    nodes: list[Any] = []
    for name, value in zip(names, input_values, strict=True):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError("has a malformed input name")
        ph = graph.placeholder(name)
        ph.meta["val"] = value
        nodes.append(ph)
    return nodes


_NODE_FIELDS = {"name", "target", "args", "kwargs", "inherited", "own", "custom", "value"}


def _decode_node(
    graph: Any, entry: Any, nodes: list[Any], fake_mode: Any, inherited_fields: tuple[str, ...]
) -> tuple[Any, tuple[str, ...], dict[str, Any]]:
    """The node ``entry`` describes, added to ``graph`` after ``nodes`` (which it may
    read), with the meta fields it inherits and its own."""
    import torch

    if not isinstance(entry, dict) or set(entry) != _NODE_FIELDS:
        raise ValueError("has a malformed node")
    name = entry["name"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError("has a malformed node name")
    target = _resolve_target(entry["target"])
    args = _decode_value(entry["args"], nodes)
    pairs = entry["kwargs"]
    if not isinstance(args, tuple) or not isinstance(pairs, list):
        raise ValueError("has malformed arguments")
    if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise ValueError("has malformed keyword arguments")
    kwargs = {k: _decode_value(v, nodes) for k, v in pairs}
    taken = entry["inherited"]
    if not isinstance(taken, list) or not set(taken) <= set(inherited_fields):
        raise ValueError("has unknown inherited meta")
    own_data, custom = entry["own"], entry["custom"]
    if not isinstance(own_data, dict) or not set(own_data) <= set(inherited_fields):
        raise ValueError("has unknown meta")
    if custom is not None and not isinstance(custom, dict):
        raise ValueError("has malformed custom meta")
    node = graph.create_node("call_function", target, args, kwargs, name=name)
    if node.name != name:
        raise ValueError("has a repeated node name")
    # The values are recomputed here, from operators looked up above, on fake
    # tensors: the entry holds no values of its own.
    vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = target(*vals[0], **vals[1])
    own = {k: _decode_value(v, nodes) for k, v in own_data.items()}
    if custom:
        node.meta["custom"] = {str(k): _decode_value(v, nodes) for k, v in custom.items()}
    return node, tuple(taken), own

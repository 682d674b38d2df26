"""The roles of the strings in torch's program schema: what each kind of string field
may hold, its check, and the tables giving every (dataclass, field) its role."""

from __future__ import annotations

import contextlib
import functools
import json
import keyword
import re
import unicodedata
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from epass import _operators, _pt2
from epass._screen.expressions import expression_problem
from epass._screen.text import TEXT_LIMIT, is_plain

__all__ = [
    "ARGUMENT_NAME",
    "DEVICE",
    "FQN",
    "GUARD",
    "IDENTIFIER",
    "INPUT_ROLES",
    "JSON_DATA",
    "KEY_ROLES",
    "LINE",
    "MODULE_PATH",
    "NN_MODULE_STACK",
    "NODE_METADATA",
    "OPERATOR",
    "PROGRAM_INPUT",
    "ROLES",
    "SOURCE_FN_STACK",
    "SYMBOLIC",
    "TEXT",
    "TREESPEC",
    "Role",
]


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
    if len(text) > TEXT_LIMIT:
        return "longer than 1 MiB"
    return None if is_plain(text) else "quotes, backslashes or control characters"


def _text(text: str) -> str | None:
    # free text: kept as data (meta), shown by print_readable in comments, one per line
    if len(text) > TEXT_LIMIT:
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
    if text in _pt2.serialized_builtin_targets():
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
    return None if _operators.is_operator(target) else "not an operator"


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
    types = _pt2.pytree_type_names()
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
            if isinstance(item, str) and not is_plain(item):
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
SYMBOLIC = Role("symbolic expression", lambda t: expression_problem(t, guard=False))
GUARD = Role("guard expression", lambda t: expression_problem(t, guard=True))
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

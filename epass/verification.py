"""Program checks run after each pass: torch's verifier plus state/signature consistency."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from epass import _graph, _operators, _validated, _writes
from epass.errors import ArgumentTypeError, ProgramError

__all__ = [
    "Before",
    "CallWalk",
    "argument_problems",
    "before",
    "check_arguments",
    "check_output",
    "check_state_writes",
    "state_problems",
    "state_writes",
    "verify_program",
]

_MUTATION_KINDS = tuple(
    k for k in OutputKind if k.name in ("BUFFER_MUTATION", "PARAMETER_MUTATION")
)


def state_problems(
    ep: ExportedProgram, source: ExportedProgram | Before | None = None
) -> list[str]:
    """Every way the signature and the state dicts disagree, as readable lines.

    With ``source`` (the program a pass made ``ep`` from, or :func:`before` of it), a
    state tensor whose placeholder holds the same ``meta["val"]`` object, under the
    same key, as in ``source`` is not compared with it again: the pass changed
    neither (a write into the tensor is the store watch's to catch).
    """
    problems: list[str] = []
    sd, consts = ep.state_dict, ep.constants
    for spec in ep.graph_signature.input_specs:
        target = spec.target
        if spec.kind == InputKind.PARAMETER:
            if target not in sd:
                problems.append(f"parameter {target!r} is missing from state_dict")
            elif not isinstance(sd[target], torch.nn.Parameter):
                problems.append(f"parameter {target!r} is not an nn.Parameter")
        elif spec.kind == InputKind.BUFFER:
            if spec.persistent:
                if target not in sd:
                    problems.append(f"persistent buffer {target!r} is missing from state_dict")
            elif target not in consts:
                problems.append(f"non-persistent buffer {target!r} is missing from constants")
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            if target not in consts:
                problems.append(f"constant {target!r} is missing from constants")
            elif not isinstance(consts[target], torch.Tensor):
                problems.append(f"constant {target!r} is not a tensor")
        elif spec.kind == InputKind.CUSTOM_OBJ and target not in consts:
            problems.append(f"custom object {target!r} is missing from constants")
    before = _state_pairs(source)
    for target, name, value, val in _state_values(ep):
        was = before.get(target)
        if was is None or was[0] is not value or was[1] is not val:
            problem = _value_problem(f"state {target!r} (placeholder {name!r})", value, val)
            if problem is not None:
                problems.append(problem)
    return problems


def _state_pairs(source: ExportedProgram | Before | None) -> dict[str, tuple[Any, Any]]:
    """Key -> (state tensor, placeholder value) of ``source``'s state inputs."""
    if source is None:
        return {}
    if isinstance(source, Before):
        return source.state
    return {k: (value, val) for k, _, value, val in _state_values(source)}


def _state_values(ep: ExportedProgram) -> list[tuple[str, Any, torch.Tensor, torch.Tensor]]:
    """(key, placeholder name, state tensor, placeholder ``meta["val"]``) of each
    state input whose tensor and value are both tensors."""
    nodes = {node.name: node for node in _graph.placeholders(ep.graph_module)}
    out: list[tuple[str, Any, torch.Tensor, torch.Tensor]] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in _graph.STATE_KINDS or spec.target is None:
            continue
        name = getattr(spec.arg, "name", None)
        node = nodes.get(name) if isinstance(name, str) else None
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
        val = node.meta.get("val") if node is not None else None
        if isinstance(value, torch.Tensor) and isinstance(val, torch.Tensor):
            out.append((spec.target, name, value, val))
    return out


def _value_problem(what: str, value: torch.Tensor, val: torch.Tensor) -> str | None:
    """How a state tensor's dtype, rank, static sizes or device disagree with its
    placeholder's value, or None."""
    if value.dtype != val.dtype:
        return f"{what} is {value.dtype}, the graph expects {val.dtype}"
    if value.dim() != val.dim():
        return f"{what} has rank {value.dim()}, the graph expects {val.dim()}"
    if any(
        isinstance(want, int) and have != want
        for have, want in zip(value.shape, val.shape, strict=True)
    ):
        return f"{what} has shape {tuple(value.shape)}, the graph expects {tuple(val.shape)}"
    if value.device != val.device and value.device.type != "meta" and val.device.type != "meta":
        return f"{what} is on {value.device}, the graph expects {val.device}"
    return None


def state_writes(ep: ExportedProgram) -> tuple[set[str], set[str]]:
    """The state keys ``ep``'s graph writes in place (through any view of them,
    including items of multi-output views and the bodies of higher-order ops such
    as ``torch.cond``), and the keys its signature declares as mutated."""
    state = {
        s.arg.name: s.target
        for s in ep.graph_signature.input_specs
        if s.kind in _graph.STATE_KINDS and s.target is not None and hasattr(s.arg, "name")
    }
    declared = _declared_writes(ep)
    written: set[str] = set()
    for root in _writes.in_place_writes(ep.graph_module).written:
        target = state.get(root.name) if root.op == "placeholder" else None
        if target is not None:
            written.add(target)
    return written, declared


def _declared_writes(ep: ExportedProgram) -> set[str]:
    """The state keys ``ep``'s signature declares as mutated."""
    return {
        str(s.target)
        for s in ep.graph_signature.output_specs
        if s.kind in _MUTATION_KINDS and s.target is not None
    }


def check_state_writes(output: ExportedProgram, source: ExportedProgram | Before) -> None:
    """Raise when ``output`` writes in place into a parameter, buffer or constant
    that its signature does not declare mutated and that ``source`` (the pass's
    input) did not write (in place or declared) either.

    Outputs share the caller's tensors, so running such a program would write into
    the caller's model; a pass may keep the writes its input had (torch's training
    IR holds undeclared ``add_`` on buffers) but must not introduce one.

    Raises:
        ProgramError: naming each key written.
    """
    written, declared = state_writes(output)
    new = written - declared
    if not new:
        return
    before, before_declared = source.writes if isinstance(source, Before) else state_writes(source)
    bad = sorted(new - before - before_declared)
    if bad:
        raise ProgramError(
            f"it writes in place into state {bad}, which its input did not write and "
            "its signature does not declare; outputs share the caller's tensors, so "
            "running it would change them",
            [f"undeclared in-place write into state {k!r}" for k in bad],
        )


# --- operator arguments against their schemas -----------------------------------
# torch's verifier checks call targets but not the values passed to them: a pass
# that writes ``clamp_min(x, "x")`` makes a program that verifies and fails only
# when it runs. A literal argument must fit its schema type.

_NUMBER = (bool, int, float, complex)
_INT_LIKE = (int, torch.dtype, torch.layout, torch.memory_format)
# What a literal may be for each schema type kind; kinds not listed accept anything.
_LITERALS: dict[str, tuple[type, ...]] = {
    "StringType": (str,),
    "TensorType": _NUMBER,
    "NumberType": _NUMBER,
    "FloatType": _NUMBER,
    "SymFloatType": _NUMBER,
    "ComplexType": _NUMBER,
    "IntType": _INT_LIKE,
    "SymIntType": _INT_LIKE,
    "BoolType": (bool, int),
    "SymBoolType": (bool, int),
    "DeviceObjType": (torch.device, str, int),
}


@attrs.frozen
class _Type:
    """A schema argument type reduced to what the literal check needs."""

    kind: str
    optional: bool = False
    element: _Type | None = None  # for lists
    text: str = ""
    # The literals every item of a list of this type may be without a closer look:
    # graph values and the element type's literals (None when items need one).
    items: tuple[type, ...] | None = None


def _reduce(jit_type: Any) -> _Type:
    kind = jit_type.kind()
    if kind == "OptionalType":
        inner = _reduce(jit_type.getElementType())
        return attrs.evolve(inner, optional=True, text=str(jit_type))
    if kind == "ListType":
        element = _reduce(jit_type.getElementType())
        allowed = _LITERALS.get(element.kind)
        items = (torch.fx.Node, *allowed) if element.element is None and allowed else None
        return _Type(kind, element=element, text=str(jit_type), items=items)
    return _Type(kind, text=str(jit_type))


@attrs.frozen
class _Argument:
    name: str
    type: _Type
    kwarg_only: bool
    required: bool


@attrs.frozen
class _Signature:
    """An operator's arguments, reduced, with what every call checks first."""

    arguments: tuple[_Argument, ...]
    positional: int  # arguments that may be passed by position (they come first)
    names: frozenset[str]
    writes: bool  # the schema writes into an argument (``FunctionSchema.is_mutable``)
    # A call passing at least this many positional arguments and no keyword
    # passes every required one.
    needs: int


# Per operator overload, keyed by id with the overload held in the value (so the id
# is never reused while the entry lives): an OpOverload hashes in Python, and this
# is read for every call of every pass's output. Overloads live for the whole
# process, so holding them frees nothing that could be reused.
_SCHEMAS: dict[int, tuple[Any, _Signature]] = {}


def _signature(target: Any, schema: Any) -> _Signature:
    """The schema's arguments, reduced once per operator."""
    found = _SCHEMAS.get(id(target))
    if found is not None and found[0] is target:
        return found[1]
    arguments = tuple(
        _Argument(
            a.name,
            _reduce(a.type),
            a.kwarg_only,
            not a.has_default_value() and a.type.kind() != "OptionalType",
        )
        for a in schema.arguments
    )
    signature = _Signature(
        arguments,
        sum(not a.kwarg_only for a in arguments),
        frozenset(a.name for a in arguments),
        bool(schema.is_mutable),
        max((i + 1 for i, a in enumerate(arguments) if a.required), default=0),
    )
    _SCHEMAS[id(target)] = (target, signature)
    return signature


def _fits(value: Any, t: _Type) -> bool:
    """Whether a literal ``value`` may be passed where the schema says ``t``.

    Graph values (nodes) and types this does not model are accepted: the check
    is for literals a pass wrote, and errs on the side of accepting.
    """
    if isinstance(value, torch.fx.Node):
        return True
    if value is None:
        return t.optional or t.kind in ("NoneType", "AnyType")
    if t.element is not None:
        if isinstance(value, (list, tuple)):
            items = t.items
            if items is not None and all(isinstance(v, items) for v in value):
                return True  # what _fits says of each item, in one pass
            return all(_fits(v, t.element) for v in value)
        # int[2] stride=1: a single int stands for the list in ATen's schemas.
        return t.element.kind in ("IntType", "SymIntType") and _fits(value, t.element)
    allowed = _LITERALS.get(t.kind)
    return allowed is None or isinstance(value, allowed)


def _node_argument_problems(node: torch.fx.Node, signature: _Signature) -> list[str]:
    args, kwargs = node.args, node.kwargs
    if not kwargs and signature.needs <= len(args) <= signature.positional:
        # Positional arguments only, each required one passed: the common call.
        return [
            _misfit(node, value, arg)
            for value, arg in zip(args, signature.arguments, strict=False)
            if type(value) is not torch.fx.Node and not _fits(value, arg.type)
        ]
    problems: list[str] = []
    if len(args) > signature.positional:
        return [
            f"{_where(node)} gets {len(args)} positional arguments, its schema takes "
            f"{signature.positional}"
        ]
    for key in kwargs:
        if key not in signature.names:
            problems.append(f"{_where(node)} gets an unknown keyword argument {key!r}")
    for i, arg in enumerate(signature.arguments):
        # Positional arguments come first in a schema, so index i < len(args) is one.
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            if arg.required:
                problems.append(f"{_where(node)} is missing its argument {arg.name!r}")
            continue
        if type(value) is not torch.fx.Node and not _fits(value, arg.type):
            problems.append(_misfit(node, value, arg))
    return problems


def _misfit(node: torch.fx.Node, value: Any, arg: _Argument) -> str:
    return (
        f"{_where(node)} passes {value!r} ({type(value).__name__}) as {arg.name!r}, "
        f"which its schema types {arg.type.text}"
    )


def _where(node: torch.fx.Node) -> str:
    return f"node {node.name!r} ({node.target})"


def argument_problems(ep: ExportedProgram) -> list[str]:
    """Every call of an ATen operator in ``ep`` (nested graphs included) whose
    literal arguments do not fit the operator's schema, as readable lines."""
    return _walk_calls(ep.graph_module).problems


@attrs.frozen
class CallWalk:
    """What one walk over a program's calls finds (:func:`check_output` walks its
    output so)."""

    targets: list[Any]  # each top-level call_function target, in order
    problems: list[str]  # :func:`argument_problems`
    writes: bool  # some call, nested graphs included, has a schema that writes
    # What the walk found per call, for the next walk to reuse on the calls it
    # meets unchanged: node -> (name, target, args, kwargs, problems, writes).
    calls: dict[torch.fx.Node, tuple[Any, ...]] = attrs.field(factory=dict, repr=False, eq=False)


@attrs.frozen
class Before:
    """What :func:`check_output` compares a pass's output with, read from the pass's
    input before the pass ran (:func:`before`): for a pass that may edit its input's
    graph in place, after which the input no longer shows what it was."""

    state: dict[str, tuple[Any, Any]]  # key -> (state tensor, placeholder value)
    problems: frozenset[str]  # argument_problems
    writes: tuple[set[str], set[str]]  # state_writes


def before(ep: ExportedProgram, walk: CallWalk | None = None) -> Before:
    """:class:`Before` of ``ep``. ``walk`` is a walk of ``ep``'s calls made already
    (by the check of the pass that made ``ep``); without one, ``ep`` is walked now.
    The walk that finds writes into state runs only when some call's schema writes."""
    walk = _walk_calls(ep.graph_module) if walk is None else walk
    writes = state_writes(ep) if walk.writes else (set(), _declared_writes(ep))
    return Before(_state_pairs(ep), frozenset(walk.problems), writes)


def _walk_calls(gm: torch.fx.GraphModule, previous: CallWalk | None = None) -> CallWalk:
    """Walk ``gm``'s calls. A call ``previous`` (a walk of the program a pass
    started from) met with the same name, target and argument containers (fx
    replaces a node's argument tuple on every change, and its containers are
    immutable) keeps what that walk found, so a pass that changed a few calls
    costs a check of those few."""
    targets: list[Any] = []
    problems: list[str] = []
    writes = False
    known = previous.calls if previous is not None else {}
    calls: dict[torch.fx.Node, tuple[Any, ...]] = {}
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if module is gm:
                targets.append(target)
            name, args, kwargs = node.name, node.args, node.kwargs
            seen = known.get(node)
            if seen is None or not (
                seen[0] == name and seen[1] is target and seen[2] is args and seen[3] is kwargs
            ):
                schema = _operators.op_schema(target)
                if schema is None:
                    seen = (name, target, args, kwargs, (), False)
                else:
                    signature = _signature(target, schema)
                    found = tuple(_node_argument_problems(node, signature))
                    seen = (name, target, args, kwargs, found, signature.writes)
            calls[node] = seen
            if seen[4]:
                problems += seen[4]
            writes = writes or seen[5]
    return CallWalk(targets, problems, writes, calls)


def check_arguments(output: ExportedProgram, source: ExportedProgram | Before) -> None:
    """Raise when ``output`` calls an operator with literal arguments its schema
    does not take, and ``source`` (the pass's input) did not already do so.

    Raises:
        ProgramError: listing each bad call (node, operator, argument, value).
    """
    _raise_new_argument_problems(argument_problems(output), source)


def _raise_new_argument_problems(problems: list[str], source: ExportedProgram | Before) -> None:
    if not problems:
        return
    before = source.problems if isinstance(source, Before) else set(argument_problems(source))
    new = [p for p in problems if p not in before]
    if new:
        raise ProgramError(
            "it calls operators with arguments their schemas do not take:\n  " + "\n  ".join(new),
            new,
        )


def check_output(
    output: ExportedProgram, source: ExportedProgram | Before, previous: CallWalk | None = None
) -> CallWalk:
    """:func:`verify_program`, :func:`check_state_writes` and
    :func:`check_arguments` of a pass's ``output`` against its input ``source`` (or
    :func:`before` of it, read before a pass that may edit it in place ran).

    The state check compares only the state inputs the pass changed
    (:func:`state_problems` with ``source``).
    One walk over the output's calls serves the last two: it checks each call's
    arguments, and the walk that finds writes into state runs only when some call's
    schema writes at all. Returns that walk: the top-level call targets it met, in
    order (the manager's op count is made from them), which serves :func:`before`
    of the output for the next pass. ``previous``, the walk of the program the
    pass started from, lets the walk reuse what it found on the calls the pass
    left as they were.

    Raises:
        ProgramError: as the three checks do.
    """
    _verify(output, source)
    calls = _walk_calls(output.graph_module, previous)
    if calls.writes:
        check_state_writes(output, source)
    _raise_new_argument_problems(calls.problems, source)
    return calls


def verify_program(ep: ExportedProgram) -> None:
    """Run ``ep.validate()`` and the state checks.

    ``validate()`` is skipped for a program epass built (whose constructor has just
    run it) while nothing torch's verifier reads has changed since
    (``_validated.still_validated``).

    Raises:
        ArgumentTypeError: ``ep`` is not an ExportedProgram.
        ProgramError: torch's verifier rejects the program, or its state and
            signature disagree (``problems`` lists every disagreement).
    """
    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(f"verify_program takes an ExportedProgram, got {type(ep).__name__}")
    _verify(ep, None, marked=False)


def _verify(
    ep: ExportedProgram, source: ExportedProgram | Before | None, *, marked: bool = True
) -> None:
    try:
        if not (marked and _validated.still_validated(ep)):
            ep.validate()
    except Exception as exc:
        raise ProgramError(f"{type(exc).__name__}: {exc}", [str(exc)]) from exc
    problems = state_problems(ep, source)
    if problems:
        raise ProgramError("inconsistent program state:\n  " + "\n  ".join(problems), problems)

"""The ``Pass`` protocol, ``PassResult``, and adapters for functions and torch.fx passes.

The contract, checked by :class:`~epass.PassManager` around every call:

=====================  =========================================================
what a pass may do     what the manager guarantees
=====================  =========================================================
return a new program   it is verified and its state linked to the store; a
                       program the pass did not get from the manager (the
                       caller's own input) is linked as a shallow clone, so
                       the caller's object is never re-pointed
return its input       unmodified when returned unchanged; when the pass
                       edited it in place (graph, node meta, signature, state
                       keys or entries) it is the output, verified and linked
mutate its input       the input is a private view: dict copies always, and a
                       graph copy (nested ``meta`` containers copied too)
                       unless the pass declares ``changes_input = False``;
                       such a pass that returns its input edited is an error
write to a dict        the dicts a pass sees are private copies; the linker
                       never inserts into a dict another program reads (an
                       output with added entries owns a new dict)
write to a tensor      detected (``_version`` counters, optionally a
                       fingerprint of bytes and layout) and raised as
                       :class:`~epass.StateMutationError` naming the keys
add an in-place write  its output fails verification when it writes into
into state             state in place that its input did not write and its
                       signature does not declare
return PassResult      the ``modified`` flag is trusted; so is that of any
                       result carrying a program and a ``modified`` flag
                       (ExecuTorch's ``ExportedProgramPassResult``)
say what the user      the result's ``notices`` (:class:`Notice`: a fallback,
should know            a cache that stepped aside) go into the pass's record;
                       every view shows each one and counts the fallbacks
=====================  =========================================================

One concept: what a pass is (the protocol, its result, and the adapters that make a
function or a torch.fx pass one).
"""

from __future__ import annotations

import contextlib
import graphlib
import inspect
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.pass_base import PassBase

from epass import _graph
from epass.errors import ArgumentTypeError, OrderingError

__all__ = [
    "CONTRACT",
    "FxPass",
    "NamedPass",
    "Notice",
    "Pass",
    "PassModel",
    "PassResult",
    "RewriteCounter",
    "adapt",
    "check_ordering",
    "label",
    "notices_of",
    "pass_name",
]

FALLBACK = "fallback"  # the one kind of notice every view counts


@attrs.frozen
class Notice:
    """Something about a pass's run that its user should see, beyond the program:
    a pass result's ``notices`` are copied into its record, and the command line,
    :meth:`~epass.PipelineResult.summary` and both reports show each one as
    ``<pass>: <text>`` and count them.

    Attributes:
        kind: a short word. ``"fallback"``: the pass did not take the path it takes by
            default (its fast path) and did its work another way; the views count
            these ("1 of 3 passes fell back"). A path the user asked for is no
            fallback. Any other word (``"cache"``) is a plain notice.
        text: one line saying what happened and why (for a fallback, what the pass
            did instead: ``"retraced: a write into input b_count (aten.add_.Tensor at add_)"``).

    Example::

        return PassResult(out, True, notices=[Notice("fallback", f"rewrote the graph: {why}")])
    """

    kind: str = attrs.field(validator=attrs.validators.matches_re(r"[a-z][a-z0-9_-]*"))
    text: str = attrs.field(validator=attrs.validators.instance_of(str))

    @property
    def fallback(self) -> bool:
        """Whether this notice says the pass fell back."""
        return self.kind == FALLBACK

    def as_dict(self) -> dict[str, str]:
        """JSON-ready form: ``{"kind", "text"}``."""
        return {"kind": self.kind, "text": self.text}


def _notice_tuple(notices: Iterable[Notice]) -> tuple[Notice, ...]:
    return tuple(notices)


@attrs.frozen
class PassResult:
    """What a pass returns: the resulting program, whether it differs from the input,
    and what its user should know about the run (``notices``, keyword only)."""

    program: ExportedProgram = attrs.field(validator=attrs.validators.instance_of(ExportedProgram))
    modified: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    notices: tuple[Notice, ...] = attrs.field(
        default=(),
        kw_only=True,
        converter=_notice_tuple,
        validator=attrs.validators.deep_iterable(attrs.validators.instance_of(Notice)),
    )


def notices_of(out: Any) -> tuple[Notice, ...]:
    """The :class:`Notice` values a pass's result carries (its ``notices``), if any:
    a result of another framework that has none, or holds something else there,
    has none."""
    notices = getattr(out, "notices", None)
    if isinstance(notices, (tuple, list)) and all(isinstance(n, Notice) for n in notices):
        return tuple(notices)
    return ()


@runtime_checkable
class Pass(Protocol):
    """Anything callable as ``(ExportedProgram) -> PassResult | ExportedProgram``.

    Optional attributes a pass may declare, each read once, by :func:`adapt`, into
    the pass's :class:`PassModel` when a :class:`~epass.PassManager` is built:

    * ``name``: used in records and errors (default: the function or class name);
    * ``requires(ep)`` / ``ensures(ep)``: checks on the input / on the *result*;
      return False or raise to fail;
    * ``skip_reason(ep)``: return a reason string when the pass would be a no-op on
      ``ep``; the manager then skips it and records why. A :class:`Notice` instead
      runs the pass and records the notice (it could not tell, and says why);
    * ``changes_input``: set False when the pass never mutates the program it gets
      (an edit of it anyway is then a :class:`~epass.PassError`: the manager checks
      the promise on the private copy every pass that is not epass's own gets);
      default True;
    * ``merge(next_pass)``: return one pass doing the work of this one and the next,
      or None; the manager merges adjacent passes this way when it is built;
    * ``run_before`` / ``run_after``: names or types of passes it must precede or follow;
    * ``imports``: modules to import before a program is loaded for this pass (the
      ones registering the custom ops it works on, ``("torchao",)``);
    * ``origin``: the registry name and options that recreate the pass, as
      ``(name, options)``; :func:`~epass.create_pass` sets it on what it makes.
    * ``with_max_rewrites(limit)``: for a pass made of independent rewrites, the
      same pass applying only its first ``limit`` rewrites (None: all of them);
      see :class:`RewriteCounter`. :func:`~epass.bisect` uses it to name the one
      rewrite that breaks a program.

    A ``__call__`` annotated to return :class:`PassResult` (or a subclass) tells the
    manager that the pass reports its own ``modified`` flag: it takes no snapshot
    to find out, and a bare program returned instead is a :class:`~epass.PassError`.
    """

    def __call__(self, ep: ExportedProgram, /) -> PassResult | ExportedProgram: ...


# The attributes of the contract above: the only ones adapt reads from a pass.
CONTRACT = (
    "name",
    "requires",
    "ensures",
    "skip_reason",
    "changes_input",
    "merge",
    "run_before",
    "run_after",
    "imports",
    "origin",
    "with_max_rewrites",
)

Check = Callable[[ExportedProgram], Any]
Origin = tuple[str, Mapping[str, Any]]


@attrs.frozen(eq=False)
class PassModel:
    """One pass as the manager sees it: what it calls and everything the pass
    declares, read once by :func:`adapt` (LLVM's ``detail::PassModel``). Nothing
    after that reads an attribute of the pass.

    Attributes:
        pass_: the object called (a :class:`FxPass` around a torch.fx pass).
        name: its name in records and errors.
        origin: the registry name and options it was made from, or None.
        requires / ensures / skip_reason: its checks, or None.
        changes_input: False when it promised not to mutate its input.
        merge: its ``merge(next_pass)``, or None.
        run_before / run_after: names or types of passes it must precede or follow.
        imports: modules to import before a program is loaded for it.
        module: the module defining its function or class.
        children: the models of a nested pipeline's passes.
        limit_rewrites: its ``with_max_rewrites``, or None.
        takes_lease: a built-in pass that edits in place a graph the manager
            leases it, when this run made that graph and nobody else holds it, and
            copies it otherwise (``epass._graph.editable_graph``): its own
            ``_takes_lease``, believed only of a class epass defines
            (:func:`epass_defined`). It is also what makes a pass epass's own: the
            manager believes its ``modified`` flag and ``changes_input``, and checks
            every other pass's against a snapshot of a private copy.
    """

    pass_: Any
    name: str
    origin: Origin | None = None
    requires: Check | None = None
    ensures: Check | None = None
    skip_reason: Check | None = None
    changes_input: bool = True
    merge: Callable[[Any], Any] | None = None
    run_before: tuple[Any, ...] = ()
    run_after: tuple[Any, ...] = ()
    imports: tuple[str, ...] = ()
    module: str | None = None
    children: tuple[PassModel, ...] = ()
    limit_rewrites: Callable[[int | None], Any] | None = None
    takes_lease: bool = False


class RewriteCounter:
    """Counts the rewrites of one pass run and holds back those past ``limit``:
    LLVM's ``-debug-counter`` for a pass made of independent rewrites.

    The protocol a pass adopts to be bisected below the pass, rewrite by rewrite:

    1. it takes a ``max_rewrites: int | None = None`` option and has a method
       ``with_max_rewrites(limit)`` returning the same pass with that option set;
    2. in each run it makes a ``RewriteCounter(self.max_rewrites)`` and asks
       :meth:`allow` before each rewrite, in a fixed order (graph order), skipping
       the rewrite when it says no;
    3. its result carries :attr:`notes` (a :class:`PassResult` subclass with a
       ``notes`` mapping; the manager copies it into the pass record).

    With a limit the pass applies exactly the first ``limit`` rewrites it would
    make, and its notes hold ``rewrites`` (how many it applied) and
    ``last_rewrite`` (``"aten.gelu.default at node gelu_3"``). A limit no smaller
    than the number of rewrites applies them all, and still counts them.

    Example::

        counter = RewriteCounter(self.max_rewrites)
        for node in gm.graph.nodes:
            if matches(node) and counter.allow(node.target, node.name):
                rewrite(node)
        return MyResult(program, counter.count > 0, notes=counter.notes)
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ArgumentTypeError(f"max_rewrites must be None or an int >= 0, got {limit!r}")
        self.limit = limit
        self.count = 0
        self.held = 0
        self.last: str | None = None

    def allow(self, op: Any, node: str) -> bool:
        """Whether the next rewrite (of ``op`` at node ``node``) may be applied."""
        if self.limit is not None and self.count >= self.limit:
            self.held += 1
            return False
        self.count += 1
        self.last = f"{_op_text(op)} at node {node}"
        return True

    @property
    def notes(self) -> dict[str, Any]:
        """``rewrites`` and ``last_rewrite``, and ``held_back`` under a limit."""
        notes: dict[str, Any] = {"rewrites": self.count, "last_rewrite": self.last}
        if self.limit is not None:
            notes["held_back"] = self.held
        return notes


def _op_text(op: Any) -> str:
    name = str(op)
    if name.startswith("<"):  # "<built-in function getitem>"
        name = getattr(op, "__qualname__", name)
    return name


def pass_name(p: Any) -> str:
    """The name a pass goes by in records and errors.

    Raises:
        ArgumentTypeError: when reading its ``name`` raises (a property).
    """
    name = _read_name(p)
    return name if isinstance(name, str) and name else _own_name(p)


def _read_name(p: Any) -> Any:
    """``p.name`` or None; a ``name`` that raises is the pass author's error to fix,
    so it is named like any other contract attribute that raises."""
    try:
        return getattr(p, "name", None)
    except Exception as exc:
        raise _raised(p, exc, "name") from exc


class NamedPass:
    """A registered pass that has no ``name`` of its own, under its registry name.

    Records and errors then show the registry name. Other attributes (``requires``,
    ``changes_input``, ...) are the wrapped pass's.
    """

    def __init__(self, name: str, inner: Any) -> None:
        self.name = name
        self.inner = inner

    def __call__(self, ep: Any) -> Any:
        return self.inner(ep)

    def __getattr__(self, attr: str) -> Any:
        if attr == "inner":  # not set yet (copying, unpickling)
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        return f"NamedPass({self.name!r}, {self.inner!r})"


def label(obj: Any, name: str, options: Mapping[str, Any]) -> Any:
    """``obj``, made by the factory registered as ``name`` with ``options``, labelled
    with both: a pass without a name of its own takes the registry name (a fresh
    instance is ours to label; anything else is wrapped in :class:`NamedPass`), and
    ``origin`` records how to make it again, where the object takes attributes."""
    own = _read_name(obj)
    if not (isinstance(own, str) and own):
        if isinstance(obj, type) or _is_routine(obj):
            obj = NamedPass(name, obj)
        else:
            try:
                obj.name = name
            except (AttributeError, TypeError):
                obj = NamedPass(name, obj)
    # attrs passes and other slotted objects print from their fields instead.
    with contextlib.suppress(AttributeError, TypeError):
        obj.origin = (name, dict(options))
    return obj


class FxPass:
    """Runs a torch.fx pass (``GraphModule -> PassResult | GraphModule | None``) on a program.

    The pass works on a copy of the graph, so the input program's graph is never
    touched (unlike ``ExportedProgram._transform_do_not_use``); tensors are never
    copied. The signature is re-derived from the new graph: placeholders may be
    removed (their state entries leave the output's dicts); adding inputs or
    changing the number of outputs is an error. Tensors the pass registers on the
    GraphModule and reads through ``get_attr`` are lifted to new ``constants``
    entries (see :class:`~epass.passes.LiftConstants`).

    Example::

        def relu_to_gelu(gm):
            for node in gm.graph.nodes:
                if node.target is torch.ops.aten.relu.default:
                    node.target = torch.ops.aten.gelu.default
            gm.recompile()
            return gm

        PassManager([FxPass(relu_to_gelu)]).run(ep)
    """

    changes_input = False

    def __init__(self, fn: Callable[[torch.fx.GraphModule], Any], *, name: str | None = None):
        if not callable(fn):
            raise ArgumentTypeError(f"FxPass needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or pass_name(fn)

    def __repr__(self) -> str:
        return f"FxPass({self.name})"

    def __call__(self, ep: ExportedProgram) -> PassResult:
        program, modified, unreported = _graph.run_graph_pass(ep, self.fn, self.name)
        return PassResult(program, modified, notices=unreported_edit(unreported))


def unreported_edit(unreported: bool) -> tuple[Notice, ...]:
    """The notice of a pass whose ``modified=False`` came with an edit, kept."""
    if not unreported:
        return ()
    return (
        Notice("declaration", "it returned modified=False but edited its graph: taken as modified"),
    )


def adapt(
    p: Any,
    *,
    position: int | None = None,
    origin: Origin | None = None,
) -> PassModel:
    """The :class:`PassModel` of a pass object, or ArgumentTypeError when ``p`` is
    not a pass: the one place that reads the attributes a pass declares.

    A torch.fx ``PassBase`` is wrapped in :class:`FxPass`. ``origin`` (the registry
    name and options, known to whoever resolved a name) overrides the pass's own.
    A nested pipeline's ``models`` become the model's ``children``. Names and
    pipeline text are made into objects by :mod:`epass.building`.
    """
    if isinstance(p, PassBase):
        p = FxPass(p, name=pass_name(p))
    if isinstance(p, (str, ExportedProgram, torch.nn.Module)) or not callable(p):
        where = f"pipeline position {position}: " if position is not None else ""
        raise ArgumentTypeError(
            f"{where}{p!r} ({type(p).__name__}) is not a pass; a pass is a callable "
            "taking an ExportedProgram and returning a PassResult or ExportedProgram, "
            "a torch.fx PassBase, or FxPass(fn) around a GraphModule function"
        )
    try:
        declared = _declared(p)
    except Exception as exc:
        raise _raised(p, exc) from exc
    label = declared["name"]
    name = label if isinstance(label, str) and label else _own_name(p)
    for attr in ("requires", "ensures", "skip_reason", "with_max_rewrites"):
        if declared[attr] is not None and not callable(declared[attr]):
            raise _wrong(name, attr, declared[attr], "a callable taking the program, or None")
    if not isinstance(declared["changes_input"], bool):
        raise _wrong(name, "changes_input", declared["changes_input"], "True or False")
    imports = _names(declared["imports"], name, "imports", (str,))
    merge = declared["merge"]
    return PassModel(
        pass_=p,
        name=name,
        origin=origin if origin is not None else _origin(declared["origin"]),
        requires=declared["requires"],
        ensures=declared["ensures"],
        skip_reason=declared["skip_reason"],
        changes_input=declared["changes_input"],
        merge=merge if callable(merge) else None,
        run_before=_names(declared["run_before"], name, "run_before", (str, type)),
        run_after=_names(declared["run_after"], name, "run_after", (str, type)),
        imports=imports,
        module=_module(p.fn if isinstance(p, FxPass) else p),
        children=tuple(m for m in declared["models"] or () if isinstance(m, PassModel)),
        limit_rewrites=declared["with_max_rewrites"],
        takes_lease=declared["_takes_lease"] is True and epass_defined(p),
    )


def epass_defined(p: Any) -> bool:
    """Whether ``p`` is an instance of a class epass itself defines: its class is found
    under its own name in the ``epass`` module it names. Only such a pass's
    declarations (``_takes_lease``, its ``modified`` flag) are believed unchecked; a
    subclass or look-alike defined elsewhere is checked like any other pass."""
    kind = type(p)
    module = kind.__module__
    if module != "epass" and not module.startswith("epass."):
        return False
    found: Any = sys.modules.get(module)
    for part in kind.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is kind


def _declared(p: Any) -> dict[str, Any]:
    """What ``p`` declares, each attribute read once (or its default)."""
    return {
        "name": getattr(p, "name", None),
        "requires": getattr(p, "requires", None),
        "ensures": getattr(p, "ensures", None),
        "skip_reason": getattr(p, "skip_reason", None),
        "changes_input": getattr(p, "changes_input", True),
        "merge": getattr(p, "merge", None),
        "run_before": getattr(p, "run_before", ()),
        "run_after": getattr(p, "run_after", ()),
        "imports": getattr(p, "imports", ()),
        "origin": getattr(p, "origin", None),
        "with_max_rewrites": getattr(p, "with_max_rewrites", None),
        "models": getattr(p, "models", ()),
        "_takes_lease": getattr(p, "_takes_lease", False),
    }


def _is_routine(obj: Any) -> bool:
    """``inspect.isroutine(obj)``, which depends on ``type(obj)`` alone, answered once
    per type."""
    kind = type(obj)
    try:
        return _ROUTINE_TYPES[kind]
    except KeyError:
        answer = _ROUTINE_TYPES[kind] = inspect.isroutine(obj)
        return answer


_ROUTINE_TYPES: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _own_name(p: Any) -> str:
    try:
        name = getattr(p, "__name__", None)
    except Exception:  # only names the pass in a message: the class will do
        name = None
    return str(name) if name is not None else type(p).__name__


def _raised(p: Any, exc: Exception, attr: str | None = None) -> ArgumentTypeError:
    """A declared attribute (a property) raised: name the pass and the attribute
    (``attr``, or the first that raises again)."""
    name = _own_name(p)
    for candidate in () if attr is not None else (*CONTRACT, "models"):
        try:
            value = getattr(p, candidate, None)
        except Exception:
            attr = candidate
            break
        if candidate == "name" and isinstance(value, str) and value:
            name = value
    return ArgumentTypeError(
        f"pass {name!r}: reading its {attr or '?'!r} raised {type(exc).__name__}: {exc}"
    )


def _wrong(name: str, attr: str, value: Any, wanted: str) -> ArgumentTypeError:
    return ArgumentTypeError(
        f"pass {name!r}: {attr} must be {wanted}, not {value!r:.60} ({type(value).__name__})"
    )


def _origin(value: Any) -> Origin | None:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        name, options = value
        if isinstance(options, Mapping):
            return name, dict(options)
    return None


def _names(value: Any, name: str, attr: str, kinds: tuple[type, ...]) -> tuple[Any, ...]:
    """A declared sequence of names, where one string stands for itself (not its letters)."""
    if value == ():
        return ()
    if isinstance(value, (str, type)):
        value = (value,)
    try:
        names = tuple(value or ())
    except TypeError:
        names = (value,)
    if not all(isinstance(n, kinds) for n in names):
        raise _wrong(
            name, attr, value, f"a {' or '.join(k.__name__ for k in kinds)} or a sequence of them"
        )
    return names


def _module(p: Any) -> str | None:
    """The module defining a pass's function or class (a registered function's own)."""
    inner = p.inner if isinstance(p, NamedPass) else p
    owner = inner if isinstance(inner, type) or _is_routine(inner) else type(inner)
    module = getattr(owner, "__module__", None)
    return module if isinstance(module, str) else None


# --- ordering constraints ------------------------------------------------------------


def _matches(model: PassModel, target: Any) -> bool:
    if isinstance(target, type):
        return isinstance(model.pass_, target)
    return bool(model.name == target)


def check_ordering(models: Sequence[PassModel]) -> None:
    """Raise OrderingError when the pass order breaks a declared constraint."""
    if not any(m.run_before or m.run_after for m in models):
        return
    edges: dict[int, set[int]] = {i: set() for i in range(len(models))}  # node -> predecessors
    for i, m in enumerate(models):
        for target in m.run_before:
            for j, q in enumerate(models):
                if j != i and _matches(q, target):
                    edges[j].add(i)
        for target in m.run_after:
            for j, q in enumerate(models):
                if j != i and _matches(q, target):
                    edges[i].add(j)
    try:
        tuple(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as exc:
        cycle = " -> ".join(f"{models[k].name}@{k}" for k in exc.args[1])
        raise OrderingError(f"ordering constraints form a cycle: {cycle}") from None
    for node, preds in edges.items():
        for pred in sorted(preds):
            if pred > node:
                raise OrderingError(
                    f"pass {models[pred].name!r} at position {pred} must run before "
                    f"pass {models[node].name!r} at position {node}; reorder the pipeline"
                )

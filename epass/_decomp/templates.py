"""Templates as a decomposition finds them: in memory, on disk, from the program's
batched trace or traced alone; and what a program still needs traced.

One concept: where a template comes from; its four sources are tried in one order
under one key.
"""

from __future__ import annotations

import collections
import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import ExportedProgram

from epass import _operators
from epass._decomp import (
    batch,
    disk,
    encoding,
    identity,
    keys,
    safety,
    shapes,
    state,
    table,
    tracing,
)
from epass._decomp.safety import Fallback
from epass._torch import operators
from epass._torch.programs import pytree

__all__ = [
    "Session",
    "cache_info",
    "clear_cache",
    "clear_memory",
    "fill",
    "find",
    "memory_info",
    "missing_templates",
    "pending_calls",
    "template_work",
]


_CACHE: collections.OrderedDict[Any, tracing.Template] = collections.OrderedDict()
_CACHE_SIZE = 4096
_STATS = {"hits": 0, "misses": 0}


def memory_info() -> dict[str, int]:
    """The memory cache's statistics: hits, misses, current size and bound."""
    with state.LOCK:
        return {**_STATS, "size": len(_CACHE), "maxsize": _CACHE_SIZE}


def clear_memory() -> None:
    """Forget every template, table split and table name this process keeps (the
    disk cache stays: a new process would find it)."""
    with state.LOCK:
        _CACHE.clear()
        table.SPLITS.clear()
        identity.NAMED.clear()
        _STATS.update(hits=0, misses=0)


def cache_info() -> dict[str, Any]:
    """Both template caches: ``memory`` (this process) and ``disk`` (shared by processes).

    Example::

        info = epass.cache_info()
        print(info["disk"]["directory"], info["disk"]["entries"])
    """
    return {"memory": memory_info(), "disk": disk.info()}


def clear_cache() -> dict[str, Any]:
    """Empty both template caches; returns how many disk entries were removed
    (``disk_entries``) and the files of the entries folder that were left, each with
    why (``left``: a file this cache did not write is never removed)."""
    clear_memory()
    removed, left = disk.clear()
    return {"disk_entries": removed, "left": left}


class Session:
    """The traces of one decomposition: the CompositeImplicitAutograd override of the
    table, entered at the first trace and left (with torch's state put back) at the
    end of the decomposition, and the templates one batched trace made for it."""

    def __init__(self, tables: table.Tables) -> None:
        self.tables = tables
        self.name = identity.cache_name(tables)
        # The templates of a table without a name: this decomposition's alone.
        self.local: dict[Any, tracing.Template] = {}
        self.grads: frozenset[str] = frozenset()
        # The program being decomposed, whose missing templates one batch traces.
        self.program: ExportedProgram | None = None
        self.traced = 0
        self.batched: dict[Any, tracing.Template] = {}
        # The program's shape environment through the decomposition (see shapes.Watch).
        self.watch: shapes.Watch | None = None
        self._stack = contextlib.ExitStack()
        self._entered = False
        self._batch_done = False

    def take(self, key: Any, fake_mode: Any) -> tracing.Template | None:
        """The template of ``key`` from the program's batched trace, which runs at the
        first template that is neither in memory nor on disk (a warm run never pays
        for the walk that collects them)."""
        if self.program is not None and not self._batch_done:
            self._batch_done = True
            with self.watching(fake_mode).retrace("a batched trace"):
                _prefill(self.program, fake_mode, self)
        return self.batched.pop(key, None)

    def watching(self, fake_mode: Any) -> shapes.Watch:
        """The watch over the program's shape environment (made at the first use)."""
        if self.watch is None:
            self.watch = shapes.Watch(fake_mode)
        return self.watch

    def cache(
        self, op: Any
    ) -> collections.OrderedDict[Any, tracing.Template] | dict[Any, tracing.Template]:
        """Where this decomposition keeps its templates of ``op``: the process's cache
        when the table has a name and the operator's kernels have one too
        (:meth:`identity.CacheName.keeps`), else its own."""
        return _CACHE if self.name.keeps(op) else self.local

    @contextlib.contextmanager
    def overrides(self) -> Iterator[None]:
        if not self._entered:
            self._stack.enter_context(state.torch_state(self.tables.cia))
            self._stack.enter_context(operators.override_cia(self.tables.cia))
            self._entered = True
        yield

    def close(self) -> None:
        self._stack.close()
        self._entered = False
        self.batched.clear()
        self.local.clear()


def pending_calls(
    ep: ExportedProgram, tables: table.Tables, session: Session, checked: bool = False
) -> tuple[list[batch.Pending], int, int]:
    """The distinct templates decomposing ``ep`` needs that are neither in memory nor
    on disk, keyed from the nodes' values before any rewrite, in program order; how
    many calls could not be keyed; how many nodes the program has. One walk
    (``checked``: :func:`safety.unsafe_reason` found nothing already).

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    reason = None if checked else safety.unsafe_reason(ep, tables)
    if reason is not None:
        raise Fallback(reason)  # the incremental path says so, and no estimate is due
    fake_mode = keys.detected_fake_mode(ep)
    grads = safety.retrace_grads(ep)
    seen: set[Any] = set()
    pending: list[batch.Pending] = []
    unkeyed = 0
    nodes = 0
    for node in ep.graph.nodes:
        nodes += 1
        if not (
            node.op == "call_function"
            and isinstance(node.target, operators.OpOverload)
            and table.rewrites(node.target, tables)
        ):
            continue
        try:
            args, kwargs = keys.normalize(node.target, node.args, dict(node.kwargs))
            spec, parts, inputs, flags = keys.template_key(node.target, args, kwargs, grads)
        except Exception:
            unkeyed += 1  # counted as a trace; the walk itself decides
            continue
        key = keys.memory_key(node.target, spec, parts, session.name, fake_mode)
        if key in seen:
            continue
        seen.add(key)
        with state.LOCK:
            if key in session.cache(node.target):
                continue
        disk_key = _disk_key(node.target, spec, parts, session.name, fake_mode)
        if disk_key is None or not disk.exists(disk_key.data):
            values = [a.meta["val"] for a in inputs]
            pending.append(batch.Pending(key, disk_key, node.target, args, kwargs, values, flags))
    return pending, unkeyed, nodes


def _prefill(ep: ExportedProgram, fake_mode: Any, session: Session) -> None:
    """Trace the templates ``ep`` needs at once, for the walk to take."""
    try:
        pending, _, _ = pending_calls(ep, session.tables, session, checked=True)
    except Exception:
        return  # the walk decides, and explains
    calls = [c for c in pending if batch.batchable(c) and c.key[-1] is fake_mode]
    if len(calls) > 1:
        session.batched.update(
            batch.trace_batch(calls, session.tables, fake_mode, session.overrides)
        )


def fill(ep: ExportedProgram, tables: table.Tables, limit: int | None = None) -> int:
    """Trace, in one batch, up to ``limit`` (None: all) of the templates decomposing
    ``ep`` needs that are neither in memory nor on disk, in program order, and keep
    them for later decompositions (on disk where their key allows). Returns how many
    were kept: none for a table without a name (see :class:`identity.CacheName`), whose
    templates no later decomposition may reuse. Holds :data:`state.LOCK`.

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    with state.LOCK:
        session = Session(tables)
        if session.name.table is None:
            return 0
        pending, _, _ = pending_calls(ep, tables, session)
        fake_mode = keys.fake_mode_of(ep)
        calls = [c for c in pending if batch.batchable(c)][:limit]
        if not calls:
            return 0
        try:
            templates = batch.trace_batch(calls, tables, fake_mode, session.overrides)
        finally:
            session.close()
            disk.prune_soon()
        for call in calls:
            template = templates.get(call.key)
            if template is None:
                continue
            if call.disk_key is not None:
                _store(call.disk_key, template, tables)
            if session.name.keeps(call.op):
                _keep(_CACHE, call.key, template)
        return len(templates)


def _keep(cache: dict[Any, tracing.Template], key: Any, template: tracing.Template) -> None:
    _STATS["misses"] += 1
    cache[key] = template
    if cache is _CACHE:
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)


def _hit(cache: dict[Any, tracing.Template], key: Any) -> tracing.Template | None:
    with state.LOCK:
        hit = cache.get(key)
        if hit is not None:
            if cache is _CACHE:
                _CACHE.move_to_end(key)
            _STATS["hits"] += 1
        return hit


def find(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tables: table.Tables,
    fake_mode: Any,
    session: Session,
    expected: Any = None,
) -> tuple[tracing.Template, list[torch.fx.Node]]:
    """The template decomposing ``op`` on ``args``, from memory, disk, a batched trace
    or its own trace, and the argument nodes its placeholders stand for. ``expected``:
    the operator's value on these arguments where the caller has it (a template read
    from disk must return its like; it is computed otherwise)."""
    spec, parts, inputs, flags = keys.template_key(op, args, kwargs, session.grads)
    values = [a.meta["val"] for a in inputs]
    key = keys.memory_key(op, spec, parts, session.name, fake_mode)
    cache = session.cache(op)
    hit = _hit(cache, key)
    if hit is not None:
        return hit, inputs
    watch = session.watching(fake_mode)
    disk_key = _disk_key(op, spec, parts, session.name, fake_mode)
    template = (
        None
        if disk_key is None
        else _load(disk_key, (op, args, kwargs), flags, tables, watch, expected)
    )
    if template is None:
        template = session.take(key, fake_mode)
        if template is None:
            with watch.retrace(f"the trace of {op}"):
                template = tracing.trace(
                    op, args, kwargs, values, flags, tables, fake_mode, session.overrides
                )
        session.traced += 1
        if disk_key is not None:
            _store(disk_key, template, tables)
        elif not session.name.keeps(op):
            disk.count("bypassed")
    with state.LOCK:
        _keep(cache, key, template)
    return template, inputs


def region(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tables: table.Tables,
    fake_mode: Any,
    session: Session,
) -> tuple[tracing.Template, list[torch.fx.Node]]:
    """The template of a region (``table.REGIONS``), from memory or its own trace.

    In memory it is keyed by the code its body runs (:func:`body_key`: what the
    trace runs, and what the stack traces of its nodes quote) in place of the body,
    and by its other arguments as any call's template is; a body whose code does not
    tell it apart is traced each time. Never on disk: a region's template is its
    program's.

    Raises:
        Fallback: when the body returns a view of one of its inputs, or writes into one.
    """
    bodies = [body_key(a) if isinstance(a, torch.fx.GraphModule) else () for a in args]
    key = None
    if None not in bodies:
        keyed = tuple(b[0] if b else a for b, a in zip(bodies, args, strict=True))
        spec, parts, _, _ = keys.template_key(op, keyed, kwargs, session.grads)
        # The code names a function it calls by a name; the key holds the function.
        targets = tuple(t for b in bodies if b for t in b[1])
        key = (keys.memory_key(op, spec, parts, session.name, fake_mode), targets)
    inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Node)]
    cache = session.cache(op)
    hit = None if key is None else _hit(cache, key)
    if hit is not None:
        return hit, inputs
    flags = [keys.requires_grad(a, session.grads) for a in inputs]
    values = [a.meta["val"] for a in inputs]
    with session.watching(fake_mode).retrace(f"the trace of {op.name()}"):
        template = tracing.trace(
            op, args, kwargs, values, flags, tables, fake_mode, session.overrides, frames=True
        )
    session.traced += 1
    if safety.returns_a_view_of_an_input(template.graph):
        raise Fallback(f"the body of {op.name()} returns a view of its input")
    if key is not None:
        with state.LOCK:
            _keep(cache, key, template)
    return template, inputs


def body_key(body: torch.fx.GraphModule) -> tuple[str, tuple[Any, ...]] | None:
    """The code a region's body runs, then that of each body nested in it by
    attribute name, and every function their nodes call; None when a body reads any
    other attribute or calls a module (its value would be part of what the code
    does), or has no code."""
    try:
        parts = [body.code]
    except RuntimeError:  # never generated
        return None
    targets: list[Any] = []
    for node in body.graph.nodes:
        if node.op == "call_module":
            return None
        if node.op == "call_function":
            targets.append(node.target)
        if node.op == "get_attr":
            try:
                nested = operator.attrgetter(str(node.target))(body)
            except AttributeError:
                return None
            inner = body_key(nested) if isinstance(nested, torch.fx.GraphModule) else None
            if inner is None:
                return None
            parts.append(f"# {node.target}\n{inner[0]}")
            targets += inner[1]
    return "\n".join(parts), tuple(targets)


def missing_templates(ep: ExportedProgram, tables: table.Tables) -> tuple[int, int]:
    """How many distinct templates decomposing ``ep`` would trace (neither in memory nor
    on disk), estimated from the nodes' values before any rewrite, and how many nodes
    the program has. One walk, no tracing.

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    pending, unkeyed, nodes = pending_calls(ep, tables, Session(tables))
    return len(pending) + unkeyed, nodes


def template_work(ep: ExportedProgram, tables: table.Tables) -> tuple[int, int, int]:
    """What decomposing ``ep`` would trace: how many missing templates one batched
    trace takes, how many are traced one at a time (symbolic ones, and calls that
    cannot be keyed before the walk), and how many nodes the program has. One walk.

    Raises:
        Fallback: when the incremental path cannot be taken at all.
    """
    pending, unkeyed, nodes = pending_calls(ep, tables, Session(tables))
    batched = sum(batch.batchable(c) for c in pending)
    if batched < 2:
        batched = 0  # a batch of one is a trace of its own
    return batched, len(pending) + unkeyed - batched, nodes


def _disk_key(
    op: Any, spec: str, parts: tuple[Any, ...], name: identity.CacheName, fake_mode: Any
) -> keys.DiskKey | None:
    if not name.keeps(op) or not isinstance(op, operators.OpOverload):
        return None
    if disk.directory() is None:
        return None
    data: dict[str, Any] = {
        **disk.environment(),
        "op": str(op),
        "spec": spec,
        "parts": repr(parts),
        "table": name.table,
        "settings": [list(item) for item in name.settings],
    }
    if "'sym'" not in data["parts"]:
        return keys.DiskKey(data)
    # A decomposition can branch on what the shape environment knows of a size (its
    # range, its hint, earlier guards): the key holds the symbols by position and all
    # of that, or there is no key.
    shape_env = getattr(fake_mode, "shape_env", None)
    names = None if shape_env is None else shapes.renaming(parts, shape_env)
    known = None if names is None else shapes.facts(shape_env, names)
    if names is None or known is None:
        return None
    data["parts"] = repr(names.parts(parts))
    data["shapes"] = known
    return keys.DiskKey(data, names)


def _storable(template: tracing.Template, tables: table.Tables) -> bool:
    for node in template.graph.nodes:
        target = node.target
        # A kept CompositeImplicitAutograd op's value depends on the override that
        # was active when it was computed: traced ones only. A size query's value is
        # the size, whatever the override.
        if (
            node.op == "call_function"
            and isinstance(target, operators.OpOverload)
            and target not in table.SIZE_OPS
            and (table.is_cia(target) or table.left_behind(target, tables))
        ):
            return False
    return True


def _store(key: keys.DiskKey, template: tracing.Template, tables: table.Tables) -> None:
    # A template whose trace taught the shape environment something is the retrace's
    # only together with that lesson: it is stored with it, for a later process to
    # learn, or not at all.
    if not _storable(template, tables):
        return
    taught = None
    if template.taught is not None:
        if key.names is None:
            return
        taught = shapes.lesson(*template.taught, key.names)
        if taught is None:
            return
    try:
        values = {
            n: shapes.describe(n.meta.get("val"), key.names)
            for n in template.graph.nodes
            if n.op == "call_function"
        }
        body = encoding.encode(template.graph, template.inherited, template.own, values)
    except (encoding.Unrepresentable, ValueError):
        return
    if taught is not None:
        body["lesson"] = taught
    disk.save(key.data, body)


def _load(
    key: keys.DiskKey,
    call: tuple[Any, tuple[Any, ...], dict[str, Any]],
    grads: list[bool],
    tables: table.Tables,
    watch: shapes.Watch,
    expected: Any = None,
) -> tracing.Template | None:
    body = disk.load(key.data)
    if body is None:
        return None
    op = call[0]
    try:
        # Values no trace computes: in the trace's context, guards suppressed, and
        # the shape environment must come out as it went in.
        taught = body.pop("lesson", None) if isinstance(body, dict) else None
        with watch.frozen(f"reading the template of {op} from disk"):
            template = _rebuild(body, key, call, grads, tables, watch.fake_mode, expected)
        if taught is not None:
            if key.names is None:
                raise ValueError("holds a lesson without symbols")
            # What its trace taught the shape environment, the retrace's trace of
            # the same call teaches it too.
            with watch.retrace(f"the lesson of the template of {op}"):
                shapes.teach(watch.shape_env, taught, key.names)
    except shapes.Changed:
        disk.reject(key.data, "changed the shape environment")
        raise
    except Exception as exc:
        disk.reject(key.data, f"{type(exc).__name__}: {exc}")
        return None
    return template


def _rebuild(
    body: Any,
    key: keys.DiskKey,
    call: tuple[Any, tuple[Any, ...], dict[str, Any]],
    grads: list[bool],
    tables: table.Tables,
    fake_mode: Any,
    expected: Any = None,
) -> tracing.Template:
    """The template a disk entry describes, its values recomputed on fresh fake inputs
    and checked against the stored ones and the operator's own result (``expected``,
    or computed).

    Raises:
        ValueError: for an entry that does not describe this call's template.
    """
    op, args, kwargs = call
    values = [
        a.meta["val"] for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Node)
    ]
    fakes = keys.fresh_fakes(fake_mode, values, grads)
    graph, inherited, own, stored = encoding.decode(body, fakes, fake_mode, tracing.INHERITED_META)
    for node in graph.nodes:
        if node.op == "call_function" and not (
            _operators.is_op_overload(node.target) or safety.is_plain_call(node.target)
        ):
            raise ValueError(f"calls {node.target!r}")
    template = tracing.Template(graph, len(values), inherited, own)
    if not _storable(template, tables):
        raise ValueError("holds an operator the table rewrites")
    # The symbols of the stored values are the key's, by position: this program's
    # symbols in the same places must give the same values (a decomposition that
    # branched on a hint would show here).
    for node, description in stored.items():
        if shapes.describe(node.meta.get("val"), key.names) != description:
            raise ValueError(f"recomputes another value at {node.name} than it stored")
    # An entry the checks above accept can still describe another computation;
    # one that does not even return what the operator returns is caught here.
    if expected is None:
        expected = op(*keys.values_of(args), **keys.values_of(kwargs))
    problem = _result_mismatch(graph, expected)
    if problem:
        raise ValueError(problem)
    return template


def _result_mismatch(graph: torch.fx.Graph, expected: Any) -> str:
    """What differs between a template's result and the operator's own (shape, dtype,
    device and structure; strides may differ, as the retrace's do); empty: nothing."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    got = pytree.tree_leaves(keys.values_of(out.args[0]))
    want = pytree.tree_leaves(expected)
    if len(got) != len(want):
        return f"returns {len(got)} values where the operator returns {len(want)}"
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            if not (
                isinstance(a, torch.Tensor)
                and a.shape == b.shape
                and a.dtype == b.dtype
                and a.device == b.device
            ):
                return (
                    f"returns {keys.describe_val(a)} "
                    f"where the operator returns {keys.describe_val(b)}"
                )
        elif type(a) is not type(b):
            return f"returns a {type(a).__name__} where the operator returns a {type(b).__name__}"
    return ""

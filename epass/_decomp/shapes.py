"""The program's shape environment, kept as the retrace keeps it: the context every
fake value is computed in, the watch that proves a decomposition changed only what a
trace changes, and symbols named by position for the disk cache.

One concept: the shape environment while a program is decomposed.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from epass._decomp import state
from epass._decomp.safety import Fallback
from epass._torch import fakes, programs, tracing

__all__ = [
    "expr_text",
    "free_symbols",
    "run_guards",
    "Changed",
    "Renaming",
    "Snapshot",
    "Watch",
    "as_traced",
    "describe",
    "difference",
    "learnt",
    "facts",
    "forget_unknowns",
    "lesson",
    "static",
    "renaming",
    "snapshot",
    "teach",
]


Snapshot = tuple[Any, ...]
"""What a shape environment knows, as shallow copies: its guards, ranges,
replacements, deferred runtime assertions, unbacked symbol counter and divisibility
facts. Two snapshots are equal when nothing was learnt between them."""


def snapshot(shape_env: Any) -> Snapshot | None:
    """The shape environment's knowledge now (None: a program without one)."""
    if shape_env is None:
        return None
    return (
        tuple(shape_env.guards),
        dict(shape_env.var_to_range),
        dict(shape_env.replacements),
        {k: tuple(v) for k, v in shape_env.deferred_runtime_asserts.items()},
        shape_env.unbacked_symint_counter,
        frozenset(shape_env.divisible),
    )


def difference(before: Snapshot | None, after: Snapshot | None) -> str:
    """What the shape environment learnt between two snapshots, in words."""
    if before is None or after is None or before == after:
        return "nothing"
    said: list[str] = []
    guards0, guards1 = before[0], after[0]
    if guards0 != guards1:
        new = [g for g in guards1 if g not in guards0]
        said.append("guards " + (", ".join(str(g.expr) for g in new) or "removed"))
    for name, old, now in (("range", before[1], after[1]), ("replacement", before[2], after[2])):
        for sym in sorted(set(old) | set(now), key=str):
            if old.get(sym) != now.get(sym):
                said.append(f"{name} of {sym}: {old.get(sym)} -> {now.get(sym)}")
    asserts0 = {r.expr for rs in before[3].values() for r in rs}
    asserts1 = {r.expr for rs in after[3].values() for r in rs}
    if asserts0 != asserts1:
        said.append("runtime assertions " + ", ".join(sorted(map(str, asserts1 ^ asserts0))))
    if before[4] != after[4]:
        said.append(f"unbacked symbols {before[4]} -> {after[4]}")
    if before[5] != after[5]:
        said.append("divisible " + ", ".join(sorted(map(str, after[5] ^ before[5]))))
    return "; ".join(said)


@contextlib.contextmanager
def as_traced(fake_mode: Any, *, suppress: bool = False) -> Iterator[None]:
    """Compute fake values as a template trace (and the retrace) computes them: in the
    program's fake mode, with the Python dispatcher on (a kept operator runs torch's
    Python kernel, which keeps sizes symbolic, where its C++ kernel reads them as
    integers and guards on them), mkldnn, nnpack and cudnn off (fake convolution asks
    them whether the batch is large, which guards on it) and grad off (meta functions
    read ``requires_grad``). ``suppress``: and the shape environment records no guard,
    a second fence for values no trace computes (templates read from disk, checks);
    those are computed once, so the fake mode's cache neither answers nor keeps them
    (making an entry for a symbolic value costs more than computing it: a third of
    a first run that reads its templates from disk)."""
    shape_env = fake_mode.shape_env
    with contextlib.ExitStack() as stack:
        stack.enter_context(state.backend_decomps_off())
        stack.enter_context(torch.no_grad())
        stack.enter_context(tracing.python_dispatcher())
        if suppress and shape_env is not None:
            stack.enter_context(shape_env.suppress_guards())
        if suppress:
            stack.enter_context(fakes.fake_cache_off(fake_mode))
        stack.enter_context(fake_mode)
        yield


def forget_unknowns(shape_env: Any) -> None:
    """Drop what the shape environment remembers of expressions it could not decide
    (``ShapeEnv._maybe_evaluate_static``'s cache, which a new guard does not clear):
    evaluated with guards suppressed, one would stay undecided after a later guard
    decides it, and the next evaluation would guard on it again (the retrace then
    adds a guard the program already has)."""
    if shape_env is not None:
        fakes.forget_static_evaluations(shape_env)


def static(shape_env: Any) -> set[str]:
    """The symbols the shape environment holds to one value, each as ``s = value``."""
    if shape_env is None:
        return set()
    held = {
        f"{sym} = {value}"
        for sym, value in shape_env.replacements.items()
        if not value.free_symbols
    }
    held |= {
        f"{sym} = {r.lower}"
        for sym, r in shape_env.var_to_range.items()
        if r.is_singleton() and sym not in shape_env.replacements
    }
    return held


class Changed(Fallback):
    """epass changed the program's shape environment outside a trace (a bug in epass:
    the retrace, which runs instead, finds the environment as it is now)."""


class Watch:
    """A program's shape environment through one decomposition.

    A change is allowed only inside :meth:`retrace`: a template trace, a kept
    operator's value, the runtime-assertion pass, each computed as the retrace
    computes it, in its context; whatever such a region learns, the retrace learns
    too. :meth:`frozen` regions (values read from disk, checks) must learn nothing,
    and :meth:`verify` raises :class:`Changed` for any change made outside a region.
    """

    def __init__(self, fake_mode: Any) -> None:
        self.fake_mode = fake_mode
        self.shape_env = fake_mode.shape_env
        self.last = snapshot(self.shape_env)
        # What each region learnt, in order (a test reads it).
        self.learnt: list[str] = []

    def verify(self, where: str) -> None:
        """Raise :class:`Changed` when the shape environment changed since the last
        region ended."""
        if self.shape_env is None:
            return
        now = snapshot(self.shape_env)
        if now != self.last:
            raise Changed(
                f"{where} changed the program's shape environment outside a trace "
                f"({difference(self.last, now)})"
            )

    @contextlib.contextmanager
    def retrace(self, what: str) -> Iterator[None]:
        """A region the retrace runs too, in the same context: what it learns is kept."""
        self.verify("epass")
        try:
            yield
        finally:
            if self.shape_env is not None:
                now = snapshot(self.shape_env)
                if now != self.last:
                    self.learnt.append(f"{what}: {difference(self.last, now)}")
                    self.last = now

    @contextlib.contextmanager
    def frozen(self, what: str) -> Iterator[None]:
        """Values computed in the trace's context with guards suppressed, which must
        leave the shape environment as it was."""
        self.verify("epass")
        try:
            with as_traced(self.fake_mode, suppress=True):
                yield
        finally:
            forget_unknowns(self.shape_env)
            self.verify(what)


# Symbols by name in a key's expressions; a name of this shape that the shape
# environment does not know is not renamed, and the key not written.
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SYMBOL_LIKE = re.compile(r"^[a-z]+[0-9]+$")


# What was computed lately of size expressions: their text, renamed text and free
# symbols. Printing or walking a deeply nested one (GoogLeNet's sizes with dynamic
# height and width) takes milliseconds, and the same expressions recur on every node
# whose shape holds them and in every key's facts. Equal expressions print alike
# (sympy compares them by structure, a float never equal to an integer).
_REMEMBERED: dict[Any, Any] = {}
_REMEMBERED_LIMIT = 1 << 16


def _remember(key: Any, compute: Callable[[], Any]) -> Any:
    found = _REMEMBERED.get(key, _REMEMBERED)
    if found is _REMEMBERED:
        if len(_REMEMBERED) >= _REMEMBERED_LIMIT:
            _REMEMBERED.clear()
        found = _REMEMBERED[key] = compute()
    return found


def expr_text(expr: Any) -> str:
    """``str(expr)`` of a sympy expression."""
    return _remember(("text", expr), lambda: str(expr))  # type: ignore[no-any-return]


def free_symbols(expr: Any) -> Any:
    """``expr.free_symbols`` of a sympy expression."""
    return _remember(("free", expr), lambda: frozenset(expr.free_symbols))


class Renaming:
    """A template key's symbols named by first appearance (``$0``, ``$1``, ...): a key
    written this way names the same template in any program whose symbols stand in
    the same places."""

    def __init__(self, symbols: list[Any]) -> None:
        import sympy

        self.symbols = symbols
        self.key = tuple(symbols)
        self.names = {str(s): f"${i}" for i, s in enumerate(symbols)}
        self.mapping = {s: sympy.Symbol(f"${i}", **s.assumptions0) for i, s in enumerate(symbols)}

    def text(self, expr: Any) -> str:
        """``expr`` with each of the key's symbols by its position.

        Raises:
            ValueError: when ``expr`` holds a symbol the key does not.
        """
        outside = free_symbols(expr) - self.mapping.keys()
        if outside:
            raise ValueError(f"mentions {sorted(map(str, outside))}, outside the key")
        return _remember(  # type: ignore[no-any-return]
            ("renamed", expr, self.key), lambda: str(expr.xreplace(self.mapping))
        )

    def parts(self, parts: Any) -> Any:
        """A template key's parts with the symbolic expressions renamed."""
        if isinstance(parts, tuple):
            if len(parts) == 3 and parts[0] == "sym":
                renamed = _TOKEN.sub(lambda m: self.names.get(m[0], m[0]), parts[2])
                return (parts[0], parts[1], renamed)
            return tuple(self.parts(p) for p in parts)
        return parts


def renaming(parts: Any, shape_env: Any) -> Renaming | None:
    """The symbols of a template key's ``parts`` by first appearance (None: it names
    a symbol the shape environment does not know)."""
    known = {str(s): s for s in shape_env.var_to_range}
    order: dict[str, Any] = {}

    def walk(p: Any) -> bool:
        if isinstance(p, tuple):
            if len(p) == 3 and p[0] == "sym":
                for token in _TOKEN.findall(p[2]):
                    if token in known:
                        order.setdefault(token, known[token])
                    elif _SYMBOL_LIKE.match(token):
                        return False
                return True
            return all(walk(x) for x in p)
        return True

    if not walk(parts):
        return None
    return Renaming(list(order.values()))


def facts(shape_env: Any, names: Renaming) -> dict[str, Any] | None:
    """What the shape environment knows of a key's symbols, renamed: each one's range,
    hint (None: unbacked), and every guard, replacement, deferred runtime assertion
    and divisibility fact that mentions any of them; and the environment's settings.
    None when such a fact also mentions a symbol outside the key: the template could
    depend on a symbol the key cannot name."""
    symbols = set(names.symbols)
    hints = shape_env.backed_var_to_val
    known: list[str] = []
    exprs: list[tuple[str, Any]] = [("guard", g.expr) for g in shape_env.guards]
    exprs += [("assert", r.expr) for rs in shape_env.deferred_runtime_asserts.values() for r in rs]
    exprs += [("divisible", d) for d in shape_env.divisible]
    for kind, expr in exprs:
        if free_symbols(expr) & symbols:
            try:
                known.append(f"{kind} {names.text(expr)}")
            except ValueError:
                return None
    for sym, value in shape_env.replacements.items():
        mentioned = {sym} | free_symbols(value)
        if mentioned & symbols:
            if not mentioned <= symbols:
                return None
            known.append(f"replace {names.text(sym)} {names.text(value)}")
    return {
        "symbols": [
            [str(shape_env.var_to_range.get(s)), None if s not in hints else int(hints[s])]
            for s in names.symbols
        ],
        "known": sorted(known),
        "settings": repr(shape_env.settings),
    }


def lesson(before: Snapshot | None, after: Snapshot | None, names: Renaming) -> Any:
    """What the shape environment learnt between two snapshots, as JSON data with the
    symbols by position: the guards added, in order, and the ranges and replacements
    they changed. None when it learnt anything else (a runtime assertion, a new
    symbol, a divisibility fact) or about a symbol outside ``names``.
    """
    if before is None or after is None:
        return None
    if before[3:] != after[3:]:
        return None
    try:
        guards = [names.text(g.expr) for g in after[0][len(before[0]) :]]
        if tuple(after[0][: len(before[0])]) != tuple(before[0]):
            return None
        changed: dict[str, list[str]] = {}
        for label, old, now in (("range", before[1], after[1]), ("replace", before[2], after[2])):
            for sym in set(old) | set(now):
                if old.get(sym) != now.get(sym):
                    value = now.get(sym)
                    shown = names.text(value) if label == "replace" else str(value)
                    changed.setdefault(label, []).append(f"{names.text(sym)}: {shown}")
    except ValueError:  # a symbol outside the key
        return None
    return {"guards": guards, **{k: sorted(v) for k, v in changed.items()}}


def teach(shape_env: Any, taught: Any, names: Renaming) -> None:
    """Teach ``shape_env`` the guards of a ``lesson``, as the trace that learnt them
    did, and require that it learns exactly that lesson.

    Raises:
        ValueError: for a guard that does not hold for the program's example sizes
            (before anything is taught), or a lesson other than ``taught``.
    """
    import sympy

    if not isinstance(taught, dict) or not isinstance(taught.get("guards"), list):
        raise ValueError("holds a malformed lesson")
    local = {f"_symbol{i}": s for i, s in enumerate(names.symbols)}
    hints = {s: shape_env.backed_var_to_val[s] for s in names.symbols}
    exprs = []
    for text in taught["guards"]:
        if not isinstance(text, str):
            raise ValueError("holds a malformed lesson")
        expr = sympy.sympify(re.sub(r"\$(\d+)", r"_symbol\1", text), locals=local)
        if expr.free_symbols - set(names.symbols) or expr.xreplace(hints) is not sympy.true:
            raise ValueError(f"teaches {text}, which the program's example does not meet")
        exprs.append(expr)
    before = snapshot(shape_env)
    for expr in exprs:
        shape_env.evaluate_expr(expr)
    learnt = lesson(before, snapshot(shape_env), names)
    if learnt != taught:
        raise Changed(f"a stored lesson taught {learnt} where it says {taught}")


def describe(value: Any, names: Renaming | None) -> Any:
    """A fake value as JSON data, its symbols renamed (shape, strides, offset, dtype,
    device; a symbolic scalar by its expression). Equal descriptions: the same value.

    Raises:
        ValueError: for a value of another kind, or one naming a symbol outside ``names``.
    """

    def size(s: Any) -> Any:
        if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            if names is None:
                raise ValueError("a symbolic value without symbols to name it")
            return {type(s).__name__: names.text(s.node.expr)}
        if isinstance(s, bool) or s is None:
            return s
        if isinstance(s, int):
            return s
        if isinstance(s, float):
            return {"float": s.hex()}
        raise ValueError(f"a value of type {type(s).__name__}")

    if isinstance(value, torch.Tensor):
        return {
            "tensor": [
                [size(s) for s in value.shape],
                [size(s) for s in value.stride()],
                size(value.storage_offset()),
                str(value.dtype),
                str(value.device),
            ]
        }
    if isinstance(value, (list, tuple)):
        return {"list": [describe(v, names) for v in value]}
    return size(value)


def run_guards(ep: Any) -> None:
    """Run the program's guards on its own inputs, as the retrace does: it traces
    ``ep.module()``, whose first call checks them (``_guards_fn``). Where sympy cannot
    settle one statically, evaluating it adds guards to the shape environment (in a
    simpler form, ``x + 1 > 1`` for ``x + 1 != 1``), which every program made after it
    carries in its ``_guards_code``. The function's other checks (each input size
    within its range, sizes that are one symbol equal) are statically true, so a
    program without guards code has nothing to run, and no copy of its graph is made
    for it (``ep.module()`` makes one)."""
    if not programs.guards_code(ep):
        return
    guards = programs.guards_fn(ep.module())
    if guards is None:  # ep.module() makes none (called from ExecuTorch, say)
        return
    users = set(ep.graph_signature.user_inputs)
    values = [
        n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in users
    ]
    guards(*values)


def learnt(before: Snapshot | None, after: Snapshot | None) -> str | None:
    """What the retrace taught the shape environment after the incremental path ran
    (None: nothing)."""
    if before == after:
        return None
    return (
        "the retrace taught the program's shape environment what the incremental path "
        f"did not: {difference(before, after)}"
    )

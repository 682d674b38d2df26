"""``bisect``: find the first pass after which a check on the program fails."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
from torch.export import ExportedProgram

from epass.errors import ArgumentValueError, PassError
from epass.manager import PassManager, resolve_pass
from epass.protocol import pass_name

__all__ = ["BisectResult", "bisect"]

logger = logging.getLogger("epass")

# How a bisection searches: binary (the predicate, once false, stays false) or linear.
Search = Literal["binary", "linear"]
Predicate = Callable[[ExportedProgram], Any]


@attrs.frozen
class BisectResult:
    """The culprit of a bisection.

    Attributes:
        index: the culprit's position in ``passes`` (0-based); the shortest
            failing prefix is ``passes[: index + 1]``.
        pass_: the culprit pass object; ``name`` its name.
        before: the program just before the culprit (the predicate holds on it).
        after: the program just after it, or None when the culprit raised.
        error: the exception, when the culprit raised or the predicate raised on
            ``after``; None when the predicate simply returned False.
        evaluations: how many prefixes the predicate was evaluated on.
        method: ``"binary"`` or ``"linear"``.
        inner: when the culprit is a nested ``PassManager`` and ``recursive`` is
            set, the bisection inside it.
    """

    index: int
    pass_: Any
    name: str
    before: ExportedProgram
    after: ExportedProgram | None
    error: BaseException | None
    evaluations: int
    method: str
    inner: BisectResult | None = None

    def __str__(self) -> str:
        text = f"culprit: pass {self.name!r} at position {self.index}"
        if self.inner is not None:
            text += f" -> {self.inner}"
        elif self.error is not None:
            text += f" ({type(self.error).__name__}: {str(self.error).splitlines()[0]})"
        return text


class _Prefixes:
    """Programs after each prefix of the pipeline, computed lazily from the nearest
    computed shorter prefix and cached."""

    def __init__(self, ep: ExportedProgram, passes: Sequence[Any], manager_options: Any) -> None:
        self.passes = passes
        self.options = manager_options
        self.programs: dict[int, ExportedProgram] = {0: ep}
        self.errors: dict[int, BaseException] = {}
        self.verdicts: dict[int, tuple[bool, BaseException | None]] = {}

    def program(self, k: int) -> ExportedProgram | None:
        """The program after ``passes[:k]``, or None when one of them raised."""
        if k in self.programs:
            return self.programs[k]
        if any(j <= k for j in self.errors):
            return None
        start = max(j for j in self.programs if j <= k)

        current = self.programs[start]
        for j in range(start, k):
            try:
                current = PassManager([self.passes[j]], **self.options).run(current)
            except PassError as exc:
                self.errors[j + 1] = exc
                return None
            self.programs[j + 1] = current
        return current

    def good(self, k: int, predicate: Predicate) -> bool:
        if k in self.verdicts:
            return self.verdicts[k][0]
        program = self.program(k)
        error: BaseException | None = None
        if program is None:
            ok = False
            error = next(e for j, e in sorted(self.errors.items()) if j <= k)
        else:
            try:
                ok = predicate(program) is not False
            except Exception as exc:
                ok, error = False, exc
        self.verdicts[k] = (ok, error)
        logger.debug("bisect: prefix %d (%s) is %s", k, self._last_name(k), "good" if ok else "bad")
        return ok

    def _last_name(self, k: int) -> str:
        return pass_name(self.passes[k - 1]) if k else "<input>"


def bisect(
    ep: ExportedProgram,
    passes: Sequence[Any],
    predicate: Predicate,
    *,
    method: Literal["auto", "binary", "linear"] = "auto",
    recursive: bool = True,
    verify: bool = True,
) -> BisectResult | None:
    """Find the shortest prefix of ``passes`` after which ``predicate`` fails.

    ``predicate(program)`` fails when it returns False or raises; a pass that
    raises also counts as a failure at its position. The passes run one at a
    time through a ``PassManager`` (so state is linked and outputs verified as in
    a real pipeline), and every program computed is cached, so each pass runs at
    most once per bisection.

    Args:
        ep: the input program; the predicate must hold on it.
        passes: the pipeline, as a list (a ``PassManager`` is taken as its passes).
        predicate: the check, e.g. a numerics comparison or a verifier.
        method: ``"binary"`` assumes that once the predicate fails it keeps failing
            (LLVM's ``-opt-bisect-limit`` style), evaluating it O(log n) times;
            ``"linear"`` tries every prefix in order and always finds the first
            failure; ``"auto"`` (default) is binary unless the predicate has a
            ``monotonic = False`` attribute; when the whole pipeline passes it
            falls back to a linear scan, since a later pass may hide an earlier
            failure that binary search cannot see.
        recursive: when the culprit is a nested ``PassManager``, bisect inside it.
        verify: verify each pass's output (as ``PassManager(verify=...)``).

    Returns:
        A :class:`BisectResult`, or None when the predicate holds after every pass.

    Raises:
        ValueError: the predicate already fails on ``ep``.

    Example::

        found = bisect(ep, passes, lambda p: torch.allclose(p.module()(x), expected))
        print(found)  # culprit: pass 'swap-add' at position 3
    """
    if isinstance(passes, PassManager):
        passes = passes.passes
    passes = [resolve_pass(p, i) for i, p in enumerate(passes)]
    if method not in ("auto", "binary", "linear"):
        raise ArgumentValueError(f"method must be 'auto', 'binary' or 'linear', got {method!r}")
    prefixes = _Prefixes(ep, passes, {"verify": verify})
    if not prefixes.good(0, predicate):
        _, error = prefixes.verdicts[0]
        raise ArgumentValueError(
            "the predicate already fails on the input program, before any pass"
            + (f": {type(error).__name__}: {error}" if error else "")
        )
    bad, found_by = _search(prefixes, predicate, len(passes), method)
    if bad is None:
        return None
    return _found(prefixes, passes, bad, predicate, found_by, recursive)


def _search(
    prefixes: _Prefixes,
    predicate: Predicate,
    n: int,
    method: Literal["auto", "binary", "linear"],
) -> tuple[int | None, Search]:
    """The shortest failing prefix length (None if none fails), and how it was found:
    ``auto`` is binary unless the predicate says it is not monotonic, and scans
    linearly when binary search finds nothing."""
    if method == "linear" or (method == "auto" and getattr(predicate, "monotonic", 1) is False):
        return next((k for k in range(1, n + 1) if not prefixes.good(k, predicate)), None), "linear"
    bad = _binary(prefixes, predicate, n)
    if bad is None and method == "auto":
        return next((k for k in range(1, n) if not prefixes.good(k, predicate)), None), "linear"
    return bad, "binary"


def _found(
    prefixes: _Prefixes,
    passes: list[Any],
    bad: int,
    predicate: Predicate,
    method: Search,
    recursive: bool,
) -> BisectResult:
    """The result for the culprit at ``bad - 1``, bisected inside when it is a pipeline."""
    index = bad - 1
    before = prefixes.program(index)
    assert before is not None  # prefix `index` was evaluated good
    after = prefixes.program(bad)
    _, error = prefixes.verdicts[bad]
    culprit = passes[index]
    inner = None
    if recursive and isinstance(culprit, PassManager) and culprit.passes:
        # verify=culprit.verify: the nested pipeline's own setting decides.
        inner = bisect(
            before,
            culprit.passes,
            predicate,
            method=method,
            verify=culprit.verify,  # type: ignore[arg-type]
        )
    return BisectResult(
        index=index,
        pass_=culprit,
        name=pass_name(culprit),
        before=before,
        after=after,
        error=error,
        evaluations=len(prefixes.verdicts),
        method=method,
        inner=inner,
    )


def _binary(prefixes: _Prefixes, predicate: Predicate, n: int) -> int | None:
    """Smallest failing prefix length, assuming good ... good bad ... bad."""
    if n == 0 or prefixes.good(n, predicate):
        return None
    lo, hi = 0, n  # lo is good, hi is bad
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefixes.good(mid, predicate):
            lo = mid
        else:
            hi = mid
    return hi

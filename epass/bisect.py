"""``bisect``: find the first pass after which a check on the program fails."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch
from torch.export import ExportedProgram

from epass.errors import ArgumentTypeError, ArgumentValueError, PassError
from epass.instruments.values import private_copy
from epass.manager import PassManager, resolve_pass
from epass.protocol import adapt, pass_name

__all__ = ["BisectResult", "RewriteCulprit", "bisect"]

logger = logging.getLogger("epass")

# How a bisection searches: binary (the predicate, once false, stays false) or linear.
Search = Literal["binary", "linear"]
Predicate = Callable[[ExportedProgram], Any]


@attrs.frozen
class RewriteCulprit:
    """The one rewrite of a counted pass after which the check fails (the pass's
    ``with_max_rewrites``, :class:`~epass.protocol.RewriteCounter`).

    Attributes:
        number: the rewrite's number (1-based): the pass limited to ``number - 1``
            rewrites passes the check, limited to ``number`` it fails.
        total: how many rewrites the pass makes on that program (None when the
            pass raised before it could say).
        rewrite: which one, as the pass counts it: ``"aten.gelu.default at node gelu_3"``.
        before / after: the programs with ``number - 1`` and ``number`` rewrites
            (``after`` is None when the limited pass raised).
        error: the exception, when the limited pass or the predicate raised.
        evaluations: how many limited runs the search made.
    """

    number: int
    total: int | None
    rewrite: str | None
    before: ExportedProgram
    after: ExportedProgram | None
    error: BaseException | None
    evaluations: int

    def __str__(self) -> str:
        total = "?" if self.total is None else str(self.total)
        return f"rewrite {self.number} of {total}: {self.rewrite or '(unnamed)'}"


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
        rewrite: when the culprit counts its rewrites (``with_max_rewrites``, as
            ``Decompose``, ``ReplaceOps``, ``CSE``, ``ConstantFold`` and
            ``FuseConvBN`` do) and ``rewrites`` is set, the first rewrite after which
            the predicate fails (:class:`RewriteCulprit`; found assuming that once it
            fails it keeps failing as more rewrites are applied), or None.
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
    rewrite: RewriteCulprit | None = None

    def __str__(self) -> str:
        text = f"culprit: pass {self.name!r} at position {self.index}"
        if self.rewrite is not None:
            text += f", {self.rewrite}"
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
                current = _run_on_copy(self.passes[j], current, self.options)
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


def _run_on_copy(pass_: Any, program: ExportedProgram, options: Any) -> ExportedProgram:
    """``pass_`` run on a copy of ``program``'s state: the cached program the pass
    started from is judged later, and must still hold the values it had, whatever
    the pass wrote. Entries the pass left equal are the input's tensors again, so
    that the cached programs hold one copy of the state, not one per pass."""
    copy = private_copy(program)
    out = PassManager([pass_], **options).run(copy)
    originals = {
        id(mine): given
        for d, theirs in (
            (copy.state_dict, program.state_dict),
            (copy.constants, program.constants),
        )
        for key, mine in d.items()
        if isinstance((given := theirs.get(key)), torch.Tensor)
    }
    for d in (out.state_dict, out.constants):
        for key, value in d.items():
            given = originals.get(id(value))
            if given is not None and _unchanged(value, given):
                d[key] = given
    return out


def _unchanged(value: torch.Tensor, given: torch.Tensor) -> bool:
    return (
        value.dtype == given.dtype
        and value.shape == given.shape
        and value.stride() == given.stride()
        and value.storage_offset() == given.storage_offset()
        and bool(torch.equal(value, given))
    )


def bisect(
    ep: ExportedProgram,
    passes: Sequence[Any],
    predicate: Predicate,
    *,
    method: Literal["auto", "binary", "linear"] = "auto",
    recursive: bool = True,
    verify: bool = True,
    rewrites: bool = True,
) -> BisectResult | None:
    """Find the shortest prefix of ``passes`` after which ``predicate`` fails.

    ``predicate(program)`` fails when it returns False or raises; a pass that
    raises also counts as a failure at its position. The passes run one at a
    time through a ``PassManager`` (so state is linked and outputs verified as in
    a real pipeline), and every program computed is cached, so each pass runs at
    most once per bisection. They run on a private copy of ``ep`` (its graph,
    dicts, state tensors and example inputs), and each pass on a copy of its
    input's state: a pass that writes into the weights, raising or not, leaves the
    user's tensors as they were, and the programs before it hold the values they
    had when the predicate judges them. The programs of the result hold copies of
    the user's tensors (one copy for the entries no pass changed).

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
        rewrites: go below a culprit that counts its rewrites (``result.rewrite``).

    Returns:
        A :class:`BisectResult`, or None when the predicate holds after every pass.

    Raises:
        ValueError: the predicate already fails on ``ep``.

    Example::

        found = bisect(ep, passes, lambda p: torch.allclose(p.module()(x), expected))
        print(found)  # culprit: pass 'swap-add' at position 3
    """
    if not isinstance(ep, ExportedProgram):
        raise ArgumentTypeError(f"bisect takes an ExportedProgram, got {type(ep).__name__}")
    if method not in ("auto", "binary", "linear"):
        raise ArgumentValueError(f"method must be 'auto', 'binary' or 'linear', got {method!r}")
    return _bisect(private_copy(ep), passes, predicate, method, recursive, verify, rewrites)


def _bisect(
    ep: ExportedProgram,
    passes: Sequence[Any],
    predicate: Predicate,
    method: Literal["auto", "binary", "linear"],
    recursive: bool,
    verify: bool,
    rewrites: bool,
) -> BisectResult | None:
    """:func:`bisect` on ``ep``, a program the bisection owns (no copy is made)."""
    if isinstance(passes, PassManager):
        passes = passes.passes
    passes = [resolve_pass(p, i) for i, p in enumerate(passes)]
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
    return _found(prefixes, passes, bad, predicate, found_by, recursive, rewrites)


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
    rewrites: bool,
) -> BisectResult:
    """The result for the culprit at ``bad - 1``, bisected inside when it is a pipeline,
    or below the pass, rewrite by rewrite, when it counts its rewrites."""
    index = bad - 1
    before = prefixes.program(index)
    assert before is not None  # prefix `index` was evaluated good
    after = prefixes.program(bad)
    _, error = prefixes.verdicts[bad]
    culprit = passes[index]
    inner = None
    if recursive and isinstance(culprit, PassManager) and culprit.passes:
        # verify=culprit.verify: the nested pipeline's own setting decides.
        inner = _bisect(
            before,
            culprit.passes,
            predicate,
            method,
            recursive,
            culprit.verify,  # type: ignore[arg-type]
            rewrites,
        )
    rewrite = None
    if rewrites and inner is None:
        rewrite = _rewrite(before, culprit, predicate, bool(prefixes.options["verify"]))
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
        rewrite=rewrite,
    )


def _binary(prefixes: _Prefixes, predicate: Predicate, n: int) -> int | None:
    """Smallest failing prefix length, assuming good ... good bad ... bad."""
    if n == 0 or prefixes.good(n, predicate):
        return None
    return _halve(0, n, lambda k: prefixes.good(k, predicate))[1]


def _halve(lo: int, hi: int, good: Callable[[int], bool]) -> tuple[int, int]:
    """Halve ``lo`` (good) .. ``hi`` (bad) down to adjacent ``(good, bad)`` limits."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if good(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


# One limited run: its program (None when it raised), the error, its notes.
_Run = tuple[ExportedProgram | None, BaseException | None, dict[str, Any]]


class _Limited:
    """The runs of one counted pass on one program, each with a limit on its
    rewrites, cached by limit."""

    def __init__(self, before: ExportedProgram, limit: Callable[[int | None], Any], verify: bool):
        self.before = before
        self.limit = limit
        self.verify = verify
        self.runs: dict[int, _Run] = {}
        self.verdicts: dict[int, bool] = {}

    def run(self, k: int) -> _Run:
        if k not in self.runs:
            try:
                result = PassManager([self.limit(k)], verify=self.verify)(self.before)
            except PassError as exc:
                self.runs[k] = (None, exc, {})
            else:
                notes = dict(result.records[-1].notes) if result.records else {}
                self.runs[k] = (result.program, None, notes)
        return self.runs[k]

    def good(self, k: int, predicate: Predicate) -> bool:
        if k not in self.verdicts:
            program = self.run(k)[0]
            ok = False
            if program is not None:
                try:
                    ok = predicate(program) is not False
                except Exception as exc:
                    self.runs[k] = (program, exc, self.runs[k][2])
            self.verdicts[k] = ok
        return self.verdicts[k]

    def applied(self, k: int) -> int | None:
        count = self.run(k)[2].get("rewrites")
        return count if isinstance(count, int) else None


def _rewrite(
    before: ExportedProgram, culprit: Any, predicate: Predicate, verify: bool
) -> RewriteCulprit | None:
    """The first rewrite of ``culprit`` after which ``predicate`` fails, found by
    doubling the limit until it fails, then halving the interval (LLVM's
    ``-opt-bisect-limit``, inside one pass). None when the pass does not count its
    rewrites, or when limiting them does not reproduce the failure."""
    limit = adapt(culprit).limit_rewrites
    if limit is None:
        return None
    runs = _Limited(before, limit, verify)
    if not runs.good(0, predicate):
        return None  # the failure is not one rewrite's
    lo, hi = 0, 1
    while runs.good(hi, predicate):
        applied = runs.applied(hi)
        if applied is None or applied < hi:
            return None  # every rewrite applied, and the check still holds
        lo, hi = hi, hi * 2
    lo, hi = _halve(lo, hi, lambda k: runs.good(k, predicate))
    full = runs.run(sys.maxsize)[2].get("rewrites") if runs.run(hi)[1] is None else None
    program, error, notes = runs.run(hi)
    before_program = runs.run(lo)[0]
    assert before_program is not None  # limit lo was evaluated good
    logger.debug("bisect: %s fails at rewrite %d", pass_name(culprit), hi)
    return RewriteCulprit(
        number=hi,
        total=full if isinstance(full, int) else None,
        rewrite=notes.get("last_rewrite"),
        before=before_program,
        after=program,
        error=error,
        evaluations=len(runs.verdicts),
    )

"""Expected failures that are a backend's bug, named by what the backend raises: the
exact class of its error and patterns its message (or the message of an error it
chains from) holds. A strict xfail that names no exception passes on any failure,
an error of epass's own included; one made here fails on anything but that error."""

from __future__ import annotations

import re
from typing import Any

import pytest


class _Exactly(type):
    """The metaclass of :func:`exactly`'s classes: ``isinstance`` (which pytest's xfail
    asks of the raised error) holds only for the named class itself, not a subclass,
    and only where each pattern is found in its message or a chained one."""

    wanted: str
    patterns: tuple[re.Pattern[str], ...]

    def __instancecheck__(cls, error: Any) -> bool:
        kind = type(error)
        if f"{kind.__module__}.{kind.__qualname__}" != cls.wanted:
            return False
        chain, seen = [], set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            chain.append(str(error))
            error = error.__cause__ or error.__context__
        return all(any(p.search(text) for text in chain) for p in cls.patterns)


def exactly(error: str, *match: str) -> type[BaseException]:
    """A class whose instances, for ``isinstance``, are the errors of exactly the class
    named ``error`` (``module.QualName``, so that naming a backend's class imports
    nothing; not a subclass: epass's own errors subclass ``RuntimeError`` and
    ``ValueError``) in whose message, or a chained one, each pattern of ``match`` is
    found."""
    name = f"exactly {error} matching {match!r}"
    namespace = {"wanted": error, "patterns": tuple(map(re.compile, match))}
    return _Exactly(name, (BaseException,), namespace)  # type: ignore[return-value]


def upstream_bug(reason: str, raises: str, *match: str) -> Any:
    """A strict xfail for a backend's bug that raises exactly the class named
    ``raises``, each pattern of ``match`` found in its message or a chained one; any
    other failure fails the test."""
    return pytest.mark.xfail(strict=True, reason=reason, raises=exactly(raises, *match))


# What each backend bug raises: the class and patterns of its messages. torch's pass
# manager, which ExecuTorch runs, raises a bare Exception from the pass's error.
XNNPACK_BMM_LINEAR = (
    "builtins.Exception",
    r"'ConvertToLinearPass' pass",
    r"t\(\) expects a tensor with <= 2 dimensions",
)
TVM_CUMSUM_BOOL = ("tvm.error.InternalError", r"MatchesCode\(DLDataTypeCode::kDLFloat\)")
# IREE says only "Compilation failed: See diagnostics"; consumer_models.iree_run adds
# the diagnostics IREE printed, which name the operator it has no lowering for.
IREE_BATCH_NORM = ("builtins.RuntimeError", r"'torch\.operator'.*aten\._native_batch_norm_legit")
IREE_DIFF = ("builtins.RuntimeError", r"'torch\.operator'.*torch\.aten\.diff\"")

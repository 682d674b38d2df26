"""How the screen says no: the refusal every check raises, the one-line error it
becomes at the edge of the screen, and the first line of any error's text."""

from __future__ import annotations

from epass.errors import UnsafeArchiveError

__all__ = ["Refusal", "first_line", "unsafe_error"]


class Refusal(Exception):
    """A member the screen refuses, and why; :func:`screen` turns it into an
    :class:`~epass.errors.UnsafeArchiveError` (see :func:`unsafe_error`)."""

    def __init__(self, member: str, why: str) -> None:
        super().__init__(why)
        self.member = member
        self.why = why


def unsafe_error(name: str, refused: Refusal) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"{name}: refused member {refused.member!r}: {refused.why}; nothing was loaded "
        "(rerun with --trust only if you trust where the file came from)",
        path=name,
        member=refused.member,
    )


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an error, cut to its first sentence when long."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > limit and ". " in line:
        line = line[: line.index(". ") + 1]
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__

"""Whether the incremental decomposition ran: the errors it raised, which
``Decompose`` answers with torch's retrace and names only in its notes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from epass._decomp import splice
from epass._decomp.safety import Fallback


@contextlib.contextmanager
def incremental_path_errors() -> Iterator[list[BaseException]]:
    """The errors the incremental path raised while the block ran, other than its
    declared ``Fallback`` (a reason it cannot promise torch's program): a test of the
    fast path fails on one, where ``Decompose`` would retrace and pass."""
    raised: list[BaseException] = []
    real = splice.decompose

    def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        except Fallback:
            raise
        except Exception as exc:
            raised.append(exc)
            raise

    splice.decompose = watched  # type: ignore[assignment]
    try:
        yield raised
    finally:
        splice.decompose = real  # type: ignore[assignment]

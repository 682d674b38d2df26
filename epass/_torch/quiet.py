"""The warnings torch raises from its own code, silenced: one message, for one call."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

__all__ = ["leaf_specs", "loader"]

# warnings.catch_warnings saves and restores the process's filter list: two threads
# that overlap would restore each other's filter, and leave it on for good.
_WARNINGS_LOCK = threading.RLock()


@contextlib.contextmanager
def _quiet(message: str, category: type[Warning]) -> Iterator[None]:
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message, category=category)
        yield


def leaf_specs() -> contextlib.AbstractContextManager[None]:
    """Silence torch's ``LeafSpec`` ``FutureWarning`` (2.13 and later) while torch
    itself deep-copies a program's call graph (``run_decompositions`` and
    ``_get_updated_module_call_graph`` do): that one message, for that call. epass's
    own copies share leaf specs (``_program.copy_call_graph``) and raise none."""
    return _quiet(r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)


def loader() -> contextlib.AbstractContextManager[None]:
    """Silence the ``UserWarning`` torch 2.11 and 2.12 raise while loading an archive
    (``torch.frombuffer`` over bytes only the tensor owns): that message, for that call."""
    return _quiet(r"The given buffer is not writable", UserWarning)

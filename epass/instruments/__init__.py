"""Instrumentation: the built-in instruments, one per module, on the hooks of
:mod:`epass.instrumentation`.

========================  ===================================================
instrument                what it records
========================  ===================================================
:class:`Timing`           wall time per pass, aggregated over steps and runs
:class:`PrintIR`          graphs before/after passes, or unified diffs
:class:`OpCounts`         call_function histograms and their change per pass
:class:`NumericsCheck`    output drift per pass; names the first drifting one
:class:`MemoryAccounting` unique state bytes, bytes added, duplicated values
:class:`Progress`         a live progress display (``rich``, terminals only)
:class:`Reproducer`       a ``repro.py`` directory when a pass fails
========================  ===================================================

:class:`Spinner` is no instrument: it is the ``progress`` callable ``epass.load`` and
``epass.save`` take, a spinner line for loading, screening and saving.

With no instrument registered the manager skips every hook call.
"""

from epass.errors import NumericsDriftError
from epass.instrumentation import Dispatch, Instrument
from epass.instruments.ir import IRDump, OpCountEntry, OpCounts, PrintIR, format_delta
from epass.instruments.memory import MemoryAccounting, MemoryEntry, StateMemory, state_memory
from epass.instruments.numerics import Drift, NumericsCheck, compare_outputs, run_program
from epass.instruments.progress import Progress, Spinner
from epass.instruments.reproducer import Reproducer
from epass.instruments.timing import Timing, TimingRow
from epass.records import PassInfo

__all__ = [
    "Dispatch",
    "Drift",
    "IRDump",
    "Instrument",
    "MemoryAccounting",
    "MemoryEntry",
    "NumericsCheck",
    "NumericsDriftError",
    "OpCountEntry",
    "OpCounts",
    "PassInfo",
    "PrintIR",
    "Progress",
    "Spinner",
    "Reproducer",
    "StateMemory",
    "Timing",
    "TimingRow",
    "compare_outputs",
    "format_delta",
    "run_program",
    "state_memory",
]

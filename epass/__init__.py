"""epass: a pass manager for torch.export.ExportedProgram that keeps state shared.

This module re-exports the public API. The package is layered; each layer imports
only from the ones below it (``lint-imports`` checks this, see docs/concepts.md)::

    face         cli, __main__, this module
    tools        report, bisect, onnx, executorch
    instruments  instruments/*
    text         pipeline
    built-ins    passes/*
    engine       manager, instrumentation, io
    contract     protocol, records, linker, registry
    core         errors, verify, _program, _graph, _version
"""

from epass._version import __version__
from epass.bisect import BisectResult, bisect
from epass.errors import (
    EpassError,
    InstrumentError,
    OrderingError,
    PassError,
    PipelineError,
    ProgramError,
    StateConflictError,
    StateMutationError,
    VerificationError,
)
from epass.instruments import (
    Instrument,
    MemoryAccounting,
    NumericsCheck,
    OpCounts,
    PassInfo,
    PrintIR,
    Progress,
    Reproducer,
    Timing,
)
from epass.linker import DictReport, LinkReport, LinkResult, StateLinker, prune
from epass.manager import PassManager
from epass.passes import Decompose
from epass.pipeline import create_pass
from epass.protocol import FxPass, Pass, PassResult
from epass.records import PassRecord, PipelineResult
from epass.registry import list_passes, register_pass
from epass.verify import verify_program

__all__ = [
    "BisectResult",
    "Decompose",
    "DictReport",
    "EpassError",
    "FxPass",
    "Instrument",
    "InstrumentError",
    "LinkReport",
    "LinkResult",
    "MemoryAccounting",
    "NumericsCheck",
    "OpCounts",
    "OrderingError",
    "Pass",
    "PassError",
    "PassInfo",
    "PassManager",
    "PassRecord",
    "PassResult",
    "PipelineError",
    "PipelineResult",
    "PrintIR",
    "ProgramError",
    "Progress",
    "Reproducer",
    "StateConflictError",
    "StateLinker",
    "StateMutationError",
    "Timing",
    "VerificationError",
    "bisect",
    "create_pass",
    "list_passes",
    "prune",
    "register_pass",
    "__version__",
    "verify_program",
]

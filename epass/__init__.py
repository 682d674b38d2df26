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
    CliError,
    EpassError,
    HandOffError,
    InstrumentError,
    LoadError,
    OptionError,
    OrderingError,
    PassError,
    PipelineError,
    ProgramError,
    SaveError,
    StateConflictError,
    StateMutationError,
    UnsafeArchiveError,
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
from epass.io import inspect, load, prune, save
from epass.linker import DictReport, LinkReport, LinkResult, StateLinker
from epass.manager import PassManager
from epass.passes import Decompose
from epass.pipeline import create_pass
from epass.protocol import FxPass, Pass, PassResult
from epass.records import PassRecord, PipelineResult
from epass.registry import list_passes, register_pass, unregister_pass
from epass.verify import verify_program

__all__ = [
    "BisectResult",
    "CliError",
    "Decompose",
    "DictReport",
    "EpassError",
    "FxPass",
    "HandOffError",
    "Instrument",
    "InstrumentError",
    "LinkReport",
    "LinkResult",
    "LoadError",
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
    "OptionError",
    "PipelineError",
    "PipelineResult",
    "PrintIR",
    "ProgramError",
    "Progress",
    "Reproducer",
    "SaveError",
    "StateConflictError",
    "StateLinker",
    "StateMutationError",
    "Timing",
    "UnsafeArchiveError",
    "VerificationError",
    "bisect",
    "create_pass",
    "inspect",
    "list_passes",
    "load",
    "prune",
    "register_pass",
    "unregister_pass",
    "save",
    "__version__",
    "verify_program",
]

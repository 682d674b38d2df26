"""epass: a pass manager for torch.export.ExportedProgram that keeps state shared."""

from epass.bisect import BisectResult, bisect
from epass.errors import (
    CliError,
    EpassError,
    InstrumentError,
    LoadError,
    OrderingError,
    PassError,
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
from epass.manager import PassManager, PassRecord, PipelineResult
from epass.passes import Decompose
from epass.pipeline import PipelineError
from epass.protocol import FxPass, Pass, PassResult
from epass.registry import create_pass, list_passes, register_pass
from epass.verify import verify_program

__all__ = [
    "BisectResult",
    "CliError",
    "Decompose",
    "DictReport",
    "EpassError",
    "FxPass",
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
    "PipelineError",
    "PipelineResult",
    "PrintIR",
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
    "save",
    "verify_program",
]

__version__ = "0.1.0"

"""epass: a pass manager for torch.export.ExportedProgram that keeps state shared."""

from epass.bisect import BisectResult, bisect
from epass.errors import (
    EpassError,
    InstrumentError,
    OrderingError,
    PassError,
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
from epass.manager import PassManager, PassRecord, PipelineResult
from epass.passes import Decompose
from epass.pipeline import PipelineError
from epass.protocol import FxPass, Pass, PassResult
from epass.registry import create_pass, list_passes, register_pass
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
    "verify_program",
]

__version__ = "0.1.0"

"""epass: a pass manager for torch.export.ExportedProgram that keeps state shared.

This module re-exports the public API, lazily: a name's module is imported the first
time the name is used, so ``import epass`` and ``epass --help`` do not wait for torch.
The package is layered; each layer imports only from the ones below it
(``lint-imports`` checks this, see docs/concepts.md)::

    face         cli/, fast_decompositions, _terminal, __main__, this module
    tools        report, bisect, reduce, onnx, executorch, tvm, iree, _handoff, _switch
    instruments  instruments/*
    built-ins    passes/*
    engine       manager, io; planning, _outcome; _screen/, instrumentation
    contract     building; records, registry; protocol, linker, watch, options, _catalog, _paths
    grammar      pipeline
    core         verification, _decomp/, _snapshot, _graph, _program, errors, _version
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from epass._version import __version__

if TYPE_CHECKING:
    # What type checkers read: the names of _EXPORTS, re-exported (``X as X``);
    # tests/test_layers.py checks that the two agree.
    from epass._decomp.templates import cache_info as cache_info
    from epass._decomp.templates import clear_cache as clear_cache
    from epass.bisect import BisectResult as BisectResult
    from epass.bisect import bisect as bisect
    from epass.errors import CliError as CliError
    from epass.errors import EpassError as EpassError
    from epass.errors import HandOffError as HandOffError
    from epass.errors import InstrumentError as InstrumentError
    from epass.errors import LoadError as LoadError
    from epass.errors import OptionError as OptionError
    from epass.errors import OrderingError as OrderingError
    from epass.errors import PassError as PassError
    from epass.errors import PipelineError as PipelineError
    from epass.errors import ProgramError as ProgramError
    from epass.errors import SaveError as SaveError
    from epass.errors import StateConflictError as StateConflictError
    from epass.errors import StateMutationError as StateMutationError
    from epass.errors import UnsafeArchiveError as UnsafeArchiveError
    from epass.errors import VerificationError as VerificationError
    from epass.fast_decompositions import DecompositionLog as DecompositionLog
    from epass.fast_decompositions import fast_decompositions as fast_decompositions
    from epass.instruments import Instrument as Instrument
    from epass.instruments import MemoryAccounting as MemoryAccounting
    from epass.instruments import NumericsCheck as NumericsCheck
    from epass.instruments import OpCounts as OpCounts
    from epass.instruments import PassInfo as PassInfo
    from epass.instruments import PrintIR as PrintIR
    from epass.instruments import Progress as Progress
    from epass.instruments import Reproducer as Reproducer
    from epass.instruments import Timing as Timing
    from epass.io import inspect as inspect
    from epass.io import load as load
    from epass.io import prune as prune
    from epass.io import save as save
    from epass.linker import DictReport as DictReport
    from epass.linker import LinkReport as LinkReport
    from epass.linker import LinkResult as LinkResult
    from epass.linker import StateLinker as StateLinker
    from epass.manager import PassManager as PassManager
    from epass.manager import create_pass as create_pass
    from epass.passes import Decompose as Decompose
    from epass.protocol import FxPass as FxPass
    from epass.protocol import Notice as Notice
    from epass.protocol import Pass as Pass
    from epass.protocol import PassResult as PassResult
    from epass.records import PassRecord as PassRecord
    from epass.records import PipelineResult as PipelineResult
    from epass.reduce import ReduceResult as ReduceResult
    from epass.reduce import reduce as reduce
    from epass.registry import list_passes as list_passes
    from epass.registry import register_pass as register_pass
    from epass.registry import unregister_pass as unregister_pass
    from epass.verification import verify_program as verify_program

# The public API: where each name lives (its module is imported on first use). The
# one list of public names: ``__all__`` and the lazy lookup below are made from it.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "epass._decomp.templates": ("cache_info", "clear_cache"),
    "epass.bisect": ("BisectResult", "bisect"),
    "epass.errors": (
        "CliError",
        "EpassError",
        "HandOffError",
        "InstrumentError",
        "LoadError",
        "OptionError",
        "OrderingError",
        "PassError",
        "PipelineError",
        "ProgramError",
        "SaveError",
        "StateConflictError",
        "StateMutationError",
        "UnsafeArchiveError",
        "VerificationError",
    ),
    "epass.fast_decompositions": ("DecompositionLog", "fast_decompositions"),
    "epass.instruments": (
        "Instrument",
        "MemoryAccounting",
        "NumericsCheck",
        "OpCounts",
        "PassInfo",
        "PrintIR",
        "Progress",
        "Reproducer",
        "Timing",
    ),
    "epass.io": ("inspect", "load", "prune", "save"),
    "epass.linker": ("DictReport", "LinkReport", "LinkResult", "StateLinker"),
    "epass.manager": ("PassManager", "create_pass"),
    "epass.passes": ("Decompose",),
    "epass.protocol": ("FxPass", "Notice", "Pass", "PassResult"),
    "epass.records": ("PassRecord", "PipelineResult"),
    "epass.reduce": ("ReduceResult", "reduce"),
    "epass.registry": ("list_passes", "register_pass", "unregister_pass"),
    "epass.verification": ("verify_program",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [*_MODULE_OF, "__version__"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        # A submodule, such as epass.io: `import epass` used to import them all.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # Importing the submodule epass.bisect binds the package's ``bisect`` to that
        # module; the public name is the function it defines.
        if isinstance(value, types.ModuleType) and _MODULE_OF.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

"""epass: a pass manager for torch.export.ExportedProgram that keeps state shared.

This module re-exports the public API, lazily: a name's module is imported the first
time the name is used, so ``import epass`` and ``epass --help`` do not wait for torch.
The package is layered; each layer imports only from the ones below it
(``lint-imports`` checks this, see docs/concepts.md)::

    face         cli/, _terminal, __main__, this module
    tools        report, bisect, reduce, onnx, executorch, tvm, iree, _handoff
    instruments  instruments/*
    built-ins    passes/*
    engine       manager, io, _screen/, instrumentation
    contract     records, registry; protocol, linker, watch, options, _catalog, _paths
    grammar      pipeline
    core         verify, _decomp/, _snapshot, _graph, _program, errors, _version
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from epass._version import __version__

if TYPE_CHECKING:
    from epass._decomp.templates import cache_info, clear_cache
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
    from epass.manager import PassManager, create_pass
    from epass.passes import Decompose
    from epass.protocol import FxPass, Notice, Pass, PassResult
    from epass.records import PassRecord, PipelineResult
    from epass.reduce import ReduceResult, reduce
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
    "Notice",
    "NumericsCheck",
    "OpCounts",
    "OptionError",
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
    "ReduceResult",
    "Reproducer",
    "SaveError",
    "StateConflictError",
    "StateLinker",
    "StateMutationError",
    "Timing",
    "UnsafeArchiveError",
    "VerificationError",
    "bisect",
    "cache_info",
    "clear_cache",
    "create_pass",
    "inspect",
    "list_passes",
    "load",
    "prune",
    "reduce",
    "register_pass",
    "save",
    "unregister_pass",
    "__version__",
    "verify_program",
]

# Where each public name lives; the modules are imported on first use.
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
    "epass.verify": ("verify_program",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


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

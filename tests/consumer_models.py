"""The five small models every consumer of epass's output is tested with: an MLP with
a buffer, conv + BatchNorm, a tiny Llama-like decoder, the MLP with a dynamic batch,
and an MLP whose forward computes on state alone (so folding adds constants)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import hf_models
import models
import torch
from fingerprint import fingerprint
from torch import nn
from torch.export import Dim

import epass
from epass.passes import Decompose, presets

MODELS = ["mlp_buffer", "convbn", "llama", "mlp_dynamic", "folding"]
PIPELINES: dict[str, Callable[[], epass.PassManager | None]] = {
    "raw": lambda: None,
    "decompose": lambda: epass.PassManager([Decompose()]),
    "lower": presets.lower,
    "cleanup": presets.cleanup,
}


class MLPWithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.scale)  # type: ignore[no-any-return]


class Folding(nn.Module):
    """Computes on state alone (``scale * 2 + 1``, a transposed weight): ``lower()``
    folds those into new constants."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x)) * (self.scale * 2 + 1)
        return h @ self.fc2.weight.t() + self.fc2.bias


class Subject:
    """One exported model: eager module, the user's program, inputs, reference."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        dynamic_shapes: Any = None
        if name in ("mlp_buffer", "mlp_dynamic", "folding"):
            self.module = (Folding() if name == "folding" else MLPWithBuffer()).eval()
            self.args: tuple[Any, ...] = (
                torch.randn(3, 8, generator=torch.Generator().manual_seed(0)),
            )
            if name == "mlp_dynamic":
                dynamic_shapes = ({0: Dim("batch", min=1, max=64)},)
            self.ep = torch.export.export(self.module, self.args, dynamic_shapes=dynamic_shapes)
        elif name == "convbn":
            self.module, self.ep, self.args = models.export("convbn")
        else:
            self.module, self.ep, self.args = hf_models.export(name)
        self.dynamic = dynamic_shapes is not None
        with torch.no_grad():
            self.expected = self.module(*self.args)
        self.pristine = fingerprint(self.ep)
        self.state_dict = dict(self.ep.state_dict)
        self.constants = dict(self.ep.constants)

    def other_args(self) -> tuple[Any, ...]:
        """Inputs of another batch size (for the dynamic program)."""
        return (torch.randn(5, 8, generator=torch.Generator().manual_seed(1)),)

    def check_untouched(self) -> None:
        """The user's program is bit-identical, its dicts hold the same objects."""
        assert fingerprint(self.ep) == self.pristine, "the user's program changed"
        assert self.ep.state_dict == self.state_dict and self.ep.constants == self.constants
        for d, before in (
            (self.ep.state_dict, self.state_dict),
            (self.ep.constants, self.constants),
        ):
            assert all(d[k] is v for k, v in before.items())


_SUBJECTS: dict[str, Subject] = {}


def subject(name: str) -> Subject:
    """One Subject per model and test session (exports are shared between cells)."""
    if name not in _SUBJECTS:
        _SUBJECTS[name] = Subject(name)
    return _SUBJECTS[name]


def cumsum_int64(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """TVM 0.27's workaround for the tiny Llama: give ``cumsum`` of a bool tensor its
    int64 result dtype explicitly (TVM's importer keeps bool, and its LLVM codegen
    then fails: "Check failed: (t.MatchesCode(DLDataTypeCode::kDLFloat))")."""
    for node in gm.graph.nodes:
        if (
            node.target is torch.ops.aten.cumsum.default
            and node.args[0].meta["val"].dtype == torch.bool
            and node.kwargs.get("dtype") is None
        ):
            node.kwargs = {**node.kwargs, "dtype": torch.int64}
    gm.recompile()
    return gm


def tvm_run(mod: Any, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Build a Relax module for the CPU (llvm) and run its ``main`` on ``args``."""
    import tvm
    from tvm import relax

    executable = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in args])
    return torch.from_numpy(out[0].numpy())


@contextlib.contextmanager
def _diagnostics() -> Iterator[list[str]]:
    """What the block's native code printed to the standard error (where IREE's
    compiler prints its diagnostics), given back to it after the block."""
    printed: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield printed
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            printed.append(file.read().decode(errors="replace"))
            sys.stderr.write(printed[0])


def iree_run(output: Any, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Compile an iree-turbine export for ``llvm-cpu`` and run its ``main`` on ``args``.
    A failed compile raises with the diagnostics IREE printed, which say what failed."""
    import iree.runtime as rt

    with _diagnostics() as printed:
        try:
            binary = output.compile(save_to=None, target_backends="llvm-cpu")
        except RuntimeError as exc:
            failure = exc
        else:
            failure = None
    if failure is not None:
        raise RuntimeError(f"{failure}:\n{printed[0]}") from failure
    context = rt.SystemContext(config=rt.Config("local-task"))
    context.add_vm_module(rt.VmModule.copy_buffer(context.instance, binary.map_memory()))
    out = context.modules.module["main"](*[a.numpy() for a in args])
    return torch.from_numpy(out.to_host())

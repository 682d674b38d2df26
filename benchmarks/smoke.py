"""A real-model smoke of the running torch release: a torchvision CNN and transformers
decoders, static and dynamic, through ``Decompose`` in check mode, ``presets.lower()``
and a save and load, as a user runs them.

    python benchmarks/smoke.py

Each program must come out of ``Decompose`` with torch's graph on the incremental path
(check mode compares it with ``run_decompositions``), share the user's ``state_dict``,
compute what the eager model computes, leave the user's program unchanged, and make
torch raise no warning from epass's own work. Prints a line per program and one
summary line; exits 1 when any program fails. ``.ci/run`` runs it on every declared
release (``benchmarks/compat.sh``).
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import epass  # noqa: E402
from epass.passes import presets  # noqa: E402

# The programs, each (label, export); an export returns (module, program, inputs).
Export = Callable[[], tuple[torch.nn.Module, torch.export.ExportedProgram, tuple[Any, ...]]]


def _vision(dynamic: bool) -> Export:
    def export() -> Any:
        import vision_models

        return vision_models.export("tv_resnet18", dynamic=dynamic)

    return export


def _hf(name: str, dynamic: bool) -> Export:
    def export() -> Any:
        import hf_models

        return hf_models.export(name, dynamic=dynamic)

    return export


PROGRAMS: dict[str, Export] = {
    "resnet18 static": _vision(False),
    "resnet18 dynamic batch": _vision(True),
    "gpt2 static": _hf("gpt2", False),
    "gpt2 dynamic sequence": _hf("gpt2", True),
    "llama static": _hf("llama", False),
}


def _epass_work(ep: torch.export.ExportedProgram, folder: Path) -> tuple[Any, Any, list[str]]:
    """Decompose in check mode, then the lowering preset, then a save and load; the
    warnings torch raised meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decomposed = epass.PassManager([epass.Decompose(method="incremental", check=True)])(ep)
        lowered = presets.lower().run(ep)
        epass.save(lowered, folder / "lowered.pt2")
        epass.load(folder / "lowered.pt2")
    said = [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]
    return decomposed, lowered, said


def check(label: str, export: Export, folder: Path) -> str:
    """One program's line; raises AssertionError naming what failed."""
    module, ep, args = export()
    code, keys = ep.graph_module.code, list(ep.state_dict)
    began = time.perf_counter()
    decomposed, lowered, said = _epass_work(ep, folder)
    seconds = time.perf_counter() - began
    (record,) = decomposed.records
    assert record.notes["method"] == "incremental", f"retraced: {record.notes['fallback']}"
    assert record.notes["checked"], "check mode did not compare with torch"
    assert decomposed.program.state_dict is ep.state_dict, "a new state_dict"
    assert lowered.state_dict is ep.state_dict, "lowering gave a new state_dict"
    assert ep.graph_module.code == code and list(ep.state_dict) == keys, (
        "the user's program changed"
    )
    assert not said, f"torch warned: {said}"
    with torch.no_grad():
        want = module(*args)
        for out in (decomposed.program, lowered):
            got = out.module()(*args)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return f"{label}: incremental, torch's graph, the user's state_dict, {seconds:.1f} s"


def main() -> int:
    import importlib.util

    torch.manual_seed(0)
    failed = skipped = 0
    with tempfile.TemporaryDirectory() as folder:
        for label, export in PROGRAMS.items():
            if label.startswith("resnet18") and importlib.util.find_spec("torchvision") is None:
                skipped += 1
                print(f"{label}: skipped: torchvision is not installed", flush=True)
                continue
            try:
                print(check(label, export, Path(folder)), flush=True)
            except Exception as exc:
                failed += 1
                print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=-3)
    passed = len(PROGRAMS) - failed - skipped
    print(
        f"smoke: torch {torch.__version__}: {passed} of {len(PROGRAMS)} programs passed"
        + (f", {skipped} skipped (no torchvision)" if skipped else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

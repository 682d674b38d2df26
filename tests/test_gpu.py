"""Programs with CUDA tensors: ``Decompose`` (auto and check mode), ``presets.lower()``
and AOTInductor on the GPU, in float32, float16 and bfloat16, numbers compared with
eager; and templates keyed by device, so that no CPU template serves a CUDA program
or the reverse.

The tests marked ``gpu`` are skipped where ``torch.cuda.is_available()`` is False;
``pytest -m gpu tests/test_gpu.py`` (or ``benchmarks/gpu.py``) runs them on a GPU.
``EPASS_TEST_DEVICE=cpu`` runs the same tests on the CPU instead. The device-key tests
without the mark run everywhere: a CUDA program can be exported with fake tensors on
a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import models
import pytest
import torch
import torch.nn.functional as F
from fast_path import incremental_path_errors
from fingerprint import fingerprint
from torch import nn
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree

import epass
from epass import Decompose, PassManager
from epass._decomp import keys
from epass._decomp.check import first_difference
from epass.errors import IncrementalDecompositionError
from epass.passes import presets

DEVICE = torch.device(os.environ.get("EPASS_TEST_DEVICE", "cuda"))
_NO_DEVICE = DEVICE.type == "cuda" and not torch.cuda.is_available()

needs_device = pytest.mark.skipif(
    _NO_DEVICE,
    reason="no CUDA GPU here (torch.cuda.is_available() is False); "
    "EPASS_TEST_DEVICE=cpu runs these tests on the CPU",
)


def on_gpu(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test ``gpu`` and skip it, saying why, where there is no GPU."""
    return pytest.mark.gpu(needs_device(test))  # type: ignore[no-any-return]


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Relative to the largest magnitude of eager's output: the decomposed program runs
# other kernels than eager (a linear becomes permute + addmm, attention a softmax of
# bmm's), which round differently in half precision.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _with_statistics(module: nn.Module) -> nn.Module:
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):  # non-trivial running statistics
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return module


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


# The zoo's modules a GPU user lowers: an MLP, a CNN (convolution, BatchNorm, in-place
# ReLU, a residual add, pooling), a decoder whose layer norms and causal attention are
# written out in plain torch ops, and nn.TransformerEncoder (scaled dot-product
# attention, whose decomposition depends on the device).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "mlp": (lambda: models.build("mlp"), models.CASES["mlp"].inputs),
    "cnn": (lambda: _with_statistics(models.InplaceCNN()), models.DYNAMIC["cnn"][1]),
    "decoder": (models.CausalDecoder, lambda: (_ids(2, 8),)),
    "encoder": (lambda: models.build("transformer"), models.CASES["transformer"].inputs),
}


def _to(value: Any, dtype: torch.dtype) -> Any:
    """``value`` on the device; floating tensors in ``dtype``, token ids as they are."""
    if value.is_floating_point():
        return value.to(DEVICE, dtype)
    return value.to(DEVICE)


class Subject:
    """One model on the device in one dtype: the eager module, the user's program,
    its inputs, eager's output and the program's fingerprint."""

    def __init__(self, name: str, dtype: torch.dtype, dynamic: Any = None) -> None:
        make, inputs = MODELS[name]
        torch.manual_seed(0)
        self.dtype = dtype
        self.module = make().eval().to(DEVICE, dtype)
        self.args = tuple(_to(a, dtype) for a in inputs())
        self.ep = torch.export.export(self.module, self.args, dynamic_shapes=dynamic)
        self.expected = self.eager(*self.args)
        self.pristine = fingerprint(self.ep)

    def eager(self, *args: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.module(*args)  # type: ignore[no-any-return]

    def check_numbers(self, got: Any, expected: torch.Tensor | None = None) -> None:
        """``got`` is eager's output, on the device, in the dtype, to the tolerance."""
        want = self.expected if expected is None else expected
        (got,) = pytree.tree_leaves(got)
        assert got.device.type == DEVICE.type and got.dtype == want.dtype
        scale = max(want.abs().max().item(), 1.0)
        tol = TOLERANCE[self.dtype]
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol)

    def check_untouched(self, out: ExportedProgram) -> None:
        """The output shares the user's state_dict and the user's program is unchanged."""
        assert out.state_dict is self.ep.state_dict
        assert fingerprint(self.ep) == self.pristine, "the user's program changed"


_SUBJECTS: dict[tuple[str, str], Subject] = {}


def subject(name: str, dtype: str) -> Subject:
    """One export per model and dtype in a test session (the tests never change it)."""
    if (name, dtype) not in _SUBJECTS:
        _SUBJECTS[name, dtype] = Subject(name, DTYPES[dtype])
    return _SUBJECTS[name, dtype]


CELLS = [(name, dtype) for name in MODELS for dtype in DTYPES]


@on_gpu
@pytest.mark.parametrize(("name", "dtype"), CELLS)
def test_decompose_of_a_gpu_program_is_torchs_with_eagers_numbers(name: str, dtype: str) -> None:
    s = subject(name, dtype)
    result = PassManager([Decompose()])(s.ep)
    assert result.records[0].notes["method"] in ("incremental", "retrace")
    assert first_difference(result.program, s.ep.run_decompositions()) is None
    s.check_untouched(result.program)
    s.check_numbers(result.program.module()(*s.args))
    s.check_untouched(result.program)


@on_gpu
@pytest.mark.parametrize(("name", "dtype"), CELLS)
def test_check_mode_passes_on_a_gpu_program(name: str, dtype: str) -> None:
    s = subject(name, dtype)
    result = PassManager([Decompose(method="incremental", check=True)])(s.ep)
    notes = result.records[0].notes
    assert notes["method"] == "incremental" and notes["checked"], notes
    s.check_untouched(result.program)


@on_gpu
@pytest.mark.parametrize(("name", "dtype"), CELLS)
def test_lower_of_a_gpu_program_matches_eager(name: str, dtype: str) -> None:
    s = subject(name, dtype)
    out = presets.lower().run(s.ep)
    s.check_untouched(out)
    s.check_numbers(out.module()(*s.args))
    s.check_untouched(out)


# Loads an AOTInductor package and runs it on saved inputs, in a process of its own:
# on some machines (gVisor sandboxes) the loader crashes the process, for torch's own
# programs as much as for epass's, and a crash must not take the test session along.
_RUN_PACKAGE = """
import sys, torch
package, inputs, output, device = sys.argv[1:]
runner = torch._inductor.aoti_load_package(package)
args = [a.to(device) for a in torch.load(inputs)]
torch.save(runner(*args).cpu(), output)
"""


def _compiled_and_run(program: ExportedProgram, args: Any, folder: Path) -> Any:
    """``program`` compiled with AOTInductor and run on ``args`` in a child process: its
    output on the device, or the child's exit status when it did not finish."""
    import subprocess
    import sys

    folder.mkdir()
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "m.pt2"))
    torch.save([a.cpu() for a in args], folder / "inputs.pt")
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN_PACKAGE,
            package,
            str(folder / "inputs.pt"),
            str(folder / "out.pt"),
            str(DEVICE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if child.returncode != 0:
        return child.returncode, child.stderr.strip().splitlines()[-1:]
    return torch.load(folder / "out.pt").to(DEVICE)


@on_gpu
@pytest.mark.parametrize(
    ("name", "dtype"), [("mlp", "bfloat16"), ("cnn", "float16"), ("decoder", "float32")]
)
def test_aot_inductor_runs_the_lowered_gpu_program(name: str, dtype: str, tmp_path: Path) -> None:
    s = subject(name, dtype)
    out = presets.lower().run(s.ep)
    got = _compiled_and_run(out, s.args, tmp_path / "lowered")
    s.check_untouched(out)
    if isinstance(got, tuple):
        # The same compile and load of torch's own program tells a loader that cannot
        # run here from a program epass broke.
        theirs = _compiled_and_run(s.ep, s.args, tmp_path / "torch")
        if isinstance(theirs, tuple):
            pytest.skip(f"AOTInductor's loader fails here on torch's own program too: {theirs}")
        pytest.fail(f"the lowered program failed under AOTInductor, torch's ran: {got}")
    s.check_numbers(got)


@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dynamic_gpu_decoder_takes_other_shapes_after_decompose(dtype: str) -> None:
    s = Subject("decoder", DTYPES[dtype], models.DYNAMIC["decoder"][2]())
    result = PassManager([Decompose(check=True)])(s.ep)
    assert result.records[0].notes["method"] == "incremental", result.records[0].notes
    s.check_untouched(result.program)
    other = _ids(3, 11, seed=1).to(DEVICE)
    s.check_numbers(result.program.module()(other), expected=s.eager(other))


# Templates keyed by device. torch decomposes scaled dot-product attention by the
# device's kernels (on torch 2.13 the CPU's math path ends in a permute, clone and
# permute that CUDA's does not): a template traced for one device must never serve
# the other. Each program goes through the disk cache, which programs share (the
# memory cache lives with one program's fake mode).


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q)


_SHAPE = (1, 2, 8, 16)


def _cpu_attention() -> ExportedProgram:
    return torch.export.export(_Attention(), (torch.randn(*_SHAPE),))


def _fake_cuda_attention() -> ExportedProgram:
    """A CUDA program made without a GPU: exported from fake CUDA tensors."""
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.export.export(_Attention(), (torch.empty(*_SHAPE, device="cuda"),))


def _cuda_attention() -> ExportedProgram:
    return torch.export.export(_Attention(), (torch.randn(*_SHAPE, device="cuda"),))


_CUDA_PROGRAMS = [
    pytest.param(_fake_cuda_attention, id="fake-cuda"),
    pytest.param(
        _cuda_attention,
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="no CUDA GPU here (torch.cuda.is_available() is False)",
            ),
        ],
    ),
]


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty template cache of this test's own, on disk and in memory."""
    monkeypatch.setenv("EPASS_CACHE_DIR", str(tmp_path / "cache"))
    epass.clear_cache()
    yield tmp_path / "cache"
    epass.clear_cache()


def test_a_tensors_template_key_names_its_device() -> None:
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        on = {d: torch.empty(2, 3, device=d) for d in ("cpu", "cuda", "cuda:1", "meta")}
    found = {keys.tensor_key(t, False) for t in on.values()}
    assert len(found) == len(on)


def _decompose_as_torch(ep: ExportedProgram) -> tuple[int, int]:
    """Decompose ``ep`` incrementally, assert torch's program; the disk cache's
    entries and hits after."""
    with incremental_path_errors() as raised:
        try:
            result = Decompose(method="incremental")(ep)
        except IncrementalDecompositionError as exc:
            # The path raised: that is a fault, not a program it cannot take.
            assert not raised, f"the incremental path raised {raised[0]!r}"
            # It declined (on a release it does not mirror exactly): then no template
            # serves this program, from either device.
            assert first_difference(Decompose()(ep).program, ep.run_decompositions()) is None
            pytest.skip(f"the incremental path declines the attention program ({exc})")
    assert first_difference(result.program, ep.run_decompositions()) is None
    info = epass.cache_info()["disk"]
    return info["entries"], info["hits"]


@pytest.mark.parametrize("cuda", _CUDA_PROGRAMS)
@pytest.mark.parametrize("first", ["cpu", "cuda"])
def test_a_template_for_one_device_never_serves_the_other(
    first: str, cuda: Callable[[], ExportedProgram], own_cache: Path
) -> None:
    make = {"cpu": _cpu_attention, "cuda": cuda}
    second = "cuda" if first == "cpu" else "cpu"
    stored, hits = _decompose_as_torch(make[first]())
    assert hits == 0
    served = _decompose_as_torch(make[first]())[1]
    if stored:
        assert served == 1  # the cache serves the same device
    entries, hits = _decompose_as_torch(make[second]())
    assert hits == served  # and never the other
    assert entries > 0, "no template was stored: nothing was tested"
    if cuda is _fake_cuda_attention:  # both devices' templates are stored
        assert (stored, entries) == (1, 2)
    _decompose_as_torch(make[second]())
    _decompose_as_torch(make[first]())

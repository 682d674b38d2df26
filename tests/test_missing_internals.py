"""Every fast path has the plain path behind it: with any one torch internal of
``INTERNALS`` gone, whatever torch's public ``run_decompositions`` still does, epass
still does (the same program), and ``presets.lower()`` still lowers, saying why it
stepped aside."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from epass import Decompose, PassManager
from epass._decomp import templates
from epass._decomp.check import first_difference
from epass._torch import internals
from epass.instruments import Timing
from epass.passes import CSE, presets

pytestmark = pytest.mark.slow


class _Block(nn.Module):
    """A norm, an attention-like product, a silu MLP and a buffer: decomposed and
    CIA operators, a view chain and state."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = torch.softmax(self.proj(h) @ h.transpose(-1, -2), dim=-1) @ h
        return x + nn.functional.silu(self.mlp(a)) * self.scale


def _programs() -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(_Block(), (torch.randn(3, 5, 8),), dynamic_shapes=({0: batch},))
    return ep, ep.run_decompositions()


_EP, _DECOMPOSED = _programs()
_REF = _EP.run_decompositions()


def _owner_and_name(path: str) -> tuple[Any, str] | None:
    owner, _, name = path.rpartition(".")
    try:
        parent = internals.resolve(owner)
    except (ImportError, AttributeError):
        return None
    if name not in getattr(parent, "__dict__", {}):
        return None  # an instance attribute, or inherited: nothing to delete here
    return parent, name


def _deletable(path: str) -> bool:
    found = _owner_and_name(path)
    if found is None:
        return False
    parent, name = found
    value = parent.__dict__[name]
    try:
        delattr(parent, name)
    except (AttributeError, TypeError):
        return False
    setattr(parent, name, value)
    return True


DELETABLE = [p for p in internals.INTERNALS if _deletable(p)]


def test_most_internals_can_be_taken_away_here() -> None:
    # The test below is only as strong as the internals it can remove.
    assert len(DELETABLE) >= len(internals.INTERNALS) // 2, DELETABLE


def _torch_decomposes(ep: torch.export.ExportedProgram, path: str) -> Any:
    try:
        return ep.run_decompositions()
    except Exception as exc:  # torch's own method needs it: nothing to mirror
        pytest.skip(f"torch's run_decompositions needs {path}: {type(exc).__name__}")


@pytest.mark.parametrize("path", DELETABLE)
def test_without_an_internal_decompose_makes_what_torch_still_makes(monkeypatch, path: str) -> None:
    parent, name = _owner_and_name(path)  # type: ignore[misc]
    templates.clear_memory()
    monkeypatch.setenv("EPASS_CACHE_DIR", "")  # no disk cache: every template traced
    monkeypatch.delattr(parent, name)
    ref = _torch_decomposes(_EP, path)
    out = PassManager([Decompose()]).run(_EP)
    assert first_difference(out, ref) is None
    assert out.state_dict is _EP.state_dict


_SKIPPED = PassManager([Decompose(method="retrace")]).run(_DECOMPOSED)


@pytest.mark.parametrize("path", DELETABLE)
def test_without_an_internal_the_retrace_makes_what_torch_still_makes(
    monkeypatch, path: str
) -> None:
    # On a decomposed program the retrace is a no-op epass skips (torch's own retrace
    # only rewrites meta); without the internal it still skips or retraces as torch.
    parent, name = _owner_and_name(path)  # type: ignore[misc]
    templates.clear_memory()
    monkeypatch.delattr(parent, name)
    ref = _torch_decomposes(_DECOMPOSED, path)
    out = PassManager([Decompose(method="retrace")]).run(_DECOMPOSED)
    assert first_difference(out, _SKIPPED) is None or first_difference(out, ref) is None


def _lower(instruments: list[Any]) -> tuple[str, Any]:
    try:
        out = PassManager([presets.lower()], instruments=instruments).run(_EP)
    except Exception as exc:
        return type(exc).__name__, None
    return str(out.graph), out


@pytest.mark.parametrize("path", DELETABLE)
def test_without_an_internal_lower_does_the_same_watched_or_not(monkeypatch, path: str) -> None:
    # No outcome depends on an instrument: the leased path (none attached) and the
    # copying path (one attached) both lower, or fail alike; and where torch's own
    # method still decomposes, lowering works.
    parent, name = _owner_and_name(path)  # type: ignore[misc]
    templates.clear_memory()
    monkeypatch.setenv("EPASS_CACHE_DIR", "")
    monkeypatch.delattr(parent, name)
    plain, out = _lower([])
    templates.clear_memory()
    watched, _ = _lower([Timing()])
    assert plain == watched
    try:
        _EP.run_decompositions()
    except Exception:
        return
    assert out is not None, plain
    x = torch.randn(4, 5, 8)
    torch.testing.assert_close(out.module()(x), _EP.module()(x))
    out.validate()


class _Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) + torch.sin(x)  # one sin for CSE to erase


@pytest.mark.parametrize("returns", ["a str", "a missing internal"])
def test_an_erasure_steps_aside_to_the_constructor_when_an_internal_misbehaves(
    monkeypatch, returns: str
) -> None:
    # The leased erasure path (no instrument) leans on _convert_guards_to_code; when
    # it misbehaves, the pass takes the constructor's path, as with an instrument
    # attached, and says so.
    from epass._torch import programs

    ep = torch.export.export(_Twice(), (torch.randn(2, 3),))
    pipeline = [Decompose(), CSE()]
    watched = PassManager(pipeline, instruments=[Timing()]).run(ep)

    def missing(gm: Any) -> Any:
        raise AttributeError("module 'torch.export.exported_program' has no attribute")

    if returns == "a str":  # torch's own function, as the adapter's shape check sees it
        monkeypatch.setattr(torch.export.exported_program, "_convert_guards_to_code", str)
    else:
        monkeypatch.setattr(programs, "graph_guards_code", missing)
    result = PassManager(pipeline)(ep)
    cse = result.records[1]
    assert cse.modified
    assert any("rebuilt with torch's constructor" in n.text for n in cse.notices), cse.notices
    assert str(result.program.graph) == str(watched.graph)
    result.program.validate()

"""Shared tools for the screen's tests: archives as member dicts, ``model.json`` as
JSON data to edit, and writing them back as ``.pt2`` files."""

from __future__ import annotations

import contextlib
import io
import json
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch


def archive(ep: torch.export.ExportedProgram) -> dict[str, bytes]:
    """The members of ``torch.export.save(ep)``, in order."""
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    with zipfile.ZipFile(buffer) as z:
        return {name: z.read(name) for name in z.namelist()}


def model_json(members: dict[str, bytes]) -> str:
    return next(name for name in members if name.endswith("models/model.json"))


def write(members: dict[str, bytes], path: Path, program: Any | None = None) -> Path:
    """Write an archive; ``program`` (JSON data) replaces models/model.json."""
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            if program is not None and name == model_json(members):
                data = json.dumps(program).encode()
            z.writestr(name, data)
    return path


def program_of(members: dict[str, bytes]) -> Any:
    return json.loads(members[model_json(members)])


def assert_torch_runs_it(path: Path, marker: Path, why: str) -> None:
    """``torch.export.load(path)`` alone creates ``marker`` (the payload is live, so the
    screen's refusal is what stops it); the marker is removed again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(Exception):
            torch.export.load(path)
    assert marker.exists(), why
    marker.unlink()


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2

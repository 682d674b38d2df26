"""Type checkers see the installed package and the documented attributes."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

GOOD = """\
import torch

from epass import PassManager, PipelineResult, bisect
from epass.passes import ConstantFold, Decompose, RemoveAssertions

ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
added: tuple[str, ...] = ConstantFold()(ep).added
folded: tuple[str, ...] = ConstantFold()(ep).folded
notes: dict[str, object] = Decompose()(ep).notes
removed: int = RemoveAssertions()(ep).removed
found = bisect(ep, [Decompose()], lambda p: True, method="linear")
result: PipelineResult = PassManager([Decompose()])(ep)
program: torch.export.ExportedProgram = PassManager([Decompose()]).run(ep)
"""

BAD = """\
import torch

from epass import bisect
from epass.passes import Decompose

ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
bisect(ep, [Decompose()], lambda p: True, method="fast")
count: str = Decompose()(ep).removed
"""

CONFIG = "[mypy]\nstrict = True\n\n[mypy-torch.*]\nfollow_imports = skip\n"
ROOT = Path(__file__).resolve().parent.parent


def test_the_editable_install_is_a_plain_path_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install -e .` with any extras, in any order, gives a .pth file that names
    this folder and nothing else: mypy and pyright follow a path, not an import hook
    (setuptools' default editable mode), and no flag is needed to get it."""
    text = (ROOT / "pyproject.toml").read_text()
    (name,) = re.findall(r'^build-backend = "([\w.]+)"$', text, re.M)
    try:
        backend = importlib.import_module(name)
    except ImportError:
        pytest.skip(f"the build backend {name} is not installed (the test extra has it)")
    monkeypatch.chdir(ROOT)
    wheel = tmp_path / backend.build_editable(str(tmp_path))
    with zipfile.ZipFile(wheel) as archive:
        entries = [
            (member, archive.read(member).decode())
            for member in archive.namelist()
            if member.endswith(".pth")
        ]
    assert entries, f"{wheel.name} has no .pth file"
    for member, lines in entries:
        for line in lines.splitlines():
            assert not line.startswith("import"), f"{member}: an import hook: {line}"
            assert Path(line).resolve() == ROOT, f"{member}: {line} is not this checkout"


@pytest.mark.slow
def test_mypy_strict_sees_the_installed_package_and_its_result_types(tmp_path: Path) -> None:
    # The mypy this interpreter runs (a mypy elsewhere on PATH does not count).
    if subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode:
        pytest.skip("mypy is not installed (it comes with the dev extra)")
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    (tmp_path / "mypy.ini").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "good.py", "bad.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert "Cannot find implementation or library stub" not in out, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert not [e for e in errors if e.startswith("good.py")], out
    assert any(e.startswith("bad.py:7:") and "method" in e for e in errors), out
    assert any(e.startswith("bad.py:8:") and "DecomposeResult" in e for e in errors), out

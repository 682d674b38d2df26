"""Every Python code block in README.md, docs/ and examples/ runs."""

from __future__ import annotations

import importlib.util
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose examples need an optional extra, and the modules they import.
NEEDS = {
    "onnx.md": ("onnxscript", "onnxruntime"),
    "backends.md": (
        "executorch",
        "torchao",
        "openvino",
        "coremltools",
        "onnxscript",
        "tvm",
        "iree.turbine",
        "iree.runtime",
    ),
}
# Pages whose examples convert models with real backends (tens of seconds).
SLOW = {"backends.md"}


def _missing(page: Path) -> list[str]:
    return [m for m in NEEDS.get(page.name, ()) if importlib.util.find_spec(m) is None]


def _page_param(page: Path) -> object:
    marks = [pytest.mark.slow] if page.name in SLOW else []
    return pytest.param(page, marks=marks, id=page.relative_to(ROOT).as_posix())


def _blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES])
def test_markdown_code_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = _blocks(page)
    if not blocks:
        pytest.skip(f"{page.name} has no python blocks")
    missing = _missing(page)
    if missing:
        pytest.skip(f"{page.name} needs {', '.join(missing)} (not installed)")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"doc_{page.stem}"}
    # Blocks on one page share a namespace, in order, like a reader pasting them.
    for i, block in enumerate(blocks):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)


def test_every_page_has_a_block() -> None:
    empty = [p.name for p in PAGES if not _blocks(p)]
    assert not empty, f"pages without a runnable example: {empty}"


@pytest.mark.parametrize(
    "script",
    sorted((ROOT / "examples").glob("*.py")),
    ids=lambda p: p.name,
)
def test_example_runs(script: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")


SHELL = re.compile(r"^```\n\$ (epass .*?)\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"\d+\.\d+")


def _normalized(text: str) -> list[str]:
    """Lines without trailing blanks, timings replaced (they differ from run to run)."""
    return [NUMBER.sub("#", line.rstrip()) for line in text.strip("\n").splitlines()]


def _quoted_runs() -> list[tuple[str, str, str]]:
    return [
        (page.name, command, output)
        for page in PAGES
        for command, output in SHELL.findall(page.read_text())
    ]


def test_docs_quote_at_least_one_command() -> None:
    assert any(command.startswith("epass run") for _, command, _ in _quoted_runs())


@pytest.mark.parametrize(
    ("page", "command", "output"),
    [pytest.param(*run, id=f"{run[0]}: {run[1]}") for run in _quoted_runs()],
)
def test_quoted_cli_output_matches_a_real_run(
    page: str,
    command: str,
    output: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The numbers a page quotes from `epass ...` are what the command prints today."""
    pytest.importorskip("rich")  # the quoted tables are rich's
    import shlex

    import torch

    from epass.cli import _demo_program, main

    if not torch.__version__.startswith("2.13."):
        pytest.skip("the docs quote torch 2.13's node counts")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EPASS_PLAIN", raising=False)
    torch.export.save(_demo_program(), "tf.pt2")  # the file the pages run on
    argv = shlex.split(command)[1:]
    assert main(argv) == 0
    assert _normalized(capsys.readouterr().out) == _normalized(output), f"{page}: $ {command}"

"""Every Python code block in README.md, docs/ and examples/ runs, and every output
a page shows is what the code prints today.

Conventions a page may use:

* ```` ```python ```` blocks run in order, in one namespace per page;
* an ```` ```output ```` block right after a Python block is that block's
  printed output (compared with timings and padding normalized, on the reference
  torch 2.13, whose node counts the pages quote);
* a ```` ```python file=NAME.py ```` block is a file the page's reader saves: it is
  written to the working folder (importable) before the page's code and quoted
  commands run;
* a plain block starting with ``$ epass ...`` is a command and its output.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import re
import runpy
import sys
from collections.abc import Iterator
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


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; ``find_spec("iree.turbine")`` imports
    ``iree`` first and raises when that is missing, rather than answer None."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _missing(page: Path) -> list[str]:
    return [m for m in NEEDS.get(page.name, ()) if not _installed(m)]


def _page_param(page: Path) -> object:
    marks = [pytest.mark.slow] if page.name in SLOW else []
    return pytest.param(page, marks=marks, id=page.relative_to(ROOT).as_posix())


# Shown outputs (node counts, op lists) are those of the reference torch; on other
# releases the blocks still run, and only the comparison is left out.
_REFERENCE_TORCH = importlib.metadata.version("torch").startswith("2.13.")


def _blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


ANY_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def _runs(page: Path) -> list[tuple[str, str | None]]:
    """The page's Python blocks in order, each with the output shown after it."""
    fences = ANY_FENCE.findall(page.read_text())
    runs: list[tuple[str, str | None]] = []
    for i, (info, body) in enumerate(fences):
        if info.strip() != "python":
            continue
        following = fences[i + 1] if i + 1 < len(fences) else None
        shown = following[1] if following is not None and following[0] == "output" else None
        runs.append((body, shown))
    return runs


def _files(page: Path) -> dict[str, str]:
    """The ``python file=NAME`` blocks of a page."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"^```python file=(\S+)\n(.*?)^```", page.read_text(), re.S | re.M)
    }


def _write_files(page: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(page)
    for name, text in files.items():
        (folder / name).write_text(text)
        monkeypatch.delitem(sys.modules, Path(name).stem, raising=False)
    if files:
        monkeypatch.syspath_prepend(str(folder))


@contextlib.contextmanager
def _registry_restored() -> Iterator[None]:
    """Names a page registers (through its files or code) are removed afterwards."""
    from epass import registry

    before = set(registry.pass_names())
    try:
        yield
    finally:
        for name in set(registry.pass_names()) - before:
            registry.unregister_pass(name)


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
    _write_files(page, tmp_path, monkeypatch)
    namespace: dict[str, object] = {"__name__": f"doc_{page.stem}"}
    # Blocks on one page share a namespace, in order, like a reader pasting them.
    with _registry_restored():
        for i, (block, shown) in enumerate(_runs(page)):
            code = compile(block, f"{page.name}[block {i}]", "exec")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(code, namespace)
            if shown is not None and _REFERENCE_TORCH:
                assert _normalized(printed.getvalue()) == _normalized(shown), (
                    f"{page.name}[block {i}]: the output shown differs from a real run"
                )


def test_every_page_has_a_block() -> None:
    empty = [p.name for p in PAGES if not _blocks(p)]
    assert not empty, f"pages without a runnable example: {empty}"


def test_a_page_needing_a_module_of_a_missing_package_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # find_spec("a.b") imports "a" and raises when it is missing.
    monkeypatch.setitem(NEEDS, "backends.md", ("epass_no_such_package.turbine", "json"))
    assert _missing(ROOT / "docs" / "backends.md") == ["epass_no_such_package.turbine"]


# --- the install story -------------------------------------------------------------

# torch first, the CPU wheel; then epass from the checkout, extras the same way.
TORCH_FIRST = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
START = [TORCH_FIRST, 'pip install -e ".[rich]"']
# A pip command in a code block or span; not another interpreter's pip (docs/compat.md).
INSTALL = re.compile(r"(?<![\w/.-])pip install [^`\n]*")


def _declared_extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", table, re.M))


def _install_lines(page: Path) -> list[str]:
    """The page's pip commands, but the warning against a plain ``pip install torch``."""
    lines = [m.group(0).split("#", 1)[0].strip() for m in INSTALL.finditer(page.read_text())]
    return [line for line in lines if line != "pip install torch"]


def test_every_page_tells_one_install_story() -> None:
    """torch first from the CPU wheel index, then epass from the checkout, extras too:
    never from an index (epass is not published), never with a flag to remember."""
    import shlex

    extras = _declared_extras()
    wrong = []
    for page in [*PAGES, ROOT / "examples" / "plugin" / "README.md"]:
        for line in _install_lines(page):
            args = shlex.split(line)[2:]
            requirements = [a for a in args if not a.startswith("-")]
            editable = [args[i + 1] for i, a in enumerate(args) if a == "-e" and i + 1 < len(args)]
            requirements = [r for r in requirements if r not in editable]
            why = []
            if any(r.startswith("epass") for r in requirements):
                why.append("installs epass from an index")
            if "--config-settings" in args:
                why.append("a flag to remember")
            for e in editable:
                named = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", e)
                if named is None:
                    why.append(f"an editable install of {e!r}, not of the checkout")
                elif named[1] and set(named[1].split(",")) - extras:
                    why.append(f"names undeclared extras {set(named[1].split(',')) - extras}")
            pins = [r for r in requirements if r.startswith("torch==")]
            if any(r != "torch==2.13.0" for r in pins):
                why.append("pins another torch")
            if requirements == ["torch==2.13.0"] and not editable and line != TORCH_FIRST:
                why.append(f"torch alone, but not as {TORCH_FIRST!r}")
            wrong += [f"{page.name}: {line}: {w}" for w in why]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_first_install_is_the_same_on_every_starting_page(page: str) -> None:
    assert _install_lines(ROOT / page)[: len(START)] == START


def test_the_readme_starts_with_the_quick_start() -> None:
    """The first screen gets a user running: install, demo, a model of their own."""
    lines = (ROOT / "README.md").read_text().splitlines()
    first_screen = "\n".join(lines[:30])
    assert "## Quick start" in first_screen
    for command in [*START, "epass demo", "epass run model.pt2"]:
        assert command in first_screen, command
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Quick start", headings
    assert headings.index("## Layout") > headings.index("## What is in the box") > 0


@pytest.mark.parametrize(
    "script",
    sorted((ROOT / "examples").glob("*.py")),
    ids=lambda p: p.name,
)
def test_example_runs(script: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")


SHELL = re.compile(r"^```\n\$ (epass .*?)\n(.*?)^```", re.S | re.M)
# A decimal, with its exponent: rounding noise (1e-07 against 1e-06) moves with the
# machine's thread count.
NUMBER = re.compile(r"\d+\.\d+(?:e[-+]\d+)?")


def _normalized(text: str) -> list[str]:
    """Lines without trailing blanks, timings and measured errors replaced (they differ
    from run to run), and the padding around them too (a slow run widens the seconds
    column)."""
    return [
        re.sub(r" *# *", " # ", NUMBER.sub("#", line.rstrip()))
        for line in text.rstrip().lstrip("\n").splitlines()
    ]


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

    from epass.cli import main
    from epass.cli.demo import demo_program

    if not torch.__version__.startswith("2.13."):
        pytest.skip("the docs quote torch 2.13's node counts")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EPASS_PLAIN", raising=False)
    _write_files(
        ROOT / ("README.md" if page == "README.md" else f"docs/{page}"), tmp_path, monkeypatch
    )
    torch.export.save(demo_program(), "tf.pt2")  # the file the pages run on
    argv = shlex.split(command)[1:]
    with _registry_restored():
        assert main(argv) == 0
    assert _normalized(capsys.readouterr().out) == _normalized(output), f"{page}: $ {command}"


def layout_problems(readme: str, package: Path) -> list[str]:
    """Modules of ``package`` the README's Layout map leaves out, and rooms it names
    that no longer exist: the map is a ```` ```text ```` block of one room a line,
    indented two spaces a folder level."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    named: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        word = stripped.split()[0]
        folders = folders[: max(depth - 1, 0)]
        if word.endswith("/"):
            if depth > 0:
                folders.append(word.rstrip("/"))
                named.add("/".join([*folders, "__init__.py"]))
            continue
        named.add("/".join([*folders, word]))
    present = {
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    problems = [f"the Layout leaves out epass/{m}" for m in sorted(present - named)]
    problems += [
        f"the Layout names epass/{m}, which does not exist" for m in sorted(named - present)
    ]
    return problems


def test_the_readme_layout_names_every_module_once_a_line() -> None:
    readme = (ROOT / "README.md").read_text()
    assert layout_problems(readme, ROOT / "epass") == []


def test_the_layout_check_catches_a_missing_and_a_stale_room(tmp_path: Path) -> None:
    package = tmp_path / "epass"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "kept.py", "new.py", "sub/__init__.py", "sub/inner.py"):
        (package / name).write_text("")
    readme = (
        "# pkg\n\n## Layout\n\n```text\nepass/\n  __init__.py  the API\n  kept.py  kept\n"
        "  gone.py  removed since\n  sub/  a package\n    inner.py  inside\n```\n\n## Next\n"
    )
    assert layout_problems(readme, package) == [
        "the Layout leaves out epass/new.py",
        "the Layout names epass/gone.py, which does not exist",
    ]

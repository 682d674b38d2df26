"""The torch range pyproject.toml declares is exactly the range CI tests."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _declared() -> tuple[tuple[int, int], tuple[int, int]]:
    """pyproject.toml's torch requirement as (lowest release, first release excluded)."""
    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"torch([<>=!~][^"]*)"', text)
    match = re.fullmatch(r">=(\d+\.\d+),<(\d+\.\d+)", spec)
    assert match, f"torch requirement {spec!r} is not '>=X.Y,<X.Z'"
    return _release(match[1]), _release(match[2])


def _ci_releases() -> list[str]:
    """The torch versions CI tests: .ci/run's reference install and its compat.sh runs
    (each one installed in the background first)."""
    text = (ROOT / ".ci" / "run").read_text()
    reference = re.findall(r'^python -m pip install -q "torch==([\d.]+)"$', text, re.M)
    others = re.findall(r"^bash benchmarks/compat\.sh ([\d.]+)$", text, re.M)
    (installed,) = re.findall(r'^OTHER_RELEASES="([\d. ]+)"$', text, re.M)
    assert sorted(installed.split()) == sorted(others), "installed and tested releases differ"
    return reference + others


def test_ci_tests_every_declared_release() -> None:
    low, high = _declared()
    tested = sorted(_release(v) for v in _ci_releases())
    declared = [(low[0], minor) for minor in range(low[1], high[1])]
    assert low[0] == high[0], "a range over a major release: list its releases here"
    assert tested == declared, f"CI tests {tested}; pyproject declares {declared}"
    assert "by hand" not in (ROOT / "docs" / "compat.md").read_text()


def test_compat_docs_list_every_torch_ci_runs() -> None:
    text = (ROOT / "docs" / "compat.md").read_text()
    missing = [v for v in _ci_releases() if f"| {v}" not in text]
    assert not missing, f"docs/compat.md's table lacks {missing}"


def test_running_torch_is_in_the_declared_range() -> None:
    low, high = _declared()
    running = _release(torch.__version__)
    assert low <= running < high, f"torch {torch.__version__} is outside the declared range"

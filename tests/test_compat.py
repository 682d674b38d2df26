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
    """The torch versions tested: .ci/run's reference install and compat.sh runs, and
    the compat.sh run .ci/run names as run by hand (too big a download for CI)."""
    text = (ROOT / ".ci" / "run").read_text()
    reference = re.findall(r'^python -m pip install -q "torch==([\d.]+)"$', text, re.M)
    others = re.findall(r"^bash benchmarks/compat\.sh ([\d.]+)$", text, re.M)
    by_hand = re.findall(r"^#   bash benchmarks/compat\.sh ([\d.]+)$", text, re.M)
    return reference + others + by_hand


def test_declared_range_is_the_range_ci_tests() -> None:
    low, high = _declared()
    tested = sorted(_release(v) for v in _ci_releases())
    assert len(tested) >= 3, tested  # the reference, the newest and the oldest
    assert tested[0] == low, f"CI's oldest torch is {tested[0]}, pyproject declares {low}"
    assert (tested[-1][0], tested[-1][1] + 1) == high, f"CI's newest is {tested[-1]}"


def test_compat_docs_list_every_torch_ci_runs() -> None:
    text = (ROOT / "docs" / "compat.md").read_text()
    missing = [v for v in _ci_releases() if f"| {v}" not in text]
    assert not missing, f"docs/compat.md's table lacks {missing}"


def test_running_torch_is_in_the_declared_range() -> None:
    low, high = _declared()
    running = _release(torch.__version__)
    assert low <= running < high, f"torch {torch.__version__} is outside the declared range"

"""The screen tests' shared program: a small linear model with a dynamic batch."""

from __future__ import annotations

import pytest
import screen_helpers as h
import torch


@pytest.fixture(scope="package")
def small() -> dict[str, bytes]:
    """The members of a saved program: nodes, parameters, one shape symbol."""
    batch = torch.export.Dim("batch", min=2, max=64)
    return h.archive(
        torch.export.export(h.Small(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    )

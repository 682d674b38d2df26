"""Built-in passes, one per module."""

from epass.passes.decompose import Decompose

__all__ = ["Decompose"]

"""The epass version (one place; the package and reports read it)."""

__version__ = "0.1.0"

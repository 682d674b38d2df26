"""Plain text, the one rule for strings torch pastes between quotes into code it
generates, and the size limit of a text member or field."""

from __future__ import annotations

__all__ = ["TEXT_LIMIT", "is_plain"]

TEXT_LIMIT = 1 << 20


def is_plain(text: str) -> bool:
    """Text torch may paste between quotes in generated code without escaping it."""
    return text.isprintable() and not any(c in text for c in "'\"\\")

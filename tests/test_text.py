"""The one escaping rule for text a program brings into a view (epass/_text.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from epass._text import json_text, printable, printable_lines

ANY_TEXT = st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF))


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT)
def test_printable_lines_keeps_the_lines_and_nothing_unprintable(text: str) -> None:
    shown = printable_lines(text)
    assert shown.count("\n") == text.count("\n")
    assert all(line.isprintable() for line in shown.split("\n"))
    assert [printable(line) for line in text.split("\n")] == shown.split("\n")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(ANY_TEXT, st.lists(ANY_TEXT, max_size=3), max_size=3))
def test_json_text_is_exact_and_holds_no_raw_control_character(value: dict[str, list[str]]) -> None:
    written = json_text(value)
    assert json.loads(written) == value
    assert all(c.isprintable() for line in written.split("\n") for c in line)
    assert "\x7f" not in json_text("\x7f") and json.loads(json_text("\x7f")) == "\x7f"

"""Notices: what a pass says its user should see (a fallback and why, a cache that
stepped aside), carried by its record and shown and counted by every view."""

from __future__ import annotations

import io
import json
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import export

from epass import Notice, PassManager, PassRecord, PassResult, PipelineResult
from epass._terminal import Out, notices
from epass._text import json_text
from epass.passes import DeadCodeElimination as DCE
from epass.passes import Decompose
from epass.report import PipelineRun, build_report, render_html

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x00\r\nforged\u202e\x85"


def _raw_controls(text: str) -> list[str]:
    return sorted({c for line in text.split("\n") for c in line if not c.isprintable()})


def _linear() -> Any:
    return torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))


class SlowWay:
    """A third-party pass that did its work another way, and says so."""

    name = "slow-way"

    def __init__(self, text: str = "took the slow way: no fast kernel for aten.relu") -> None:
        self.text = text

    def __call__(self, ep: Any) -> PassResult:
        return PassResult(
            ep, False, notices=[Notice("fallback", self.text), Notice("cache", "kept nowhere")]
        )


def test_a_third_party_pass_notices_reach_its_record_the_summary_and_both_reports() -> None:
    ep = _linear()
    pm = PassManager([DCE(), PassManager([SlowWay()], name="inner")])
    result = pm(ep)
    inner = result.records[1].children[0]
    assert inner.notices == (
        Notice("fallback", "took the slow way: no fast kernel for aten.relu"),
        Notice("cache", "kept nowhere"),
    )
    assert inner.fell_back and not result.records[0].fell_back
    lines = result.summary().splitlines()
    assert lines[-3:] == [
        "1 of 3 passes fell back, 1 notice:",
        "  inner/slow-way: took the slow way: no fast kernel for aten.relu",
        "  inner/slow-way: kept nowhere",
    ]
    report = build_report(PipelineRun(result, manager=pm))
    assert report["fallbacks"] == 1
    assert report["notice_count"] == "1 of 3 passes fell back, 1 notice"
    assert report["notices"] == [
        {"pass": "inner/slow-way", "kind": "fallback", "text": inner.notices[0].text},
        {"pass": "inner/slow-way", "kind": "cache", "text": "kept nowhere"},
    ]
    assert (
        report["verdict"]["summary"]
        == "3 passes (1 pipeline) ran; 1 of 3 passes fell back, 1 notice"
    )
    assert report["passes"][1]["children"][0]["notices"][1] == {
        "kind": "cache",
        "text": "kept nowhere",
    }
    page = render_html(report)
    verdict = page[page.index('<div class="verdict') : page.index("</div>")]
    assert "1 of 3 passes fell back" in verdict
    assert "<code>inner/slow-way</code>: took the slow way: no fast kernel" in verdict
    assert '<span class="badge skip" title="kept nowhere">cache</span>' in page
    assert ">fell back</span>" in page


def test_a_run_without_notices_says_nothing_of_them() -> None:
    pm = PassManager([DCE()])
    result = pm(_linear())
    assert result.records[0].notices == () and result.records[0].as_dict()["notices"] == []
    assert result.summary().splitlines()[-1].endswith(" s")
    report = build_report(PipelineRun(result, manager=pm))
    assert (report["fallbacks"], report["notice_count"], report["notices"]) == (0, "", [])
    assert report["verdict"]["summary"] == "1 pass ran"
    assert 'class="notices"' not in render_html(report)


def test_a_failed_run_lists_its_notices_under_the_verdict_with_their_count() -> None:
    from epass.report import verdict

    pm = PassManager([SlowWay()])
    failed = verdict("pass failed", summary="pass 'x' failed", pass_path="x")
    report = build_report(PipelineRun(pm(_linear()), manager=pm, outcome=failed))
    page = render_html(report)
    verdict_html = page[page.index('<div class="verdict') : page.index("</div>")]
    assert "<p>1 of 1 pass fell back, 1 notice:</p>" in verdict_html


def test_every_view_escapes_a_notice_and_json_keeps_it_exact() -> None:
    ep = _linear()
    pm = PassManager([SlowWay(f"fell back {HOSTILE}")])
    result = pm(ep)
    summary = result.summary()
    assert _raw_controls(summary) == [] and "fell back \\x1b]0;pwned\\x07" in summary
    for plain in (True, False):
        stream = io.StringIO()
        notices(Out(plain=plain, stream=stream), result.records)
        shown = stream.getvalue()
        assert _raw_controls(shown) == [] and "slow-way: fell back \\x1b]0;pwned" in shown
    report = build_report(PipelineRun(result, manager=pm))
    text = json_text(report)
    assert _raw_controls(text) == [] and text.isascii()
    assert json.loads(text)["notices"][0]["text"] == f"fell back {HOSTILE}"
    page = render_html(report)
    assert _raw_controls(page) == [] and "fell back \\x1b]0;pwned\\x07" in page


_LINEAR = _linear()


@settings(max_examples=150, deadline=None)
@given(
    st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF)),
    st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), min_size=1),
)
def test_no_notice_text_or_pass_name_reaches_any_view_raw(text: str, name: str) -> None:
    record = PassRecord(name, 0, 0, 0.0, False, 1, 1, notices=(Notice("fallback", text),))
    result = PipelineResult(_LINEAR, False, (record,))
    stream = io.StringIO()
    notices(Out(plain=True, stream=stream), result.records)
    report = build_report(result)
    document = json_text(report)
    for shown in (result.summary(), stream.getvalue(), document, render_html(report)):
        assert _raw_controls(shown) == []
    assert json.loads(document)["notices"] == [{"pass": name, "kind": "fallback", "text": text}]


def test_a_notice_is_a_kind_word_and_a_text_and_a_result_holds_only_notices() -> None:
    ep = _linear()
    with pytest.raises(ValueError):
        Notice("Fell Back", "x")
    with pytest.raises(TypeError):
        Notice("fallback", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PassResult(ep, False, notices=["fell back"])  # type: ignore[list-item]
    assert PassResult(ep, False).notices == ()
    assert Notice("fallback", "x").fallback and not Notice("cache", "x").fallback


@attrs.frozen
class _ForeignResult:
    """Another framework's result: a program, a flag, and a ``notices`` of its own."""

    exported_program: Any
    modified: bool
    notices: Any = "not notices"


def test_a_result_whose_notices_are_not_notices_has_none() -> None:
    result = PassManager([lambda ep: _ForeignResult(ep, False)])(_linear())
    assert result.records[0].notices == ()


def test_decompose_says_it_fell_back_and_the_summary_counts_it() -> None:
    _, ep, _ = export("seed")  # writes into a buffer: the incremental path refuses it
    result = PassManager([Decompose(), DCE()])(ep)
    (notice,) = result.records[0].notices
    assert notice.fallback and notice.text.startswith("retraced: ")
    assert notice.text == f"retraced: {result.records[0].notes['fallback']}"
    lines = result.summary().splitlines()
    assert lines[-2:] == ["1 of 2 passes fell back:", f"  decompose: {notice.text}"]

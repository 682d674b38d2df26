"""Reports: stable JSON keys and a self-contained HTML page, rendered in a real browser."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from epass import Decompose, FxPass, PassManager, PassResult, registry
from epass.report import SCHEMA, PipelineRun, build_report, render_html, write_report

ROOT = Path(__file__).resolve().parent.parent

RECORD_KEYS = {
    "name", "index", "step", "seconds", "modified", "nodes_before", "nodes_after", "op_delta",
    "link", "skipped", "skip_reason", "depth", "children", "path", "spec", "options", "state_bytes",
    "notes", "notices", "diff",
}  # fmt: skip
TOP_KEYS = {
    "schema", "epass_version", "torch_version", "created", "pipeline", "input", "output",
    "modified", "shared", "owners", "seconds", "nodes_before", "nodes_after", "numerics", "passes",
    "count", "verdict", "fallbacks", "notice_count", "notices",
}  # fmt: skip


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 2.0))
        self.b = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.w + self.b)


def _drop_bias(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten.add.Tensor:
            mul, bias = node.args
            node.replace_all_uses_with(mul)
            gm.graph.erase_node(node)
            gm.graph.erase_node(bias)
    return gm


@attrs.define(eq=False)
class Rescale:
    """Replace the weight ``w`` by a new tensor (a changed state entry)."""

    name: ClassVar[str] = "rescale-test"
    dtype: torch.dtype = torch.float32
    factor: float = 3.0

    def __call__(self, ep: Any) -> PassResult:
        new = (ep.state_dict["w"].detach() * self.factor).to(self.dtype)
        ep.state_dict["w"] = torch.nn.Parameter(new)
        return PassResult(ep, True)


@pytest.fixture(scope="module", autouse=True)
def test_passes() -> Iterator[None]:
    registry.register_pass("drop-bias-report", lambda: FxPass(_drop_bias, name="drop-bias-report"))
    registry.register_pass("rescale-test", Rescale)
    yield
    registry.unregister_pass("drop-bias-report")
    registry.unregister_pass("rescale-test")


TEXT = "decompose, repeat(2, [drop-bias-report]), rescale-test(factor=0.5)"


@pytest.fixture(scope="module")
def run() -> tuple[PassManager, Any, Any]:
    ep = torch.export.export(Affine(), (torch.randn(3, 4),))
    pm = PassManager.from_text(TEXT)
    return pm, pm(ep), ep


def test_json_keys_are_stable(run: tuple[PassManager, Any, Any]) -> None:
    pm, result, _ = run
    report = build_report(PipelineRun(result, manager=pm, input_path="in.pt2"))
    assert set(report) == TOP_KEYS
    assert report["schema"] == SCHEMA == "epass.report/2"
    assert report["pipeline"] == TEXT
    passes = report["passes"]
    assert [p["path"] for p in passes] == ["decompose", "repeat", "rescale-test"]
    for p in passes:
        assert set(p) == RECORD_KEYS
    nested = passes[1]["children"]
    assert [(c["path"], c["step"]) for c in nested] == [
        ("repeat/drop-bias-report", 0),
        ("repeat/drop-bias-report", 1),
    ]
    assert all(set(c) == RECORD_KEYS for c in nested)
    assert passes[2]["spec"] == "rescale-test(factor=0.5)"
    assert passes[2]["options"] == {"factor": 0.5}
    assert passes[1]["spec"] is None  # a group, not a registered pass
    assert nested[0]["link"]["state_dict"]["removed"] == ["b"]
    assert passes[2]["link"]["state_dict"]["changed"] == ["w"]
    assert passes[2]["link"]["shared"] is False
    assert report["shared"] is False
    assert passes[0]["link"]["owners"] == {"state_dict": "user", "constants": "user"}
    assert passes[2]["link"]["owners"] == {"state_dict": "own", "constants": "user"}
    assert report["owners"] == {"state_dict": "own", "constants": "user"}
    assert report["nodes_before"] == passes[0]["nodes_before"]
    assert json.loads(json.dumps(report)) == report


def test_json_options_render_dtypes_and_ops_as_text() -> None:
    p = Rescale(dtype=torch.bfloat16)
    ep = torch.export.export(Affine(), (torch.randn(3, 4),))
    # A bfloat16 state entry under a float32 placeholder does not verify; only the
    # rendering of the options matters here.
    pm = PassManager([p], verify=False)
    report = build_report(PipelineRun(pm(ep), manager=pm))
    assert report["passes"][0]["options"] == {"dtype": "bfloat16"}
    assert report["pipeline"] == "rescale-test(dtype=bfloat16)"


def test_write_report_picks_the_format_by_suffix(
    run: tuple[PassManager, Any, Any], tmp_path: Path
) -> None:
    pm, result, _ = run
    report = build_report(PipelineRun(result, manager=pm))
    assert json.loads(write_report(tmp_path / "r.json", report).read_text())["schema"] == SCHEMA
    assert write_report(tmp_path / "r.html", report).read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(ValueError, match=r"\.json or \.html"):
        write_report(tmp_path / "r.txt", report)


def _leaf_paths(report: dict[str, Any]) -> list[str]:
    out: list[str] = []

    def walk(passes: list[dict[str, Any]]) -> None:
        for p in passes:
            if p["children"]:
                walk(p["children"])
            else:
                out.append(p["path"])

    walk(report["passes"])
    return out


def test_html_is_self_contained_and_shows_every_part(run: tuple[PassManager, Any, Any]) -> None:
    pm, result, _ = run
    report = build_report(PipelineRun(result, manager=pm))
    page = render_html(report)
    for forbidden in ("http://", "https://", "<script", "<link", " src=", "@import", "url("):
        assert forbidden not in page
    leaves = _leaf_paths(report)
    assert leaves == [
        "decompose",
        "repeat/drop-bias-report",
        "repeat/drop-bias-report",
        "rescale-test",
    ]
    bars = re.findall(r'<rect class="bar[^"]*" data-pass="([^"]+)"', page)
    assert bars == leaves
    assert len(re.findall(r'<circle class="node"', page)) == len(leaves) + 1
    assert '<polyline class="nodes"' in page
    assert 'class="delta"' in page and "aten.add.Tensor" in page  # op-delta table
    assert page.count('class="state diverged"') == 1  # rescale-test changed w
    assert "own state_dict, user&#x27;s constants" in page
    assert "state_dict:b" in page and "state_dict:w" in page


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_renders_in_headless_chromium(
    run: tuple[PassManager, Any, Any], tmp_path: Path
) -> None:
    browser = _browser()
    if browser is None:
        pytest.skip(
            "chromium is not installed: .ci/run installs Debian's chromium with apt-get, "
            "and that failed or was not possible on this machine"
        )
    pm, result, _ = run
    report = build_report(PipelineRun(result, manager=pm))
    page = write_report(tmp_path / "report.html", report)
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "<svg" in dom
    bars = re.findall(r'<rect class="bar[^"]*" data-pass="([^"]+)"', dom)
    assert bars == _leaf_paths(report)
    for name in ("decompose", "drop-bias-report", "rescale-test"):
        assert name in dom
    shot = tmp_path / "report.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1100,1400", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one


@pytest.mark.parametrize(
    ("method", "words"),
    [
        ("retrace", "retraced the whole program (run_decompositions)"),
        ("incremental", "rewrote only the nodes to decompose (1 node)"),
    ],
)
def test_reports_say_which_decompose_path_ran_in_words_with_the_values_behind_a_toggle(
    method: str, words: str
) -> None:
    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    pm = PassManager([Decompose(method=method)])
    report = build_report(PipelineRun(pm(ep), manager=pm))
    assert report["passes"][0]["notes"]["method"] == method
    page = render_html(report)
    (cell,) = re.findall(r'<td class="notes">(.*?)</td>', page)
    (summary,) = re.findall(r"<summary>(.*?)</summary>", cell)
    assert summary == words  # what a user reads first
    assert cell.startswith('<details class="notes">')  # the values, one click away
    assert f"<li><code>method</code>: {method}</li>" in cell
    assert "<li><code>checked</code>: False</li>" in cell


def test_the_notes_column_breaks_no_word() -> None:
    """Words wrap whole in the notes column (it is the widest); a word breaks only
    where it alone is wider than its column."""
    from epass._page import CSS

    assert "anywhere" not in CSS and "break-all" not in CSS
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    pm = PassManager([Decompose()])
    page = render_html(build_report(PipelineRun(pm(ep), manager=pm)))
    widths = [int(w) for w in re.findall(r'<col style="width:(\d+)%">', page)]
    assert len(widths) == 9 and sum(widths) == 100 and widths[-1] == max(widths)


def test_report_says_which_dicts_are_the_users_and_which_the_outputs_own() -> None:
    from epass.passes import ConstantFold

    class Folds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("t", torch.linspace(-1, 1, 4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.exp(self.t)

    ep = torch.export.export(Folds(), (torch.randn(2, 4),))
    pm = PassManager([Decompose(), ConstantFold()])
    report = build_report(PipelineRun(pm(ep), manager=pm))
    owners = [p["link"]["owners"] for p in report["passes"]]
    assert owners == [
        {"state_dict": "user", "constants": "user"},
        {"state_dict": "user", "constants": "own"},
    ]
    assert report["owners"] == {"state_dict": "user", "constants": "own"}
    page = render_html(report)
    assert page.count('class="state own"') == 1 and page.count('class="state shared"') == 1
    assert "user&#x27;s state_dict, own constants" in page


def test_every_view_counts_a_run_the_same_way(tmp_path: Path) -> None:
    from epass.passes import presets

    ep = torch.export.export(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),)
    )
    result = PassManager([presets.lower()])(ep)  # as "-p lower" builds it
    want = "6 passes (1 pipeline)"  # lower and the five passes inside it
    assert re.search(rf"^{re.escape(want)} in \d+\.\d\d s$", result.summary(), re.M)
    report = build_report(PipelineRun(result, pipeline="lower"))
    assert report["count"] == want
    assert f"<p>{want} in " in render_html(report)
    torch.export.save(ep, tmp_path / "in.pt2")
    out_path = tmp_path / "out.pt2"
    printed = subprocess.run(
        [sys.executable, "-m", "epass", "--plain", "run", str(tmp_path / "in.pt2"), "-p", "lower",
         "-o", str(out_path)],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    ).stdout  # fmt: skip
    assert f"{want} in " in printed


FAILING_PLUGIN = """\
import time

import epass


@epass.register_pass("explode")
def explode(ep):
    raise ValueError("explode always fails")


@epass.register_pass("nap")
def nap(ep):
    open("napping", "w").close()
    time.sleep(60)
    return ep
"""


def _epass(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epass", "--plain", *argv],
        cwd=cwd, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), path)
    (tmp_path / "failing.py").write_text(FAILING_PLUGIN)
    return path


def test_a_failed_pass_is_reported_with_what_ran_the_error_and_the_reproducer(
    mlp_file: Path,
) -> None:
    work = mlp_file.parent
    proc = _epass(
        "run", str(mlp_file), "--import", "failing", "-p", "decompose, dce, explode",
        "--report", "r.json", "--repro-dir", "repros", cwd=work,
    )  # fmt: skip
    assert proc.returncode == 1
    report = json.loads((work / "r.json").read_text())
    v = report["verdict"]
    assert v["status"] == "pass failed" and v["pass"] == "explode"
    assert "explode always fails" in v["error"]
    assert any("explode always fails" in line for line in v["traceback"])
    assert v["reproducer"].endswith("repro.py") and v["next"] == f"python {v['reproducer']}"
    assert [p["name"] for p in report["passes"]] == ["decompose", "dce"]
    assert report["output"] is None


def test_a_failed_run_html_report_leads_with_the_verdict(mlp_file: Path) -> None:
    work = mlp_file.parent
    proc = _epass(
        "run", str(mlp_file), "--import", "failing", "-p", "decompose, explode",
        "--report", "r.html", cwd=work,
    )  # fmt: skip
    assert proc.returncode == 1
    page = (work / "r.html").read_text()
    body = page[page.index("<h1>") :]
    assert body.index('class="verdict diverged"') < body.index("<table")
    assert "PASS FAILED" in page and "explode always fails" in page


def test_an_interrupted_run_is_reported(mlp_file: Path) -> None:
    import signal
    import time

    work = mlp_file.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "epass", "--plain", "run", str(mlp_file), "--import", "failing",
         "-p", "decompose, nap", "--report", "r.json"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (work / "napping").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    report = json.loads((work / "r.json").read_text())
    assert report["verdict"]["status"] == "interrupted"
    assert [p["name"] for p in report["passes"]] == ["decompose"]


def test_a_numerics_drift_report_names_the_drifting_pass_with_its_errors(tmp_path: Path) -> None:
    (tmp_path / "drift.py").write_text(
        "import torch\nimport epass\n\n\n"
        "@epass.register_pass('flip-relu')\n"
        "def flip_relu(ep):\n"
        "    for n in ep.graph.nodes:\n"
        "        if n.target is torch.ops.aten.relu.default:\n"
        "            n.target = torch.ops.aten.neg.default\n"
        "    ep.graph_module.recompile()\n"
        "    return ep\n"
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), tmp_path / "m.pt2")
    proc = _epass(
        "run", "m.pt2", "--import", "drift", "-p", "decompose, flip-relu", "--check-numerics",
        "--report", "r.json", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    report = json.loads((tmp_path / "r.json").read_text())
    v = report["verdict"]
    assert v["status"] == "numerics drift" and v["pass"] == "flip-relu"
    per_pass = {p["pass"]: p for p in report["numerics"]["passes"]}
    assert per_pass["flip-relu"]["ok"] is False and per_pass["flip-relu"]["max_abs"] > 0
    assert per_pass["decompose"]["ok"] is True


def test_a_result_or_a_run_is_written_by_the_report_module(tmp_path: Path) -> None:
    ep = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(1, 3),))
    pm = PassManager([Decompose()])
    result = pm(ep)
    assert not hasattr(result, "write_report")  # values only: records write no files
    report = json.loads(write_report(tmp_path / "r.json", result).read_text())
    assert report["verdict"]["status"] == "ok"
    assert [p["name"] for p in report["passes"]] == ["decompose"]
    assert report["pipeline"] is None and report["passes"][0]["spec"] is None
    run = PipelineRun(result, manager=pm)
    report = json.loads(write_report(tmp_path / "run.json", run).read_text())
    assert report["pipeline"] == "decompose" and report["passes"][0]["spec"] == "decompose"


CHECK_SCRIPT = """<script>
const w = window.innerWidth, out = {};
const v = document.querySelector('.verdict');
out.verdict_top = v ? v.getBoundingClientRect().top : null;
out.columns = [...document.querySelectorAll('th')].map(th => {
  const b = th.getBoundingClientRect();
  return [th.textContent, b.width > 0 && b.left >= 0 && b.right <= w + 1];
});
out.axis = [...document.querySelectorAll('svg.nodes text.axis')].map(
  t => [t.textContent, t.getBBox().width > 0]);
out.page_fits = document.documentElement.scrollWidth <= w + 1;
out.sections = document.querySelectorAll('details.pass-diff').length;
out.links = [...document.querySelectorAll('td.pass a')].every(
  a => document.getElementById(a.getAttribute('href').slice(1)) !== null);
document.body.setAttribute('data-check', JSON.stringify(out));
</script>"""


def test_html_report_fits_1280_pixels_in_chromium_with_verdict_axis_and_every_column(
    tmp_path: Path,
) -> None:
    from epass.passes import presets
    from epass.report import RunLog, verdict

    browser = _browser()
    if browser is None:
        pytest.skip("chromium is not installed (.ci/run installs it with apt-get)")
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    ep = torch.export.export(model, (torch.randn(3, 2, 16),))
    log = RunLog()
    pm = PassManager([presets.lower()], instruments=[log])
    result = pm(ep)
    outcome = verdict(
        "pass failed", summary="pass 'lower/dce' failed", pass_path="lower/dce",
        error="ValueError: " + "a long error message " * 12, next_step="python repros/repro.py",
    )  # fmt: skip
    report = build_report(
        PipelineRun(result, manager=pm, pipeline="lower", outcome=outcome, diffs=log.diffs)
    )
    assert any(p["diff"] for p in report["passes"][0]["children"])
    page = write_report(tmp_path / "report.html", report)
    checked = tmp_path / "checked.html"
    checked.write_text(page.read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
         "--window-size=1280,2000", "--virtual-time-budget=3000", "--dump-dom",
         checked.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    found = re.search(r"data-check=\"([^\"]*)\"", dom)
    assert found, dom[:2000]
    out = json.loads(html.unescape(found.group(1)))
    assert out["verdict_top"] is not None and out["verdict_top"] < 200
    hidden = [name for name, visible in out["columns"] if not visible]
    assert not hidden and len(out["columns"]) >= 9, out["columns"]
    assert [name for name, _ in out["axis"]][:2] == ["input", "lower/decompose"]
    assert all(visible for _, visible in out["axis"])
    assert out["page_fits"] and out["links"]
    assert out["sections"] == len(report["passes"]) + len(report["passes"][0]["children"])


# --- what a report shows of the machine it was written on ---------------------------


def test_shown_paths_are_relative_to_the_import_path_or_the_working_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import epass.report
    from epass.report import shown_path

    assert shown_path(torch.__file__) == "torch/__init__.py"
    assert shown_path(epass.report.__file__) == "epass/report.py"
    monkeypatch.chdir(tmp_path)
    assert shown_path(str(tmp_path / "my_passes.py")) == "my_passes.py"
    assert shown_path("/no/such/folder/model.py") == "model.py"
    assert shown_path("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"


def test_a_failure_report_names_no_folder_of_the_machine(mlp_file: Path) -> None:
    work = mlp_file.parent
    for name in ("r.json", "r.html"):
        proc = _epass(
            "run", str(mlp_file), "--import", "failing", "-p", "decompose, explode",
            "--report", name, cwd=work,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
    frames = json.loads((work / "r.json").read_text())["verdict"]["traceback"][:-1]
    assert frames and any(f.startswith("failing.py:") for f in frames), frames
    assert all(f.startswith(("epass/", "failing.py:", "torch/")) for f in frames), frames
    page = (work / "r.html").read_text()
    assert "failing.py:" in page
    for folder in {str(ROOT), str(work), sys.prefix, *map(str, Path(torch.__file__).parents)}:
        if len(folder) > 1:
            assert f"{folder}/" not in page.replace(f"{work}/mlp.pt2", "")


def test_the_html_says_what_its_columns_mean() -> None:
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    pm = PassManager([Decompose()])
    page = render_html(build_report(PipelineRun(pm(ep), manager=pm)))
    legends = re.findall(r'<p class="legend">(.*?)</p>', page)
    assert len(legends) == 2
    assert "<strong>no longer used</strong>: entries the output no longer reads" in legends[0]
    assert "Your dicts are untouched" in legends[0]
    assert "<strong>delta</strong>: how many calls" in legends[1]
    assert "<th>no longer used</th>" in page and "<th>removed</th>" not in page


# --- no raw control character in any report (issue: hostile meta under --trust) -----

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x00\r\nforged\u202e\x85\x7f"
# The same within one line (a stack trace is read line by line).
IN_LINE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x00forged\u202e\x7f"


def _raw(text: str) -> list[str]:
    """The characters a terminal or a viewer would act on (line breaks aside)."""
    return sorted({c for line in text.split("\n") for c in line if not c.isprintable()})


@pytest.fixture(scope="module")
def hostile_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program whose every node's stack trace holds terminal escapes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    ep = torch.export.export(model, (torch.randn(3, 4),))
    for node in ep.graph.nodes:
        if node.op == "call_function":
            node.meta["stack_trace"] = (
                f'  File "/home/someone/model{IN_LINE}.py", line 3, in forward\n'
                f"    return x{IN_LINE}\n"
            )
    path = tmp_path_factory.mktemp("hostile") / "hostile.pt2"
    torch.export.save(ep, path)
    return path


NAMING_PLUGIN = """\
import epass


@epass.register_pass("quote-the-source")
def quote_the_source(ep):
    node = next(n for n in ep.graph.nodes if n.op == "call_function")
    raise ValueError("cannot handle " + node.meta["stack_trace"].splitlines()[-1])
"""


def test_a_trusted_hostile_program_leaves_no_raw_control_character_in_any_report(
    hostile_program: Path, tmp_path: Path
) -> None:
    """HTML, JSON, the reproducer and the terminal: one escaping rule for all."""
    (tmp_path / "naming.py").write_text(NAMING_PLUGIN)
    seen: dict[str, str] = {}
    for report in ("r.html", "r.json"):
        ok = _epass(
            "run", str(hostile_program), "--trust", "-p", "decompose", "--report", report,
            cwd=tmp_path,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
        seen[f"ok {report}"] = (tmp_path / report).read_text()
        seen[f"ok terminal {report}"] = ok.stdout + ok.stderr
        failed = _epass(
            "run", str(hostile_program), "--trust", "--import", "naming", "-p",
            "decompose, quote-the-source", "--report", f"failed-{report}", "--repro-dir",
            "repros", cwd=tmp_path,
        )  # fmt: skip
        assert failed.returncode == 1, failed.stderr
        seen[f"failed {report}"] = (tmp_path / f"failed-{report}").read_text()
        seen[f"failed terminal {report}"] = failed.stdout + failed.stderr
    for written in sorted((tmp_path / "repros").glob("*/*")):
        if written.suffix not in (".pt2", ".pkl"):
            seen[f"reproducer {written.name}"] = written.read_text("utf-8")
    assert "x\\x1b]0;pwned\\x07" in seen["failed r.html"]  # the error, escaped
    assert "model\\x1b]0;pwned" in seen["ok r.html"]  # the stack trace, escaped
    assert "\\u001b]0;pwned\\u0007" in seen["failed r.json"]  # JSON keeps it exact
    assert "x\\x1b]0;pwned" in seen["reproducer error.txt"]
    raw = {where: _raw(text) for where, text in seen.items() if _raw(text)}
    assert not raw, raw
    assert "x\x1b]0;pwned" in json.loads(seen["failed r.json"])["verdict"]["error"]


def _string_fields(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every string in a report: values, and the keys of the mappings whose
    keys are data (op names, option names, notes)."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _string_fields(item, (*path, i))
    elif isinstance(value, dict) and path[-1:] != ("owners",):  # "user" / "own": our words
        data_keys = path[-1:] in (("op_delta",), ("options",), ("notes",)) or path[-2:] in (
            ("diff", "added"),
            ("diff", "removed"),
        )
        for key, item in value.items():
            if data_keys:
                yield (*path, ("key", key))
            yield from _string_fields(item, (*path, key))


def _replace(report: Any, path: tuple[Any, ...], text: str) -> None:
    *parents, last = path
    holder = report
    for step in parents:
        holder = holder[step]
    if isinstance(last, tuple):  # a key
        holder[f"{last[1]}{text}"] = holder.pop(last[1])
    else:
        holder[last] = f"{holder[last]}{text}"


@pytest.fixture(scope="module")
def full_report(run: tuple[PassManager, Any, Any]) -> dict[str, Any]:
    """A report with every part filled: passes with links, notes, options and diffs,
    numerics, and a failure's verdict with a traceback."""
    from epass.report import RunLog, verdict

    _, _, ep = run
    log = RunLog()
    pm2 = PassManager.from_text(TEXT)
    pm2.instruments.append(log)
    result = pm2(ep)
    outcome = verdict(
        "pass failed", summary="pass 'p' failed", pass_path="p", error="ValueError: e",
        traceback_lines=["epass/manager.py:1 in run", "ValueError: e"], reproducer="r/repro.py",
        next_step="python r/repro.py",
    )  # fmt: skip
    numerics = {"max_abs_diff": 0.0, "ok": True, "atol": 1e-5, "rtol": 1e-4,
                "first_drift": "p", "passes": [{"pass": "decompose", "max_abs": 0.0}]}  # fmt: skip
    report = build_report(
        PipelineRun(
            result, manager=pm2, pipeline=TEXT, input_path="in.pt2", output_path="out.pt2",
            numerics=numerics, outcome=outcome, diffs=log.diffs,
        )
    )  # fmt: skip
    assert any(p["diff"] for p in report["passes"]) and any(p["notes"] for p in report["passes"])
    return report


@settings(max_examples=60, deadline=None)
@example(HOSTILE)
@given(st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), min_size=1))
def test_every_string_field_of_a_report_is_escaped_in_html_and_json(
    full_report: dict[str, Any], text: str
) -> None:
    import copy

    from epass._text import json_text

    report = copy.deepcopy(full_report)
    fields = list(_string_fields(report))
    assert len(fields) > 40
    keys = sorted((f for f in fields if isinstance(f[-1], tuple)), key=len, reverse=True)
    for path in [*(f for f in fields if not isinstance(f[-1], tuple)), *keys]:
        _replace(report, path, text)  # values first, then keys, the deepest first
    page = render_html(report)
    assert _raw(page) == []
    written = json_text(report)
    assert _raw(written) == []
    assert json.loads(written) == report  # JSON keeps every string exact

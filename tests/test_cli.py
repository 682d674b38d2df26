"""The ``epass`` command: run, passes, inspect, demo, and its errors."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import export

import epass
from epass import FxPass, registry
from epass.cli import main, printable
from epass.io import load, unreferenced

ROOT = Path(__file__).resolve().parent.parent


class AddBias(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 2.0))
        self.b = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + self.b


def _drop_bias(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace ``x * w + b`` by ``x * w`` and drop the ``b`` placeholder."""
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten.add.Tensor:
            mul, bias = node.args
            node.replace_all_uses_with(mul)
            gm.graph.erase_node(node)
            gm.graph.erase_node(bias)
    return gm


def _explode(ep: Any) -> Any:
    raise RuntimeError("boom in the test pass")


@pytest.fixture(scope="module", autouse=True)
def test_passes() -> Iterator[None]:
    registry.register_pass("drop-bias-test", lambda: FxPass(_drop_bias, name="drop-bias-test"))
    registry.register_pass("explode-test", _explode)
    yield
    registry.unregister_pass("drop-bias-test")
    registry.unregister_pass("explode-test")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    _, mlp, _ = export("mlp")
    torch.export.save(mlp, root / "mlp.pt2")
    bias = torch.export.export(AddBias(), (torch.randn(3, 4),))
    torch.export.save(bias, root / "bias.pt2")
    (root / "notes.pt2").write_text("this is not an archive")
    with zipfile.ZipFile(root / "other.pt2", "w") as z:
        z.writestr("hello.txt", "a zip, but not a program")
    data = (root / "mlp.pt2").read_bytes()
    (root / "truncated.pt2").write_bytes(data[: len(data) // 2])
    return {
        "mlp": root / "mlp.pt2",
        "bias": root / "bias.pt2",
        "notes": root / "notes.pt2",
        "other": root / "other.pt2",
        "truncated": root / "truncated.pt2",
    }


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["--plain", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "expected a reason on stderr"
    assert lines[0].startswith("epass: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_run_writes_program_summary_and_json_report(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file, report = tmp_path / "out.pt2", tmp_path / "r.json"
    code, out, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "decompose", "-o", str(out_file),
        "--report", str(report), "--check-numerics",
    )  # fmt: skip
    assert code == 0, err
    assert "decompose" in out and "shared" in out
    assert "state_dict shared: yes, constants shared: yes" in out
    assert "numerics: max abs diff" in out and " ok" in out
    loaded = torch.export.load(out_file)
    ops = {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert "aten.linear.default" not in ops  # decomposed
    data = json.loads(report.read_text())
    assert data["pipeline"] == "decompose"
    assert [p["name"] for p in data["passes"]] == ["decompose"]
    assert data["numerics"]["ok"] is True


def test_run_prunes_unreferenced_state_before_saving(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "out.pt2"
    code, out, err = _run(
        capsys, "run", str(files["bias"]), "-p", "drop-bias-test", "-o", str(out_file)
    )
    assert code == 0, err
    assert "pruned 1 unreferenced state entries" in out
    assert sorted(torch.export.load(out_file).state_dict) == ["w"]


def test_prune_keeps_the_input_program_intact() -> None:
    ep = torch.export.export(AddBias(), (torch.randn(3, 4),))
    from epass import PassManager

    out = PassManager([FxPass(_drop_bias)]).run(ep)
    assert "b" in out.state_dict  # the linker keeps it: the input still needs it
    assert unreferenced(out) == ["state_dict:b"]
    pruned = epass.prune(out, compact=True)
    assert sorted(pruned.state_dict) == ["w"] and pruned.state_dict["w"] is ep.state_dict["w"]
    assert "b" in ep.state_dict and "b" in out.state_dict
    assert unreferenced(ep) == []


def test_run_with_steps_and_nested_groups(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "repeat(2, [decompose])", "--steps", "2"
    )
    assert code == 0, err
    assert "repeat" in out and "  decompose" in out


@pytest.mark.parametrize(
    ("make_args", "expected"),
    [
        (lambda f, t: ["run", str(t / "missing.pt2"), "-p", "decompose"], "no such file"),
        (lambda f, t: ["run", str(t), "-p", "decompose"], "is a directory"),
        (lambda f, t: ["run", str(f["notes"]), "-p", "decompose"], "not a .pt2 archive"),
        (lambda f, t: ["run", str(f["other"]), "-p", "decompose"], "not an exported program"),
        (lambda f, t: ["run", str(f["truncated"]), "-p", "decompose"], "not a .pt2 archive"),
        (lambda f, t: ["run", str(f["mlp"]), "-p", "decompose, dce2"], "unknown pass 'dce2'"),
        (lambda f, t: ["run", str(f["mlp"]), "-p", "decompose(kep=1)"], "no option 'kep'"),
        (lambda f, t: ["run", str(f["mlp"]), "-p", "decompose("], "bad pipeline"),
        (
            lambda f, t: ["run", str(f["mlp"]), "-p", "decompose", "-o", str(t / "x.onnx")],
            "must end in .pt2",
        ),
        (
            lambda f, t: ["run", str(f["mlp"]), "-p", "decompose", "--report", str(t / "r.txt")],
            "must end in .json or .html",
        ),
        (lambda f, t: ["run", str(f["mlp"]), "-p", "decompose", "--steps", "0"], "--steps"),
        (lambda f, t: ["run", str(f["mlp"])], "required: -p/--pipeline"),
        (lambda f, t: ["frobnicate"], "invalid choice: 'frobnicate'"),
        (lambda f, t: ["inspect", str(f["notes"])], "not a .pt2 archive"),
    ],
)
def test_bad_input_gives_one_line_and_nonzero_exit(
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make_args: Any,
    expected: str,
) -> None:
    code, _, err = _run(capsys, *make_args(files, tmp_path))
    assert code == 2
    assert expected in _one_line_error(err)


def test_pipeline_error_shows_the_caret(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, err = _run(capsys, "run", str(files["mlp"]), "-p", "decompose, dce2")
    assert err.splitlines() == [
        "epass: error: bad pipeline: unknown pass 'dce2' at column 12; did you mean 'dce'?",
        "  decompose, dce2",
        "             ^",
    ]


def test_failing_pass_exits_1_and_writes_a_reproducer(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repro = tmp_path / "repro"
    code, _, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "decompose, explode-test",
        "--repro-dir", str(repro), "-o", str(tmp_path / "never.pt2"),
    )  # fmt: skip
    assert code == 1
    reason = [line for line in err.splitlines() if line.startswith("epass: error:")]
    assert reason == [
        "epass: error: pass 'explode-test' (position 1, step 0) failed: "
        "RuntimeError: boom in the test pass"
    ]
    assert "Traceback" not in err
    assert not (tmp_path / "never.pt2").exists()
    # The library's Reproducer format: one folder per failure.
    (where,) = repro.iterdir()
    assert f"epass: reproducer written to {where}" in err
    assert sorted(p.name for p in where.iterdir()) == [
        "error.txt", "graph.json", "passes.pkl", "pipeline.txt", "program.pt2", "repro.py",
    ]  # fmt: skip
    assert (where / "pipeline.txt").read_text() == "explode-test\n"
    assert "RuntimeError: boom" in (where / "error.txt").read_text()
    # The saved input is the program the failing pass was given: already decomposed.
    before = torch.export.load(where / "program.pt2")
    assert "aten.linear.default" not in {str(n.target) for n in before.graph.nodes}
    code, _, err = _run(capsys, "run", str(where / "program.pt2"), "-p", "explode-test")
    assert code == 1 and "boom in the test pass" in err


def test_numerics_failure_exits_1(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(
        capsys, "run", str(files["bias"]), "-p", "drop-bias-test", "--check-numerics"
    )
    assert code == 1
    assert "FAILED" in out
    assert _one_line_error(err) == (
        "epass: error: numerics differ after pass 'drop-bias-test': "
        "max abs diff 1 exceeds atol 1e-05 / rtol 0.0001"
    )


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickled_payload_is_refused_and_not_executed(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "executed"
    evil = _evil_copy(files["mlp"], tmp_path / "evil.pt2", marker)
    code, _, err = _run(capsys, "inspect", str(evil))
    assert code == 2
    line = _one_line_error(err)
    assert "refused member 'mlp/data/sample_inputs/model.pt'" in line, line
    assert not marker.exists()


def _evil_copy(source: Path, dest: Path, marker: Path) -> Path:
    """A copy of ``source`` whose sample inputs are a pickle that creates ``marker``."""
    payload = pickle.dumps(((_Marker(str(marker)),), {}))
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("sample_inputs/model.pt"):
                data = payload
            zout.writestr(item, data)
    return dest


class _Marker:
    """Unpickling this creates a file: the stand-in for arbitrary code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_torch_export_load_alone_would_run_the_payload(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """Why the CLI guards loading: torch 2.13 falls back to full unpickling."""
    marker = tmp_path / "executed"
    evil = _evil_copy(files["mlp"], tmp_path / "evil.pt2", marker)
    with pytest.raises(Exception):  # noqa: B017 (the load fails, but only after unpickling)
        torch.export.load(evil)
    assert marker.exists()
    load(files["mlp"])  # the guarded path still loads ordinary files


def test_inspect_reports_dialect_ops_state_and_signature(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "inspect", str(files["bias"]))
    assert code == 0, err
    assert f"dialect {load(files['bias']).dialect}, 6 nodes" in out
    assert "aten.mul.Tensor" in out and "aten.add.Tensor" in out
    assert "parameters" in out and "dtype float32" in out
    assert "inputs:  x" in out
    code, out, _ = _run(capsys, "inspect", "--json", str(files["bias"]))
    info = json.loads(out)
    assert info["ops"] == {"aten.mul.Tensor": 1, "aten.add.Tensor": 1}
    assert info["state"]["parameters"] == {"count": 2, "bytes": 32}
    assert info["signature"]["input_kinds"] == {"parameter": 2, "user_input": 1}


class DynamicLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset.float()


def test_inspect_lists_inputs_with_kind_shape_symbolic_dims_and_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(DynamicLinear(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, tmp_path / "dyn.pt2")
    code, out, err = _run(capsys, "inspect", str(tmp_path / "dyn.pt2"))
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    (symbol,) = re.findall(r"^x +user input +\((s\d+), 4\) +float32$", out, re.M)
    assert re.search(
        r"^p_linear_weight \(linear\.weight\) +parameter +\(4, 4\) +float32$", out, re.M
    )
    assert re.search(r"^b_offset \(offset\) +buffer +\(4\) +float64$", out, re.M), rows
    assert f"symbolic dims: {symbol} in [2, 64]" in out
    code, out, _ = _run(capsys, "inspect", "--json", str(tmp_path / "dyn.pt2"))
    sig = json.loads(out)["signature"]
    assert sig["inputs"][-1] == {
        "name": "x", "kind": "user input", "target": None, "shape": [symbol, 4], "dtype": "float32"
    }  # fmt: skip
    assert sig["dims"] == {symbol: [2, 64]}


def test_passes_lists_names_sources_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "passes")
    assert code == 0
    (line,) = [x for x in out.splitlines() if x.startswith("decompose ")]
    assert "epass" in line and "keep=[]" in line
    code, out, _ = _run(capsys, "passes", "--json")
    names = {e["name"] for e in json.loads(out)}
    assert {"decompose", "fold-constants", "lower", "drop-bias-test"} <= names


def test_rich_and_plain_tables_show_the_same_rows(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["passes"]) == 0
    rich_out = capsys.readouterr().out
    assert "━" in rich_out  # drawn by rich
    monkeypatch.setitem(sys.modules, "rich", None)  # as if rich were not installed
    monkeypatch.setitem(sys.modules, "rich.console", None)
    assert main(["passes"]) == 0
    plain_out = capsys.readouterr().out
    assert "━" not in plain_out
    for name in ("decompose", "fold-constants"):
        assert name in rich_out and name in plain_out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def untimed_display(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich's displays without their refresh thread: they draw only when epass asks,
    so what a test sees does not depend on how long each step took."""
    rich_progress = pytest.importorskip("rich.progress")
    untimed = functools.partial(rich_progress.Progress, auto_refresh=False)
    monkeypatch.setattr(rich_progress, "Progress", untimed)


def _drawn(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n")


def _states(text: str) -> list[str]:
    """Each state a display was drawn in (its count and text: no spinner frame, bar or
    elapsed time), in order, repeats of one state once."""
    states: list[str] = []
    for line in _drawn(text).split("\n"):
        state = re.sub(r"^[\u2800-\u28ff]|[━╺╸]+|\d+:\d\d:\d\d$", "", line.strip()).strip()
        state = re.sub(r"\s+", " ", state)
        if state and (not states or states[-1] != state):
            states.append(state)
    return states


def test_progress_is_shown_on_a_terminal_only(
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    untimed_display: None,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["run", str(files["mlp"]), "-p", "decompose, repeat(2, [cse])"]) == 0
    size = f"({files['mlp'].stat().st_size / 1000:.0f} kB)"
    # Every pass is drawn as it starts, however short (epass.instruments.Progress).
    assert _states(terminal.getvalue()) == [
        f"screening mlp.pt2 {size}",
        f"loading mlp.pt2 {size}",
        "0/2 pipeline",
        "0/2 decompose",
        "1/2 repeat",
        "1/2 repeat > cse",
        "2/2 repeat > cse",
    ]
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no progress
    assert main(["run", str(files["mlp"]), "-p", "decompose"]) == 0
    assert sys.stderr.getvalue() == ""


def test_demo_shows_saving_on_a_terminal_only(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    untimed_display: None,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["demo", "--save", str(tmp_path / "demo.pt2")]) == 0
    (state,) = _states(terminal.getvalue())
    assert re.fullmatch(r"saving demo\.pt2 \(\d+ kB\)", state), state
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: nothing at all
    assert main(["demo", "--save", str(tmp_path / "again.pt2")]) == 0
    assert sys.stderr.getvalue() == ""
    assert (tmp_path / "again.pt2").is_file()
    capsys.readouterr()


def test_loading_screening_saving_and_nested_passes_show_on_a_terminal_only(
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    untimed_display: None,
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    out = tmp_path / "out.pt2"
    assert main(["run", str(files["mlp"]), "-p", "lower, cse, dce", "-o", str(out)]) == 0
    shown = _drawn(terminal.getvalue())
    size = f"({files['mlp'].stat().st_size / 1000:.0f} kB)"
    for text in (f"screening mlp.pt2 {size}", f"loading mlp.pt2 {size}", "saving out.pt2 ("):
        assert text in shown, text
    assert "0/7 lower > decompose" in shown and "6/7 dce" in shown
    assert "/2" not in shown  # the two top-level passes are not what is counted
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)  # not a terminal: nothing at all
    assert main(["run", str(files["mlp"]), "-p", "lower", "-o", str(out)]) == 0
    assert quiet.getvalue() == ""
    capsys.readouterr()


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_spinners_draw_on_a_real_terminal(files: dict[str, Path], tmp_path: Path) -> None:
    """The command, run with stderr on a pseudo-terminal, draws the spinners there."""
    pytest.importorskip("rich")
    leader, follower = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR", "EPASS_PLAIN"):
        env.pop(key, None)
    out = tmp_path / "out.pt2"
    argv = ["run", str(files["mlp"]), "-p", "lower", "-o", str(out)]
    with subprocess.Popen(
        [sys.executable, "-m", "epass", *argv], env=env, stdout=subprocess.PIPE, stderr=follower
    ) as child:
        os.close(follower)
        drawn = b""
        with contextlib.suppress(OSError):  # EIO: the child closed the terminal
            while chunk := os.read(leader, 1 << 16):
                drawn += chunk
        assert child.wait(timeout=300) == 0
    os.close(leader)
    shown = _drawn(drawn.decode(errors="replace"))
    for text in ("screening mlp.pt2", "loading mlp.pt2", "lower > decompose", "saving out.pt2"):
        assert text in shown, text


def _cli(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "epass.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_debug_shows_the_traceback(files: dict[str, Path]) -> None:
    quiet = _cli("run", str(files["notes"]), "-p", "decompose")
    assert quiet.returncode == 2
    assert quiet.stderr.startswith("epass: error: ") and "Traceback" not in quiet.stderr
    loud = _cli("--debug", "run", str(files["notes"]), "-p", "decompose")
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "LoadError" in loud.stderr


@pytest.mark.slow
def test_demo_runs_and_writes_a_report(tmp_path: Path) -> None:
    proc = _cli("demo", "--report", str(tmp_path / "demo.html"))
    assert proc.returncode == 0, proc.stderr
    assert "exported a 2-layer TransformerEncoder" in proc.stdout
    assert "state_dict shared: True" in proc.stdout
    assert "every tensor is the user's object: True" in proc.stdout
    assert (tmp_path / "demo.html").read_text().count('class="bar') >= 1


def test_demo_save_writes_the_program_and_its_last_line_is_the_next_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    saved = Path("demo.pt2")  # --save without a name: the default
    code, out, _ = _run(capsys, "demo", "--save")
    assert code == 0
    assert f"wrote {saved}" in out
    program = load(saved)
    assert len(program.graph.nodes) == 96  # the exported program, before any pass
    last = out.strip().splitlines()[-1]
    assert last == f"next: epass run {saved} -p lower -o lowered.pt2 --report report.html"
    code, out, _ = _run(capsys, *last.removeprefix("next: epass ").split()[:2], "-p", "dce")
    assert code == 0


def test_demo_refuses_a_save_path_that_is_not_pt2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "demo", "--save", str(tmp_path / "demo.txt"))
    assert code != 0 and "demo.txt" in err
    assert not (tmp_path / "demo.txt").exists()


def test_run_result_is_unchanged_by_a_noop_pipeline(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "same.pt2"
    code, out, _ = _run(capsys, "run", str(files["mlp"]), "-p", "", "-o", str(out_file))
    assert code == 0
    assert "0 passes" in out
    before, after = load(files["mlp"]), load(out_file)
    assert sorted(before.state_dict) == sorted(after.state_dict)
    for key, value in before.state_dict.items():
        assert torch.equal(value, after.state_dict[key])


def test_rejected_option_value_is_one_readable_line(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # attrs validators raise ValueError(message, attribute, options, value): only the
    # message belongs on the line, not the repr of the whole tuple.
    code, _, err = _run(capsys, "run", str(files["mlp"]), "-p", "cast-dtype(dtype=int8)")
    assert code == 2
    line = _one_line_error(err)
    assert line == (
        "epass: error: bad pipeline: bad options for pass 'cast-dtype' at column 1: "
        "'dtype' must be in (torch.bfloat16, torch.float16) (got torch.int8)"
    )


@pytest.mark.parametrize("flag", ["-o", "--report"])
def test_output_path_that_is_a_directory_fails_before_running(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    target = tmp_path / ("out.pt2" if flag == "-o" else "r.html")
    target.mkdir()
    code, out, err = _run(capsys, "run", str(files["mlp"]), "-p", "decompose", flag, str(target))
    assert code == 2
    assert _one_line_error(err) == f"epass: error: {target}: is a directory"
    assert "decompose" not in out  # refused before the pipeline ran


def test_unwritable_repro_dir_keeps_the_pass_error(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "explode-test", "--repro-dir", str(blocker)
    )
    assert code == 1
    assert "Traceback" not in err
    reason = [line for line in err.splitlines() if line.startswith("epass: error:")]
    assert reason == [
        "epass: error: pass 'explode-test' (position 0, step 0) failed: "
        "RuntimeError: boom in the test pass"
    ]
    assert f"cannot write a reproducer to {blocker}" in err


def test_output_program_that_cannot_run_the_inputs_is_named(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # keep_io=false makes the program take bfloat16: the float32 example inputs fail.
    code, _, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "cast-dtype(keep_io=false)", "--check-numerics"
    )
    assert code == 1
    assert _one_line_error(err).startswith(
        "epass: error: numerics differ after pass 'cast-dtype': running it raised RuntimeError("
    )


# --- outputs are all-or-nothing; exit codes ------------------------------------------


def test_unwritable_report_path_fails_before_running(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "out.pt2"
    code, out, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "decompose", "-o", str(out_file),
        "--report", "/proc/x.json",
    )  # fmt: skip
    assert code == 2
    assert "/proc/x.json" in _one_line_error(err)
    assert "decompose" not in out and not out_file.exists()


def test_numerics_failure_writes_the_report_but_not_the_program(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file, report = tmp_path / "out.pt2", tmp_path / "r.json"
    code, _, err = _run(
        capsys, "run", str(files["bias"]), "-p", "drop-bias-test", "--check-numerics",
        "-o", str(out_file), "--report", str(report),
    )  # fmt: skip
    assert code == 1
    assert _one_line_error(err).endswith(f"{out_file} was not written")
    assert not out_file.exists()
    data = json.loads(report.read_text())
    assert data["numerics"]["ok"] is False and data["output"] is None
    assert data["numerics"]["first_drift"].startswith("drop-bias-test: DRIFT")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp files either


@pytest.mark.parametrize(
    ("flag", "value"), [("--atol", "-1"), ("--rtol", "nan"), ("--atol", "inf")]
)
def test_bad_tolerance_exits_2_before_running(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    code, out, err = _run(
        capsys, "run", str(files["mlp"]), "-p", "decompose", "--check-numerics", flag, value
    )
    assert code == 2
    assert f"argument {flag}: must be a finite number >= 0" in _one_line_error(err)
    assert out == ""


def _exit_three(ep: Any) -> Any:
    sys.exit(3)


def test_sys_exit_in_a_pass_is_a_pass_failure(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    registry.register_pass("exit-test", _exit_three)
    try:
        code, _, err = _run(capsys, "run", str(files["mlp"]), "-p", "decompose, exit-test")
    finally:
        registry.unregister_pass("exit-test")
    assert code == 1
    assert err.splitlines() == [
        "epass: error: pass 'exit-test' (position 1, step 0) failed: SystemExit: 3"
    ]


def test_cli_numerics_verdict_is_numerics_check_verdict(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One tolerance rule: the command's verdict is NumericsCheck's on the same program."""
    from epass import NumericsCheck, PassManager

    ep = load(files["bias"])
    for atol in ("0.5", "1.5"):  # the dropped bias is 1.0: fails, then passes
        report = tmp_path / f"r{atol}.json"
        code, _, _ = _run(
            capsys, "run", str(files["bias"]), "-p", "drop-bias-test", "--check-numerics",
            "--atol", atol, "--rtol", "0", "--report", str(report),
        )  # fmt: skip
        check = NumericsCheck(reference="input", atol=float(atol), rtol=0.0)
        PassManager.from_text("drop-bias-test", instruments=[check]).run(ep)
        numerics = json.loads(report.read_text())["numerics"]
        assert numerics["ok"] is (check.first_drift is None) is (code == 0)
        assert numerics["max_abs_diff"] == check.checks[-1].max_abs
    assert code == 0  # the last one, atol 1.5, passed


def test_passes_prints_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    from epass.cli.passes import plain_text

    assert plain_text("Fold :class:`~torch.nn.BatchNorm2d` into ``conv``") == (
        "Fold BatchNorm2d into conv"
    )
    code, out, _ = _run(capsys, "passes")
    assert code == 0
    assert "``" not in out and ":class:" not in out and ":func:" not in out


# --- loading programs that need extra libraries ------------------------------------

_OPS_LIBRARY = """
import torch


@torch.library.custom_op("epass_test_ops::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)
"""

_PLUGIN = """
import epass
from epass import PassResult


class NeedsOps:
    name = "needs-ops"
    imports = ("epass_test_ops",)

    def __call__(self, ep):
        return PassResult(ep, False)


epass.register_pass("needs-ops", NeedsOps)
"""


@pytest.fixture(scope="module")
def custom_op_program(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A program calling a custom op, and the folder holding the op's library."""
    root = tmp_path_factory.mktemp("ops")
    (root / "epass_test_ops.py").write_text(_OPS_LIBRARY)
    (root / "needs_ops_plugin.py").write_text(_PLUGIN)
    script = (
        "import sys, torch\nsys.path.insert(0, sys.argv[1])\nimport epass_test_ops\n"
        "class M(torch.nn.Module):\n    def forward(self, x):\n"
        "        return torch.ops.epass_test_ops.twice(x) + 1\n"
        "torch.export.save(torch.export.export(M(), (torch.randn(3),)), sys.argv[2])\n"
    )
    program = root / "ops.pt2"
    subprocess.run([sys.executable, "-c", script, str(root), str(program)], check=True)
    return program, root


def _epass(*argv: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(path)])}
    return subprocess.run(
        [sys.executable, "-m", "epass", "--plain", *argv],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


EXIT_WORK = """\
import atexit, os, threading, time

def _mark(name):
    with open(os.environ["EPASS_TEST_MARK"], "a") as f:
        f.write(name + "\\n")

atexit.register(_mark, "exit handler")

def _late():
    output = os.environ["EPASS_TEST_OUTPUT"]
    while not os.path.exists(output):  # the command has written its output
        time.sleep(0.05)
    time.sleep(0.5)
    _mark("thread")

threading.Thread(target=_late).start()  # not a daemon: the process waits for it
"""


EXIT_QUICK = """\
import atexit, os

def _mark(name):
    with open(os.environ["EPASS_TEST_MARK"], "a") as f:
        f.write(name + "\\n")

atexit.register(_mark, "exit handler")

_fd = os.open(os.environ["EPASS_TEST_MARK"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

class _Finalized:
    def __del__(self, write=os.write, fd=_fd):  # bound now: teardown clears modules
        write(fd, b"teardown\\n")

kept = _Finalized()
"""


def test_the_command_exits_as_python_would_with_its_handlers_and_threads(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    """The process ends without the interpreter's teardown, but exit handlers run,
    output is whole, and a thread that is not a daemon is waited for first."""
    (tmp_path / "exit_work.py").write_text(EXIT_WORK)
    mark = tmp_path / "mark"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-m", "epass", "--plain", "run", str(files["mlp"]), "-p", "dce",
         "-o", str(tmp_path / "out.pt2"), "--import", "exit_work"],
        capture_output=True, text=True, timeout=300,
        env={**env, "EPASS_TEST_MARK": str(mark), "EPASS_TEST_OUTPUT": str(tmp_path / "out.pt2")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(f"wrote {tmp_path / 'out.pt2'}")
    assert mark.read_text().splitlines() == ["thread", "exit handler"]
    # With no such thread the interpreter is not torn down: a module's objects are
    # never finalized one by one (here, one that would say so).
    (tmp_path / "exit_quick.py").write_text(EXIT_QUICK)
    mark.unlink()
    alone = subprocess.run(
        [sys.executable, "-m", "epass", "--plain", "inspect", str(files["mlp"]),
         "--import", "exit_quick"],
        capture_output=True, text=True, timeout=300, env={**env, "EPASS_TEST_MARK": str(mark)},
    )  # fmt: skip
    assert alone.returncode == 0 and "nodes" in alone.stdout, alone.stderr
    assert mark.read_text().splitlines() == ["exit handler"]


def test_import_option_registers_custom_ops_before_loading(
    custom_op_program: tuple[Path, Path],
) -> None:
    program, library = custom_op_program
    refused = _epass("inspect", str(program), path=library)
    assert refused.returncode == 2
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"epass: error: {program}: cannot load (SerializeError: ")
    assert "torch.ops.epass_test_ops.twice.default" in line and "--import" in line
    loaded = _epass("inspect", str(program), "--import", "epass_test_ops", path=library)
    assert loaded.returncode == 0, loaded.stderr
    assert "epass_test_ops.twice.default" in loaded.stdout
    missing = _epass("inspect", str(program), "--import", "no_such_module_xyz", path=library)
    assert missing.returncode == 2
    assert missing.stderr.startswith("epass: error: --import no_such_module_xyz: ")


def test_import_from_the_wrong_folder_says_where_it_looked_and_what_to_set(
    files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "my_passes_nc.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    code, _, err = _run(capsys, "run", str(files["mlp"]), "-p", "dce", "--import", "my_passes_nc")
    assert code == 2
    line = _one_line_error(err)
    assert line.startswith("epass: error: --import my_passes_nc: ")
    assert f"the current folder {elsewhere} " in line  # where it looked
    assert "PYTHONPATH is not set" in line  # and what to set
    assert "holds my_passes_nc.py, put that folder on PYTHONPATH" in line


def test_plugin_declared_imports_are_imported_before_loading(
    custom_op_program: tuple[Path, Path], tmp_path: Path
) -> None:
    program, library = custom_op_program
    out = tmp_path / "out.pt2"
    proc = _epass(
        "run", str(program), "-p", "needs-ops", "-o", str(out),
        "--import", "needs_ops_plugin", path=library,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert out.exists()


@pytest.mark.slow
def test_torchao_pt2e_program_loads_with_import_torchao(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    script = (
        "import sys, warnings, torch\nwarnings.simplefilter('ignore')\n"
        "from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, convert_pt2e\n"
        "import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()\n"
        "args = (torch.randn(2, 8),)\n"
        "q = xiq.X86InductorQuantizer()\n"
        "q.set_global(xiq.get_default_x86_inductor_quantization_config())\n"
        "p = prepare_pt2e(torch.export.export(m, args).module(), q)\np(*args)\n"
        "ep = torch.export.export(convert_pt2e(p), args)\n"
        "torch.export.save(ep, sys.argv[1])\n"
    )
    program = tmp_path / "quantized.pt2"
    subprocess.run([sys.executable, "-c", script, str(program)], check=True, timeout=600)
    refused = _epass("inspect", str(program), path=tmp_path)
    assert refused.returncode == 2
    assert "We failed to resolve torch.ops.quantized_decomposed." in refused.stderr
    loaded = _epass("inspect", str(program), "--import", "torchao", path=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert "quantized_decomposed.quantize_per_tensor.default" in loaded.stdout


def _imported_by(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -m epass ARGV`` and list every module it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "epass", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    modules = {line.rsplit("|", 1)[-1].strip() for line in lines[1:]}
    return proc, modules


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["run", "--help"], ["passes"], ["passes", "--json"], ["bogus"],
     ["run", "x.pt2"], ["run", "x.pt2", "-p", "dce", "--atol", "nope"]],
)  # fmt: skip
def test_help_passes_and_argument_errors_import_no_torch(argv: list[str]) -> None:
    proc, modules = _imported_by(*argv)
    assert proc.returncode == (0 if "--help" in argv or argv[0] == "passes" else 2)
    assert "epass.cli" in modules and "argparse" in modules
    assert sorted(m for m in modules if m == "torch" or m.startswith("torch.")) == []
    if argv[0] == "passes":
        assert "fold-constants" in proc.stdout and "max_growth" in proc.stdout


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "{missing}", "-p", "dce"], "no such file"),
        (["run", "{folder}", "-p", "dce"], "is a directory"),
        (["run", "{notes}", "-p", "dce"], "not a .pt2 archive"),
        (["run", "{zip}", "-p", "decompose, dce2"], "unknown pass 'dce2' at column 12"),
        (["run", "{zip}", "-p", "decompose("], "bad pipeline"),
        (["run", "{zip}", "-p", "decompose(kep=1)"], "no option 'kep'; did you mean 'keep'?"),
        (
            ["run", "{zip}", "-p", "fold-constants(max_growth=big)"],
            "option 'max_growth' of pass 'fold-constants' takes float, got big at column 27",
        ),
        (
            ["run", "{zip}", "-p", "repeat(2, [decompose(method=fast)])"],
            'option \'method\' of pass \'decompose\' takes "auto" | "incremental" | "retrace"',
        ),
        (["run", "{zip}", "-p", "decompose(table=5)"], "option 'table' of pass 'decompose'"),
        (["run", "{zip}", "-p", "lower(verify=false)"], "takes no options in pipeline text"),
        (["run", "{zip}", "-p", "dce", "-o", "{folder}/x.onnx"], "must end in .pt2"),
        (["run", "{zip}", "-p", "dce", "--report", "{folder}/no/r.html"], "does not exist"),
        (["inspect", "{missing}"], "no such file"),
        (["inspect", "{notes}"], "not a .pt2 archive"),
        (["demo", "--save", "{folder}/demo.onnx"], "must end in .pt2"),
        (["demo", "--report", "{folder}/r.txt"], "must end in .json or .html"),
    ],
)
def test_argument_errors_are_found_before_torch_is_imported(
    tmp_path: Path, argv: list[str], expected: str
) -> None:
    names = {
        "missing": tmp_path / "missing.pt2",
        "folder": tmp_path,
        "notes": tmp_path / "notes.pt2",
        "zip": tmp_path / "a-zip.pt2",  # a zip archive: its members are the loader's to check
    }
    names["notes"].write_text("not an archive")
    with zipfile.ZipFile(names["zip"], "w") as z:
        z.writestr("hello.txt", "a zip, but not a program")
    proc, modules = _imported_by(*(a.format(**names) for a in argv))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("epass: error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert sorted(m for m in modules if m == "torch" or m.startswith("torch.")) == []


# ESC ] 0 ; ... BEL sets the window title, ESC [ 2 J clears the screen, U+009B is the
# one-byte CSI, NUL and a newline forge output, U+202E reverses text; [bold] is rich markup.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x00\r\nforged\u202e\x85[bold]b[/bold]"


def _raw_controls(text: str) -> list[str]:
    return sorted({c for line in text.split("\n") for c in line if not c.isprintable()})


@pytest.fixture(scope="module")
def hostile_names(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program whose user input and output names hold terminal escapes."""
    ep = torch.export.export(AddBias(), (torch.randn(3, 4),))
    renamed = {}
    for node in ep.graph.nodes:
        if node.name in ("x", "add"):  # the user input and the user output
            renamed[node.name] = node.name + HOSTILE
            node.name = renamed[node.name]
    for spec in [*ep.graph_signature.input_specs, *ep.graph_signature.output_specs]:
        spec.arg.name = renamed.get(spec.arg.name, spec.arg.name)
    path = tmp_path_factory.mktemp("hostile") / "names.pt2"
    torch.export.save(ep, path)
    return path


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_inspect_escapes_control_characters_in_names_from_the_file(
    hostile_names: Path, plain: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--plain"] if plain else []
    assert main([*flags, "inspect", str(hostile_names), "--trust"]) == 0
    out, err = capsys.readouterr()
    assert _raw_controls(out + err) == []
    assert "inputs:  x\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\x00\\r\\nforged\\u202e\\x85[bold]b" in out
    assert "outputs: add\\x1b]0;pwned" in out
    # Screened (a screen may also refuse such names): nothing raw either way.
    code = main([*flags, "inspect", str(hostile_names)])
    out, err = capsys.readouterr()
    assert code in (0, 2) and _raw_controls(out + err) == []
    assert "\\x1b]0;pwned\\x07" in out + err


def test_inspect_json_keeps_names_exact_and_escaped(
    hostile_names: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(hostile_names), "--trust", "--json"]) == 0
    out = capsys.readouterr().out
    assert _raw_controls(out) == [] and out.isascii()
    assert json.loads(out)["signature"]["user_inputs"] == ["x" + HOSTILE]


def test_errors_naming_files_and_members_escape_control_characters(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A downloaded file's name is the sender's text too (`epass inspect *.pt2`).
    evil = tmp_path / "named\x1b]0;pwned\x07\x9b2J.pt2"
    with zipfile.ZipFile(files["mlp"]) as src, zipfile.ZipFile(evil, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        root = src.namelist()[0].split("/")[0]
        dst.writestr(f"{root}/code/evil{HOSTILE}.py", b"print('hi')")
    assert main(["inspect", str(evil)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epass: error: ") and err.count("\n") == 1
    assert _raw_controls(err) == [] and "evil\\x1b]0;pwned" in err and "named\\x1b]0;" in err


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF)))
def test_printable_leaves_no_control_character_and_keeps_printable_text(text: str) -> None:
    shown = printable(text)
    assert shown.isprintable()
    assert printable(shown) == shown
    if text.isprintable():
        assert shown == text


SLEEPY_PLUGIN = """
import os
import pathlib
import time

import torch

import epass

MARK = pathlib.Path(os.environ["EPASS_TEST_MARK"])


def _stall(stage):
    MARK.write_text(stage)
    time.sleep(120)


@epass.register_pass("sleep-test")
def sleep_test(ep):
    _stall("pass")
    return epass.PassResult(ep, False)


_save = torch.export.save


def slow_save(ep, f, **kwargs):
    _save(ep, f, **kwargs)  # the temporary file is written, not yet renamed
    if os.environ.get("EPASS_TEST_SLOW_SAVE"):
        _stall("save")


torch.export.save = slow_save
"""


def _wait_for(mark: Path, proc: subprocess.Popen[str]) -> None:
    for _ in range(3000):
        if mark.exists():
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} first: {proc.communicate()[1]}")
        time.sleep(0.1)
    raise AssertionError("the command never reached the slow step")


@pytest.mark.parametrize(
    ("stage", "sig", "code", "word"),
    [("pass", signal.SIGTERM, 143, "terminated"), ("save", signal.SIGTERM, 143, "terminated"),
     ("save", signal.SIGINT, 130, "interrupted")],
)  # fmt: skip
def test_a_signal_during_run_cleans_up_and_exits_with_its_code(
    files: dict[str, Path], tmp_path: Path, stage: str, sig: int, code: int, word: str
) -> None:
    (tmp_path / "sleepy_plugin.py").write_text(SLEEPY_PLUGIN)
    out = tmp_path / "out"
    out.mkdir()
    mark = tmp_path / "mark"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
        "EPASS_TEST_MARK": str(mark),
        "EPASS_TEST_SLOW_SAVE": "1" if stage == "save" else "",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "epass", "--plain", "run", str(files["mlp"]),
         "-p", "sleep-test" if stage == "pass" else "dce", "-o", str(out / "out.pt2"),
         "--import", "sleepy_plugin"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        _wait_for(mark, proc)
        assert mark.read_text() == stage
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert err.splitlines() == [f"epass: {word}"]
    assert list(out.iterdir()) == []  # no temporary file, no partial output


MARK_DECOMPOSE = """
import os
import pathlib

import epass.passes.decompose as decompose
from epass._decomp import templates

_call = decompose.Decompose.__call__


def _marked(self, ep):
    pathlib.Path(os.environ["EPASS_TEST_MARK"]).write_text("decompose")
    # One decomposition of the demo takes a fraction of a second: trace its
    # templates again and again, so that Ctrl-C lands while templates are traced,
    # not after the command has finished.
    for _ in range(200):
        templates.clear_memory()
        _call(self, ep)
    return _call(self, ep)


decompose.Decompose.__call__ = _marked
"""


def test_ctrl_c_during_decompose_ends_the_command_at_once(tmp_path: Path) -> None:
    """Neither a full cycle collection over torch's objects (which holds signal
    handlers back) nor the interpreter's teardown stands between Ctrl-C and the
    shell prompt: seconds before, about 0.1 s now (0.5 s on a loaded machine)."""
    from epass.cli.demo import demo_program

    torch.export.save(demo_program(), tmp_path / "tf.pt2")
    (tmp_path / "mark_decompose.py").write_text(MARK_DECOMPOSE)
    mark = tmp_path / "mark"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
        "EPASS_TEST_MARK": str(mark),
        "EPASS_CACHE_DIR": "",  # no disk cache: Decompose traces its templates
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "epass", "--plain", "run", str(tmp_path / "tf.pt2"),
         "-p", "decompose", "--import", "mark_decompose"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        _wait_for(mark, proc)
        time.sleep(0.3)  # well inside the tracing of templates
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == ["epass: interrupted"]
    assert took < 1.5, f"Ctrl-C took {took:.2f} s to end the command"


def test_ctrl_c_while_torch_imports_exits_130_without_a_traceback(files: dict[str, Path]) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "epass", "run", str(files["mlp"]), "-p", "dce"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        for line in proc.stderr:  # -X importtime reports each module as it finishes
            if line.rsplit("|", 1)[-1].strip().startswith("torch."):
                proc.send_signal(signal.SIGINT)  # `import torch` has begun, not finished
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if not line.startswith("import time:")] == [
        "epass: interrupted"
    ]


PLUGIN = """\
import torch

import epass

aten = torch.ops.aten


@epass.register_pass("relu-twice")
def relu_twice(ep):
    for node in ep.graph.nodes:
        if node.target is aten.relu.default:
            raise RuntimeError("relu-twice cannot handle relu yet")
    return ep
"""


def _as_console_script(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the CLI as the ``epass`` script does: the current folder is not on the path."""
    runner = cwd.parent / "runner" / "epass_script.py"
    runner.parent.mkdir(exist_ok=True)
    runner.write_text("import sys\nfrom epass.cli import main\nsys.exit(main())\n")
    return subprocess.run(
        [sys.executable, str(runner), "--plain", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )


def _failing_run(files: dict[str, Path], tmp_path: Path, pipeline: str) -> tuple[Path, Path]:
    """Run ``pipeline`` with my_passes.py imported from the current folder, as the
    ``epass`` script; returns that folder and the reproducer the failure wrote."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_passes.py").write_text(PLUGIN)
    proc = _as_console_script(
        "run", str(files["mlp"]), "--import", "my_passes", "-p", pipeline,
        "--repro-dir", "repros", cwd=work,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "relu-twice cannot handle relu yet" in proc.stderr
    (repro,) = (work / "repros").glob("*/repro.py")
    return work, repro


def _run_script(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )


def test_import_finds_a_module_in_the_current_folder_and_the_reproducer_imports_it(
    files: dict[str, Path], tmp_path: Path
) -> None:
    _, repro = _failing_run(files, tmp_path, "decompose, relu-twice")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = _run_script(repro, elsewhere)
    assert again.returncode != 0
    assert "relu-twice cannot handle relu yet" in again.stderr, again.stderr
    assert "unknown pass" not in again.stderr


def test_a_reproducer_whose_module_is_gone_says_what_to_set(
    files: dict[str, Path], tmp_path: Path
) -> None:
    work, repro = _failing_run(files, tmp_path, "relu-twice")
    (work / "my_passes.py").unlink()
    again = _run_script(repro, tmp_path)
    assert again.returncode != 0
    assert "cannot import my_passes" in again.stderr
    assert f"put the folder {work.resolve()} on PYTHONPATH" in again.stderr


def test_the_pass_table_is_followed_by_a_legend_of_its_columns(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from epass._terminal import LEGEND

    code, out, _ = _run(capsys, "run", str(files["mlp"]), "-p", "decompose, dce")
    assert code == 0
    lines = out.splitlines()
    assert lines[lines.index(LEGEND) - 1].startswith("dce ")  # the table's last row
    assert LEGEND.startswith("ops: op calls added + removed; state: whose dicts")


# --- notices: a pass that fell back says so ----------------------------------------

_NOTICING_PLUGIN = f"""
import epass
from epass import Notice, PassResult


class SlowWay:
    name = "slow-way"

    def __call__(self, ep):
        text = "took the slow way: " + {HOSTILE!r}
        return PassResult(ep, False, notices=[Notice("fallback", text)])


epass.register_pass("slow-way", SlowWay)
"""


@pytest.fixture(scope="module")
def seed_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program writing into a buffer, which Decompose's incremental path refuses,
    and beside it a plugin whose pass says it fell back, in hostile words."""
    root = tmp_path_factory.mktemp("seed")
    _, ep, _ = export("seed")
    torch.export.save(ep, root / "seed.pt2")
    (root / "noticing_plugin.py").write_text(_NOTICING_PLUGIN)
    return root / "seed.pt2"


def test_run_prints_a_line_for_each_pass_that_fell_back_and_the_report_counts_them(
    seed_program: Path, tmp_path: Path
) -> None:
    from epass.report import render_html

    report_path = tmp_path / "r.json"
    proc = _epass(
        "run", str(seed_program), "-p", "lower, slow-way", "--report", str(report_path),
        "--import", "noticing_plugin", path=seed_program.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    count = lines.index("2 of 7 passes fell back:")
    assert lines[count - 1].startswith("7 passes (1 pipeline) in ")
    assert lines[count + 1].startswith("  lower/decompose: retraced: ")
    assert lines[count + 2] == "  slow-way: took the slow way: " + printable(HOSTILE)
    assert _raw_controls(proc.stdout + proc.stderr) == []
    text = report_path.read_text()
    assert _raw_controls(text) == [] and text.isascii()
    report = json.loads(text)
    assert report["fallbacks"] == 2 and report["notice_count"] == "2 of 7 passes fell back"
    assert [(n["pass"], n["kind"]) for n in report["notices"]] == [
        ("lower/decompose", "fallback"),
        ("slow-way", "fallback"),
    ]
    assert report["notices"][1]["text"] == "took the slow way: " + HOSTILE
    assert report["verdict"]["summary"] == "7 passes (1 pipeline) ran; 2 of 7 passes fell back"
    page = render_html(report)
    verdict = page[page.index('<div class="verdict') : page.index("</div>")]
    assert (
        "2 of 7 passes fell back" in verdict
        and "<code>lower/decompose</code>: retraced: " in verdict
    )
    assert _raw_controls(page) == []


def test_a_retrace_asked_for_is_no_fallback(
    seed_program: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "run", str(seed_program), "-p", 'decompose(method="retrace")')
    assert code == 0
    assert "fell back" not in out and "retraced" not in out
    assert out.splitlines()[-1].startswith("1 pass in ")

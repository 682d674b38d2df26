"""The ``epass`` command: run, passes, inspect, demo, and its errors."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import export

import epass
from epass import FxPass, registry
from epass.cli import main
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
        "error.txt", "passes.pkl", "pipeline.txt", "program.pt2", "repro.py",
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


def test_progress_is_shown_on_a_terminal_only(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["run", str(files["mlp"]), "-p", "decompose, repeat(2, [cse])"]) == 0
    shown = terminal.getvalue()
    assert "decompose" in shown and "repeat > cse" in shown  # epass.instruments.Progress
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no progress
    assert main(["run", str(files["mlp"]), "-p", "decompose"]) == 0
    assert sys.stderr.getvalue() == ""


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

"""epass.reduce never harms what it is given: a pass that writes into the weights
changes neither the user's tensors nor the next candidate's, a pass that hangs is
stopped by the time limit (the smallest program so far kept), and ``-o`` never
replaces the input or anything but an earlier reduction."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fingerprint import fingerprint
from test_reduce import RefuseNode, chain

import epass
from epass import FxPass, registry
from epass.cli import main
from epass.errors import ArgumentValueError, SaveError
from epass.instruments.values import private_copy
from epass.reduce import _watchdog

aten = torch.ops.aten


class WriteThenRaise:
    """Writes into every state tensor it is given, past ``_version`` and through it,
    then raises; it records the first weight's sum as each call found it, one line
    of ``log`` a call (the calls run in child processes)."""

    name = "write-then-raise"
    changes_input = False

    def __init__(self, log: Path) -> None:
        self.log = log

    @property
    def seen(self) -> list[float]:
        return [float(line) for line in self.log.read_text().split()]

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        tensors = [*ep.state_dict.values(), *ep.constants.values()]
        with self.log.open("a") as log:
            log.write(f"{float(tensors[0].detach().sum())!r}\n")
        with torch.no_grad():
            for t in tensors:
                t.data.add_(7)  # no write counter moves
                t.add_(1)  # the write counter moves
        raise RuntimeError("the backend gave up")


def _versions(ep: torch.export.ExportedProgram) -> dict[str, int]:
    return {k: v._version for k, v in {**ep.state_dict, **ep.constants}.items()}


@pytest.fixture(params=["process", "thread"])
def runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where candidates run: a child process, or a thread where fork cannot be used."""
    if request.param == "thread":
        monkeypatch.setattr(_watchdog, "_forkable", lambda: False)
    return str(request.param)


def test_a_pass_writing_into_every_weight_then_raising_leaves_the_users_tensors_alone(
    runner: str, tmp_path: Path
) -> None:
    ep = chain()
    before, versions = fingerprint(ep), _versions(ep)
    hostile = WriteThenRaise(tmp_path / "seen.txt")
    result = epass.reduce(ep, [hostile])
    assert fingerprint(ep) == before and _versions(ep) == versions
    assert result.failure.error_type == "RuntimeError" and result.steps > 3
    # Every candidate found the weights as the user's program holds them.
    first = float(ep.state_dict["a.weight"].detach().sum())
    assert len(hostile.seen) == result.steps
    assert all(math.isclose(s, first, rel_tol=1e-6) for s in hostile.seen)
    # The result is built over the user's own (untouched) tensors.
    for key, value in result.program.state_dict.items():
        assert value is ep.state_dict[key]


def test_the_pass_gets_tensors_of_its_own(runner: str) -> None:
    ep = chain()
    user = {t.untyped_storage().data_ptr() for t in ep.state_dict.values()}

    def check(program: torch.export.ExportedProgram) -> Any:
        for key, weight in program.state_dict.items():
            if not (
                torch.equal(weight, ep.state_dict[key])
                and weight.untyped_storage().data_ptr() not in user
                and isinstance(weight, torch.nn.Parameter)
                and weight.requires_grad
            ):
                raise TypeError(f"{key} is the user's, or not as the user's is")
        raise RuntimeError("own tensors")

    result = epass.reduce(ep, [FxPass(lambda gm: gm, name="x"), check], max_steps=2)
    assert result.failure.message.endswith("own tensors"), result.failure


def test_a_private_copy_aliases_as_the_users_tensors_do() -> None:
    ep = chain()
    ep.constants["tied"] = ep.state_dict["a.weight"][1]  # a view, as tied weights are
    copy = private_copy(ep)
    weight = copy.state_dict["a.weight"]
    assert weight.data_ptr() != ep.state_dict["a.weight"].data_ptr()
    assert copy.constants["tied"].untyped_storage().data_ptr() == weight.data_ptr()
    assert torch.equal(copy.constants["tied"], weight[1])
    assert copy.graph_module is not ep.graph_module
    assert copy.example_inputs[0][0] is not ep.example_inputs[0][0]


# --- a pass that hangs ----------------------------------------------------------------

RELEASE = threading.Event()


class HangOnSlices:
    """Raises on programs that still hold both linear layers; on any smaller program
    it hangs until the test lets it go."""

    name = "hang-on-slices"
    changes_input = False

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        if sum(n.target is aten.addmm.default for n in ep.graph.nodes) >= 2:
            raise NotImplementedError("two linear layers")
        RELEASE.wait(120)
        raise NotImplementedError("released")


@pytest.fixture
def hang() -> Iterator[HangOnSlices]:
    RELEASE.clear()
    yield HangOnSlices()
    RELEASE.set()  # the abandoned threads end


def test_the_time_limit_stops_a_hung_pass_and_keeps_the_smallest_program(
    hang: HangOnSlices,
) -> None:
    ep = chain()
    before = fingerprint(ep)
    start = time.monotonic()
    result = epass.reduce(ep, [hang], time_limit=2)
    assert time.monotonic() - start < 6
    assert result.stopped == "time limit"
    assert result.failure.message.endswith("two linear layers")
    assert result.nodes_after <= result.nodes_before
    assert sum(n.target is aten.addmm.default for n in result.program.graph.nodes) == 2
    assert fingerprint(ep) == before


def test_ctrl_c_stops_a_hung_pass_and_keeps_the_smallest_program(hang: HangOnSlices) -> None:
    ep = chain()
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        result = epass.reduce(ep, [hang])
    finally:
        timer.cancel()
    assert time.monotonic() - start < 8
    assert result.stopped == "interrupted"
    assert result.failure.message.endswith("two linear layers")


def test_a_pipeline_that_hangs_on_the_whole_program_is_named_with_the_limit(
    hang: HangOnSlices,
) -> None:
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ArgumentValueError, match=r"did not finish .* within time_limit \(1 s\)"):
        epass.reduce(ep, [hang], time_limit=1)


@pytest.mark.parametrize("limit", [math.nan, math.inf, -1.0, 0.0, True, "3"])
def test_a_time_limit_that_is_not_a_finite_positive_number_is_refused(limit: Any) -> None:
    with pytest.raises(ArgumentValueError, match="time_limit must be None or a finite number"):
        epass.reduce(chain(), [RefuseNode("relu")], time_limit=limit)


# --- the command ------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working folder, holding ``p.pt2`` and a module registering the hostile
    passes (``hang-on-slices``, ``refuse-relu``)."""
    (tmp_path / "hostile_passes.py").write_text(
        "import epass\nfrom test_reduce import RefuseNode\n"
        "from test_reduce_safety import HangOnSlices\n\n"
        "epass.register_pass('hang-on-slices')(HangOnSlices)\n"
        "epass.register_pass('refuse-relu')(lambda: RefuseNode('relu'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    torch.export.save(chain(), tmp_path / "p.pt2")
    RELEASE.clear()
    yield tmp_path
    RELEASE.set()
    for name in ("hang-on-slices", "refuse-relu"):
        if name in registry.pass_names():
            registry.unregister_pass(name)
    sys.modules.pop("hostile_passes", None)


ARGV = ["--plain", "reduce", "--import", "hostile_passes"]


def test_the_command_writes_the_smallest_program_when_the_limit_stops_a_hung_pass(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    code = main([*ARGV, "p.pt2", "-p", "hang-on-slices", "--time-limit", "2", "-o", "out"])
    assert time.monotonic() - start < 8
    assert code == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("[stopped: time limit]") and "two linear layers" in line
    assert {p.name for p in (workdir / "out").iterdir()} >= {"program.pt2", "repro.py"}
    assert not [p for p in workdir.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
def test_the_command_refuses_a_time_limit_that_is_not_finite_and_positive(
    workdir: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*ARGV, "p.pt2", "-p", "refuse-relu", f"--time-limit={value}"]) == 2
    err = capsys.readouterr().err
    assert "--time-limit" in err and "finite number above 0" in err
    assert not (workdir / "reduced").exists()


def _outputs(workdir: Path) -> dict[str, tuple[str, str]]:
    """Each refused ``-o``: how to make it, and the input the command is given."""
    (workdir / "d").mkdir()
    (workdir / "d" / "program.pt2").write_bytes((workdir / "p.pt2").read_bytes())
    (workdir / "theirs").mkdir()
    (workdir / "theirs" / "notes.txt").write_text("mine")
    (workdir / "dangling").symlink_to(workdir / "nowhere")
    (workdir / "linked").symlink_to(workdir / "theirs")
    (workdir / "file").write_text("")
    (workdir / "prev").mkdir()  # an earlier reduction's name, linked to the input
    (workdir / "prev" / "program.pt2").symlink_to(workdir / "p.pt2")
    return {
        "holds a link to the input": ("prev", "prev/program.pt2"),
        "holds the input": ("d", "d/program.pt2"),
        "holds the input deeper": (".", "d/program.pt2"),
        "is the input": ("p.pt2", "p.pt2"),
        "dangling symlink": ("dangling", "p.pt2"),
        "symlink to a folder": ("linked", "p.pt2"),
        "holds other files": ("theirs", "p.pt2"),
        "a file": ("file", "p.pt2"),
        "cannot be created": ("file/sub", "p.pt2"),
    }


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("holds the input", "d: holds the input d/program.pt2"),
        ("holds a link to the input", "prev: holds the input prev/program.pt2"),
        ("holds the input deeper", ".: holds the input d/program.pt2"),
        ("is the input", "p.pt2: is the input p.pt2"),
        ("dangling symlink", "dangling: is a symbolic link"),
        ("symlink to a folder", "linked: is a symbolic link"),
        ("holds other files", "theirs: holds notes.txt"),
        ("a file", "file: is a file"),
        ("cannot be created", "file/sub: cannot be created"),
    ],
)
def test_an_output_that_would_replace_the_input_or_others_files_is_refused_before_the_work(
    workdir: Path,
    case: str,
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    output, given = _outputs(workdir)[case]
    files = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file() and not p.is_symlink()}

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the reduction started")

    monkeypatch.setattr(sys.modules["epass.reduce"], "reduce", never)
    assert main([*ARGV, given, "-p", "refuse-relu", "-o", output]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"epass: error: -o {says}"), err
    assert {p: p.read_bytes() for p in files} == files
    assert (workdir / "dangling").is_symlink() and not (workdir / "nowhere").exists()


def test_an_earlier_reduction_is_replaced_whole_and_a_failed_write_leaves_it(
    workdir: Path,
) -> None:
    ep = chain()
    first = epass.reduce(ep, [RefuseNode("relu")])
    where = first.write("out")
    (where / "passes.pkl").write_bytes(b"stale")
    old = {p.name: p.read_bytes() for p in where.iterdir()}
    second = epass.reduce(ep, [RefuseNode("relu"), FxPass(lambda gm: gm, name="f")])

    def broken(program: Any, where: Path) -> None:
        (where / "program.pt2").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules["epass.reduce"], "save_program", broken)
        with pytest.raises(OSError, match="disk full"):
            second.write("out")
    assert {p.name: p.read_bytes() for p in where.iterdir()} == old
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".")) == []
    second.write("out")
    assert not (where / "passes.pkl").exists()  # the lambda does not pickle: none is stale
    assert "<lambda>" in (where / "pipeline.txt").read_text()
    os.symlink(where, workdir / "again")
    with pytest.raises(SaveError, match="again: is a symbolic link"):
        second.write(workdir / "again")


# --- a pass that holds the GIL, or ends the process ---------------------------------------


class HoldGilOnSlices(HangOnSlices):
    """Raises on programs that hold both linear layers; on any smaller program it
    spins in C with the GIL held (a regular expression that backtracks for ages),
    where no thread, signal handler or watchdog of this process gets to run."""

    name = "hold-gil-on-slices"

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        if sum(n.target is aten.addmm.default for n in ep.graph.nodes) >= 2:
            raise NotImplementedError("two linear layers")
        re.match(r"(a+)+b", "a" * 64)
        raise NotImplementedError("done backtracking")


@pytest.mark.slow
def test_the_time_limit_stops_a_pass_that_holds_the_gil(tmp_path: Path) -> None:
    (tmp_path / "gil_passes.py").write_text(
        "import epass\nfrom test_reduce_safety import HoldGilOnSlices\n\n"
        "epass.register_pass('hold-gil-on-slices')(HoldGilOnSlices)\n"
    )
    torch.export.save(chain(), tmp_path / "p.pt2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    argv = [sys.executable, "-m", "epass", "--plain", "reduce", "--import", "gil_passes"]
    argv += ["p.pt2", "-p", "hold-gil-on-slices", "--time-limit", "2", "-o", "out"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith("[stopped: time limit]")
    assert (tmp_path / "out" / "program.pt2").is_file()


def test_a_candidate_that_ends_its_process_is_not_the_failure_kept(runner: str) -> None:
    if runner == "thread":
        pytest.skip("os._exit in a thread ends the whole process")

    class ExitOnSlices(HangOnSlices):
        def __call__(self, ep: torch.export.ExportedProgram) -> Any:
            if sum(n.target is aten.addmm.default for n in ep.graph.nodes) >= 2:
                raise NotImplementedError("two linear layers")
            os._exit(3)

    result = epass.reduce(chain(), [ExitOnSlices()])
    assert result.failure.message.endswith("two linear layers")
    assert sum(n.target is aten.addmm.default for n in result.program.graph.nodes) == 2
    with pytest.raises(ArgumentValueError, match=r"ended the process it ran in.*exit code 3"):
        epass.reduce(chain(), [lambda ep: os._exit(3)])


def test_no_worker_is_left_running_after_the_time_limit(hang: HangOnSlices) -> None:
    before = set(threading.enumerate())
    result = epass.reduce(chain(), [hang], time_limit=1)
    assert result.stopped == "time limit"
    assert set(threading.enumerate()) <= before
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # every child was reaped


def test_sigterm_ends_the_search_and_writes_the_smallest_program(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = main([*ARGV, "p.pt2", "-p", "hang-on-slices", "-o", "out"])
    finally:
        timer.cancel()
    assert code == 143
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("[stopped: terminated]") and "two linear layers" in line
    assert (workdir / "out" / "program.pt2").is_file()

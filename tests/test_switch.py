"""``epass.fast_decompositions()``: under it ``ExportedProgram.run_decompositions``
gives torch's program, made by ``Decompose``; outside it, and in every other thread,
torch's own method runs; nothing it installs outlives it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import models
import pytest
import torch
from fingerprint import fingerprint
from torch.export import ExportedProgram

import epass
from epass import _switch
from epass._decomp.check import first_difference
from epass.passes import decompose

aten = torch.ops.aten
TORCHS = ExportedProgram.__dict__["run_decompositions"]


def _torchs_constants(out: ExportedProgram, ep: ExportedProgram) -> bool:
    """Whether ``out`` holds the constants dict as torch's own method leaves it: the
    input's (torch 2.13), or one of its own (2.15)."""
    return (out.constants is ep.constants) == (TORCHS(ep).constants is ep.constants)


def _served(ep: ExportedProgram, *args, **kwargs):
    with epass.fast_decompositions() as log:
        out = ep.run_decompositions(*args, **kwargs)
    return out, log


def _assert_torchs_program(ep: ExportedProgram, *args, **kwargs):
    """The switch's program is torch's, the input untouched and torch's method back."""
    before = fingerprint(ep)
    out, log = _served(ep, *args, **kwargs)
    assert ExportedProgram.__dict__["run_decompositions"] is TORCHS
    assert fingerprint(ep) == before
    ref = ep.run_decompositions(*args, **kwargs)
    assert first_difference(out, ref) is None
    assert out.range_constraints.keys() == ref.range_constraints.keys()
    assert [e.fqn for e in out.module_call_graph] == [e.fqn for e in ref.module_call_graph]
    assert out.graph_signature.user_inputs == ref.graph_signature.user_inputs
    assert len(log.served) == 1 and log.counts["torch"] == 0, log.summary()
    return out, log


@pytest.mark.parametrize("name", ["mixed", "no_constants", "mlp", "convbn"])
def test_switch_gives_torchs_program_on_static_zoo_models(name):
    _, ep, _ = models.export(name)
    _, log = _assert_torchs_program(ep)
    assert log.served[0].how in ("incremental", "no-op")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["transformer", "seed"])
def test_switch_gives_torchs_program_on_larger_zoo_models(name):
    _, ep, _ = models.export(name)
    _assert_torchs_program(ep)


@pytest.mark.parametrize("name", ["mlp", "convbn"])
def test_switch_gives_torchs_program_on_dynamic_programs(name):
    _, ep, _ = models.export(name, dynamic=True)
    _assert_torchs_program(ep)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "decoder"])
def test_switch_gives_torchs_program_on_dynamic_zoo_programs(name):
    _, ep, _ = models.export_dynamic(name)
    _assert_torchs_program(ep)


def _relu_as_clamp(x):
    return torch.clamp(x, min=0)


def test_switch_takes_a_table_with_a_python_decomposition():
    _, ep, _ = models.export("mlp")
    out, log = _assert_torchs_program(ep, {aten.relu.default: _relu_as_clamp})
    assert aten.clamp.default in {n.target for n in out.graph.nodes}
    assert log.served[0].table == "1 entries"


def test_switch_takes_the_default_table_with_preserved_ops():
    _, ep, _ = models.export("convbn")
    table = torch.export.default_decompositions()
    table.pop(aten.linear.default)
    table.pop(aten.relu.default, None)
    out, _ = _assert_torchs_program(ep, decomp_table=table)
    assert aten.linear.default in {n.target for n in out.graph.nodes}


def test_switch_takes_an_empty_table():
    _, ep, _ = models.export("mixed")
    _assert_torchs_program(ep, {})


def test_result_dicts_are_new_and_hold_the_callers_tensors():
    _, ep, _ = models.export("mixed")
    assert ep.constants  # torch's own result shares a non-empty constants dict
    out, _ = _served(ep)
    assert out.state_dict is not ep.state_dict and out.constants is not ep.constants
    assert out.state_dict.keys() == ep.state_dict.keys()
    assert out.constants.keys() == ep.constants.keys()
    for store, theirs in ((ep.state_dict, out.state_dict), (ep.constants, out.constants)):
        assert all(theirs[key] is value for key, value in store.items())


def test_a_consumer_writing_into_the_result_leaves_the_users_dicts_alone():
    _, ep, _ = models.export("mixed")
    keys = (set(ep.state_dict), set(ep.constants))
    out, _ = _served(ep)
    out.constants["_lifted_tensor_constant99"] = torch.ones(1)  # as ExecuTorch lifts
    out.state_dict["added"] = torch.ones(1)
    assert (set(ep.state_dict), set(ep.constants)) == keys


def test_no_op_call_gives_a_new_program_equal_to_torchs():
    _, ep, _ = models.export("mlp")
    lowered = ep.run_decompositions()
    out, log = _assert_torchs_program(lowered)
    assert log.served[0].how == "no-op"
    assert out is not lowered and out.graph_module is not lowered.graph_module


def test_the_log_says_how_and_counts():
    _, ep, _ = models.export("mlp")
    with epass.fast_decompositions() as log:
        lowered = ep.run_decompositions()
        lowered.run_decompositions()
    assert [e.how for e in log.served] == ["incremental", "no-op"]
    assert log.counts == {"incremental": 1, "no-op": 1, "retrace": 0, "torch": 0}
    assert log.summary().startswith("epass served 2 run_decompositions calls in ")
    assert log.served[0].nodes == len(ep.graph.nodes) and log.served[0].rewritten


def test_fallback_to_the_retrace_reaches_torchs_own_method(monkeypatch):
    # Seed writes into a buffer: Decompose retraces, calling ep.run_decompositions
    # while the switch is on; that call must reach torch's method, not the switch.
    calls = []

    def spy(self, *args, **kwargs):
        calls.append(threading.get_ident())
        return TORCHS(self, *args, **kwargs)

    monkeypatch.setattr(ExportedProgram, "run_decompositions", spy)
    _, ep, _ = models.export("seed")
    with epass.fast_decompositions() as log:
        out = ep.run_decompositions()
    assert ExportedProgram.__dict__["run_decompositions"] is spy
    assert log.counts["retrace"] == 1 and "b_count" in log.served[0].reason
    assert len(calls) == 1  # the switch's call, which went to the original once
    assert first_difference(out, TORCHS(ep)) is None


def test_other_threads_keep_torchs_method_while_one_is_switched(monkeypatch):
    served_in = []
    serve = _switch._serve

    def spy(*args, **kwargs):
        served_in.append(threading.get_ident())
        return serve(*args, **kwargs)

    monkeypatch.setattr(_switch, "_serve", spy)
    _, ep, _ = models.export("mixed")
    inside, done = threading.Event(), threading.Event()
    results = {}

    def switched():
        with epass.fast_decompositions() as log:
            results["switched"] = ep.run_decompositions()
            inside.set()
            done.wait(60)
        results["log"] = log

    thread = threading.Thread(target=switched)
    thread.start()
    try:
        assert inside.wait(60)
        assert _switch.installed()
        plain = ep.run_decompositions()  # this thread never turned it on
    finally:
        done.set()
        thread.join(60)
    assert served_in == [thread.ident]
    assert _torchs_constants(plain, ep)  # torch's own semantics
    assert results["switched"].constants is not ep.constants
    assert len(results["log"].served) == 1
    assert ExportedProgram.__dict__["run_decompositions"] is TORCHS


def test_scopes_nest_and_the_method_is_restored_after_the_last():
    _, ep, _ = models.export("mlp")
    with epass.fast_decompositions() as outer:
        with epass.fast_decompositions() as inner:
            ep.run_decompositions()
        assert _switch.installed()
        assert ExportedProgram.__dict__["run_decompositions"] is not TORCHS
        ep.run_decompositions({})
    assert not _switch.installed()
    assert ExportedProgram.__dict__["run_decompositions"] is TORCHS
    assert len(inner.served) == 1 and len(outer.served) == 2


def test_the_method_is_restored_when_the_block_raises():
    with pytest.raises(KeyError), epass.fast_decompositions():
        raise KeyError("x")
    assert ExportedProgram.__dict__["run_decompositions"] is TORCHS


def test_the_installed_method_looks_like_torchs():
    with epass.fast_decompositions():
        installed = ExportedProgram.__dict__["run_decompositions"]
        assert installed.__wrapped__ is TORCHS
        assert installed.__name__ == TORCHS.__name__ and installed.__doc__ == TORCHS.__doc__


def _boom(x):
    raise RuntimeError("no decomposition today")


@pytest.mark.parametrize(
    "table", [5, "abc", {aten.relu.default: _boom}], ids=["int", "str", "raising"]
)
def test_a_bad_table_raises_what_torch_raises(table):
    _, ep, _ = models.export("mlp")
    with pytest.raises(Exception) as theirs:
        ep.run_decompositions(table)
    with pytest.raises(Exception) as ours, epass.fast_decompositions():
        ep.run_decompositions(table)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]


@pytest.mark.parametrize("kind", ["iterator", "generator"])
def test_a_table_read_once_reaches_torchs_method_whole(kind):
    # torch's method reads any iterable of pairs into a dict; one epass read first
    # must not leave torch an empty one
    _, ep, _ = models.export("mlp")
    pairs = [(aten.relu.default, _relu_as_clamp)]

    def table():
        return iter(pairs) if kind == "iterator" else (pair for pair in pairs)

    ref = ep.run_decompositions(table())
    assert aten.clamp.default in {n.target for n in ref.graph.nodes}
    out, _ = _served(ep, table())
    assert first_difference(out, ref) is None
    out, _ = _served(ep, decomp_table=table())
    assert first_difference(out, ref) is None


class _Gelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.c = torch.ones(4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) + self.c


def _constant_of_another_shape(ep):
    ep.constants["c"] = torch.ones(7)


def _call_that_does_not_bind(ep):
    for node in ep.graph.nodes:
        if node.target is aten.gelu.default:
            node.args = (node.args[0], "tanh")
    ep.graph_module.recompile()


def _keyword_it_does_not_take(ep):
    for node in ep.graph.nodes:
        if node.target is aten.gelu.default:
            node.kwargs = {"approx": "tanh"}
    ep.graph_module.recompile()


@pytest.mark.parametrize(
    "spoil", [_constant_of_another_shape, _call_that_does_not_bind, _keyword_it_does_not_take]
)
def test_a_program_torch_refuses_raises_what_torch_raises(spoil):
    # the retrace reads the constants themselves and calls every operator; the
    # engine, which reads the recorded values, must not make a program of these
    ep = torch.export.export(_Gelu(), (torch.randn(2, 4),))
    spoil(ep)
    with pytest.raises(Exception) as theirs:
        ep.run_decompositions()
    with pytest.raises(Exception) as ours, epass.fast_decompositions():
        ep.run_decompositions()
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]


def test_a_table_epass_refuses_goes_to_torchs_method():
    _, ep, _ = models.export("mlp")
    out, log = _served(ep, {"aten::relu": _relu_as_clamp})  # torch ignores such a key
    assert log.counts["torch"] == 1 and "table" in log.served[0].reason
    assert first_difference(out, ep.run_decompositions({"aten::relu": _relu_as_clamp})) is None
    assert out.constants is not ep.constants


def test_triton_decomposition_goes_to_torchs_method():
    _, ep, _ = models.export("mlp")
    _, log = _served(ep, decompose_custom_triton_ops=True)
    assert log.counts["torch"] == 1
    assert log.served[0].reason == "decompose_custom_triton_ops=True"


def _checks_seen(monkeypatch) -> list:
    """The ``check`` of every ``Decompose`` the switch runs, in order."""
    seen = []
    call = decompose.Decompose.__call__

    def spy(self, ep):
        seen.append(self.check)
        return call(self, ep)

    monkeypatch.setattr(decompose.Decompose, "__call__", spy)
    return seen


def test_check_mode_compares_with_torch(monkeypatch):
    seen = _checks_seen(monkeypatch)
    _, ep, _ = models.export("mlp")
    with epass.fast_decompositions(check=True):
        ep.run_decompositions()
    assert seen == [True]


class _Item(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= 4)
        return torch.nn.functional.gelu(x[:k])


def test_a_trace_given_up_leaves_no_symbol_in_the_programs_shape_environment():
    # the template trace of item() makes a symbol and is given up for the retrace;
    # that symbol, left in the input's shape environment, would be listed among the
    # range constraints of the retrace's program, and of torch's own ever after
    ep = torch.export.export(_Item(), (torch.randn(4, 4), torch.tensor(2)))
    ranges = ep.run_decompositions().range_constraints.keys()
    out, log = _served(ep)
    assert log.counts["retrace"] == 1, log.summary()
    assert out.range_constraints.keys() == ranges
    assert ep.run_decompositions().range_constraints.keys() == ranges


class _Items(torch.nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= 4)
        return torch.nn.functional.silu(torch.nn.functional.gelu(x[:k])) + n.float().item()


def test_a_batched_trace_given_up_leaves_no_symbol_either(monkeypatch):
    # static calls missing from every cache are traced in one batch first
    from epass._decomp import templates

    monkeypatch.setenv("EPASS_CACHE_DIR", "")
    templates.clear_memory()
    ep = torch.export.export(_Items(), (torch.randn(4, 4), torch.tensor(2)))
    ranges = ep.run_decompositions().range_constraints.keys()
    out, _ = _served(ep)
    assert out.range_constraints.keys() == ranges
    assert ep.run_decompositions().range_constraints.keys() == ranges


def test_an_inner_block_without_check_keeps_the_enclosing_check(monkeypatch):
    # a hand-off's own block, or a library's, inside a checking block or the
    # process-wide --check
    seen = _checks_seen(monkeypatch)
    monkeypatch.delenv("EPASS_DECOMPOSE_CHECK", raising=False)
    _, ep, _ = models.export("mlp")
    with epass.fast_decompositions(check=True), epass.fast_decompositions():
        ep.run_decompositions()
    stop = _switch.process_wide(check=True)
    try:
        with epass.fast_decompositions():
            ep.run_decompositions()
        with epass.fast_decompositions(check=False):
            ep.run_decompositions()
    finally:
        stop()
    assert seen == [True, True, False]


def test_a_call_under_a_fake_mode_goes_to_torchs_method():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, ep, _ = models.export("mlp")
    ref = ep.run_decompositions()
    with FakeTensorMode(), epass.fast_decompositions() as log:
        out = ep.run_decompositions()
    assert first_difference(out, ref) is None
    assert log.counts["torch"] == 1 and "fake" in log.served[0].reason


_SCRIPT = """
import sys, threading, torch
sys.path.insert(0, {tests!r})
import models

_, ep, _ = models.export("mlp")
print("argv", sys.argv[1:])
ep.run_decompositions()
thread = threading.Thread(target=ep.run_decompositions)
thread.start()
thread.join()
sys.exit(3)
"""


@pytest.mark.slow
def test_whole_script_form_covers_every_thread_and_passes_the_exit_code(tmp_path):
    script = tmp_path / "export.py"
    tests = str(models.__file__).rsplit("/", 1)[0]
    script.write_text(textwrap.dedent(_SCRIPT.format(tests=tests)))
    done = subprocess.run(
        [sys.executable, "-m", "epass.fast_decompositions", str(script), "--flag", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr
    assert "argv ['--flag', 'x']" in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("epass.fast_decompositions: epass served 2 run_decompositions calls")
    assert "0 torch" in last


_RUNS_AS_PYTHON_RUNS_IT = """
import atexit, pickle, sys, threading
import sibling

class Checkpoint:
    pass

def save():
    pickle.dumps(Checkpoint())  # looks the class up in sys.modules["__main__"]
    print("saved at exit", flush=True)

atexit.register(save)
print("argv", sys.argv[1:], "file", __file__, sibling.NAME, flush=True)
"""


@pytest.mark.slow
def test_whole_script_form_runs_the_script_as_python_runs_it(tmp_path):
    # its own __main__ after the body too (exit handlers, late threads), the folder
    # of the real file first on the path, an absolute __file__, every argument after
    # the script the script's own
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.mkdir()
    (real / "export.py").write_text(textwrap.dedent(_RUNS_AS_PYTHON_RUNS_IT))
    (real / "sibling.py").write_text('NAME = "sibling"\n')
    (link / "export.py").symlink_to(real / "export.py")
    command = [sys.executable, "-m", "epass.fast_decompositions"]
    done = subprocess.run(
        [*command, "link/export.py", "--", "--check", "x"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    file = str(tmp_path / "link" / "export.py")
    assert f"argv ['--', '--check', 'x'] file {file} sibling" in done.stdout
    assert "saved at exit" in done.stdout
    missing = subprocess.run(
        [*command, "nowhere.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert missing.returncode == 2
    assert "can't open file 'nowhere.py'" in missing.stderr


_CHILDREN = """
import multiprocessing

def report(method):
    from epass import _switch
    print(method, _switch.installed(), flush=True)

if __name__ == "__main__":
    for method in ("fork", "spawn"):
        child = multiprocessing.get_context(method).Process(target=report, args=(method,))
        child.start()
        child.join()
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_whole_script_form_reaches_forked_children_not_spawned_ones(tmp_path):
    script = tmp_path / "children.py"
    script.write_text(textwrap.dedent(_CHILDREN))
    done = subprocess.run(
        [sys.executable, "-m", "epass.fast_decompositions", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "True", "spawn", "False"]


def test_whole_script_form_says_it_is_process_wide():
    done = subprocess.run(
        [sys.executable, "-m", "epass.fast_decompositions", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0
    assert "every thread" in " ".join(done.stdout.split())


def test_process_wide_switch_serves_other_threads():
    _, ep, _ = models.export("mlp")
    stop = _switch.process_wide()
    try:
        results = []
        thread = threading.Thread(target=lambda: results.append(ep.run_decompositions()))
        thread.start()
        thread.join(60)
        log = _switch.process_log()
        assert log is not None and len(log.served) == 1
        assert first_difference(results[0], TORCHS(ep)) is None
    finally:
        stop()
    assert ExportedProgram.__dict__["run_decompositions"] is TORCHS
    assert _switch.process_log() is None


def test_a_task_started_in_the_block_keeps_torchs_method_after_it():
    import asyncio

    _, ep, _ = models.export("mlp")

    async def main():
        with epass.fast_decompositions() as log:
            started = asyncio.Event()

            async def later():
                started.set()
                await asyncio.sleep(0)
                await done.wait()
                return ep.run_decompositions()

            done = asyncio.Event()
            task = asyncio.create_task(later())  # a copy of the context, scope included
            await started.wait()
        with epass.fast_decompositions() as other:  # the class still carries the switch
            done.set()
            await task
        return log, other

    log, other = asyncio.run(main())
    assert len(log.served) == 0 and len(other.served) == 0


def test_a_wrapper_another_library_put_on_top_stays_and_reaches_torchs_method():
    import functools

    _, ep, _ = models.export("mixed")
    try:
        with epass.fast_decompositions():
            ours = ExportedProgram.__dict__["run_decompositions"]

            @functools.wraps(ours)
            def theirs(self, *args, **kwargs):
                return ours(self, *args, **kwargs)

            ExportedProgram.run_decompositions = theirs
        assert ExportedProgram.__dict__["run_decompositions"] is theirs
        out = ep.run_decompositions()  # theirs -> ours -> torch's, outside every scope
        assert _torchs_constants(out, ep)  # torch's own semantics
    finally:
        ExportedProgram.run_decompositions = TORCHS

"""The built-in instruments against real pipelines (Decompose plus fx passes)."""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch
from fingerprint import fingerprint
from models import export
from torch import nn

import epass
from epass import (
    Decompose,
    FxPass,
    InstrumentError,
    MemoryAccounting,
    NumericsCheck,
    OpCounts,
    PassError,
    PassManager,
    PassResult,
    PrintIR,
    Progress,
    Reproducer,
    Timing,
    _graph,
    _program,
)
from epass.instruments import Instrument, format_delta

aten = torch.ops.aten

# ---------------------------------------------------------------------------
# Small passes and a model with a residual add (also used by test_bisect.py)


class Residual(nn.Module):
    """Two linears, a relu and a residual ``add`` that survives decomposition."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin1(x)))


def export_residual() -> tuple[nn.Module, torch.export.ExportedProgram, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    module = Residual().eval()
    args = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)),)
    return module, torch.export.export(module, args), args


def _retarget(gm: torch.fx.GraphModule, old: Any, new: Any) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.target is old:
            node.target = new
    return gm


def swap_add(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The deliberately wrong pass: every ``add`` becomes ``sub``."""
    return _retarget(gm, aten.add.Tensor, aten.sub.Tensor)


def relu_to_clamp(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """relu(x) -> clamp_min(x, 0): same numbers, different graph."""
    for node in gm.graph.nodes:
        if node.target is aten.relu.default:
            node.target = aten.clamp_min.default
            node.args = (node.args[0], 0.0)
    return gm


def _wrap_output(gm: torch.fx.GraphModule, *ops: Any) -> torch.fx.GraphModule:
    out = gm.graph.output_node()
    value = out.args[0][0]
    with gm.graph.inserting_before(out):
        for op in ops:
            val = value.meta["val"]
            value = gm.graph.call_function(op, (value,))
            value.meta["val"] = val  # same shape and dtype
    out.args = ((value, *out.args[0][1:]),)
    return gm


def neg_neg(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """y -> neg(neg(y)): exact."""
    return _wrap_output(gm, aten.neg.default, aten.neg.default)


def clone_output(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """y -> clone(y): exact."""
    return _wrap_output(gm, aten.clone.default)


GOOD = {
    "decompose": Decompose,
    "relu-to-clamp": lambda: FxPass(relu_to_clamp, name="relu-to-clamp"),
    "neg-neg": lambda: FxPass(neg_neg, name="neg-neg"),
    "clone-output": lambda: FxPass(clone_output, name="clone-output"),
}


def five_pass_pipeline(bad_position: int) -> list[Any]:
    """Four passes that keep the numbers, with ``swap-add`` inserted at a position."""
    passes = [make() for make in GOOD.values()]
    passes.insert(bad_position, FxPass(swap_add, name="swap-add"))
    return passes


def assert_outputs_close(program: torch.export.ExportedProgram, module: nn.Module, args) -> None:
    torch.testing.assert_close(program.module()(*args), module(*args))


# ---------------------------------------------------------------------------
# Timing


def test_timing_aggregates_over_steps_and_runs() -> None:
    _, ep, _ = export_residual()
    timing = Timing()
    pm = PassManager(
        [Decompose(), FxPass(relu_to_clamp, name="relu-to-clamp")], steps=3, instruments=[timing]
    )
    result = pm(ep)
    # Round 0 lowers and rewrites relu, round 1 decomposes clamp_min into clamp,
    # round 2 changes nothing (Decompose proves it and is skipped): one row each.
    assert [r.step for r in result.records] == [0, 0, 1, 1, 2, 2]
    assert [r.skipped for r in result.records] == [False] * 4 + [True, False]
    assert [r.path for r in timing.rows.values()] == ["decompose", "relu-to-clamp"]
    assert [r.runs for r in timing.rows.values()] == [2, 3]
    assert [r.skipped for r in timing.rows.values()] == [1, 0]
    pm.run(ep)
    assert timing.rows["decompose"].runs == 4
    row = timing.rows["decompose"]
    assert 0 < row.min_seconds <= row.mean_seconds <= row.max_seconds
    assert row.seconds <= timing.pipeline_seconds
    table = timing.table()
    assert "decompose" in table and "relu-to-clamp" in table
    assert "pipeline wall time" in table
    timing.reset()
    assert not timing.rows


def test_timing_counts_skipped_passes() -> None:
    _, ep, _ = export_residual()

    class NeverNeeded:
        name = "never-needed"

        def skip_reason(self, ep: Any) -> str:
            return "nothing to do"

        def __call__(self, ep: Any) -> PassResult:
            raise AssertionError("skipped passes do not run")

    timing = Timing()
    PassManager([NeverNeeded(), Decompose()], instruments=[timing]).run(ep)
    assert timing.rows["never-needed"].skipped == 1
    assert timing.rows["never-needed"].runs == 0


def test_nested_managers_inherit_instruments() -> None:
    _, ep, _ = export_residual()
    timing, counts = Timing(), OpCounts()
    inner = PassManager(
        [FxPass(relu_to_clamp, name="relu-to-clamp"), FxPass(neg_neg, name="neg-neg")],
        name="inner",
    )
    PassManager([Decompose(), inner], instruments=[timing, counts]).run(ep)
    assert list(timing.rows) == ["decompose", "inner/relu-to-clamp", "inner/neg-neg", "inner"]
    assert timing.rows["inner/neg-neg"].depth == 1
    assert [e.path for e in counts.entries] == list(timing.rows)
    table = timing.table().splitlines()
    assert any(line.startswith("  relu-to-clamp") for line in table)
    # The nested manager's own entry sums up its passes.
    assert counts.entries[-1].delta == {
        "aten.relu.default": -1,
        "aten.clamp_min.default": 1,
        "aten.neg.default": 2,
    }


# ---------------------------------------------------------------------------
# PrintIR


def test_print_ir_prints_unified_diff_of_changed_passes() -> None:
    _, ep, _ = export_residual()
    stream = io.StringIO()
    printer = PrintIR(stream=stream)
    unchanged = FxPass(lambda gm: gm, name="no-op")
    PassManager(
        [unchanged, FxPass(relu_to_clamp, name="relu-to-clamp")], instruments=[printer]
    ).run(ep)
    assert [(d.path, d.kind) for d in printer.dumps] == [("relu-to-clamp", "diff")]
    text = stream.getvalue()
    assert "--- relu-to-clamp (before)" in text
    assert "-    relu = torch.ops.aten.relu.default(linear)" in text
    assert "+    relu = torch.ops.aten.clamp_min.default(linear, 0.0)" in text


def test_print_ir_shows_a_graph_edited_without_recompile() -> None:
    _, ep, _ = export_residual()

    def retarget_without_recompile(
        program: torch.export.ExportedProgram,
    ) -> torch.export.ExportedProgram:
        for node in program.graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.sigmoid.default
        return program  # the module's generated code still says relu

    printer = PrintIR(stream=io.StringIO())
    result = PassManager([retarget_without_recompile], instruments=[printer])(ep)
    assert result.records[0].modified
    assert [d.kind for d in printer.dumps] == ["diff"]
    assert "+    relu = torch.ops.aten.sigmoid.default(linear)" in printer.dumps[0].text


def test_print_ir_before_after_filter_and_directory(tmp_path) -> None:
    _, ep, _ = export_residual()
    printer = PrintIR(
        before=True, after=True, only_changed=False, passes=["neg-neg"], form="graph",
        directory=tmp_path,
    )  # fmt: skip
    passes = [FxPass(relu_to_clamp, name="relu-to-clamp"), FxPass(neg_neg, name="neg-neg")]
    PassManager(passes, instruments=[printer]).run(ep)
    assert [(d.path, d.kind) for d in printer.dumps] == [
        ("neg-neg", "before"),
        ("neg-neg", "after"),
    ]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["001-neg-neg-step0.before.txt", "002-neg-neg-step0.after.txt"]
    assert "aten.neg.default" not in (tmp_path / files[0]).read_text()
    assert (tmp_path / files[1]).read_text().count("aten.neg.default") == 2


def test_print_ir_regex_filter_and_failed_pass() -> None:
    _, ep, _ = export_residual()

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    printer = PrintIR(passes=r"ex.*", stream=io.StringIO())
    pm = PassManager(
        [FxPass(neg_neg, name="neg-neg"), FxPass(explode, name="explode")], instruments=[printer]
    )
    with pytest.raises(PassError, match="boom"):
        pm.run(ep)
    # The failing pass's input is shown; neg-neg is filtered out.
    assert [(d.path, d.kind) for d in printer.dumps] == [("explode", "failed")]
    assert printer.dumps[0].text.count("aten.neg.default") == 2


# ---------------------------------------------------------------------------
# OpCounts


def test_op_counts_histogram_and_delta_for_decompose() -> None:
    _, ep, _ = export("mlp")
    counts = OpCounts()
    result = PassManager([Decompose()], instruments=[counts])(ep)
    (entry,) = counts.entries
    assert entry.before["aten.linear.default"] == 3
    assert entry.after["aten.addmm.default"] == 3
    assert entry.delta == dict(result.records[0].op_delta)
    assert entry.format_delta() == "aten.linear -3 → aten.addmm +3, aten.permute +3"
    assert counts.histogram()["aten.relu.default"] == 2
    assert "aten.linear -3 → aten.addmm +3, aten.permute +3" in counts.table()


def test_format_delta_keeps_non_default_overloads() -> None:
    assert format_delta({"aten.add.Tensor": 1, "aten.mul.default": -2}) == (
        "aten.mul -2 → aten.add.Tensor +1"
    )
    assert format_delta({}) == "(no change)"


# ---------------------------------------------------------------------------
# NumericsCheck


def test_numerics_check_passes_a_correct_pipeline() -> None:
    _, ep, _ = export_residual()
    check = NumericsCheck()
    PassManager(five_pass_pipeline(0)[1:], instruments=[check]).run(ep)
    assert check.first_drift is None
    assert [d.path for d in check.checks] == list(GOOD)
    assert all(d.ok and d.max_abs < 1e-5 for d in check.checks)
    assert "no pass drifted" in check.report()


@pytest.mark.parametrize("position", range(5))
def test_numerics_check_names_the_wrong_pass_at_every_position(position: int) -> None:
    module, ep, args = export_residual()
    before = fingerprint(ep)
    check = NumericsCheck()
    out = PassManager(five_pass_pipeline(position), instruments=[check]).run(ep)
    assert check.first_drift is not None
    assert check.first_drift.path == "swap-add"
    assert check.first_drift.max_abs > 0.1 and check.first_drift.max_rel > 0.1
    # Every other pass is compared with its predecessor and keeps the numbers.
    assert [d.path for d in check.checks if not d.ok] == ["swap-add"]
    with pytest.raises(AssertionError):
        assert_outputs_close(out, module, args)
    assert fingerprint(ep) == before


def test_numerics_check_against_a_reference_and_the_input() -> None:
    module, ep, _ = export_residual()
    eager = NumericsCheck(reference=module)
    versus_input = NumericsCheck(reference="input")
    PassManager(five_pass_pipeline(1), instruments=[eager, versus_input]).run(ep)
    for check in (eager, versus_input):
        assert check.first_drift is not None and check.first_drift.path == "swap-add"
        # Compared with the reference, every pass after the wrong one drifts too.
        assert [d.ok for d in check.checks] == [True, False, False, False, False]


def test_numerics_check_raise_on_drift_stops_the_pipeline() -> None:
    _, ep, _ = export_residual()
    before = fingerprint(ep)
    pm = PassManager(five_pass_pipeline(2), instruments=[NumericsCheck(raise_on_drift=True)])
    with pytest.raises(InstrumentError) as info:
        pm.run(ep)
    assert info.value.instrument == "NumericsCheck"
    assert info.value.pass_name == "swap-add"
    assert "drifted" in str(info.value)
    assert fingerprint(ep) == before


def test_numerics_check_leaves_mutated_buffers_and_inputs_alone() -> None:
    # Seed mutates its buffer in place (training IR: aten.add_ on the buffer).
    _, ep, args = export("seed")
    assert any(n.target is aten.add_.Tensor for n in ep.graph.nodes)
    inputs = (args[0].clone(),)
    kept = inputs[0].clone()
    before = fingerprint(ep)
    check = NumericsCheck(inputs)
    # (Swapping both adds of Seed for subs happens to keep its output: x - (0 - 1).)
    add_to_mul = FxPass(lambda gm: _retarget(gm, aten.add.Tensor, aten.mul.Tensor), name="to-mul")
    passes = [FxPass(neg_neg, name="neg-neg"), Decompose(), add_to_mul]
    PassManager(passes, instruments=[check]).run(ep)
    assert fingerprint(ep) == before
    assert torch.equal(ep.state_dict["count"], torch.zeros(4))
    assert torch.equal(inputs[0], kept) and inputs[0]._version == 0
    assert [d.path for d in check.checks] == ["neg-neg", "decompose", "to-mul"]
    assert check.first_drift is not None and check.first_drift.path == "to-mul"


def test_numerics_check_needs_inputs() -> None:
    _, ep, args = export_residual()
    bare = _program.shallow_clone(ep)
    bare.example_inputs = None
    with pytest.raises(InstrumentError, match=r"NumericsCheck.*inputs="):
        PassManager([Decompose()], instruments=[NumericsCheck()]).run(bare)
    check = NumericsCheck(args)
    PassManager([Decompose()], instruments=[check]).run(bare)
    assert check.checks and check.first_drift is None


# ---------------------------------------------------------------------------
# MemoryAccounting


def _replace_weight(ep: torch.export.ExportedProgram) -> PassResult:
    """Give lin2.weight a new tensor holding lin1.weight's values."""
    state = dict(ep.state_dict)
    state["lin2.weight"] = nn.Parameter(ep.state_dict["lin1.weight"].detach().clone())
    gm = _program.copy_graph_module(ep.graph_module)
    return PassResult(_graph.build_program(ep, gm, state_dict=state), True)


_replace_weight.name = "replace-weight"  # type: ignore[attr-defined]


def test_memory_accounting_new_released_and_duplicate_bytes() -> None:
    _, ep, _ = export_residual()
    memory = MemoryAccounting()
    PassManager([Decompose(), _replace_weight], instruments=[memory]).run(ep)
    assert memory.baseline is not None
    total = sum(t.untyped_storage().nbytes() for t in ep.state_dict.values())
    assert memory.baseline.bytes == total
    assert memory.baseline.duplicates == ()
    decompose, replace = memory.entries
    assert (decompose.bytes, decompose.new_bytes, decompose.released_bytes) == (total, 0, 0)
    weight_bytes = 8 * 8 * 4
    assert replace.new_bytes == weight_bytes
    assert replace.released_bytes == weight_bytes
    assert replace.duplicates == (("state_dict:lin1.weight", "state_dict:lin2.weight"),)
    assert replace.duplicate_bytes == weight_bytes
    assert "replace-weight" in memory.table()


def test_memory_accounting_counts_tied_weights_once() -> None:
    _, ep, _ = export("mixed")
    memory = MemoryAccounting()
    PassManager([Decompose()], instruments=[memory]).run(ep)
    assert memory.baseline is not None
    tensors = [
        t for d in (ep.state_dict, ep.constants) for t in d.values() if isinstance(t, torch.Tensor)
    ]
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert len(unique) < len(tensors)  # the tied weight
    assert memory.baseline.bytes == sum(unique.values())
    assert memory.baseline.duplicates == ()  # tied entries share storage: not duplicates


# ---------------------------------------------------------------------------
# Progress


def _console(terminal: bool) -> Any:
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=terminal, width=100)


def test_progress_is_silent_when_not_a_terminal() -> None:
    _, ep, _ = export_residual()
    console = _console(terminal=False)
    progress = Progress(console)
    PassManager([Decompose()], instruments=[progress]).run(ep)
    assert console.file.getvalue() == ""
    assert not progress.active


def test_progress_shows_passes_on_a_terminal_and_stops_on_failure() -> None:
    _, ep, _ = export_residual()
    console = _console(terminal=True)
    progress = Progress(console, transient=False)
    PassManager([Decompose(), FxPass(neg_neg, name="neg-neg")], instruments=[progress]).run(ep)
    out = console.file.getvalue()
    assert "neg-neg" in out and "2/2" in out
    assert not progress.active

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    with pytest.raises(PassError):
        PassManager([FxPass(explode, name="explode")], instruments=[progress]).run(ep)
    assert not progress.active


def _shown(console: Any) -> list[str]:
    """The distinct lines a console was drawn with, escape sequences removed."""
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())
    lines = [line.strip() for line in text.replace("\r", "\n").split("\n")]
    return list(dict.fromkeys(line for line in lines if line))


def test_progress_counts_the_passes_of_nested_pipelines() -> None:
    import re

    _, ep, _ = export_residual()
    console = _console(terminal=True)
    manager = PassManager.from_text("lower, cse, dce")
    manager.instruments.append(Progress(console, transient=False))
    manager.run(ep)
    shown = _shown(console)
    counts = [
        tuple(map(int, m.groups())) for m in map(re.compile(r"(\d+)/(\d+)").search, shown) if m
    ]
    assert {total for _, total in counts} == {7}  # the 5 passes of lower, and 2
    assert [done for done, _ in counts] == sorted(done for done, _ in counts)
    assert set(range(8)) == {done for done, _ in counts}
    for label in ("0/7 lower > decompose", "2/7 lower > fold-constants", "6/7 dce"):
        assert any(label in line for line in shown), label


def test_progress_counts_a_skipped_nested_pipeline_whole() -> None:
    _, ep, _ = export_residual()
    console = _console(terminal=True)
    progress = Progress(console, transient=False)
    inner = PassManager.from_text("cse, dce")
    inner_info = epass.PassInfo(inner, "inner", 0, 0, manager=None)
    progress.before_pipeline(PassManager([inner, Decompose()]), ep)
    progress.pass_skipped(inner_info, ep, None)  # type: ignore[arg-type]
    progress.after_pipeline(None, None)  # type: ignore[arg-type]
    assert any("2/3" in line for line in _shown(console))


def test_progress_total_grows_by_a_round_when_a_pipeline_repeats() -> None:
    _, ep, _ = export_residual()
    console = _console(terminal=True)
    progress = Progress(console, transient=False)
    manager = PassManager.from_text("cse, dce")
    progress.before_pipeline(manager, ep)
    for step in (0, 1):
        for index, p in enumerate(manager.passes):
            info = epass.PassInfo(p, p.name, index, step, manager=manager)
            progress.before_pass(info, ep)
            progress.after_pass(info, ep, None)  # type: ignore[arg-type]
    progress.after_pipeline(manager, None)  # type: ignore[arg-type]
    shown = _shown(console)
    assert any("0/2 cse" in line for line in shown)
    assert any("2/4 cse (step 2)" in line for line in shown)
    assert "4/4" in shown[-1]


def test_spinner_shows_each_phase_on_a_terminal_only(tmp_path: Any) -> None:
    from epass.instruments import Spinner

    _, ep, _ = export_residual()
    path = tmp_path / "p.pt2"
    console = _console(terminal=True)
    with Spinner(console) as spinner:
        epass.save(ep, path, progress=spinner)
        epass.load(path, progress=spinner)
    size = f"({path.stat().st_size / 1000:.0f} kB)"
    state = sum(t.untyped_storage().nbytes() for t in ep.state_dict.values())
    assert spinner.shown == [
        f"saving p.pt2 ({state} B)",  # the state to write
        f"screening p.pt2 {size}",
        f"loading p.pt2 {size}",
    ]
    shown = "\n".join(_shown(console))
    assert all(text in shown for text in spinner.shown)
    quiet = _console(terminal=False)
    with Spinner(quiet) as spinner:
        epass.load(path, progress=spinner)
    assert quiet.file.getvalue() == "" and spinner.shown == []


def test_load_and_save_name_their_phases_to_a_progress_callable(tmp_path: Any) -> None:
    _, ep, _ = export_residual()
    path = tmp_path / "p.pt2"
    phases: list[str] = []
    epass.save(ep, path, progress=phases.append)
    epass.load(path, progress=phases.append)
    epass.load(path, trust=True, progress=phases.append)
    assert [p.split()[0] for p in phases] == ["saving", "screening", "loading", "loading"]
    assert all(" p.pt2 (" in p and p.endswith("B)") for p in phases)


# ---------------------------------------------------------------------------
# Every instrument together, logging, and instruments that fail


def full_set(tmp_path) -> list[Any]:
    return [
        Timing(),
        OpCounts(),
        MemoryAccounting(),
        NumericsCheck(),
        PrintIR(stream=io.StringIO()),
        Progress(_console(terminal=False)),
        Reproducer(tmp_path),
    ]


def test_full_instrument_set_keeps_results_and_state_sharing(tmp_path) -> None:
    module, ep, args = export_residual()
    before = fingerprint(ep)
    passes = five_pass_pipeline(0)[1:]
    plain = PassManager(passes)(ep)
    instruments = full_set(tmp_path)
    result = PassManager(passes, instruments=instruments)(ep)
    assert result.program.graph_module.code == plain.program.graph_module.code
    assert result.program.state_dict is ep.state_dict
    assert fingerprint(ep) == before
    assert_outputs_close(result.program, module, args)
    timing, counts, memory, numerics, printer, *_ = instruments
    assert len(timing.rows) == len(counts.entries) == len(memory.entries) == 4
    assert numerics.first_drift is None
    assert len(printer.dumps) == 4
    assert not list(tmp_path.iterdir())  # nothing failed, no reproducer


def test_manager_logs_each_pass_at_debug_and_prints_nothing(caplog, capsys) -> None:
    _, ep, _ = export_residual()
    with caplog.at_level(logging.DEBUG, logger="epass"):
        PassManager([Decompose(), FxPass(neg_neg, name="neg-neg")]).run(ep)
    messages = [r.getMessage() for r in caplog.records if r.name == "epass"]
    assert any(m.startswith("start decompose") for m in messages)
    assert any(m.startswith("end neg-neg") for m in messages)
    captured = capsys.readouterr()
    assert captured.out == ""


HOOKS = ["before_pipeline", "before_pass", "after_pass", "pass_skipped", "after_pipeline"]


class Raiser(Instrument):
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def __getattribute__(self, name: str) -> Any:
        if name in HOOKS and name == object.__getattribute__(self, "hook"):

            def fail(*args: Any) -> None:
                raise ValueError(f"instrument bug in {name}")

            return fail
        return object.__getattribute__(self, name)


class Skipped:
    name = "skipped"

    def skip_reason(self, ep: Any) -> str:
        return "always"

    def __call__(self, ep: Any) -> Any:
        raise AssertionError("not reached")


def _adds_a_constant(ep: torch.export.ExportedProgram) -> PassResult:
    """Changes a state value, so a broken run would leave traces in the store."""
    state = dict(ep.state_dict)
    state["lin1.bias"] = nn.Parameter(ep.state_dict["lin1.bias"].detach() + 1)
    gm = _program.copy_graph_module(ep.graph_module)
    return PassResult(_graph.build_program(ep, gm, state_dict=state), True)


@pytest.mark.parametrize("hook", HOOKS)
def test_raising_instrument_is_named_and_corrupts_nothing(hook: str, tmp_path) -> None:
    _, ep, _ = export_residual()
    before = fingerprint(ep)
    keys = list(ep.state_dict)
    passes = [Skipped(), Decompose(), _adds_a_constant, FxPass(neg_neg, name="neg-neg")]
    clean = PassManager(passes)(ep)
    # The other instruments are told about the failure and stay consistent.
    witnesses = full_set(tmp_path)
    pm = PassManager(passes, instruments=[*witnesses, Raiser(hook)])
    with pytest.raises(InstrumentError) as info:
        pm(ep)
    assert info.value.instrument == "Raiser"
    assert info.value.hook == hook
    assert "Raiser" in str(info.value) and "instrument bug" in str(info.value)
    assert fingerprint(ep) == before
    assert list(ep.state_dict) == keys
    # The same passes still give the same result afterwards.
    again = PassManager(passes, instruments=witnesses)(ep)
    assert again.program.graph_module.code == clean.program.graph_module.code
    for key, value in clean.program.state_dict.items():
        assert torch.equal(again.program.state_dict[key], value)
    assert fingerprint(ep) == before


def test_instrument_raising_in_pass_failed_is_named_and_keeps_the_cause() -> None:
    _, ep, _ = export_residual()
    before = fingerprint(ep)

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    class BadOnFailure(Instrument):
        def pass_failed(self, info: Any, program: Any, error: BaseException) -> None:
            raise KeyError("bug")

    pm = PassManager([Decompose(), FxPass(explode, name="explode")], instruments=[BadOnFailure()])
    with pytest.raises(InstrumentError) as info:
        pm.run(ep)
    assert (info.value.instrument, info.value.hook) == ("BadOnFailure", "pass_failed")
    assert info.value.pass_name == "explode"
    assert "while reporting: pass 'explode'" in str(info.value)
    assert "RuntimeError: boom" in str(info.value)
    assert fingerprint(ep) == before


def test_public_names_are_exported() -> None:
    for name in [
        "Timing", "PrintIR", "OpCounts", "NumericsCheck", "MemoryAccounting", "Progress",
        "Reproducer", "bisect", "BisectResult",
    ]:  # fmt: skip
        assert name in epass.__all__ and hasattr(epass, name)


@pytest.mark.slow
def test_overhead_benchmark_runs(capsys) -> None:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_instruments.py"
    bench = runpy.run_path(str(script), run_name="bench_instruments")
    bench["main"](["--layers", "1", "--d-model", "32", "--rounds", "1", "--cheap-repeat", "1"])
    out = capsys.readouterr().out
    assert "empty/none" in out and "full/none" in out
    assert "pipeline wall time" in out and "aten.linear -" in out

"""epass.reduce: a program on which a pipeline fails (or drifts) shrinks to the few
nodes that still make it fail; every candidate is a valid program over the user's
tensors (the passes run on copies of them), and the user's program is never
touched. Hostile passes: test_reduce_safety.py."""

from __future__ import annotations

import functools
import operator
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import models
import pytest
import torch
from fingerprint import fingerprint
from test_divergence import planted
from torch import nn

import epass
from epass import Decompose, FxPass, PassManager
from epass.errors import ArgumentValueError
from epass.instruments.reproducer import graph_listing, load_program
from epass.reduce import _search

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


# --- planted bugs -----------------------------------------------------------------------


def tanh_of_mul(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Miscomputes aten.tanh, but only where its input comes from aten.mul."""
    for node in gm.graph.nodes:
        if node.target is aten.tanh.default and node.args[0].target is aten.mul.Tensor:
            node.target = aten.sigmoid.default
    return gm


class RefuseNode:
    """Raises on one node of the program, named."""

    changes_input = False

    def __init__(self, node: str) -> None:
        self.node = node
        self.name = "refuse-node"

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        if any(n.name == self.node for n in ep.graph.nodes):
            raise NotImplementedError(f"the backend cannot lower {self.node}")
        return epass.PassResult(ep, False)


def user_state_is_shared(program: torch.export.ExportedProgram, ep: Any) -> bool:
    entries = {**ep.state_dict, **ep.constants}
    mine = {**program.state_dict, **program.constants}
    return all(mine[k] is entries[k] for k in mine)


# --- GPT-2 from the zoo -----------------------------------------------------------------


def _transformers() -> None:
    pytest.importorskip("transformers")


@functools.cache
def gpt2(dynamic: bool) -> torch.export.ExportedProgram:
    """The zoo's GPT-2, decomposed (a few hundred nodes)."""
    _transformers()
    import hf_models

    _, ep, _ = hf_models.export("gpt2", dynamic=dynamic)
    return PassManager([Decompose()]).run(ep)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_drift_on_one_op_pattern_deep_in_gpt2_reduces_to_a_few_nodes(dynamic: bool) -> None:
    ep = gpt2(dynamic)
    before = fingerprint(ep)
    result = epass.reduce(ep, [FxPass(tanh_of_mul, name="tanh-of-mul")], time_limit=120)
    print(f"gpt2 {'dynamic' if dynamic else 'static'} drift: {result.summary()}")
    assert result.stopped == "done"
    assert result.nodes_before >= 200 and result.nodes_after <= 10
    assert result.seconds < 60
    assert (result.failure.kind, result.failure.pass_name) == ("drift", "tanh-of-mul")
    ops = [n.target for n in result.program.graph.nodes if n.op == "call_function"]
    assert ops == [aten.mul.Tensor, aten.tanh.default]
    assert user_state_is_shared(result.program, ep)
    assert fingerprint(ep) == before
    if dynamic:  # the sizes did not matter to the bug: they were made static
        assert result.program.range_constraints == {}


@pytest.mark.slow
def test_a_pass_that_raises_on_one_node_of_gpt2_reduces_to_that_node() -> None:
    ep = gpt2(False)
    softmax = [n.name for n in ep.graph.nodes if n.target is aten._softmax.default][-1]
    result = epass.reduce(ep, [RefuseNode(softmax)], time_limit=120)
    print(f"gpt2 error: {result.summary()}")
    assert result.stopped == "done" and result.seconds < 60
    assert result.nodes_before >= 200 and result.nodes_after <= 10
    calls = [n.name for n in result.program.graph.nodes if n.op == "call_function"]
    assert calls == [softmax]
    assert result.failure.error_type == "NotImplementedError"


# --- small programs ---------------------------------------------------------------------


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x) * 0.5)
        return self.b(torch.relu(y) + x).reshape(x.shape[0], 2, 4).sum(1)


def chain(dynamic: bool = False) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    shapes = ({0: torch.export.Dim("batch", min=2, max=16)},) if dynamic else None
    ep = torch.export.export(Chain().eval(), (torch.randn(4, 8),), dynamic_shapes=shapes)
    return PassManager([Decompose()]).run(ep)


def test_a_drift_reduces_and_every_candidate_is_a_valid_program_over_the_users_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ep = chain()
    before = fingerprint(ep)
    seen: list[torch.export.ExportedProgram] = []
    judge = _search.Search._judge  # in this process; the pipeline runs in a child

    def spy(self: Any, key: Any, piece: Any, program: Any) -> Any:
        seen.append(program)
        return judge(self, key, piece, program)

    monkeypatch.setattr(_search.Search, "_judge", spy)
    result = epass.reduce(ep, [FxPass(tanh_of_mul, name="tanh-of-mul")])
    assert [str(n.target) for n in result.program.graph.nodes if n.op == "call_function"] == [
        "aten.mul.Tensor",
        "aten.tanh.default",
    ]
    assert len(seen) > 3
    for program in seen:
        epass.verify_program(program)
        assert user_state_is_shared(program, ep)
    assert fingerprint(ep) == before


def test_a_dynamic_program_keeps_its_symbolic_sizes_when_the_failure_needs_them() -> None:
    ep = chain(dynamic=True)

    class RefuseSymbolicViews:
        name = "refuse-symbolic-views"
        changes_input = False

        def __call__(self, program: Any) -> Any:
            for n in program.graph.nodes:
                if n.target is aten.view.default and any(
                    isinstance(d, torch.fx.Node) for d in n.args[1]
                ):
                    raise NotImplementedError(f"a symbolic view at {n.name}")
            return epass.PassResult(program, False)

    result = epass.reduce(ep, [RefuseSymbolicViews()])
    assert result.nodes_after < result.nodes_before
    assert result.program.range_constraints  # still dynamic
    views = [n for n in result.program.graph.nodes if n.target is aten.view.default]
    assert len(views) == 1
    static = epass.reduce(ep, [FxPass(tanh_of_mul, name="tanh-of-mul")])
    assert static.program.range_constraints == {}


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        y = self.proj(x)
        self.mean.mul_(0.9).add_(y.detach().mean(0), alpha=0.1)
        return torch.relu(y - self.mean)


class RefuseStepWrites:
    """Fails on a program that writes the buffer ``steps``."""

    name = "refuse-step-writes"
    changes_input = False

    def __call__(self, program: Any) -> Any:
        if "steps" in program.graph_signature.buffers_to_mutate.values():
            raise NotImplementedError("cannot write the buffer steps")
        for n in program.graph.nodes:
            if n.target is aten.add_.Tensor and n.args[0].name == "b_steps":
                raise NotImplementedError("cannot write the buffer steps in place")
        return epass.PassResult(program, False)


@pytest.mark.parametrize("form", ["training", "decomposed"])
def test_buffers_written_in_place_are_kept_when_the_failure_needs_them(form: str) -> None:
    ep = torch.export.export(Counter().eval(), (torch.randn(4, 8),))
    if form == "decomposed":
        ep = PassManager([Decompose()]).run(ep)
    before = fingerprint(ep)
    result = epass.reduce(ep, [RefuseStepWrites()])
    program = result.program
    calls = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert calls == [aten.add_.Tensor if form == "training" else aten.add.Tensor]
    assert set(program.state_dict) == {"steps"}
    assert program.state_dict["steps"] is ep.state_dict["steps"]
    if form == "decomposed":
        assert program.graph_signature.buffers_to_mutate == {"add": "steps"}
    assert fingerprint(ep) == before


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x)) + 1
        z = torch.cond(
            y.sum() > 0, lambda t: torch.sin(self.b(t)), lambda t: torch.nn.functional.silu(t), (y,)
        )
        return torch.tanh(z) * 2


class Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        start = (torch.tensor(0), y)
        _, z = torch._higher_order_ops.while_loop(
            lambda i, t: i < 3, lambda i, t: (i + 1, torch.tanh(t * 2)), start
        )
        return torch.sigmoid(z) + 1


class RefuseInBodies:
    """Fails on a program whose nested graphs (branches, loop bodies) call ``op``."""

    name = "refuse-in-bodies"
    changes_input = False

    def __init__(self, op: Any) -> None:
        self.op = op

    def __call__(self, program: Any) -> Any:
        for module in program.graph_module.modules():
            body = module is not program.graph_module
            if body and any(n.target is self.op for n in module.graph.nodes):
                raise NotImplementedError(f"{self.op} in a nested graph")
        return epass.PassResult(program, False)


@pytest.mark.parametrize(
    ("model", "op", "hop"),
    [
        (Branches, aten.silu.default, torch.ops.higher_order.cond),
        (Loop, aten.tanh.default, torch.ops.higher_order.while_loop),
    ],
    ids=["cond", "while_loop"],
)
def test_a_failure_inside_a_nested_graph_keeps_that_node_and_sheds_the_rest(
    model: type[nn.Module], op: Any, hop: Any
) -> None:
    ep = torch.export.export(model().eval(), (torch.randn(4, 8),))
    result = epass.reduce(ep, [RefuseInBodies(op)])
    calls = [n for n in result.program.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls if n.target is not operator.getitem] == [hop]
    assert result.nodes_after < result.nodes_before
    assert result.program.example_inputs is not None
    result.program.module()(*result.program.example_inputs[0])  # it runs


def test_match_and_in_pass_choose_which_failure_is_kept() -> None:
    ep = chain()
    relu = next(n.name for n in ep.graph.nodes if n.target is aten.relu.default)
    passes = [RefuseNode(relu), FxPass(tanh_of_mul, name="tanh-of-mul")]
    with pytest.raises(ArgumentValueError, match="does not drift"):
        epass.reduce(ep, passes, failure="drift")
    with pytest.raises(ArgumentValueError, match="matching 'addmm'"):
        epass.reduce(ep, passes, match="addmm")
    result = epass.reduce(ep, passes, match="cannot lower relu", in_pass="refuse-node")
    assert [n.name for n in result.program.graph.nodes if n.op == "call_function"] == [relu]


def test_no_failure_is_nothing_to_reduce() -> None:
    with pytest.raises(ArgumentValueError, match="nothing to reduce"):
        epass.reduce(chain(), ["dce"])


def test_budgets_and_ctrl_c_keep_the_smallest_program_so_far() -> None:
    ep = chain()
    passes = [FxPass(tanh_of_mul, name="tanh-of-mul")]
    limited = epass.reduce(ep, passes, max_steps=3)
    assert limited.stopped == "step limit" and limited.steps == 3
    assert limited.nodes_after <= limited.nodes_before
    with pytest.raises(ArgumentValueError, match="did not finish on the program within"):
        epass.reduce(ep, passes, time_limit=1e-9)  # not even the whole program's failure
    steps: list[int] = []

    def interrupt(progress: Any) -> None:
        steps.append(progress.step)
        if progress.step == 5:
            raise KeyboardInterrupt

    stopped = epass.reduce(ep, passes, progress=interrupt)
    assert stopped.stopped == "interrupted" and steps[-1] == 5
    assert stopped.nodes_after <= limited.nodes_after
    # What it kept still drifts.
    check = epass.NumericsCheck(localize=False)
    PassManager(passes, instruments=[check]).run(stopped.program)
    assert check.first_drift is not None


def test_the_written_reproducer_replays_the_reduced_program_node_for_node(tmp_path: Path) -> None:
    ep = chain()
    relu = next(n.name for n in ep.graph.nodes if n.target is aten.relu.default)
    result = epass.reduce(ep, ["decompose", RefuseNode(relu)])
    where = result.write(tmp_path / "reduced")
    assert {p.name for p in where.iterdir()} == {
        "program.pt2", "graph.json", "pipeline.txt", "passes.pkl", "repro.py", "failure.txt"
    }  # fmt: skip
    loaded, differences = load_program(where)
    assert differences == [] and graph_listing(loaded) == graph_listing(result.program)
    assert "refuse-node" in (where / "failure.txt").read_text()


@pytest.mark.slow
def test_repro_py_fails_with_the_kept_drift(tmp_path: Path) -> None:
    (tmp_path / "planted.py").write_text(
        "import torch\nfrom epass import FxPass\n\n\n"
        "def tanh_of_mul(gm):\n"
        "    for n in gm.graph.nodes:\n"
        "        if n.target is torch.ops.aten.tanh.default and "
        "n.args[0].target is torch.ops.aten.mul.Tensor:\n"
        "            n.target = torch.ops.aten.sigmoid.default\n"
        "    return gm\n\n\n"
        "PASS = FxPass(tanh_of_mul, name='tanh-of-mul')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import planted

        result = epass.reduce(chain(), [planted.PASS])
        where = result.write(tmp_path / "reduced")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("planted", None)
    assert (where / "passes.pkl").exists()
    done = subprocess.run(
        [sys.executable, str(where / "repro.py")],
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "numerics drift: tanh-of-mul: DRIFT" in done.stderr
    assert "first diverging node: tanh (aten.tanh.default)" in done.stderr


def test_the_zoo_mlp_program_is_left_alone_by_a_reduction() -> None:
    _, ep, _ = models.export("mlp")
    before = fingerprint(ep)
    relu = [n.name for n in ep.graph.nodes if n.target is aten.relu.default][-1]
    result = epass.reduce(ep, [RefuseNode(relu)])
    assert [n.name for n in result.program.graph.nodes if n.op == "call_function"] == [relu]
    assert fingerprint(ep) == before


@pytest.fixture
def planted_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from planted(
        tmp_path, monkeypatch, "tanh-of-mul-test", "tanh.default <- mul: sigmoid.default", chain()
    )


def test_the_command_writes_the_reduced_program_and_says_how_far_it_got(
    planted_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from epass.cli import main

    argv = ["--plain", "reduce", "p.pt2", "--import", "planted_passes", "-p"]
    assert main([*argv, "tanh-of-mul-test", "-o", "out"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("reduced ")
    assert " -> 4 nodes in " in lines[0]
    assert "steps): pass 'tanh-of-mul-test' drifts: DRIFT max_abs=" in lines[0]
    assert lines[1] == "wrote out/program.pt2 and out/repro.py"
    assert (planted_module / "out" / "graph.json").exists()
    assert main([*argv, "dce"]) == 1
    assert "nothing to reduce" in capsys.readouterr().err
    (planted_module / "file").write_text("")
    assert main([*argv, "tanh-of-mul-test", "-o", "file"]) == 2

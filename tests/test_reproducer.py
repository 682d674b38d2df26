"""Reproducer: a failing pass leaves a directory whose repro.py fails the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from fingerprint import fingerprint
from hypothesis import given, settings
from hypothesis import strategies as st

from epass import Decompose, FxPass, PassError, PassManager, Reproducer
from epass.instruments.reproducer import (
    GRAPH_FILE,
    QUALIFIED_HEADER,
    docstring_text,
    graph_listing,
    listing_differences,
    load_program,
    pipeline_text,
    qualified_name,
    save_program,
    script,
)

ROOT = Path(__file__).resolve().parent.parent

# The passes live in a module of their own, so that repro.py in a fresh
# interpreter can import them (as it would a user's pass library).
PASSES = '''
import attrs
import torch
from epass import FxPass, PassResult


@attrs.define(eq=False)
class Explode:
    """Fails on any graph that still has a relu."""

    name = "explode"
    changes_input = False
    message: str = "relu is not supported here"

    def __call__(self, ep):
        if any(n.target is torch.ops.aten.relu.default for n in ep.graph.nodes):
            raise RuntimeError(self.message)
        return PassResult(ep, False)


def neg_neg(gm):
    out = gm.graph.output_node()
    value = out.args[0][0]
    with gm.graph.inserting_before(out):
        for _ in range(2):
            val = value.meta["val"]
            value = gm.graph.call_function(torch.ops.aten.neg.default, (value,))
            value.meta["val"] = val
    out.args = ((value,),)
    return gm


def no_meta(gm):
    """Breaks the verifier: a new node without meta['val']."""
    out = gm.graph.output_node()
    with gm.graph.inserting_before(out):
        node = gm.graph.call_function(torch.ops.aten.neg.default, (out.args[0][0],))
    out.args = ((node,),)
    return gm
'''


@pytest.fixture
def user_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "user_passes.py").write_text(PASSES)
    monkeypatch.syspath_prepend(str(lib))
    import importlib

    module = importlib.import_module("user_passes")
    yield module
    sys.modules.pop("user_passes", None)


def run_repro(script: Path, lib: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(lib), str(ROOT)]))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=script.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def residual_program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return torch.export.export(module.eval(), (torch.randn(3, 4),))


def test_repro_script_reproduces_the_failure(user_passes: Any, tmp_path: Path) -> None:
    ep = residual_program()
    before = fingerprint(ep)
    passes = [
        FxPass(user_passes.neg_neg, name="neg-neg"),
        user_passes.Explode(message="relu is not supported by this backend"),
        Decompose(),
    ]
    reproducer = Reproducer(tmp_path / "repros")
    with pytest.raises(PassError) as info:
        PassManager(passes, instruments=[reproducer]).run(ep)
    assert fingerprint(ep) == before
    (where,) = reproducer.written
    assert where == tmp_path / "repros" / "000-explode"
    message = str(info.value)
    assert f"reproducer: {where / 'repro.py'}" in message
    assert sorted(p.name for p in where.iterdir()) == [
        "error.txt", "graph.json", "passes.pkl", "pipeline.txt", "program.pt2", "repro.py",
    ]  # fmt: skip
    # The saved program is the failing pass's input: neg-neg already ran.
    saved = torch.export.load(where / "program.pt2")
    assert sum(n.target is torch.ops.aten.neg.default for n in saved.graph.nodes) == 2
    assert (where / "pipeline.txt").read_text().splitlines() == [
        QUALIFIED_HEADER,
        "user_passes:Explode",
        "epass.passes.decompose:Decompose",
    ]
    done = run_repro(where / "repro.py", tmp_path / "lib")
    assert done.returncode != 0, done.stderr
    assert "epass.errors.PassError" in done.stderr
    # The option given to the pass survived (passes.pkl keeps it).
    assert "relu is not supported by this backend" in done.stderr


def test_repro_falls_back_to_qualified_names(user_passes: Any, tmp_path: Path) -> None:
    ep = residual_program()
    reproducer = Reproducer(tmp_path / "repros")
    with pytest.raises(PassError):
        PassManager([Decompose(), user_passes.Explode()], instruments=[reproducer]).run(ep)
    (where,) = reproducer.written
    (where / "passes.pkl").unlink()
    done = run_repro(where / "repro.py", tmp_path / "lib")
    assert done.returncode != 0
    # Decompose keeps relu, so Explode fails again with its default message.
    assert "relu is not supported here" in done.stderr


@pytest.mark.slow
def test_repro_of_a_failure_in_a_nested_pipeline(user_passes: Any, tmp_path: Path) -> None:
    ep = residual_program()
    inner = PassManager(
        [FxPass(user_passes.neg_neg, name="neg-neg"), FxPass(user_passes.no_meta, name="no-meta")],
        name="inner",
    )
    reproducer = Reproducer(tmp_path / "repros")
    with pytest.raises(PassError) as info:
        PassManager([Decompose(), inner], instruments=[reproducer]).run(ep)
    (where,) = reproducer.written
    assert where.name == "000-inner_no-meta"
    # The note is on the inner error, which the outer message quotes.
    assert f"reproducer: {where / 'repro.py'}" in str(info.value)
    assert "user_passes:no_meta" in (where / "pipeline.txt").read_text()
    done = run_repro(where / "repro.py", tmp_path / "lib")
    assert done.returncode != 0
    assert "SpecViolationError" in done.stderr and "'no-meta'" in done.stderr


def test_unpicklable_passes_still_get_a_pipeline_file(tmp_path: Path) -> None:
    ep = residual_program()

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    reproducer = Reproducer(tmp_path)
    with pytest.raises(PassError, match="boom"):
        PassManager([FxPass(explode, name="explode")], instruments=[reproducer]).run(ep)
    (where,) = reproducer.written
    assert not (where / "passes.pkl").exists()  # a local function does not pickle
    text = (where / "pipeline.txt").read_text()
    assert text.splitlines()[1] == (
        "test_reproducer:test_unpicklable_passes_still_get_a_pipeline_file.<locals>.explode"
    )
    assert "boom" in (where / "error.txt").read_text()


def test_a_reproducer_that_cannot_write_keeps_the_original_error(tmp_path: Path) -> None:
    ep = residual_program()
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    with pytest.raises(PassError) as info:
        PassManager([FxPass(explode, name="explode")], instruments=[Reproducer(blocked)]).run(ep)
    assert type(info.value) is PassError  # not an InstrumentError
    assert "boom" in str(info.value)
    assert "reproducer could not be written" in str(info.value)


def test_a_program_torch_rejects_gets_a_reproducer_too(user_passes: Any, tmp_path: Path) -> None:
    ep = residual_program()
    reproducer = Reproducer(tmp_path)
    # Rebuilding the program runs torch's verifier inside the pass.
    with pytest.raises(PassError, match="SpecViolationError") as info:
        PassManager([FxPass(user_passes.no_meta, name="no-meta")], instruments=[reproducer]).run(ep)
    assert "reproducer:" in str(info.value)
    assert reproducer.written[0].name == "000-no-meta"


def test_pipeline_text_uses_qualified_names_without_a_registry() -> None:
    fmt, text = pipeline_text([Decompose(), FxPass(textwrap.dedent, name="x")])
    assert fmt == "qualified"
    assert text.splitlines()[1:] == ["epass.passes.decompose:Decompose", "textwrap:dedent"]
    assert qualified_name(textwrap.dedent) == "textwrap:dedent"


def test_reproducers_of_later_runs_do_not_overwrite_earlier_ones(tmp_path: Path) -> None:
    ep = residual_program()

    def explode(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    for _ in range(2):
        with pytest.raises(PassError):
            PassManager([FxPass(explode, name="explode")], instruments=[Reproducer(tmp_path)]).run(
                ep
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000-explode", "001-explode"]


def test_instrument_errors_get_no_reproducer(tmp_path: Path) -> None:
    from epass import InstrumentError, NumericsCheck

    ep = residual_program()

    def scale(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.relu.default:
                node.target = torch.ops.aten.neg.default
        return gm

    reproducer = Reproducer(tmp_path)
    check = NumericsCheck(raise_on_drift=True)
    with pytest.raises(InstrumentError) as info:
        PassManager([FxPass(scale, name="relu-to-neg")], instruments=[check, reproducer]).run(ep)
    assert "reproducer" not in str(info.value)
    assert reproducer.written == [] and not list(tmp_path.iterdir())


def test_registered_passes_are_written_as_pipeline_text(tmp_path: Path) -> None:
    from epass.registry import register_pass, unregister_pass

    def refuse(program: Any) -> Any:
        raise RuntimeError("refused by the backend")

    register_pass("refuse-test", lambda: refuse, description="always fails")
    try:
        ep = residual_program()
        reproducer = Reproducer(tmp_path)
        with pytest.raises(PassError, match="refused"):
            PassManager.from_text("decompose, refuse-test, dce", instruments=[reproducer]).run(ep)
        (where,) = reproducer.written
        assert (where / "pipeline.txt").read_text() == "refuse-test, dce\n"
        (where / "passes.pkl").unlink(missing_ok=True)
        done = run_repro(where / "repro.py", tmp_path / "lib")
        # The registration lives in this test process only, so the rerun names it.
        assert done.returncode != 0
        assert "refuse-test" in done.stderr
    finally:
        unregister_pass("refuse-test")


def test_reproducer_handles_pass_instances_without_qualname(tmp_path: Path) -> None:
    """A torch.fx PassBase defined in a function: no __qualname__, not re-importable."""
    from torch.fx.passes.infra.pass_base import PassBase

    class Boom(PassBase):
        def call(self, gm: torch.fx.GraphModule) -> Any:
            raise RuntimeError("boom from a local PassBase")

    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    reproducer = Reproducer(tmp_path / "repros")
    with pytest.raises(PassError) as info:
        PassManager([Boom()], instruments=[reproducer]).run(ep)
    assert "could not be written" not in str(info.value)
    (where,) = reproducer.written
    assert {"program.pt2", "error.txt", "pipeline.txt", "repro.py"} <= {
        p.name for p in where.iterdir()
    }
    assert [p.name for p in (tmp_path / "repros").iterdir()] == [where.name]  # no temp dirs
    script = (where / "repro.py").read_text()
    assert "Boom cannot be re-imported: it is defined inside a function." in script
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(where / "repro.py")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "cannot re-import pass" in proc.stderr and "Traceback" not in proc.stderr


# NUL, terminal escapes (ESC, CSI, OSC, BEL), C1 controls, line and paragraph
# separators, lone surrogates, quotes and backslashes that could end the docstring.
ODD_MESSAGE = (
    "bad\x00byte \x1b]0;title\x07 \x1b[2J \x9b31m \x85 \u2028 \ud800 \r\x0c "
    '""" \'\'\' \\N{x} \\ {curly} "'
)


def test_repro_runs_when_the_error_message_holds_odd_characters(
    user_passes: Any, tmp_path: Path
) -> None:
    ep = residual_program()
    reproducer = Reproducer(tmp_path / "repros")
    with pytest.raises(PassError):
        PassManager([user_passes.Explode(message=ODD_MESSAGE)], instruments=[reproducer]).run(ep)
    (where,) = reproducer.written
    text = (where / "repro.py").read_text("utf-8")
    compile(text, "repro.py", "exec")
    assert "\x00" not in text and "\x1b" not in text
    assert "bad\\x00byte" in text  # escaped, still readable
    error = (where / "error.txt").read_text("utf-8")
    assert "bad\\x00byte \\x1b]0;title\\x07" in error  # escaped, as on a terminal
    assert all(c.isprintable() for line in error.split("\n") for c in line)
    done = run_repro(where / "repro.py", tmp_path / "lib")
    assert done.returncode != 0
    assert "epass.errors.PassError" in done.stderr and "SyntaxError" not in done.stderr


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF)))
def test_any_error_message_gives_a_repro_script_that_compiles(message: str) -> None:
    assert eval('"""' + docstring_text(message) + '"""') == message
    source = script(message, message)
    code = compile(source, "repro.py", "exec")
    assert code.co_consts[0].startswith("Reproduce an epass pass failure.")
    source.encode("utf-8")  # no lone surrogate left to break writing the file


class Norms(torch.nn.Module):
    """Layer norms, whose decomposed form calls native_layer_norm (three outputs,
    one used), and a cond, whose operands torch reads back as a list."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.LayerNorm(8)
        self.b = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        return torch.cond(y.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (y,))


class Refuse:
    """Fails on any program, after noting the nodes of the program it was given."""

    name = "refuse"
    changes_input = False

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        self.seen = graph_listing(ep)
        raise RuntimeError("refused")


def test_the_reproducer_loads_back_the_failing_program_node_for_node(tmp_path: Path) -> None:
    ep = torch.export.export(Norms().eval(), (torch.randn(2, 8),))
    refuse = Refuse()
    reproducer = Reproducer(tmp_path)
    with pytest.raises(PassError, match="refused"):
        PassManager([Decompose(), refuse], instruments=[reproducer]).run(ep)
    (where,) = reproducer.written
    plain = torch.export.load(where / "program.pt2")
    # torch's loader adds a getitem for every unused output of native_layer_norm,
    # and reads cond's operands back as a list.
    assert graph_listing(plain) != refuse.seen
    assert len(plain.graph.nodes) == len(refuse.seen["<root>"]) + 4
    loaded, differences = load_program(where)
    assert differences == []
    assert graph_listing(loaded) == refuse.seen
    x = torch.randn(2, 8)
    assert torch.allclose(loaded.module()(x), plain.module()(x))


def test_load_program_says_what_still_differs(tmp_path: Path) -> None:
    ep = residual_program()
    save_program(ep, tmp_path)
    listing = json.loads((tmp_path / GRAPH_FILE).read_text())
    listing["<root>"][-2][2] = "aten.gelu.default"  # as if the saved program had a gelu there
    (tmp_path / GRAPH_FILE).write_text(json.dumps(listing))
    _, differences = load_program(tmp_path)
    assert differences[0] == "graph <root>: 9 nodes saved, 9 loaded"
    assert differences[1] == (
        "  node 7: saved linear_1 call_function aten.gelu.default, "
        "loaded linear_1 call_function aten.linear.default"
    )
    assert listing_differences({"g": [["a"]]}, {"g": [["a"]]}) == []


def test_repro_imports_the_module_that_registered_a_pass(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "registers_wrapped.py").write_text(
        "import epass\nfrom epass import Decompose\nfrom epass.protocol import NamedPass\n\n\n"
        "@epass.register_pass('wrapped-decompose-test')\n"
        "def make():\n"
        "    return NamedPass('wrapped-decompose-test', Decompose())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import registers_wrapped  # noqa: F401

    from epass import registry
    from epass.instruments.reproducer import _modules

    try:
        passes = PassManager.from_text("wrapped-decompose-test").passes
        # The pass is epass's own Decompose: only the registry knows the module.
        assert _modules(passes, ()) == ["registers_wrapped"]
    finally:
        registry.unregister_pass("wrapped-decompose-test")
        sys.modules.pop("registers_wrapped", None)

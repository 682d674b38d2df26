"""The first diverging node: NumericsCheck names the node of a drifting pass's input
whose values part first, with its source line and the nodes it became; the CLI's
numerics line, the JSON report and the HTML verdict say it too."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fingerprint import fingerprint
from test_instruments import export_residual
from test_rewrites import fast_gelu, widths

import epass
from epass import Decompose, FxPass, PassManager, registry
from epass.cli import main
from epass.instruments.divergence import (
    HANDLE,
    first_divergence,
    node_values,
    rerun_tagged,
    tagged,
)
from epass.passes import ReplaceOps

aten = torch.ops.aten


def block() -> torch.export.ExportedProgram:
    return export_residual()[1]


def add_to_sub(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.target is aten.add.Tensor:
            node.target = aten.sub.Tensor
    return gm


def test_a_retargeted_node_is_named_with_its_source_line() -> None:
    ep = block()
    before = fingerprint(ep)
    check = epass.NumericsCheck(rtol=1e-5, atol=1e-6)
    PassManager([Decompose(), FxPass(add_to_sub, name="add-to-sub")], instruments=[check]).run(ep)
    drift = check.first_drift
    assert drift is not None and drift.path == "add-to-sub" and drift.node is not None
    node = drift.node
    assert (node.node, node.op, node.compared) == ("add", "aten.add.Tensor", "add")
    assert node.became == ("add (aten.sub.Tensor)",)
    assert node.source.endswith("in forward: return x + self.lin2(torch.relu(self.lin1(x)))")
    assert node.source.startswith("test_instruments.py:")
    assert node.max_abs == pytest.approx(drift.max_abs)
    assert check.report().splitlines()[-1] == f"first diverging node: {node}"
    assert fingerprint(ep) == before


def test_a_one_node_bug_in_a_multi_node_rewrite_is_found_at_that_node() -> None:
    _, ep, _ = widths()
    check = epass.NumericsCheck(rtol=1e-3, atol=1e-3)
    passes = [Decompose(keep=[aten.gelu.default]), ReplaceOps({aten.gelu.default: fast_gelu})]
    PassManager(passes, instruments=[check]).run(ep)
    drift = check.first_drift
    assert drift is not None and drift.path == "replace-ops" and drift.node is not None
    node = drift.node
    assert (node.node, node.op) == ("gelu_1", "aten.gelu.default")
    assert "x = nn.functional.gelu(self.b(x))" in node.source
    assert any("aten.sigmoid" in b for b in node.became)
    assert node.max_abs > 0.01


def _bad_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """linear, decomposed; wrong (the bias left out) for 32 output features only."""
    out = torch.mm(x, w.t())
    if b is not None and w.shape[0] != 32:
        out = out + b
    return out


def test_a_bad_decomposition_of_one_node_on_the_incremental_path() -> None:
    _, ep, _ = widths()
    check = epass.NumericsCheck(rtol=1e-4, atol=1e-5)
    decompose = Decompose(table={aten.linear.default: _bad_linear}, method="incremental")
    result = PassManager([decompose], instruments=[check])(ep)
    assert result.records[0].notes["method"] == "incremental"
    drift = check.first_drift
    assert drift is not None and drift.node is not None
    assert (drift.node.node, drift.node.op) == ("linear_1", "aten.linear.default")
    assert "self.b(x)" in drift.node.source
    assert any("aten.mm" in b for b in drift.node.became)


def test_localize_off_leaves_the_node_out() -> None:
    check = epass.NumericsCheck(rtol=1e-5, atol=1e-6, localize=False)
    PassManager([FxPass(add_to_sub, name="add-to-sub")], instruments=[check]).run(block())
    assert check.first_drift is not None and check.first_drift.node is None


def test_tagging_copies_and_leaves_the_program_alone() -> None:
    ep = block()
    before = fingerprint(ep)
    copy = tagged(ep)
    assert all(n.meta["custom"][HANDLE] == n.name for n in copy.graph.nodes)
    assert all(HANDLE not in n.meta.get("custom", {}) for n in ep.graph.nodes)
    assert copy.state_dict["lin1.weight"] is ep.state_dict["lin1.weight"]
    assert fingerprint(ep) == before


def test_node_values_and_no_divergence_between_equal_programs() -> None:
    ep = block()
    x = (torch.randn(4, 8),)
    values = node_values(ep, x)
    assert torch.equal(values["x"], x[0])
    assert torch.allclose(values["add"], ep.module()(*x))
    decomposed = Decompose().__call__(tagged(ep)).program
    assert first_divergence(ep, decomposed, x) is None


def planted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, retarget: str, program: Any
) -> Iterator[Path]:
    """A module registering the pass ``name`` that retargets calls as ``retarget``
    says (``"tanh <- mul: sigmoid"``: tanh fed by a mul becomes sigmoid), importable
    from ``tmp_path``, the working folder, where ``program`` is saved as ``p.pt2``."""
    target, _, new = retarget.partition(": ")
    op, _, source = target.partition(" <- ")
    fed = f" and n.args[0].target is aten.{source}.Tensor" if source else ""
    (tmp_path / "planted_passes.py").write_text(
        "import torch\nimport epass\n\naten = torch.ops.aten\n\n\n"
        f"@epass.register_pass({name!r})\n"
        "def planted(ep):\n"
        "    for n in ep.graph.nodes:\n"
        f"        if n.target is aten.{op}{fed}:\n"
        f"            n.target = aten.{new}\n"
        "    ep.graph_module.recompile()\n"
        "    return ep\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    torch.export.save(program, tmp_path / "p.pt2")
    yield tmp_path
    registry.unregister_pass(name)
    sys.modules.pop("planted_passes", None)


@pytest.fixture
def drift_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from planted(tmp_path, monkeypatch, "add-to-sub-test", "add.Tensor: sub.Tensor", block())


def test_the_cli_line_the_json_report_and_the_html_verdict_name_the_node(
    drift_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--plain", "run", "p.pt2", "--import", "planted_passes", "-p", "add-to-sub-test"]
    argv += ["--check-numerics", "--report"]
    assert main([*argv, "r.json"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("numerics: first diverging node:"))
    assert "add (aten.add.Tensor)" in line and "became add (aten.sub.Tensor)" in line
    report = json.loads((drift_module / "r.json").read_text())
    node = report["numerics"]["first_node"]
    assert (node["node"], node["op"], node["became"]) == (
        "add",
        "aten.add.Tensor",
        ["add (aten.sub.Tensor)"],
    )
    assert report["verdict"]["node"].startswith("add (aten.add.Tensor)")
    assert main([*argv, "r.html"]) == 1
    page = (drift_module / "r.html").read_text()
    assert "first diverging node: <code>add (aten.add.Tensor)" in page


# --- a pass that writes into the weights when it runs again -----------------------------


class DriftThenWrite:
    """Drifts the first time (add becomes sub); run again, it writes into every
    weight it is given, past ``_version`` and through it, and raises."""

    name = "drift-then-write"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ep: torch.export.ExportedProgram) -> Any:
        self.calls += 1
        if self.calls == 1:
            add_to_sub(ep.graph_module)
            ep.graph_module.recompile()
            return ep
        with torch.no_grad():
            for t in [*ep.state_dict.values(), *ep.constants.values()]:
                t.data.add_(7)
                t.add_(1)
        raise RuntimeError("the second run gave up")


def test_localizing_a_drift_never_lets_the_pass_write_into_the_users_weights() -> None:
    ep = block()
    before = fingerprint(ep)
    hostile = DriftThenWrite()
    check = epass.NumericsCheck(rtol=1e-5, atol=1e-6)
    PassManager([hostile], instruments=[check]).run(ep)
    assert hostile.calls == 2  # it ran again, to localize the drift
    drift = check.first_drift
    assert drift is not None and drift.node is not None and drift.node.node == "add"
    assert fingerprint(ep) == before


def test_a_pass_run_again_on_a_tagged_copy_writes_into_tensors_of_its_own() -> None:
    ep = block()
    before = fingerprint(ep)
    hostile = DriftThenWrite()
    hostile.calls = 1
    with pytest.raises(epass.PassError, match=r"drift-then-write.*wrote in place"):
        rerun_tagged(hostile, ep)
    assert fingerprint(ep) == before

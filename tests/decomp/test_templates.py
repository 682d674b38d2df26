"""``epass._decomp.templates``: templates found in memory, on disk (in a new process,
with the retrace's result, whatever lies in the directory) or traced; the caches'
public view; the estimates ``method="auto"`` weighs."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import models
import pytest
import torch
from decomp_helpers import ROOT, entry_paths, run_script

import epass
from epass import Decompose
from epass._decomp import disk, state, templates
from epass._decomp.check import first_difference
from epass._decomp.table import split_table
from epass.passes import decompose as decompose_module

aten = torch.ops.aten


def test_template_cache_is_bounded_and_reused():
    templates.clear_memory()
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    first = templates.memory_info()
    assert first["misses"] > 0 and first["size"] <= first["maxsize"]
    Decompose(method="incremental")(ep)
    second = templates.memory_info()
    assert second["misses"] == first["misses"]  # every template came from the cache
    assert second["hits"] > first["hits"]


# Decomposes zoo programs and prints, per program, the first difference from the
# retrace and the decomposed graph's code, plus this process's disk cache counters.
_ZOO_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "tests")
    import models
    from epass import Decompose
    from epass._decomp import disk, state
    from epass._decomp.check import first_difference
    result = {}
    for name in sys.argv[1].split(","):
        for dynamic in (False, True):
            _, ep, _ = models.export(name, dynamic=dynamic)
            out = Decompose()(ep)
            ref = state.run_decompositions(ep)[0]
            result[f"{name}/{dynamic}"] = [
                out.notes["method"], first_difference(out.program, ref),
                out.program.graph_module.code,
            ]
    print(json.dumps({"programs": result, "disk": disk.info()}))
    """
)


def _check_zoo(names: str, cache: Path) -> None:
    cold = run_script(_ZOO_SCRIPT, cache, names)
    # The directory starts empty: what the cold run loads, a program before it wrote
    # (templates in memory belong to one program's fake mode; a lifted constant's
    # static template serves the dynamic program too).
    assert cold["disk"]["writes"] > 0 and cold["disk"]["hits"] < cold["disk"]["writes"]
    assert cold["disk"]["rejected"] == 0
    warm = run_script(_ZOO_SCRIPT, cache, names)
    assert warm["disk"]["hits"] > 0 and warm["disk"]["rejected"] == 0
    for key, (method, difference, code) in warm["programs"].items():
        assert difference is None, key  # disk-loaded templates give torch's program
        assert cold["programs"][key][0] == method, key
        assert cold["programs"][key][2] == code, key  # and the in-memory path's


def test_templates_loaded_in_a_new_process_give_the_retrace(tmp_path):
    _check_zoo("mlp,transformer", tmp_path / "cache")


@pytest.mark.slow
def test_every_zoo_program_from_disk_equals_the_retrace(tmp_path):
    _check_zoo(",".join(models.CASES), tmp_path / "cache")


def test_two_processes_filling_one_directory_leave_it_sound(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "EPASS_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ZOO_SCRIPT, "transformer,convbn"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        for key, (_, difference, _) in json.loads(out.splitlines()[-1])["programs"].items():
            assert difference is None, key
    assert not [n for n in os.listdir(cache / f"templates-v{disk.FORMAT}") if n.endswith(".tmp")]
    third = run_script(_ZOO_SCRIPT, cache, "transformer,convbn")
    assert third["disk"]["rejected"] == 0 and third["disk"]["writes"] == 0
    assert third["disk"]["hits"] > 0


def _rewrite(path: Path, change) -> None:
    entry = json.loads(path.read_text())
    change(entry)
    body = json.dumps(entry["template"], sort_keys=True, separators=(",", ":"))
    entry["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    path.write_text(json.dumps(entry))


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hostile_and_broken_entries_are_ignored_with_one_warning(cache, tmp_path):
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    entries = entry_paths(cache)
    assert len(entries) >= 8
    marker = tmp_path / "marker"

    def target(name):
        def change(entry):
            entry["template"]["nodes"][0]["target"] = name

        return change

    entries[0].write_bytes(pickle.dumps(_Marker(str(marker))))
    entries[1].write_text(entries[1].read_text()[:40])  # truncated
    _rewrite(entries[2], lambda e: e.update(format=0))
    _rewrite(entries[3], lambda e: e["key"].update(op="aten.add.Tensor"))
    _rewrite(entries[4], target("aten.no_such_op.default"))
    _rewrite(entries[5], target("builtins.exec"))
    _rewrite(entries[6], target("os.system"))

    def save(entry):
        node = entry["template"]["nodes"][0]
        node.update(target="aten.save.default", args={"tuple": [{"ref": 0}, str(marker)]})

    _rewrite(entries[7], save)  # would write the marker if called
    templates.clear_memory()
    before = disk.info()["rejected"]  # the process's count, whatever ran before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = Decompose(method="incremental")(ep).program
    mine = [w for w in caught if "template cache" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert not marker.exists()  # nothing in the entries ran
    assert first_difference(out, state.run_decompositions(ep)[0]) is None
    assert disk.info()["rejected"] - before == 8
    # Rejected entries were rebuilt: the next process finds sound ones.
    for path in entries[:8]:
        assert json.loads(path.read_text())["format"] == disk.FORMAT


def test_public_cache_info_and_clear_cover_memory_and_disk(cache):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    info = epass.cache_info()
    assert info["memory"]["size"] > 0 and info["disk"]["entries"] > 0
    assert info["disk"]["directory"] == str(cache)
    epass.clear_cache()
    info = epass.cache_info()
    assert info["memory"]["size"] == 0 and info["disk"]["entries"] == 0


def test_auto_decomposes_a_cold_program_incrementally_with_one_batch(cache):
    _, ep, _ = models.export("transformer")
    tables = split_table(None)
    batched, alone, nodes = templates.template_work(ep, tables)
    assert batched > 1 and alone == 0 and nodes == len(ep.graph.nodes)
    result = Decompose()(ep)  # a batched trace costs less than the retrace
    assert result.notes["method"] == "incremental"
    decision = result.notes["decision"]
    assert decision.startswith(f"incremental: {batched} templates to trace ({batched} in one")
    assert f"against a retrace of {nodes} nodes" in decision
    assert templates.missing_templates(ep, tables)[0] == 0


def test_auto_says_why_it_went_either_way_and_only_when_it_weighed(cache):
    _, ep, _ = models.export("mlp")
    for method in ("incremental", "retrace"):  # nothing to weigh
        assert "decision" not in Decompose(method=method)(ep).notes
    again = Decompose()(ep)  # the incremental run traced every template
    assert again.notes["method"] == "incremental"
    assert again.notes["decision"] == (
        "incremental: every template it needs is in memory or on disk"
    )


def test_auto_retraces_when_tracing_would_cost_more_and_fills_what_fits(cache, monkeypatch):
    _, ep, _ = models.export("transformer")
    tables = split_table(None)
    missing, nodes = templates.missing_templates(ep, tables)
    assert missing > 3 and nodes == len(ep.graph.nodes)
    # A batch of every template costs far more than the retrace's estimate, of which
    # the retrace leaves about 3 templates' worth for the fill.
    monkeypatch.setattr(decompose_module, "_SESSION_SECONDS", 0.0)
    monkeypatch.setattr(decompose_module, "_BATCH_SECONDS", 0.0)
    monkeypatch.setattr(decompose_module, "_BATCH_TEMPLATE_SECONDS", 100.0)
    monkeypatch.setattr(decompose_module, "_RETRACE_SECONDS", 350.0)
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    decision = result.notes["decision"]
    assert decision.startswith(f"retrace: {missing} templates to trace ({missing} in one batch")
    assert f"then traced 3 of {missing} templates for next time" in decision
    assert templates.missing_templates(ep, tables)[0] == missing - 3


def test_auto_weighs_a_retrace_of_symbolic_sizes_at_its_own_cost_per_node(cache):
    # A retrace propagates every symbolic size again: about twice the seconds per
    # node (decompose.py's cost model, measured).
    for dynamic, per_node in (
        (False, decompose_module._RETRACE_NODE_SECONDS),
        (True, decompose_module._RETRACE_SYMBOLIC_NODE_SECONDS),
    ):
        _, ep, _ = models.export("transformer", dynamic=dynamic)
        decision = Decompose()(ep).notes["decision"]
        retrace = decompose_module._RETRACE_SECONDS + len(ep.graph.nodes) * per_node
        assert f"(about {retrace:.2f} s)" in decision
    assert decompose_module._RETRACE_SYMBOLIC_NODE_SECONDS > decompose_module._RETRACE_NODE_SECONDS


def test_auto_fills_nothing_when_the_retrace_leaves_no_time(cache, monkeypatch):
    _, ep, _ = models.export("transformer")
    tables = split_table(None)
    missing, _ = templates.missing_templates(ep, tables)
    with monkeypatch.context() as m:
        m.setattr(decompose_module, "_BATCH_TEMPLATE_SECONDS", 1000.0)
        m.setattr(decompose_module, "_RETRACE_SECONDS", 0.0)
        m.setattr(decompose_module, "_RETRACE_NODE_SECONDS", 0.0)
        result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "traced nothing for next time" in result.notes["decision"]
    assert templates.missing_templates(ep, tables)[0] == missing  # nothing was traced
    again = Decompose()(ep)  # with the real estimates the batch is cheaper
    assert again.notes["method"] == "incremental"
    assert again.notes["decision"].startswith(f"incremental: {missing} templates to trace")


def test_auto_keeps_the_fallback_reason_of_a_program_it_cannot_rewrite(cache, monkeypatch):
    _, ep, _ = models.export("seed")  # a buffer mutated in place
    monkeypatch.setattr(decompose_module, "_TRACE_SECONDS", 1000.0)
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "a write into input b_count" in result.notes["fallback"]
    assert "decision" not in result.notes  # nothing to weigh: the fallback says why


def test_an_entry_whose_result_does_not_match_the_operator_is_rejected_and_rebuilt(cache):
    # Well-formed, with the right checksum, but not what the operator returns: its
    # result has another structure, or another shape than the operator's.
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    ops = {p: json.loads(p.read_text())["key"]["op"] for p in entry_paths(cache)}
    linear = next(p for p, op in ops.items() if op == "aten.linear.default")
    transpose = next(p for p, op in ops.items() if op == "aten.transpose.int")
    _rewrite(linear, lambda e: e["template"].update(output={"ref": 1}))  # the weight
    _rewrite(transpose, lambda e: e["template"].update(output={"list": []}))
    templates.clear_memory()
    before = disk.info()["rejected"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Decompose(method="incremental")(ep)
    assert len([w for w in caught if "template cache" in str(w.message)]) == 1
    assert disk.info()["rejected"] - before == 2
    assert result.notes["method"] == "incremental"
    assert first_difference(result.program, state.run_decompositions(ep)[0]) is None
    for path in (linear, transpose):  # rebuilt
        assert json.loads(path.read_text())["template"]["output"] != {"list": []}


@pytest.mark.parametrize("name", ["mlp", "transformer", "convbn"])
def test_a_filled_cache_serves_torchs_default_table_without_building_its_split(cache, name):
    # Building torch's split walks every operator torch knows; a process whose
    # templates are all on disk has no trace to run and so no use for it.
    _, ep, _ = models.export(name)
    first = Decompose()(ep)
    templates.clear_memory()  # a new process: templates and splits forgotten, disk kept
    again = Decompose()(ep)
    assert again.notes["method"] == "incremental"
    assert Decompose()._tables().cia.split.built is None
    assert first_difference(again.program, first.program) is None


_RESHAPE_SCRIPT = """
import json, torch
from epass import Decompose
from epass._decomp import tracing
from epass._decomp.check import first_difference
aten = torch.ops.aten

class M(torch.nn.Module):
    def forward(self, x):
        return x.reshape(2, -1) * 2

# A table without torch's _unsafe_view entry, as the ONNX exporter's.
table = {aten.hardtanh.default: torch._decomp.decomposition_table[aten.hardtanh.default]}
ep = torch.export.export(M(), (torch.randn(4, 3).t(),))
traced = []
real = tracing.trace
tracing.trace = lambda op, *a, **k: traced.append(str(op)) or real(op, *a, **k)
result = Decompose(table)(ep)
print(json.dumps({
    "method": result.method,
    "traced": traced,
    "same": first_difference(result.program, ep.run_decompositions(table)) is None,
    "targets": [str(n.target) for n in result.program.graph.nodes if n.op == "call_function"],
}))
"""


def test_a_reshape_left_as_unsafe_view_splices_and_a_new_process_reads_it_from_disk(cache):
    """``reshape`` of a non-contiguous tensor decomposes to ``clone`` and
    ``_unsafe_view``, which functionalization emits as itself: under a table without
    torch's ``_unsafe_view`` entry (the ONNX exporter's) that is the retrace's program,
    spliced, not refused; kept on disk, a new process traces nothing."""
    first = run_script(_RESHAPE_SCRIPT, cache)
    assert first["method"] == "incremental"
    assert first["traced"] == ["aten.reshape.default"]
    assert "aten._unsafe_view.default" in first["targets"]
    assert first["same"]
    assert entry_paths(cache)
    again = run_script(_RESHAPE_SCRIPT, cache)
    assert again == {**first, "traced": []}


def test_a_write_through_a_reshape_made_as_unsafe_view_keeps_the_retrace(cache):
    """Written through, an ``_unsafe_view`` is a view functionalization writes back
    into what it views; the engine does not mirror that, and says so."""

    class M(torch.nn.Module):
        def forward(self, x):
            y = x.reshape(2, -1)
            y[0].add_(1)
            return y

    table = {aten.hardtanh.default: torch._decomp.decomposition_table[aten.hardtanh.default]}
    ep = torch.export.export(M(), (torch.randn(4, 3).t(),))
    result = Decompose(table, check=True)(ep)
    assert result.method == "retrace"
    assert "_unsafe_view" in (result.fallback or "")

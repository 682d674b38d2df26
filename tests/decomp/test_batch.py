"""``epass._decomp.batch``: one batched trace for all of a program's missing templates:
each template it gives is the one its own trace gives, and what it cannot tell apart
is traced alone."""

from __future__ import annotations

import re

import models
import pytest
import torch

from epass import Decompose
from epass._decomp import batch, keys, safety, templates, tracing
from epass._decomp.table import split_table
from epass.errors import IncrementalDecompositionError

aten = torch.ops.aten

# Programs whose templates are compared: the zoo of tests/models.py that the
# incremental path takes, a 3-layer encoder, and dynamic-batch programs.
PROGRAMS = [
    ("no_constants", False),
    ("mlp", False),
    ("convbn", False),
    ("transformer", False),
    ("encoder", False),
    ("mlp", True),
    ("convbn", True),
    ("transformer", True),
]


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPASS_CACHE_DIR", str(tmp_path / "cache"))
    templates.clear_memory()
    yield
    templates.clear_memory()


def _export(name: str, dynamic: bool) -> torch.export.ExportedProgram:
    if name == "encoder":
        torch.manual_seed(0)
        module = models.transformer_encoder(layers=3, d_model=16, nhead=2).eval()
        return torch.export.export(module, (torch.randn(2, 4, 16),))
    return models.export(name, dynamic=dynamic)[1]


def _describe(template) -> tuple:
    """Everything of a template the splice and the disk cache read."""
    nodes = []
    for node in template.graph.nodes:
        meta = {}
        for field, value in node.meta.items():
            if field in ("seq_nr", "tensor_meta"):
                continue  # the tracer's counters; never read from a template
            if field == "val":
                meta[field] = keys.describe_val(value)
            else:
                # from_node names the blank meta's graph by its id: one per trace
                meta[field] = re.sub(r"graph_id=\d+", "", repr(value))
        nodes.append(
            (
                node.name,
                node.op,
                str(node.target),
                repr(node.args),
                repr(node.kwargs),
                repr(node.type),
                sorted(meta.items()),
                template.inherited.get(node),
                repr(template.own.get(node)),
            )
        )
    return template.graph.python_code("self").src, nodes, template.n_inputs


def _both_ways(ep, tables, calls):
    fake_mode = keys.fake_mode_of(ep)
    session = templates.Session(tables)
    try:
        batched = batch.trace_batch(calls, tables, fake_mode, session.overrides)
        single = {}
        for c in calls:
            try:
                single[c.key] = tracing.trace(
                    c.op, c.args, c.kwargs, c.values, c.grads, tables, fake_mode, session.overrides
                )
            except safety.Fallback as exc:
                single[c.key] = exc
    finally:
        session.close()
    return batched, single


@pytest.mark.parametrize(("name", "dynamic"), PROGRAMS)
def test_batched_templates_are_the_templates_traced_one_at_a_time(name, dynamic):
    ep = _export(name, dynamic)
    tables = split_table(None)
    calls, _, _ = templates.pending_calls(ep, tables, templates.Session(tables))
    assert calls
    batched, single = _both_ways(ep, tables, calls)
    for call in calls:
        if call.key in batched:
            assert not isinstance(single[call.key], Exception), call.op
            assert _describe(batched[call.key]) == _describe(single[call.key]), call.op
    if not dynamic:
        # Nothing of a static program is left to trace alone.
        assert set(batched) == {c.key for c in calls}


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_calls_sharing_symbols_are_left_out_of_the_batch(name, monkeypatch):
    # Each fresh input of a dynamic program carries the program's symbols; their size
    # nodes would be shared between calls, so no part of the graph is one call's own.
    ep = _export(name, dynamic=True)
    tables = split_table(None)
    calls, _, _ = templates.pending_calls(ep, tables, templates.Session(tables))
    assert calls and not any(batch.batchable(c) for c in calls)
    batched = []
    trace_batch = batch.trace_batch

    def record(calls, *rest):
        batched.extend(calls)
        return trace_batch(calls, *rest)

    monkeypatch.setattr(batch, "trace_batch", record)
    templates.clear_memory()
    result = Decompose(method="incremental")(ep)
    assert result.notes["method"] == "incremental"
    assert batched == []  # every symbolic template was traced on its own


@pytest.mark.parametrize(("name", "dynamic"), PROGRAMS)
def test_a_batched_decomposition_equals_the_retrace(name, dynamic, monkeypatch):
    ep = _export(name, dynamic)
    tables = split_table(None)
    calls, _, _ = templates.pending_calls(ep, tables, templates.Session(tables))
    batchable = sum(batch.batchable(c) for c in calls)
    alone = []
    trace = tracing.trace
    monkeypatch.setattr(tracing, "trace", lambda op, *a: alone.append(op) or trace(op, *a))
    result = Decompose(check=True)(ep)  # raises on any difference from the retrace
    assert result.notes["method"] == "incremental" and result.notes["checked"]
    # The batch traced every static template; only symbolic ones (and those whose key
    # changed after an upstream rewrite) were traced alone.
    assert len(alone) <= len(calls) - (batchable if batchable > 1 else 0)
    if not dynamic and batchable > 1:
        assert alone == []


def _sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def _relu_with_a_factory(x):
    # The zero is a factory op: a node with no inputs, which belongs to this call.
    return torch.maximum(x, torch.zeros((), dtype=x.dtype))


def _relu_with_a_constant(x):
    return x * torch.tensor(2.0)


class _Two(torch.nn.Module):
    def forward(self, x):
        return x.sigmoid() + x.relu()


def test_a_factory_op_belongs_to_the_call_that_created_it():
    ep = torch.export.export(_Two(), (torch.randn(3, 4),))
    tables = split_table({aten.sigmoid.default: _sigmoid, aten.relu.default: _relu_with_a_factory})
    calls, _, _ = templates.pending_calls(ep, tables, templates.Session(tables))
    assert [c.op for c in calls] == [aten.sigmoid.default, aten.relu.default]
    batched, single = _both_ways(ep, tables, calls)
    assert set(batched) == {c.key for c in calls}
    relu = batched[calls[1].key]
    assert any(not n.all_input_nodes for n in relu.graph.nodes if n.op == "call_function")
    for call in calls:
        assert _describe(batched[call.key]) == _describe(single[call.key])


def test_a_template_failing_a_check_is_left_out_and_keeps_its_fallback_reason():
    ep = torch.export.export(_Two(), (torch.randn(3, 4),))
    table = {aten.sigmoid.default: _sigmoid, aten.relu.default: _relu_with_a_constant}
    tables = split_table(table)
    calls, _, _ = templates.pending_calls(ep, tables, templates.Session(tables))
    batched, single = _both_ways(ep, tables, calls)
    assert set(batched) == {calls[0].key}  # the sigmoid's template is kept
    assert "creates constants" in single[calls[1].key].reason
    # The decomposition traces it alone, and gives today's reason.
    with pytest.raises(IncrementalDecompositionError, match="creates constants"):
        Decompose(table=table, method="incremental")(ep)


def test_fill_keeps_the_batched_templates_for_the_next_decomposition(monkeypatch):
    ep = _export("transformer", False)
    tables = split_table(None)
    missing, _ = templates.missing_templates(ep, tables)
    assert templates.fill(ep, tables, limit=3) == 3
    assert templates.missing_templates(ep, tables)[0] == missing - 3
    assert templates.fill(ep, tables) == missing - 3
    assert templates.missing_templates(ep, tables)[0] == 0
    templates.clear_memory()
    assert templates.missing_templates(ep, tables)[0] == 0  # each on disk, under its key
    monkeypatch.setattr(tracing, "trace", None)  # nothing may be traced now
    assert Decompose(method="incremental", check=True)(ep).notes["checked"]

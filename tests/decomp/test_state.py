"""``epass._decomp.state``: Decompose from several threads at once: every output is the
single-thread output, no input changes, and torch's global state is as before once the
threads end."""

from __future__ import annotations

import gc
import threading
import time

import models
import torch
from fingerprint import fingerprint, node_meta_fingerprint
from torch import nn
from torch.export import Dim

from epass import Decompose
from epass._decomp import splice, templates
from epass._decomp.check import first_difference
from epass._decomp.state import LOCK
from epass._decomp.table import split_table

aten = torch.ops.aten
ROUNDS = 20


def _relu_by_mask(x):
    return aten.mul.Tensor(x, aten.gt.Scalar(x, 0))


class _Multi(nn.Module):
    def forward(self, x):
        values, _ = torch.topk(x, 2)
        var, mean = torch.var_mean(x, dim=1)
        return nn.functional.silu(values).sum(1) + var * mean


def _jobs():
    """(name, program, pass) per thread: different models, keep lists and tables,
    static and dynamic."""
    _, mlp, _ = models.export("mlp")
    _, encoder, _ = models.export("transformer", dynamic=True)
    _, convbn, _ = models.export("convbn")
    x = torch.randn(4, 6)
    multi = torch.export.export(_Multi(), (x,), dynamic_shapes=({0: Dim("b", min=2)},))
    return [
        ("mlp", mlp, dict(keep=[aten.linear.default])),
        ("encoder-dynamic", encoder, dict()),
        ("convbn", convbn, dict(table={aten.relu.default: _relu_by_mask})),
        ("multi-dynamic", multi, dict(keep=[aten.silu.default])),
    ]


def _touched_ops():
    tables = split_table(None)
    return sorted({*tables.cia, *tables.python}, key=str)


def _torch_state(ops):
    from torch._subclasses import fake_impls

    kernels = {str(op): sorted((str(k), id(v)) for k, v in op.py_kernels.items()) for op in ops}
    return {
        "kernels": kernels,
        "fake rules": sorted(
            (str(k), id(v)) for k, v in fake_impls.op_implementations_dict.items()
        ),
        "fake checks": [(id(c), id(i)) for c, i in fake_impls.op_implementations_checks],
        "preserve meta": torch.fx.traceback.has_preserved_node_meta(),
        "current meta": dict(torch.fx.traceback.get_current_meta()),
        "exporting": torch.compiler.is_exporting(),
    }


def _sources(node_sources):
    for source in node_sources or ():
        yield source
        yield from _sources(getattr(source, "from_node", None))


def _epass_meta(ep):
    """Meta that only an epass template could have put there."""
    found = []
    for node in ep.graph.nodes:
        for key, value in node.meta.items():
            if type(value).__module__.startswith("epass"):
                found.append((node.name, key, value))
        for source in _sources(node.meta.get("from_node")):
            if source.name == "blank" or "epass" in repr(source.graph_id):
                found.append((node.name, "from_node", source.name))
    return found


class _Probe(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(nn.functional.linear(x, torch.ones(3, 3))) + x.softmax(-1)


def test_threads_decomposing_different_programs_match_one_thread():
    jobs = _jobs()
    probe_args = (torch.randn(2, 3),)
    before_export = torch.export.export(_Probe(), probe_args)
    ops = _touched_ops()
    state = _torch_state(ops)
    # Outputs of one thread (each thread runs once in check mode, against torch).
    expected = {name: Decompose(**options)(ep).program for name, ep, options in jobs}
    assert _torch_state(ops) == state
    prints = {name: (fingerprint(ep), node_meta_fingerprint(ep)) for name, ep, _ in jobs}
    failures: list[str] = []
    start = threading.Barrier(len(jobs))

    def work(index, name, ep, options):
        try:
            start.wait()
            for round in range(ROUNDS):
                if round == 4 * index + 1 and index % 2 == 0:
                    templates.clear_memory()  # trace again while the others splice
                # Once per thread in check mode: both paths, and torch's retrace.
                check = round == 2 * index
                # The incremental path, which splices in each thread while the others
                # do (auto could choose the retrace, which would test nothing here).
                out = Decompose(method="incremental", check=check, **options)(ep).program
                # (Node names are not compared: a template's names depend on what
                # was traced before it in the process.)
                difference = first_difference(out, expected[name])
                if difference is not None:
                    failures.append(f"{name} round {round}: {difference}")
                if (fingerprint(ep), node_meta_fingerprint(ep)) != prints[name]:
                    failures.append(f"{name} round {round}: the input changed")
        except Exception as exc:  # reported in the main thread
            failures.append(f"{name}: {type(exc).__name__}: {exc}")

    began = time.perf_counter()
    threads = [
        threading.Thread(target=work, args=(i, name, ep, options))
        for i, (name, ep, options) in enumerate(jobs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    assert not failures, failures[:5]
    assert _torch_state(ops) == state
    after_export = torch.export.export(_Probe(), probe_args)
    assert _epass_meta(after_export) == []
    assert after_export.graph_module.code == before_export.graph_module.code
    assert [sorted(n.meta) for n in after_export.graph.nodes] == [
        sorted(n.meta) for n in before_export.graph.nodes
    ]
    print(f"{len(jobs)} threads x {ROUNDS} rounds: {elapsed:.1f} s")


def _waits_for_the_lock(fn):
    """Whether ``fn`` (run in a thread) waits while this thread holds the lock."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as exc:  # reported below
            errors.append(exc)
        done.set()

    with LOCK:
        thread = threading.Thread(target=run)
        thread.start()
        waited = not done.wait(1.0)
    thread.join()
    assert not errors, errors
    return waited


def test_every_retrace_epass_runs_holds_the_lock():
    from epass.passes import ReplaceOps

    _, ep, _ = models.export("mlp")

    def tanh_gelu(x, approximate="none"):
        return nn.functional.gelu(x, approximate="tanh")

    relu = ReplaceOps({aten.relu.default: tanh_gelu})
    assert _waits_for_the_lock(lambda: Decompose(method="retrace")(ep))
    assert _waits_for_the_lock(lambda: relu(ep))
    assert _waits_for_the_lock(lambda: Decompose(method="incremental")(ep))


def test_retrace_leaves_torchs_fake_rules_as_they_were():
    # A bare run_decompositions drops the fake rule of aten.item (a CIA op torch
    # patches); epass's retrace puts it back.
    from torch._subclasses import fake_impls

    _, ep, _ = models.export("mlp")
    rules = fake_impls.op_implementations_dict
    saved = rules.get(aten.item.default)  # an earlier bare retrace may have dropped it

    def rule(fake_mode, func, *args, **kwargs):
        raise AssertionError("unreachable")

    rules[aten.item.default] = rule
    try:
        ops = _touched_ops()
        before = _torch_state(ops)
        Decompose(method="retrace")(ep)
        assert _torch_state(ops) == before
        assert rules[aten.item.default] is rule
    finally:
        rules.pop(aten.item.default, None)
        if saved is not None:
            rules[aten.item.default] = saved


# --- the garbage collector, paused while a decomposition builds its graph ---


def test_decompose_pauses_the_collector_and_leaves_it_as_it_found_it():
    seen = []
    real = splice._decompose

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    _, ep, _ = models.export("mlp")
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            splice._decompose = watched
            try:
                assert Decompose(method="incremental")(ep).notes["method"] == "incremental"
            finally:
                splice._decompose = real
            assert gc.isenabled() is enabled
        assert seen == [False, False]
    finally:
        (gc.enable if was else gc.disable)()

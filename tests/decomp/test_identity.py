"""``epass._decomp.identity``: a user's decomposition is cached only through the
identity it declares, torch's own by identity, and a table that cannot be named is
traced for its run alone."""

from __future__ import annotations

import collections
import os
import textwrap
from pathlib import Path

import pytest
import torch
from decomp_helpers import run_script
from torch import nn

from epass import Decompose
from epass._decomp import identity, made
from epass._decomp.check import first_difference
from epass._decomp.table import split_table
from epass._torch import operators

aten = torch.ops.aten

# One decomposition of aten.silu for every way a function may read state that no
# fingerprint of its code sees: a module attribute, a class attribute, the
# environment, a tensor's value, a list it closes over, and a function dressed as
# torch's own with functools.wraps. Each multiplies by the scale EPASS_TEST_SCALE says.
_BEHAVIOURS = textwrap.dedent(
    """
    import functools, os, sys, types
    import torch

    aten = torch.ops.aten
    cfg = types.ModuleType("cfg")
    cfg.FACTOR = float(os.environ["EPASS_TEST_SCALE"])
    sys.modules["cfg"] = cfg


    class Settings:
        SCALE = float(os.environ["EPASS_TEST_SCALE"])


    WEIGHT = torch.tensor(float(os.environ["EPASS_TEST_SCALE"]))
    STATE = [float(os.environ["EPASS_TEST_SCALE"])]


    def scaled(x, k):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), k)


    def module_attribute(x):
        return scaled(x, cfg.FACTOR)


    def class_attribute(x):
        return scaled(x, Settings.SCALE)


    def environment(x):
        return scaled(x, float(os.environ["EPASS_TEST_SCALE"]))


    def tensor_value(x):
        return scaled(x, WEIGHT.item())


    def closure(x):
        return scaled(x, STATE[0])


    @functools.wraps(torch._decomp.decomposition_table[aten.silu.default])
    def wrapped(x):
        return scaled(x, STATE[0])


    def declared(x):
        return scaled(x, 2.0)


    declared.cache_key = "times-two-v1"
    TABLES = {
        f.__name__: {aten.silu.default: f}
        for f in (module_attribute, class_attribute, environment, tensor_value, closure,
                  wrapped, declared)
    }
    """
)

# Lowers a SiLU with every table of _BEHAVIOURS and with torch's default table; prints
# per table the path, the first difference from torch's retrace, the cache note and
# the output, plus this process's disk cache counters.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import behaviours
    from epass import Decompose
    from epass._decomp import disk
    from epass._decomp.check import first_difference
    from epass._decomp.state import run_decompositions

    ep = torch.export.export(torch.nn.SiLU(), (torch.randn(2, 3),))
    x = torch.ones(2, 3)
    found = {}
    for name, table in [*behaviours.TABLES.items(), ("default", None)]:
        result = Decompose(table=table)(ep)
        ref, _ = run_decompositions(ep, table)
        found[name] = [
            result.notes["method"],
            first_difference(result.program, ref),
            result.notes.get("cache"),
            result.program.module()(x).tolist(),
            ref.module()(x).tolist(),
        ]
    print(json.dumps({"tables": found, "disk": disk.info()}))
    """
)


def _process(tmp_path: Path, scale: float) -> dict:
    (tmp_path / "behaviours.py").write_text(_BEHAVIOURS)
    return run_script(
        _SCRIPT, tmp_path / "cache", str(tmp_path), env={"EPASS_TEST_SCALE": str(scale)}
    )


def test_a_second_process_with_other_behaviour_gets_torchs_graph_and_numbers(tmp_path):
    first = _process(tmp_path, 2.0)
    second = _process(tmp_path, 3.0)
    for run, scale in ((first, 2.0), (second, 3.0)):
        for name, (method, difference, note, got, want) in run["tables"].items():
            assert method == "incremental", name
            assert difference is None, (name, scale, difference)
            assert got == want, (name, scale)
            if name in ("declared", "default"):
                assert note is None, name
            else:
                assert "declares no cache identity (cache_key)" in note, name
    expected = torch.nn.functional.silu(torch.ones(2, 3)) * 3.0
    assert torch.tensor(second["tables"]["environment"][3]).allclose(expected)
    # The declared table and torch's default table were served from disk.
    assert second["disk"]["hits"] >= 2 and first["disk"]["hits"] == 0
    assert first["disk"]["bypassed"] >= 6 and second["disk"]["bypassed"] >= 6


def _silu_program():
    return torch.export.export(nn.SiLU(), (torch.randn(2, 3),))


def test_a_closure_changed_between_runs_gets_torchs_graph_each_time():
    state = [2.0]

    def silu(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), state[0])

    ep = _silu_program()
    table = {aten.silu.default: silu}
    notes = []
    for scale in (2.0, 3.0, 5.0):
        state[0] = scale
        result = Decompose(table=table, method="incremental")(ep)
        ref = ep.run_decompositions(table)
        assert first_difference(result.program, ref) is None, scale
        notes.append(result.notes.get("cache"))
    assert all("silu (aten.silu.default) declares no cache identity" in n for n in notes)


def test_a_declared_identity_is_read_at_every_run():
    scale = [2.0]

    def silu(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), scale[0])

    ep = _silu_program()
    table = {aten.silu.default: silu}
    silu.cache_key = "v2"
    first = Decompose(table=table, method="incremental")(ep)
    scale[0] = 3.0  # the behaviour changes, and so does the identity it declares
    silu.cache_key = "v3"
    second = Decompose(table=table, method="incremental")(ep)
    assert "cache" not in first.notes and "cache" not in second.notes
    assert first_difference(second.program, ep.run_decompositions(table)) is None


@pytest.mark.parametrize("value", [5, b"v1", ""], ids=["int", "bytes", "empty"])
def test_a_declared_identity_that_is_not_a_string_is_named_in_the_note(value):
    def silu(x):
        return aten.mul.Tensor(x, aten.sigmoid.default(x))

    silu.cache_key = value
    result = Decompose(table={aten.silu.default: silu}, method="incremental")(_silu_program())
    assert "silu.cache_key must be a non-empty string" in result.notes["cache"]


def test_a_cache_key_method_that_raises_is_named_and_keeps_the_fast_path():
    def silu(x):
        return aten.mul.Tensor(x, aten.sigmoid.default(x))

    def refuse():
        raise ValueError("no key today")

    silu.cache_key = refuse
    ep = torch.export.export(nn.Sequential(nn.SiLU(), nn.GELU()), (torch.randn(2, 3),))
    table = {**torch.export.default_decompositions(), aten.silu.default: silu}
    result = Decompose(table=table, method="auto")(ep)
    assert result.method == "incremental" and result.fallback is None
    note = result.notes["cache"]
    assert "silu.cache_key() raised ValueError: no key today" in note
    assert [n.kind for n in result.notices] == ["cache"]
    assert first_difference(result.program, ep.run_decompositions(table)) is None


def test_a_python_kernel_registered_for_an_aten_operator_turns_the_disk_cache_off():
    # torch registers hundreds of Python kernels for ATen and prims operators itself
    # (meta kernels, the prims), from its own files: those do not count.
    assert any(k.startswith("aten/") for k in operators.library_impls())
    assert identity.library_kernels() == []
    assert identity.cache_name(split_table(None)).table is not None
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("silu", lambda x: x * 2, "CompositeImplicitAutograd")
    try:
        assert operators.registered_from("aten/silu/CompositeImplicitAutograd") == __file__
        assert identity.library_kernels() == ["aten::silu/CompositeImplicitAutograd"]
        name = identity.cache_name(split_table(None))
    finally:
        lib._destroy()
    assert name.table is None and "aten::silu/CompositeImplicitAutograd" in name.why_not
    assert identity.library_kernels() == []
    assert identity.cache_name(split_table(None)).table is not None


# --- every property of an input a decomposition may read --------------------------


def _closure_table(value, key=None):
    def silu(x):
        return aten.mul.Tensor(aten.sigmoid.default(x), value)

    if key is not None:
        silu.cache_key = key
    return {aten.silu.default: silu}


def _name(table):
    return identity.cache_name(split_table(table))


def test_a_users_table_is_named_only_through_the_identity_it_declares():
    undeclared = _name(_closure_table(2.0))
    assert undeclared.table is None
    assert "silu (aten.silu.default) declares no cache identity" in undeclared.why_not
    a, b = _name(_closure_table(2.0, "two")), _name(_closure_table(3.0, "three"))
    assert None not in (a.table, b.table) and a.table != b.table
    # The declaration names the behaviour, whatever the closure holds.
    assert _name(_closure_table(object(), "two")).table == a.table
    # torch's own decompositions are named by identity, however they are collected.
    assert _name(torch._decomp.core_aten_decompositions()).table is not None


def test_naming_torchs_table_resolves_each_code_file_once(monkeypatch):
    # torch's ~500 decompositions live in a handful of files; a fresh process judging
    # each function's code resolved its file's path once per function (a third of what
    # naming the table cost). The name is the one the table had before.
    tables = split_table(None)
    before = identity.cache_name(tables)
    assert before.table is not None
    monkeypatch.setattr(identity, "NAMED", collections.OrderedDict())
    monkeypatch.setattr(made, "_VERDICTS", {})
    monkeypatch.setattr(made, "_FILES", {})
    resolved = []
    realpath = os.path.realpath

    def spy(path, *args, **kwargs):
        resolved.append(path)
        return realpath(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", spy)
    assert identity.cache_name(tables) == before
    judged = len(made._VERDICTS)
    assert judged > 200 and resolved
    assert len(resolved) == len(set(resolved)) < judged / 10

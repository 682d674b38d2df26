"""Decomposition templates are never wrong: a user's decomposition is cached only
through the identity it declares, and a template key holds every property of its
inputs, and every process setting, that torch's decompositions read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from epass import Decompose, _decomp, _template_store

ROOT = Path(__file__).resolve().parent.parent
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
    from epass import Decompose, _decomp, _template_store

    ep = torch.export.export(torch.nn.SiLU(), (torch.randn(2, 3),))
    x = torch.ones(2, 3)
    found = {}
    for name, table in [*behaviours.TABLES.items(), ("default", None)]:
        result = Decompose(table=table)(ep)
        ref = _decomp.run_decompositions(ep, table)
        found[name] = [
            result.notes["method"],
            _decomp.first_difference(result.program, ref),
            result.notes.get("cache"),
            result.program.module()(x).tolist(),
            ref.module()(x).tolist(),
        ]
    print(json.dumps({"tables": found, "disk": _template_store.info()}))
    """
)


def _process(tmp_path: Path, scale: float) -> dict:
    (tmp_path / "behaviours.py").write_text(_BEHAVIOURS)
    env = {
        **os.environ,
        "EPASS_CACHE_DIR": str(tmp_path / "cache"),
        "EPASS_TEST_SCALE": str(scale),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
        assert _decomp.first_difference(result.program, ref) is None, scale
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
    assert _decomp.first_difference(second.program, ep.run_decompositions(table)) is None


@pytest.mark.parametrize("value", [5, b"v1", ""], ids=["int", "bytes", "empty"])
def test_a_declared_identity_that_is_not_a_string_is_named_in_the_note(value):
    def silu(x):
        return aten.mul.Tensor(x, aten.sigmoid.default(x))

    silu.cache_key = value
    result = Decompose(table={aten.silu.default: silu}, method="incremental")(_silu_program())
    assert "silu.cache_key must be a non-empty string" in result.notes["cache"]


def test_a_python_kernel_registered_for_an_aten_operator_turns_the_disk_cache_off():
    from torch import library

    library._impls.add("aten::silu/CompositeImplicitAutograd")
    try:
        name = _decomp.cache_name(_decomp.split_table(None))
    finally:
        library._impls.discard("aten::silu/CompositeImplicitAutograd")
    assert name.table is None and "aten::silu/CompositeImplicitAutograd" in name.why_not
    assert _decomp.cache_name(_decomp.split_table(None)).table is not None


# --- every property of an input a decomposition may read --------------------------


class _MatmulWeight(nn.Module):
    """``weight @ x.transpose(1, 2)``: torch's matmul folds to ``mm`` when the weight
    requires grad (transformers' Mamba does this)."""

    def __init__(self, parameter: bool) -> None:
        super().__init__()
        weight = torch.randn(8, 4)
        if parameter:
            self.weight = nn.Parameter(weight)
        else:
            self.register_buffer("weight", weight)

    def forward(self, x):
        return self.weight @ x.transpose(1, 2)


class _Reshape(nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1) * 2


class _Mean(nn.Module):
    def forward(self, x):
        return torch.var_mean(x, dim=1)[0] + x.sum()


class _Attention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


def _program(module, x):
    return torch.export.export(module.eval(), (x,))


_X = torch.randn(2, 3, 4)
_IMAGE = torch.randn(2, 3, 4, 5)
# Pairs of programs whose nodes differ in exactly one property of one input.
_VARIANTS = {
    "requires_grad (buffer, then parameter)": lambda: [
        _program(_MatmulWeight(False), _X),
        _program(_MatmulWeight(True), _X),
    ],
    "requires_grad of a user input": lambda: [
        _program(_MatmulWeight(False), _X),
        _program(_MatmulWeight(False), _X.clone().requires_grad_(True)),
    ],
    "memory format": lambda: [
        _program(_Reshape(), _IMAGE),
        _program(_Reshape(), _IMAGE.to(memory_format=torch.channels_last)),
    ],
    "strides": lambda: [
        _program(_Reshape(), _X),
        _program(_Reshape(), _X.transpose(1, 2).contiguous().transpose(1, 2)),
    ],
    "dtype": lambda: [
        _program(_Mean(), _X),
        _program(_Mean(), _X.to(torch.float64)),
    ],
    "device": lambda: [
        _program(_Mean(), _X),
        _program(_Mean(), _X.to("meta")),
    ],
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_programs_differing_in_one_input_property_each_get_torchs_graph(
    variant, tmp_path, monkeypatch
):
    monkeypatch.setenv(_template_store.DIR_ENV, str(tmp_path))  # a disk cache of its own
    for ep in _VARIANTS[variant]():
        result = Decompose(method="incremental")(ep)
        ref = _decomp.run_decompositions(ep)
        assert _decomp.first_difference(result.program, ref) is None, variant
        ops = [str(n.target) for n in result.program.graph.nodes if n.op == "call_function"]
        assert ops == [str(n.target) for n in ref.graph.nodes if n.op == "call_function"]


def test_a_parameter_gets_the_retraces_mm_path_after_a_buffer_of_its_shape():
    _, parameter = _VARIANTS["requires_grad (buffer, then parameter)"]()
    Decompose(method="incremental")(_program(_MatmulWeight(False), _X))
    out = Decompose(method="incremental")(parameter).program
    assert aten.mm.default in {n.target for n in out.graph.nodes}


def test_the_retraces_view_of_a_state_tensor_decides_its_key():
    ep = _program(_MatmulWeight(True), _X)
    ep.state_dict["weight"].requires_grad_(False)  # the retrace fakes this tensor
    out = Decompose(method="incremental")(ep).program
    assert _decomp.first_difference(out, _decomp.run_decompositions(ep)) is None


def test_a_state_tensor_unlike_the_one_recorded_keeps_the_retrace():
    ep = _program(_MatmulWeight(True), _X)
    ep.state_dict["weight"] = nn.Parameter(torch.randn(4, 8).t())  # other strides
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    why = result.notes["fallback"]
    assert "state tensor p_weight is not the tensor the program recorded" in why


def test_the_attention_backend_setting_is_part_of_the_key():
    ep = _program(_Attention(), torch.randn(1, 2, 8, 16))
    flash = torch.backends.cuda.flash_sdp_enabled()
    try:
        for enabled in (True, False, True):
            torch.backends.cuda.enable_flash_sdp(enabled)
            out = Decompose(method="incremental")(ep).program
            assert _decomp.first_difference(out, _decomp.run_decompositions(ep)) is None
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)


def test_a_fresh_fake_has_every_property_its_key_names():
    ep = _program(_MatmulWeight(True), _X)
    fake_mode = _decomp._fake_mode(ep)
    values = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"]
    with fake_mode:
        values.append(torch.empty(40).as_strided((2, 3), (1, 4), 5))  # strides, an offset
        values.append(torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last))
        values.append(torch.empty(3, dtype=torch.float16, device="meta"))
    for value in values:
        for grad in (False, True):
            fake = _decomp._fresh_fake(fake_mode, value, grad)
            assert fake is not value and fake.requires_grad is grad
            assert _decomp._tensor_key(fake, fake.requires_grad) == _decomp._tensor_key(value, grad)

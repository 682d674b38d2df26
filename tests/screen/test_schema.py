"""``epass._screen.schema``: ``models/model.json`` is walked with torch's schema, so a
value must be what its field says and every string passes its field's role; a property
test puts hostile text into every string of real programs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import sys
import time
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import screen_helpers as h
import torch

import epass
from epass import _pt2
from epass._screen import roles
from epass.cli import main
from epass.errors import EpassError, UnsafeArchiveError


def _rename_value(program: Any, old: str, new: str) -> Any:
    """Rename a graph value everywhere the graph refers to it (names and dict keys);
    the module's argument names (``forward_arg_names``) stay as they were."""
    renamed = json.loads(json.dumps(program).replace(json.dumps(old), json.dumps(new)))
    renamed["graph_module"]["module_call_graph"] = program["graph_module"]["module_call_graph"]
    return renamed


# --- the walk ---------------------------------------------------------------------------


def test_value_name_with_code_runs_in_torch_but_is_refused_by_the_screen(
    small: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "executed"
    name = f"y=__import__('pathlib').Path({str(marker)!r}).touch()"
    evil = h.write(small, tmp_path / "evil.pt2", _rename_value(h.program_of(small), "x", name))
    h.assert_torch_runs_it(evil, marker, "torch no longer writes value names into generated code")

    with pytest.raises(UnsafeArchiveError) as info:
        epass.load(evil)
    message = str(info.value)
    assert "models/model.json" in message
    assert "graph_module.graph.inputs[" in message and ".as_tensor.name" in message
    assert "identifier" in message
    for command in ("inspect", "run"):
        argv = [command, str(evil)] + (["-p", "dce"] if command == "run" else [])
        assert main(["--plain", *argv]) == 2
        assert "identifier" in capsys.readouterr().err
    assert not marker.exists()


def test_many_expressions_together_are_refused_by_the_programs_budget(
    small: dict[str, bytes], tmp_path: Path
) -> None:
    """Each expression is within bounds; together they would keep sympy busy."""
    program = h.program_of(small)
    values = program["graph_module"]["graph"]["tensor_values"]
    template = json.dumps(values["x"])
    for i in range(100):
        product = "*".join(["s0"] * 60) + f" + {i}"
        assert roles.SYMBOLIC.check(product) is None
        values[f"extra_{i}"] = json.loads(
            template.replace(values["x"]["sizes"][0]["as_expr"]["expr_str"], product)
        )
    began = time.perf_counter()
    with pytest.raises(UnsafeArchiveError, match="shape expressions exceed 10000 terms"):
        epass.load(h.write(small, tmp_path / "many.pt2", program))
    assert time.perf_counter() - began < 5.0


@pytest.mark.parametrize(
    "edit",
    [
        lambda p: p["graph_module"]["graph"].update(extra_field="x"),
        lambda p: p["graph_module"]["graph"]["nodes"][0].update(code="x"),
        lambda p: p["graph_module"]["graph"]["inputs"][0].update(as_python="x"),
        lambda p: p["graph_module"]["graph"]["nodes"][0]["metadata"].update(exec="x"),
        lambda p: p["graph_module"]["graph"]["nodes"][0].update(name=5),
        lambda p: p["graph_module"]["graph"]["inputs"][0].update(as_tensor={"name": ["x"]}),
    ],
    ids=["field", "node-field", "union-member", "metadata-key", "int-for-str", "list-for-str"],
)
def test_what_the_schema_does_not_know_is_refused(
    edit: Callable[[Any], None], small: dict[str, bytes], tmp_path: Path
) -> None:
    program = h.program_of(small)
    edit(program)
    with pytest.raises(UnsafeArchiveError, match=r"field graph_module\.graph"):
        epass.load(h.write(small, tmp_path / "a.pt2", program))


def test_unknown_schema_version_is_refused_unless_trusted(
    small: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    major, minor = _pt2.export_schema()[1]
    for version in ({"major": major + 1, "minor": 0}, {"major": major, "minor": minor + 1}):
        program = h.program_of(small)
        program["schema_version"] = version
        path = h.write(small, tmp_path / "future.pt2", program)
        with pytest.raises(UnsafeArchiveError, match=r"schema version .* does not know"):
            epass.load(path)
        assert main(["--plain", "inspect", str(path)]) == 2
        assert "--trust" in capsys.readouterr().err
    program = h.program_of(small)
    program["schema_version"] = {"major": major, "minor": minor + 1}
    path = h.write(small, tmp_path / "newer-minor.pt2", program)
    assert len(epass.load(path, trust=True).graph.nodes) > 0
    assert main(["--plain", "inspect", "--trust", str(path)]) == 0


# --- property: every string leaf of real programs, every payload ------------------------


@torch.library.custom_op("epass_screen_test::scale", mutates_args=())
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


class Shapes(torch.nn.Module):
    """Backed and unbacked symbols, float shape arithmetic and guards between inputs."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        nonzero = x.nonzero()
        return x[: y.shape[0]] * 2, nonzero.shape[0] * 1.5, y.sum()


class CustomOp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        return torch.ops.epass_screen_test.scale(self.lin(x), 0.5 if mode == "half" else 2.0)


def _dynamic() -> torch.export.ExportedProgram:
    n, m = torch.export.Dim("n", min=4, max=64), torch.export.Dim("m", max=32)
    return torch.export.export(
        Shapes(), (torch.randn(8, 4), torch.randn(3, 4)), dynamic_shapes=({0: n}, {0: m})
    )


def _cond() -> torch.export.ExportedProgram:
    from tests import hf_models

    return hf_models.export("cond", dynamic=True)[1]


def _custom_op() -> torch.export.ExportedProgram:
    return torch.export.export(CustomOp(), (torch.randn(2, 4), "half"))


def _quantized() -> torch.export.ExportedProgram:
    quantizer_module = pytest.importorskip(
        "executorch.backends.xnnpack.quantizer.xnnpack_quantizer",
        reason="PT2E needs a quantizer (executorch's XNNPACKQuantizer)",
    )
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    from tests import models

    _, ep, args = models.export("convbn")
    quantizer = quantizer_module.XNNPACKQuantizer().set_global(
        quantizer_module.get_symmetric_quantization_config()
    )
    prepared = pt2e.prepare_pt2e(ep.module(), quantizer)
    prepared(*args)
    return torch.export.export(pt2e.convert_pt2e(prepared), args)


def _hf() -> torch.export.ExportedProgram:
    pytest.importorskip("transformers")
    from tests import hf_models

    return hf_models.export("gpt2")[1]


# Smallest first: a later program covers only the field paths earlier ones lack.
PROGRAMS: dict[str, Callable[[], torch.export.ExportedProgram]] = {
    "dynamic": _dynamic,
    "cond": _cond,
    "custom-op": _custom_op,
    "pt2e-quantized": _quantized,
    "hf-gpt2": _hf,
}

PAYLOADS: dict[str, str] = {
    "code-in-name": "y=__import__('pathlib').Path({marker!r}).touch()",
    "single-quote": "a' + str(__import__('pathlib').Path({marker!r}).touch()) + '",
    "double-quote": 'a" + str(__import__("pathlib").Path({marker!r}).touch()) + "',
    "newline": "a\n__import__('pathlib').Path({marker!r}).touch()\n",
    "carriage-return": "a\r__import__('pathlib').Path({marker!r}).touch() #",
    "os-system": "__import__('os').system('touch ' + {marker!r})",
    "unicode-identifier": "größe",
    "nfkc-identifier": "\uff58",  # fullwidth x, which Python folds into x
    "5000-digits": "9" * 5000,
    "power-tower": "9**9**9",
    "terminal-escape": "\x1b]0;owned\x07\x1b[2J",
    "empty": "",
}

_MAPS = frozenset(
    name
    for cls in vars(sys.modules[_pt2.export_schema()[0].__module__]).values()
    if isinstance(cls, type) and dataclasses.is_dataclass(cls)
    for name, tp in typing.get_type_hints(cls).items()
    if typing.get_origin(tp) is dict and typing.get_args(tp)[1] is not str
)


@dataclasses.dataclass
class Leaf:
    """One string of model.json: where it is, and whether it is a dict key."""

    path: tuple[Any, ...]
    field: str  # the path with list indices and map keys folded: one per schema field
    key: bool


def _leaves(value: Any, path: tuple[Any, ...] = (), field: str = "") -> Iterator[Leaf]:
    if isinstance(value, dict):
        is_map = bool(path) and path[-1] in _MAPS
        for k, item in value.items():
            inner = f"{field}[*]" if is_map else f"{field}.{k}"
            if is_map:
                yield Leaf((*path, k), inner + "{key}", True)
            yield from _leaves(item, (*path, k), inner)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i), f"{field}[]")
    elif isinstance(value, str):
        yield Leaf(path, field, False)


def _replaced(program: Any, leaf: Leaf, text: str) -> Any:
    out = json.loads(json.dumps(program))
    parent = out
    for step in leaf.path[:-1]:
        parent = parent[step]
    last = leaf.path[-1]
    if leaf.key:
        items = [(text if k == last else k, v) for k, v in parent.items()]
        parent.clear()
        parent.update(items)
    else:
        parent[last] = text
    return out


@pytest.fixture(scope="module")
def archives() -> dict[str, dict[str, bytes] | str]:
    """Each program's archive members, or why it could not be built."""
    out: dict[str, dict[str, bytes] | str] = {}
    for name, build in PROGRAMS.items():
        try:
            out[name] = h.archive(build())
        except pytest.skip.Exception as skipped:
            out[name] = str(skipped)
    return out


def _exercise(ep: torch.export.ExportedProgram) -> None:
    """What a user does with a loaded program: build its module and call it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(Exception):
            module = ep.module()
            args, kwargs = ep.example_inputs or ((), {})
            module(*args, **kwargs)
        with contextlib.suppress(Exception):
            torch.export.unflatten(ep)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_every_string_leaf_with_every_payload_loads_or_is_refused_and_runs_nothing(
    name: str, archives: dict[str, dict[str, bytes] | str], tmp_path: Path
) -> None:
    import faulthandler

    members = archives[name]
    if isinstance(members, str):
        pytest.skip(members)
    program = h.program_of(members)
    covered = {
        leaf.field
        for earlier in list(PROGRAMS)[: list(PROGRAMS).index(name)]
        if not isinstance(archives[earlier], str)
        for leaf in _leaves(h.program_of(archives[earlier]))  # type: ignore[arg-type]
    }
    leaves = list(_leaves(program))
    chosen: dict[str, Leaf] = {}
    for leaf in leaves:  # every field path this program adds, once
        if leaf.field not in covered:
            chosen.setdefault(leaf.field, leaf)
    for leaf in random.Random(name).sample(leaves, min(3, len(leaves))):  # and a few more
        chosen.setdefault(f"{leaf.field} {leaf.path}", leaf)
    assert chosen or name != "dynamic"
    marker = tmp_path / "executed"
    archive = tmp_path / "case.pt2"
    outcomes = {"refused": 0, "loaded": 0}
    for leaf in chosen.values():
        for payload_name, template in PAYLOADS.items():
            text = template.format(marker=str(marker))
            h.write(members, archive, _replaced(program, leaf, text))  # type: ignore[arg-type]
            faulthandler.dump_traceback_later(120, exit=True)  # a hang fails loudly
            began = time.perf_counter()
            try:
                ep = epass.load(archive)
            except EpassError:
                outcomes["refused"] += 1
                ep = None
            finally:
                elapsed = time.perf_counter() - began
                faulthandler.cancel_dump_traceback_later()
            case = f"{leaf.field} ({'key' if leaf.key else 'value'}) <- {payload_name}"
            assert elapsed < 5.0, f"{case}: {elapsed:.1f} s"
            if ep is not None:
                outcomes["loaded"] += 1
                _exercise(ep)
            assert not marker.exists(), f"{case} ran code"
    assert outcomes["refused"] > 0
    print(f"{name}: {len(leaves)} leaves, {len(chosen)} screened with "
          f"{len(PAYLOADS)} payloads: {outcomes}")  # fmt: skip

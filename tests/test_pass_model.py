"""PassModel: a pass's declared attributes are read once, by protocol.adapt, and
nothing else in epass probes a pass with getattr."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import models
import pytest
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as FxPassResult

import epass
from epass import FxPass, PassManager, PassResult, registry
from epass.protocol import CONTRACT, PassModel, adapt

PACKAGE = Path(epass.__file__).parent
# What adapt reads besides the contract: a nested pipeline's models, and the
# attributes older code probed passes for (nested passes, a registered function).
PROBED = frozenset(CONTRACT) | {"models", "passes", "inner"}


def _is_signature_argument(node: ast.expr) -> bool:
    # ``spec.arg`` (or a loop variable ``arg`` over them) is a torch.export
    # signature argument, whose ``name`` is the graph node's name, not a pass's.
    return (isinstance(node, ast.Attribute) and node.attr == "arg") or (
        isinstance(node, ast.Name) and node.id == "arg"
    )


def contract_probes(source: str) -> list[str]:
    """Every ``getattr(x, "<contract attribute>", ...)`` / ``hasattr(...)`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
        ):
            continue
        obj, attr = node.args[0], node.args[1]
        if not (isinstance(attr, ast.Constant) and attr.value in PROBED):
            continue
        if attr.value == "name" and _is_signature_argument(obj):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_finder_flags_pass_reads_and_not_signature_arguments():
    source = (
        "def f(p, spec, arg):\n"
        "    getattr(p, 'requires', None)\n"
        "    hasattr(p, 'changes_input')\n"
        "    getattr(p.inner, 'name', None)\n"
        "    getattr(spec.arg, 'name', None)\n"
        "    getattr(arg, 'name', None)\n"
        "    getattr(p, 'fn', None)\n"
    )
    assert [line.split(":")[0] for line in contract_probes(source)] == ["2", "3", "4"]


def test_no_module_outside_protocol_reads_a_pass_attribute_with_getattr():
    offenders = {
        str(path.relative_to(PACKAGE)): probes
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "protocol.py" or path.parent != PACKAGE
        if (probes := contract_probes(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}


def test_protocol_reads_every_contract_attribute():
    probes = contract_probes((PACKAGE / "protocol.py").read_text(encoding="utf-8"))
    read = {attr for attr in CONTRACT if any(f"'{attr}'" in probe for probe in probes)}
    assert read == set(CONTRACT)


def test_the_pass_docstring_lists_every_contract_attribute():
    doc = epass.Pass.__doc__ or ""
    assert [attr for attr in CONTRACT if f"``{attr}" not in doc] == []


class Declaring:
    """A pass that declares every attribute of the contract, and counts the reads."""

    reads: list[str]

    def __init__(self) -> None:
        object.__setattr__(self, "reads", [])

    def __getattribute__(self, attr: str) -> Any:
        if attr in CONTRACT:
            object.__getattribute__(self, "reads").append(attr)
        return object.__getattribute__(self, attr)

    name = "declaring"
    changes_input = False
    run_before = "dce"
    run_after = ()
    imports = ("json",)
    origin = ("declaring", {"k": 1})

    def requires(self, ep: Any) -> bool:
        return True

    def ensures(self, ep: Any) -> bool:
        return True

    def skip_reason(self, ep: Any) -> None:
        return None

    def merge(self, other: Any) -> None:
        return None

    def __call__(self, ep: Any) -> PassResult:
        return PassResult(ep, False)


def test_adapt_reads_every_declared_attribute_into_the_model():
    p = Declaring()
    model = adapt(p)
    assert isinstance(model, PassModel)
    assert (model.pass_, model.name, model.changes_input) == (p, "declaring", False)
    assert (model.run_before, model.run_after, model.imports) == (("dce",), (), ("json",))
    assert model.origin == ("declaring", {"k": 1})
    assert model.requires is not None and model.requires(None) is True
    assert model.ensures is not None and model.skip_reason is not None
    assert model.merge is not None and model.module == __name__
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        model.name = "other"  # type: ignore[misc]


def test_the_manager_reads_a_pass_once_when_it_is_built_and_never_while_running():
    p = Declaring()
    pm = PassManager([p])
    built = list(p.reads)
    assert set(built) == set(CONTRACT)
    ep = models.export("mlp")[1]
    pm(ep)
    pm(ep)
    assert p.reads == built


class FxIdentity(PassBase):
    def call(self, graph_module: Any) -> FxPassResult:
        return FxPassResult(graph_module, False)


def test_pm_passes_are_the_objects_given_and_the_models_say_how_to_run_them():
    def fn(ep: Any) -> Any:
        return ep

    fx = FxIdentity()
    pm = PassManager([fn, "dce", fx])
    assert pm.passes[0] is fn
    assert pm.passes[1] is pm.models[1].pass_ and pm.models[1].name == "dce"
    assert isinstance(pm.passes[2], FxPass) and pm.passes[2].fn is fx
    assert [m.name for m in pm.models] == ["fn", "dce", "FxIdentity"]


def test_a_nested_pipeline_model_holds_its_passes_models():
    inner = PassManager(["dce", "cse"], name="inner")
    (model,) = PassManager([inner]).models
    assert model.pass_ is inner and model.children == inner.models


def test_create_pass_records_the_origin_in_the_model(fresh_registry: None):
    @registry.register_pass("origin-test")
    def make(*, factor: int = 2) -> Any:
        return lambda ep: ep

    p = epass.create_pass("origin-test(factor=3)")
    (model,) = PassManager([p]).models
    assert (model.name, model.origin) == ("origin-test", ("origin-test", {"factor": 3}))
    assert PassManager([p]).to_text() == "origin-test(factor=3)"


def test_the_registry_keeps_no_table_of_the_objects_it_made():
    assert not hasattr(registry, "_origin")
    assert not hasattr(registry, "NamedPass")


@pytest.fixture
def fresh_registry():
    yield
    registry.unregister_pass("origin-test")


def test_string_passes_resolve_with_only_the_engine_imported():
    code = (
        "import sys\n"
        "import epass.manager as m\n"
        "assert not hasattr(m, 'install_text_layer') and not hasattr(m, 'TextLayer')\n"
        "pm = m.PassManager(['dce'])\n"
        "assert pm.models[0].name == 'dce', pm.models\n"
        "assert m.PassManager.from_text('cse, dce').to_text() == 'cse, dce'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _probe(**declared: Any) -> Any:
    def call(self: Any, ep: Any) -> PassResult:
        return PassResult(ep, False)

    return type("Probe", (), {"__call__": call, **declared})()


def _raises(self: Any) -> Any:
    raise RuntimeError("kaboom")


@pytest.mark.parametrize("attr", CONTRACT)
def test_a_contract_property_that_raises_is_an_argument_error_naming_the_pass(attr: str):
    with pytest.raises(epass.errors.ArgumentTypeError, match=rf"Probe.*{attr}.*kaboom"):
        PassManager([_probe(**{attr: property(_raises)})])


class _FxProbe(PassBase):
    name = property(_raises)

    def call(self, graph_module: Any) -> FxPassResult:
        return FxPassResult(graph_module, False)


def test_a_torch_fx_pass_whose_name_raises_is_an_argument_error_naming_it():
    with pytest.raises(epass.errors.ArgumentTypeError, match=r"'_FxProbe'.*'name'.*kaboom"):
        PassManager([_FxProbe()])
    with pytest.raises(epass.errors.ArgumentTypeError, match=r"'_FxProbe'.*'name'.*kaboom"):
        FxPass(_FxProbe())


@pytest.fixture
def raising_name_registered():
    registry.register_pass("raising-name-test", lambda: _probe(name=property(_raises)))
    yield
    registry.unregister_pass("raising-name-test")


def test_a_registered_pass_whose_name_raises_is_an_argument_error_naming_it(
    raising_name_registered: None,
):
    expected = r"^pass 'Probe': reading its 'name' raised RuntimeError: kaboom$"
    with pytest.raises(epass.errors.ArgumentTypeError, match=expected):
        epass.create_pass("raising-name-test")
    with pytest.raises(epass.errors.ArgumentTypeError, match=expected):
        PassManager.from_text("dce, raising-name-test")


def test_pass_name_names_a_pass_whose_name_raises():
    with pytest.raises(epass.errors.ArgumentTypeError, match=r"'Probe'.*'name'.*kaboom"):
        epass.protocol.pass_name(_probe(name=property(_raises)))
    assert epass.protocol.pass_name(_probe(name="")) == "Probe"


@pytest.mark.parametrize(
    ("declared", "culprit"),
    [
        ({"changes_input": None}, "changes_input"),
        ({"changes_input": "no"}, "changes_input"),
        ({"changes_input": 0}, "changes_input"),
        ({"requires": "is_decomposed"}, "requires"),
        ({"ensures": ("a",)}, "ensures"),
        ({"skip_reason": "never"}, "skip_reason"),
        ({"run_before": 5}, "run_before"),
        ({"run_after": [5]}, "run_after"),
        ({"imports": [1]}, "imports"),
    ],
)
def test_a_contract_attribute_of_the_wrong_type_is_an_argument_error_naming_it(
    declared: dict[str, Any], culprit: str
):
    with pytest.raises(epass.errors.ArgumentTypeError, match=rf"'probe'.*{culprit}"):
        PassManager([_probe(name="probe", **declared)])


def test_imports_given_as_one_string_name_one_module():
    assert adapt(_probe(imports="json")).imports == ("json",)
    assert adapt(_probe(run_before="dce")).run_before == ("dce",)

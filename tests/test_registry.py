"""The pass registry: registration, lazy built-ins, entry-point plugins and their failures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch

import epass
from epass import PassManager, PassResult, registry
from epass.errors import ArgumentValueError
from epass.passes import Decompose
from epass.registry import PluginError, RegistryError, UnknownPassError

ROOT = Path(__file__).resolve().parent.parent
AGREED = [
    "decompose",
    "lift-constants",
    "fold-constants",
    "dce",
    "cse",
    "remove-asserts",
    "replace-ops",
    "cast-dtype",
    "fuse-conv-bn",
    "lower",
    "cleanup",
]


@attrs.define(eq=False)
class Scale:
    """Multiply nothing by a factor (a pass with options, for the registry tests)."""

    name: ClassVar[str] = "scale-test"
    factor: float = 1.0
    dtype: torch.dtype = torch.float32

    def __call__(self, ep: Any) -> PassResult:
        return PassResult(ep, False)


@pytest.fixture
def fresh() -> Iterator[None]:
    """Undo registrations and plugin changes made by a test."""
    before = set(registry.pass_names())
    yield
    for name in set(registry.pass_names()) - before:
        registry.unregister_pass(name)
    registry.refresh_plugins()


def _fake_dist(root: Path, dist: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[epass.passes]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(source)


def test_agreed_builtin_names_are_registered_without_importing_them() -> None:
    names = registry.pass_names()
    assert set(AGREED) <= set(names)
    assert registry.BUILTIN_TARGETS["fold-constants"] == "epass.passes.constant_fold:ConstantFold"


def test_register_as_decorator_and_create_with_options(fresh: None) -> None:
    registry.register_pass("scale-test", description="Scale for tests")(Scale)
    p = epass.create_pass("scale-test", factor=2.5)
    assert isinstance(p, Scale) and p.factor == 2.5
    q = epass.create_pass("scale-test(factor=3.0, dtype=bfloat16)")
    assert (q.factor, q.dtype) == (3.0, torch.bfloat16)
    assert epass.register_pass is registry.register_pass


def test_function_pass_and_factory_function(fresh: None) -> None:
    @registry.register_pass("identity-test")
    def identity(ep: Any) -> Any:
        """Return the program unchanged."""
        return PassResult(ep, False)

    @registry.register_pass("factory-test")
    def make(*, factor: int = 2) -> Scale:
        return Scale(factor=float(factor))

    named = epass.create_pass("identity-test")
    assert named.name == "identity-test" and named.inner is identity
    assert not hasattr(identity, "name")  # the user's function is not relabelled
    assert epass.create_pass("factory-test(factor=4)").factor == 4.0
    with pytest.raises(TypeError, match="takes no options"):
        epass.create_pass("identity-test", x=1)
    entry = registry.describe_pass("factory-test")
    assert [(o.name, o.default) for o in entry.options] == [("factor", 2)]
    assert registry.describe_pass("identity-test").description == "Return the program unchanged."


def test_list_passes_reports_description_source_and_options(fresh: None) -> None:
    registry.register_pass("scale-test", Scale)
    entries = {e.name: e for e in epass.list_passes()}
    scale = entries["scale-test"]
    assert scale.description.startswith("Multiply nothing by a factor (a pass with options")
    assert scale.kind == "user"
    assert [(o.name, o.type, o.default) for o in scale.options] == [
        ("factor", "float", 1.0),
        ("dtype", "dtype", torch.float32),
    ]
    assert scale.as_dict()["options"][1]["default"] == "float32"
    decompose = entries["decompose"]
    assert (decompose.source, decompose.kind, decompose.error) == ("epass", "builtin", None)
    assert [o.name for o in decompose.options] == [
        "table",
        "keep",
        "coalesce",
        "method",
        "check",
        "max_rewrites",
    ]
    json.dumps([e.as_dict() for e in entries.values()])


def test_unknown_name_suggests_the_nearest() -> None:
    with pytest.raises(UnknownPassError, match="unknown pass 'decompse'; did you mean 'decompose'"):
        epass.create_pass("decompse")


def test_name_clash_names_both_providers(fresh: None) -> None:
    registry.register_pass("scale-test", Scale)
    registry.register_pass("scale-test", Scale)  # the same factory again is fine

    class Other(Scale):
        pass

    with pytest.raises(RegistryError, match=r"registered by .*Scale.*test_registry:.*Other"):
        registry.register_pass("scale-test", Other)
    with pytest.raises(RegistryError, match="already registered by epass"):
        registry.register_pass("decompose", Other)
    registry.register_pass("scale-test", Other, replace=True)
    assert isinstance(epass.create_pass("scale-test"), Other)


@pytest.mark.parametrize("bad", ["Fold Constants", "fold--constants", "-x", "repeat", "", "a.b"])
def test_invalid_names_are_refused(bad: str) -> None:
    with pytest.raises(RegistryError):
        registry.register_pass(bad, Scale)


def test_missing_builtin_module_fails_only_when_used(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.BUILTIN_TARGETS, "ghost-pass", "epass.passes.no_such_module:Ghost")
    registry.refresh_plugins()
    assert "ghost-pass" in registry.pass_names()
    assert isinstance(epass.create_pass("decompose"), Decompose)
    with pytest.raises(PluginError, match=r"'ghost-pass'.*No module named 'epass.passes.no_such"):
        epass.create_pass("ghost-pass")
    entry = registry.describe_pass("ghost-pass")
    assert entry.error is not None and "no_such_module" in entry.error


def test_broken_plugin_is_reported_and_breaks_nothing_else(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_dist(
        tmp_path,
        "broken-dist",
        {"broken-pass": "broken_plugin_mod:Thing", "good-pass": "good_plugin_mod:Good"},
        {
            "broken_plugin_mod": "raise RuntimeError('plugin exploded on import')\n",
            "good_plugin_mod": (
                "from epass import PassResult\n"
                "class Good:\n"
                "    '''A plugin pass that works.'''\n"
                "    def __call__(self, ep):\n"
                "        return PassResult(ep, False)\n"
            ),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh_plugins()
    entries = {e.name: e for e in registry.list_passes()}
    broken = entries["broken-pass"]
    assert broken.source == "broken-dist"
    assert broken.error is not None
    assert "plugin 'broken-pass' from broken-dist" in broken.error
    assert "RuntimeError: plugin exploded on import" in broken.error
    assert entries["good-pass"].error is None
    assert entries["good-pass"].description == "A plugin pass that works."
    with pytest.raises(PluginError, match="plugin exploded"):
        epass.create_pass("broken-pass")
    with pytest.raises(epass.PipelineError, match="cannot load pass 'broken-pass' at column 12"):
        PassManager.from_text("decompose, broken-pass")
    assert len(PassManager.from_text("decompose, good-pass").passes) == 2


def test_two_plugins_with_one_name_name_both(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_dist(tmp_path, "twin-one", {"twin-pass": "twin_one:P"}, {"twin_one": "P = print\n"})
    _fake_dist(tmp_path, "twin-two", {"twin-pass": "twin_two:P"}, {"twin_two": "P = print\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh_plugins()
    with pytest.raises(PluginError) as info:
        epass.create_pass("twin-pass")
    message = str(info.value)
    assert "twin-one" in message and "twin-two" in message
    assert isinstance(epass.create_pass("decompose"), Decompose)


def test_plugin_cannot_shadow_a_builtin(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_dist(tmp_path, "shadow", {"decompose": "shadow_mod:P"}, {"shadow_mod": "P = print\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh_plugins()
    with pytest.raises(PluginError, match=r"epass .*and shadow"):
        epass.create_pass("decompose")


# --- the example plugin, really installed ------------------------------------------

PLUGIN_DIST = "epass-example-plugin"


@pytest.fixture
def example_plugin(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """pip-install examples/plugin into a folder of its own and put that folder on
    sys.path. The environment itself is never changed, so no other test (nor a test
    run that is stopped halfway) sees the plugin; returns the folder."""
    src = tmp_path_factory.mktemp("plugin") / "plugin"
    shutil.copytree(ROOT / "examples" / "plugin", src)  # keep build files out of the tree
    target = tmp_path_factory.mktemp("site")
    # Offline, so no build isolation: the environment's own setuptools builds the
    # wheel, and pip checks that it is the one the plugin's pyproject.toml asks for.
    install = [
        *(sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install"),
        *("--no-deps", "--no-build-isolation", "--check-build-dependencies", "--no-index"),
        *("--target", str(target), str(src)),
    ]
    proc = subprocess.run(install, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    monkeypatch.syspath_prepend(str(target))  # also invalidates the import caches
    registry.refresh_plugins()
    yield target
    monkeypatch.undo()
    registry.refresh_plugins()


def test_test_extra_brings_the_backend_that_builds_the_example_plugin() -> None:
    # The fixture above builds offline, without isolation, with the environment's
    # setuptools. A fresh venv on Python 3.11 has setuptools 65, which cannot build a
    # wheel without the separate `wheel` package ("invalid command 'bdist_wheel'");
    # 70.1 is the first with bdist_wheel built in.
    tomllib = pytest.importorskip("tomllib")
    plugin = tomllib.loads((ROOT / "examples" / "plugin" / "pyproject.toml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = plugin["build-system"]["requires"]
    assert needed == ["setuptools>=70.1"]
    assert set(needed) <= set(project["project"]["optional-dependencies"]["test"])


def test_installed_plugin_runs_by_name(example_plugin: Path) -> None:
    (entry,) = [e for e in registry.list_passes() if e.name == "swap-activation"]
    assert (entry.source, entry.kind, entry.error) == (PLUGIN_DIST, "plugin", None)
    assert [o.name for o in entry.options] == ["source", "target"]

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * 2

    x = torch.linspace(-2, 2, 9)
    ep = torch.export.export(Net(), (x,))
    text = "swap-activation(source=aten.relu.default, target=aten.gelu.default)"
    pm = PassManager.from_text(f"decompose, {text}")
    result = pm(ep)
    ops = {str(n.target) for n in result.program.graph.nodes if n.op == "call_function"}
    assert "aten.gelu.default" in ops and "aten.relu.default" not in ops
    torch.testing.assert_close(result.program.module()(x), torch.nn.functional.gelu(x) * 2)
    assert pm.to_text() == "decompose, swap-activation"  # both options are the defaults


def test_installed_plugin_is_listed_by_the_cli(example_plugin: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epass.cli", "passes", "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(example_plugin), str(ROOT)])},
        capture_output=True,
        text=True,
        check=True,
    )
    entries = {e["name"]: e for e in json.loads(proc.stdout)}
    assert entries["swap-activation"]["source"] == PLUGIN_DIST
    assert entries["swap-activation"]["options"][0] == {
        "name": "source",
        "type": "any",
        "default": "aten.relu.default",
        "required": False,
    }


@pytest.mark.parametrize("name", ["inf", "nan"])
def test_names_the_grammar_reads_as_numbers_are_reserved(name: str) -> None:
    # The pipeline tokenizer reads inf and nan as floats, so a pass under such a
    # name could never be written in a pipeline.
    with pytest.raises(registry.RegistryError, match="reserved word"):
        registry.register_pass(name, lambda ep: ep)


@pytest.mark.parametrize("spec", ["", "   ", "\n\t ", "# only a comment"])
def test_create_pass_without_a_pass_is_a_value_error(spec: str) -> None:
    with pytest.raises(ArgumentValueError, match="create_pass: spec") as info:
        epass.create_pass(spec)
    assert isinstance(info.value, ValueError)


def test_var_keyword_factories_take_only_named_options_from_text(fresh: None) -> None:
    @registry.register_pass("kwargs-test")
    def make(*, factor: int = 2, **settings: Any) -> Scale:
        return Scale(factor=float(factor + len(settings)))

    # From Python, keywords reach **settings; from text, only the named option.
    assert epass.create_pass("kwargs-test", factor=1, verify=False).factor == 2.0
    assert epass.create_pass("kwargs-test(factor=1)").factor == 1.0
    with pytest.raises(epass.PipelineError, match="no option 'verify'") as info:
        epass.create_pass("kwargs-test(factor=1, verify=false)")
    assert info.value.column == 23

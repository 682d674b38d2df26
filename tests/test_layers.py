"""The layered architecture: one error tree, one op histogram, nesting info, the registry table."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import epass
from epass import FxPass, PassManager, errors, registry
from epass.instruments import MemoryAccounting, OpCounts
from epass.passes import ConstantFold, Decompose
from epass.records import PassInfo, op_histogram
from epass.report import PipelineRun, build_report
from tests import import_graph, models

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parent.parent


def _epass_modules() -> list[Any]:
    names = ["epass"] + [
        m.name
        for m in pkgutil.walk_packages(epass.__path__, "epass.")
        if m.name not in ("epass.__main__",)
    ]
    out = []
    for name in names:
        try:
            out.append(importlib.import_module(name))
        except ImportError as exc:  # optional extras (executorch, ...)
            if "epass" in str(exc):
                raise
    return out


def test_every_error_class_epass_defines_is_an_epass_error() -> None:
    found = set()
    for module in _epass_modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            # Private classes (io's _Refuse) and those of private modules (_decomp's
            # Fallback) are control flow that the public API converts before it returns.
            private = obj.__name__.startswith("_") or any(
                part.startswith("_") for part in obj.__module__.split(".")
            )
            public = not private
            if issubclass(obj, BaseException) and obj.__module__.startswith("epass") and public:
                found.add(obj)
                assert issubclass(obj, errors.EpassError), f"{obj.__module__}.{obj.__name__}"
                assert obj.__module__ == "epass.errors", f"{obj.__name__} lives outside errors.py"
    assert {errors.PipelineError, errors.DecompositionError, errors.NumericsDriftError} <= found


def _raises(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except BaseException as exc:
        return exc
    raise AssertionError("no error raised")


BAD_CALLS: dict[str, Callable[[], Any]] = {
    "PassManager(str)": lambda: PassManager("decompose"),  # type: ignore[arg-type]
    "PassManager([5])": lambda: PassManager([5]),
    "PassManager(steps=0)": lambda: PassManager([], steps=0),
    "PassManager(linker=1)": lambda: PassManager([], linker=1),  # type: ignore[arg-type]
    "PassManager unknown name": lambda: PassManager(["no-such-pass"]),
    "from_text bad syntax": lambda: PassManager.from_text("decompose(("),
    "create_pass unknown": lambda: epass.create_pass("no-such-pass"),
    "create_pass(5)": lambda: epass.create_pass(5),  # type: ignore[arg-type]
    "create_pass bad option": lambda: epass.create_pass("dce", nope=1),
    "register_pass bad name": lambda: epass.register_pass("Bad Name", lambda ep: ep),
    "FxPass(5)": lambda: FxPass(5),  # type: ignore[arg-type]
    "Decompose(keep=[5])": lambda: Decompose(keep=[5]),
    "bisect method": lambda: epass.bisect(None, [], bool, method="nope"),  # type: ignore[arg-type]
    "run on a module": lambda: PassManager([]).run(torch.nn.Linear(2, 2)),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", list(BAD_CALLS))
def test_bad_input_to_the_public_api_raises_an_epass_error(call: str) -> None:
    exc = _raises(BAD_CALLS[call])
    assert isinstance(exc, epass.EpassError), f"{call}: {type(exc).__name__}: {exc}"


def test_verify_program_raises_a_program_error_listing_problems() -> None:
    _, ep, _ = models.export("seed")
    broken = epass._program.shallow_clone(ep)
    epass._program.set_state(broken, state_dict={})
    exc = _raises(lambda: epass.verify_program(broken))
    assert isinstance(exc, epass.ProgramError)
    assert isinstance(exc, ValueError)
    assert any("linear.weight" in p for p in exc.problems)


def test_failing_pass_inside_nested_pipeline_keeps_its_class_and_names_both_levels() -> None:
    _, ep, _ = models.export("mlp")

    def boom(program: Any) -> Any:
        raise RuntimeError("boom")

    inner = PassManager([FxPass(lambda gm: gm, name="noop"), boom], name="inner")
    exc = _raises(lambda: PassManager([inner], name="outer").run(ep))
    assert type(exc) is epass.PassError
    assert exc.pass_name == "inner" and exc.index == 0
    assert "in nested pipeline" in str(exc) and "'boom'" in str(exc)
    assert isinstance(exc.__cause__, RuntimeError)


def test_builtin_table_agrees_with_the_pass_names() -> None:
    """A built-in is registered in one place, ``epass.passes.BUILTINS``: the registry
    loads that factory under that name, the pass goes by the name, and
    ``epass.passes`` exports each class."""
    from epass import passes

    assert list(registry.BUILTIN_TARGETS) == list(passes.BUILTINS)
    for name, factory in passes.BUILTINS.items():
        assert registry.get_factory(name) is factory
        made = factory()
        assert made.name == name, f"{factory} makes a pass named {made.name!r}, registered {name!r}"
        if isinstance(factory, type):
            assert factory.__name__ in passes.__all__, f"epass.passes does not export {factory}"


def test_the_builtin_catalog_is_written_from_the_passes() -> None:
    """`epass passes` and the option check read the built-ins from a file before torch
    loads; the file is what ``python -m epass.passes`` writes from the passes now."""
    from epass import _catalog
    from epass.passes.__main__ import catalog_text

    written = _catalog.FILE.read_text(encoding="utf-8") if _catalog.FILE.is_file() else ""
    assert written == catalog_text(), (
        "epass/_catalog.json is stale: run `python -m epass.passes` to write it again"
    )
    loaded = [
        registry.describe_pass(name).as_dict()
        for name in registry.pass_names()
        if name in registry.BUILTIN_TARGETS
    ]
    assert all(entry["error"] is None for entry in loaded)
    assert [e for e in registry.pass_table() if e["name"] in registry.BUILTIN_TARGETS] == loaded


def test_the_catalog_types_are_the_option_models_own_text() -> None:
    """`epass run` checks built-in options against the table before torch: each
    type read back from its text is the type the pass declares."""
    from epass import options

    for name, (_, rows) in registry.BUILTIN_CATALOG.items():
        model = options.model_of(registry.get_factory(name))
        for option, text, _, _ in rows:
            declared = model.by_name[option].type
            assert declared is not None and declared.text == text
            assert options.parse_type(text).text == text, (name, option)


@pytest.mark.parametrize(
    "text",
    [
        "dce, decompse",
        "fold-constants(max_growth='big')",
        "fold-constants(max_growth=true)",
        "repeat(2, [cse, fold-constants(fold_views=1)])",
        "decompose(kep=[aten.linear])",
        "decompose(method='fast')",
        "decompose(table=5)",
        "decompose(check=2)",
        "cast-dtype(keep_io=none)",
        "lower(steps=2)",
        "dce(x=1)",
    ],
)
def test_text_checked_without_torch_fails_as_building_it_does(text: str) -> None:
    with pytest.raises(errors.PipelineError) as built:
        PassManager.from_text(text)
    with pytest.raises(errors.PipelineError) as checked:
        registry.check_text(text)
    assert type(checked.value) is type(built.value)
    assert (checked.value.reason, checked.value.pos) == (built.value.reason, built.value.pos)


# Modules that cost seconds to import (a compiler, an exporter) or that belong to an
# optional backend: none of them may load with epass's public API.
HEAVY = (
    "torch._dynamo", "torch._inductor", "torch.onnx", "torch.export.pt2_archive",
    "transformers", "onnx", "onnxscript", "onnxruntime", "executorch", "torchao", "tvm",
    "openvino", "coremltools", "sympy",
)  # fmt: skip


def _modules_after(code: str) -> set[str]:
    """The names in ``sys.modules`` after a fresh interpreter runs ``code``."""
    script = f"{code}\nimport sys\nprint(*sys.modules, sep='\\n')"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return set(proc.stdout.split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_import_epass_loads_no_torch_until_a_name_is_used() -> None:
    assert "torch" not in _modules_after("import epass")


def test_the_public_api_loads_no_compiler_exporter_or_backend() -> None:
    everything = _modules_after(
        "import pkgutil, epass\n"
        "from epass import *\n"
        "for m in pkgutil.walk_packages(epass.__path__, 'epass.'):\n"
        "    if m.name != 'epass.__main__':\n"
        "        __import__(m.name)"
    )
    assert {"torch", "epass.io", "epass.cli", "epass.onnx", "epass.executorch"} <= everything
    assert _heavy(everything) == []


def test_the_engine_alone_builds_and_prints_pipeline_text() -> None:
    modules = _modules_after(
        "from epass.manager import PassManager\n"
        "assert PassManager.from_text('dce, cse').to_text() == 'dce, cse'\n"
        "assert PassManager(['fold-constants(max_growth=2.0)']).to_text() == "
        "'fold-constants(max_growth=2.0)'"
    )
    assert {"epass.pipeline", "epass.registry", "epass.options"} <= modules


def test_the_grammar_the_registry_and_the_option_model_load_without_torch() -> None:
    modules = _modules_after(
        "from epass import pipeline, registry, options\n"
        "tree = pipeline.parse('decompose(keep=aten.linear), repeat(2, [dce])', resolve=False)\n"
        "assert pipeline.format_pipeline(tree) == 'decompose(keep=aten.linear), repeat(2, [dce])'\n"
        "registry.check_text('fold-constants(max_growth=2), cast-dtype(dtype=float16)')"
    )
    assert "torch" not in modules


def test_every_public_name_resolves_to_its_module_object() -> None:
    assert sorted(name for names in epass._EXPORTS.values() for name in names) == sorted(
        n for n in epass.__all__ if n != "__version__"
    )
    for module, names in epass._EXPORTS.items():
        for name in names:
            assert getattr(epass, name) is getattr(importlib.import_module(module), name)
    assert epass.io is importlib.import_module("epass.io")
    assert set(epass.__all__) <= set(dir(epass))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        epass.no_such_name  # noqa: B018


def test_type_checkers_read_the_public_names_of_the_one_table() -> None:
    """``epass/__init__.py`` lists each public name once, in ``_EXPORTS``; the
    ``TYPE_CHECKING`` imports that type checkers read re-export exactly those."""
    tree = ast.parse((ROOT / "epass" / "__init__.py").read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    imported: dict[str, list[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            assert alias.asname == alias.name, f"write `{alias.name} as {alias.name}`"
            imported.setdefault(node.module, []).append(alias.name)
    assert imported == {module: list(names) for module, names in epass._EXPORTS.items()}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, int]] = []
        self.infos: list[PassInfo] = []

    def before_pipeline(self, manager: Any, program: Any, parent: PassInfo | None) -> None:
        self.calls.append(("before_pipeline", parent.path if parent else None, manager.name))

    def after_pipeline(self, manager: Any, result: Any, parent: PassInfo | None) -> None:
        self.calls.append(("after_pipeline", parent.path if parent else None, manager.name))

    def before_pass(self, info: PassInfo, program: Any) -> None:
        self.infos.append(info)


class _OldStyle:
    """An instrument written without the ``parent`` parameter still works."""

    def __init__(self) -> None:
        self.pipelines = 0

    def before_pipeline(self, manager: Any, program: Any) -> None:
        self.pipelines += 1


def test_manager_hands_instruments_the_nesting() -> None:
    _, ep, _ = models.export("mlp")
    inner = PassManager([FxPass(lambda gm: gm, name="noop")], name="inner")
    recorder, old = _Recorder(), _OldStyle()
    PassManager([inner, ConstantFold()], name="outer", instruments=[recorder, old]).run(ep)
    assert recorder.calls == [
        ("before_pipeline", None, "outer"),
        ("before_pipeline", "inner", "inner"),
        ("after_pipeline", "inner", "inner"),
        ("after_pipeline", None, "outer"),
    ]
    assert old.pipelines == 2
    by_path = {i.path: i for i in recorder.infos}
    assert set(by_path) == {"inner", "inner/noop", "fold-constants"}
    nested = by_path["inner/noop"]
    assert nested.depth == 1 and nested.parent is by_path["inner"]
    assert nested.manager is inner and by_path["inner"].manager.name == "outer"


def test_one_op_histogram_keys_records_and_op_counts_alike() -> None:
    class Split(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = torch.split(x, 2, dim=1)
            return a * b

    ep = torch.export.export(Split(), (torch.randn(2, 4),))
    counts = OpCounts()
    result = PassManager([Decompose()], instruments=[counts])(ep)
    assert "getitem" in op_histogram(result.program)
    assert dict(result.records[0].op_delta) == counts.entries[0].delta
    assert "getitem" in counts.entries[0].after


def test_report_fills_state_bytes_from_memory_accounting() -> None:
    _, ep, _ = models.export("mixed")
    memory = MemoryAccounting()
    pm = PassManager([Decompose(), ConstantFold()], instruments=[memory])
    result = pm(ep)
    report = build_report(PipelineRun(result, manager=pm, memory=memory))
    for entry, measured in zip(report["passes"], memory.entries, strict=True):
        assert entry["state_bytes"]["bytes"] == measured.bytes
        assert entry["state_bytes"]["new_bytes"] == measured.new_bytes
    assert build_report(PipelineRun(result, manager=pm))["passes"][0]["state_bytes"] is None


def test_one_state_text_for_the_summary_the_command_line_and_the_report() -> None:
    import io
    from html import escape

    from epass._terminal import Out as _Out
    from epass._terminal import pass_table as _summary
    from epass.records import flatten, state_text
    from epass.report import render_html

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("buf", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.buf * 2  # type: ignore[no-any-return]

    ep = torch.export.export(Scaled(), (torch.ones(4),))
    aten_ep = PassManager([Decompose()]).run(ep)
    # skipped (already ATen), linked (a folded constant: own constants), unchanged
    pm = PassManager([Decompose(), ConstantFold(), lambda view: view])
    result = pm(aten_ep)
    rows = list(flatten(result.records))
    assert [r.skipped for r in rows] == [True, False, False]
    texts = [state_text(r.skipped, r.skip_reason, r.link and r.link.summary()) for r in rows]
    assert texts[0].startswith("skipped: already ATen")
    assert "own constants" in texts[1]
    stream = io.StringIO()
    _summary(_Out(plain=True, stream=stream), result)
    html = render_html(build_report(PipelineRun(result, manager=pm)))
    for text in texts:
        assert text in result.summary()
        assert text in stream.getvalue()
    # The report gives the counts columns of their own; the rest of the text is the same.
    assert escape(texts[0]) in html
    assert escape(texts[1].split(";")[0]) in html


# --- the written map matches the code --------------------------------------------------

PACKAGE = ROOT / "epass"
CONTRACT = "epass layers"
# By-name loads whose name is data, not a fixed module: (module, function) -> why.
NAME_IS_DATA = {
    ("epass", "__getattr__"): "the lazy public API: a name asked for, through _EXPORTS",
    ("epass.io", "import_modules"): "the user's --import modules",
    ("epass.registry", "_import"): "built-ins by module path, plugins by entry point",
    ("epass._torch.internals", "resolve"): (
        "torch internals by dotted path (INTERNALS), on a failure"
    ),
}
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 700
ONE_CONCEPT_LINES = 500


def by_name_problems(
    mods: dict[str, Path], package: str, allowed: dict[tuple[str, str], str]
) -> list[str]:
    """By-name loads of a fixed module of ``package``, and loads whose name is not in
    the source at a call site not known to load data."""
    problems = []
    for load in import_graph.by_name_loads(mods):
        where = f"{load.module}:{load.line} ({load.function or 'module level'})"
        name = (load.name or "").split(":")[0].rstrip("*")
        if load.name is None and (load.module, load.function) not in allowed:
            problems.append(f"{where} loads a module by a name that is not data")
        elif load.name is not None and (name == package or name.startswith(package + ".")):
            problems.append(f"{where} loads {load.name!r} by name: import it (move the code)")
    return problems


def _lazy_exports(init: Path, package: str) -> list[import_graph.Edge]:
    """The package's lazy public API as edges: ``_EXPORTS`` names each module it loads."""
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_EXPORTS":
            assert node.value is not None
            table = ast.literal_eval(node.value)
            return [import_graph.Edge(package, module, node.lineno, True) for module in table]
    return []


def layer_problems(root: Path, package: str, pyproject: Path) -> list[str]:
    """Cycles, imports against the layer order, and modules in no layer."""
    mods = import_graph.modules(root, package)
    graph = import_graph.edges(mods) + _lazy_exports(root / "__init__.py", package)
    order = import_graph.layers(pyproject, CONTRACT)
    problems = [f"cycle: {' <-> '.join(c)}" for c in import_graph.cycles(graph)]
    problems += [
        f"{e.source}:{e.line} imports {e.target}{' by name' if e.by_name else ''} "
        "against the layer order"
        for e in import_graph.against_layers(graph, order, package)
    ]
    problems += [
        f"{m} is in no layer of the contract"
        for m in mods
        if m != package and import_graph.layer_of(m, order) is None
    ]
    return problems


def length_problems(root: Path, package: str, exempt: tuple[str, ...]) -> list[str]:
    problems = []
    for name, path in import_graph.modules(root, package).items():
        if name.split(".")[1:2] and name.split(".")[1] in exempt:
            continue
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{name}.{node.name}: {length} lines")
    return problems


def test_no_module_loads_a_fixed_epass_module_by_name() -> None:
    mods = import_graph.modules(PACKAGE, "epass")
    assert by_name_problems(mods, "epass", NAME_IS_DATA) == []
    # Each allowed call site still exists, and is still the only by-name load there.
    sites = {(load.module, load.function) for load in import_graph.by_name_loads(mods)}
    assert sites == set(NAME_IS_DATA)


def test_the_import_graph_has_no_cycle_and_runs_down_the_layers() -> None:
    pytest.importorskip("tomllib")
    assert layer_problems(PACKAGE, "epass", ROOT / "pyproject.toml") == []
    # The grammar is data below the contract: the registry and the manager build
    # on it, it builds on nothing of theirs.
    order = import_graph.layers(ROOT / "pyproject.toml", CONTRACT)

    def depth(module: str) -> int:
        found = import_graph.layer_of(module, order)
        assert found is not None, module
        return found[0]

    assert depth("epass.manager") < depth("epass.registry") < depth("epass.protocol")
    assert depth("epass.options") < depth("epass.pipeline") < depth("epass.errors")


def test_no_function_over_60_lines_and_no_module_over_700() -> None:
    assert length_problems(PACKAGE, "epass", ()) == []


def one_concept_problems(root: Path, package: str) -> list[str]:
    """Modules over :data:`ONE_CONCEPT_LINES` lines whose docstring has no line
    ``One concept: ...`` saying why they are one."""
    problems = []
    for name, path in import_graph.modules(root, package).items():
        source = path.read_text()
        if len(source.splitlines()) <= ONE_CONCEPT_LINES:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        if not any(line.strip().startswith("One concept: ") for line in doc.splitlines()):
            problems.append(f"{name}: {len(source.splitlines())} lines, no 'One concept:' line")
    return problems


def test_a_module_over_500_lines_says_why_it_is_one_concept() -> None:
    assert one_concept_problems(PACKAGE, "epass") == []


def test_every_module_is_named_by_an_import_contract() -> None:
    pytest.importorskip("tomllib")
    assert import_graph.unnamed_modules(PACKAGE, "epass", ROOT / "pyproject.toml", CONTRACT) == []


PLANTED = {
    "__init__.py": "",
    "low.py": (
        "import importlib\n"
        "from importlib import import_module as load\n"
        "import pkgutil\n\n"
        "def up():\n"
        "    return importlib.import_module('pkg.high')\n\n"
        "def hidden(x):\n"
        "    return load(f'pkg.{x}')\n\n"
        "def resolved():\n"
        "    return pkgutil.resolve_name('pkg.mid:Thing')\n\n"
        "def dunder():\n"
        "    return __import__('pkg.mid')\n\n"
        "def data(name):\n"
        "    return importlib.import_module(name)\n"
    ),
    "mid.py": "def later():\n    from pkg.high import x\n    return x\n",
    "high.py": "from pkg import low\nx = low\n",
    "stray.py": "import pkg.low\n",
}
PLANTED_CONTRACT = """
[tool.importlinter]
root_package = "pkg"

[[tool.importlinter.contracts]]
name = "epass layers"
type = "layers"
layers = ["pkg.high", "pkg.mid", "pkg.low"]
"""


def _plant(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    root.mkdir()
    for name, source in PLANTED.items():
        (root / name).write_text(source)
    (tmp_path / "pyproject.toml").write_text(PLANTED_CONTRACT)
    return root


def test_the_checks_catch_planted_loads_cycles_and_upward_imports(tmp_path: Path) -> None:
    pytest.importorskip("tomllib")
    root = _plant(tmp_path)
    mods = import_graph.modules(root, "pkg")
    problems = by_name_problems(mods, "pkg", {})
    assert [p.split(" ", 1)[0] for p in problems] == [
        "pkg.low:6",  # import_module("pkg.high")
        "pkg.low:9",  # an f-string naming a pkg module
        "pkg.low:12",  # pkgutil.resolve_name
        "pkg.low:15",  # __import__
        "pkg.low:18",  # a name that is not in the source, at a site not known to load data
    ]
    assert by_name_problems(mods, "pkg", {("pkg.low", "data"): "planted"})[4:] == []
    found = layer_problems(root, "pkg", tmp_path / "pyproject.toml")
    assert "cycle: pkg.high <-> pkg.low <-> pkg.mid" in found
    assert "pkg.low:6 imports pkg.high by name against the layer order" in found
    assert "pkg.mid:2 imports pkg.high against the layer order" in found  # inside a function
    assert "pkg.stray is in no layer of the contract" in found


PLANTED_PACKAGE_CONTRACT = """
[tool.importlinter]
root_package = "pkg"

[[tool.importlinter.contracts]]
name = "epass layers"
type = "layers"
layers = ["pkg.high", "pkg.sub", "pkg.low"]

[[tool.importlinter.contracts]]
name = "inside sub"
type = "layers"
containers = ["pkg.sub"]
layers = ["top", "bottom"]
"""


def test_the_contract_check_catches_modules_no_contract_names(tmp_path: Path) -> None:
    pytest.importorskip("tomllib")
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "plain").mkdir()
    for name in ("__init__", "high", "low", "stray", "sub/__init__", "sub/top", "sub/bottom"):
        (root / f"{name}.py").write_text("")
    (root / "sub" / "new.py").write_text("")
    (root / "plain" / "__init__.py").write_text("")
    (root / "plain" / "inner.py").write_text("")
    (tmp_path / "pyproject.toml").write_text(PLANTED_PACKAGE_CONTRACT)
    assert import_graph.unnamed_modules(root, "pkg", tmp_path / "pyproject.toml", CONTRACT) == [
        "pkg.plain is in no layer of 'epass layers'",
        "pkg.plain.inner is in no layer of a contract over pkg.plain",
        "pkg.stray is in no layer of 'epass layers'",
        "pkg.sub.new is in no layer of a contract over pkg.sub",
    ]


def test_the_one_concept_check_catches_a_long_module_without_its_reason(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    body = "x = 1\n" * ONE_CONCEPT_LINES
    (root / "said.py").write_text(f'"""Long.\n\nOne concept: the planted one.\n"""\n{body}')
    (root / "silent.py").write_text(f'"""Long, and says nothing of why."""\n{body}')
    (root / "short.py").write_text('"""Short."""\nx = 1\n')
    assert one_concept_problems(root, "pkg") == [
        f"pkg.silent: {ONE_CONCEPT_LINES + 1} lines, no 'One concept:' line"
    ]


def test_the_length_check_catches_a_long_function_and_a_long_module(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (root / "long.py").write_text(f"def long():\n{body}")
    (root / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (root / "_skip.py").write_text(f"def long():\n{body}")
    assert length_problems(root, "pkg", ("_skip",)) == [
        f"pkg.big: {MAX_MODULE_LINES + 1} lines",
        f"pkg.long.long: {MAX_FUNCTION_LINES + 1} lines",
    ]

"""``epass._decomp.kernels``: the Python kernels registered through ``torch.library``
that a template may run, read again at every registration (a new kernel for a key
torch already holds included), and the ones no cache key can name."""

from __future__ import annotations

import shutil
import textwrap

import pytest
import torch
from decomp_helpers import run_script
from torch import nn

from epass import Decompose
from epass._decomp import identity
from epass._decomp.check import first_difference
from epass._decomp.table import split_table
from epass._torch import operators

aten = torch.ops.aten


def _times_two(x):
    return x * 2


def test_a_kernel_registered_in_place_of_another_with_the_same_count_is_seen():
    # A registration elsewhere, named with the table, then gone; a kernel for silu in
    # its place: torch.library holds as many registrations as before.
    other = torch.library.Library("epass_kernels_test", "FRAGMENT")
    other.define("noop(Tensor x) -> Tensor")
    other.impl("noop", lambda x: x, "CPU")
    assert identity.cache_name(split_table(None)).table is not None
    count = len(operators.library_impls())
    other._destroy()
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("silu", _times_two, "CompositeImplicitAutograd")
    try:
        assert len(operators.library_impls()) == count
        assert identity.library_kernels() == ["aten::silu/CompositeImplicitAutograd"]
        name = identity.cache_name(split_table(None))
        assert name.table is None and "aten::silu/CompositeImplicitAutograd" in name.why_not
    finally:
        lib._destroy()
    assert identity.library_kernels() == []


def test_a_kernel_overriding_one_of_torchs_own_is_seen():
    # torch registers silu's meta kernel from its own files; a kernel from here
    # replaces it under the same key (torch.library overrides by default).
    key = "aten/silu/Meta"
    assert key in operators.library_impls()
    assert identity.cache_name(split_table(None)).table is not None
    count = len(operators.library_impls())
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("silu", lambda x: torch.empty_like(x), "Meta")
    try:
        assert len(operators.library_impls()) == count
        assert identity.library_kernels() == ["aten::silu/Meta"]
        assert identity.cache_name(split_table(None)).table is None
    finally:
        lib._destroy()
    assert identity.library_kernels() == []


def test_a_kernel_registered_through_torch_library_impl_is_not_torchs_own():
    # torch.library.impl without a library makes one in torch's own file: where the
    # dispatcher says the kernel came from is no evidence of whose it is.
    kept = list(torch.library._keep_alive)
    torch.library.impl("aten::silu", "CompositeImplicitAutograd", func=_times_two)
    (made,) = [lib for lib in torch.library._keep_alive if lib not in kept]
    try:
        where = operators.registered_from("aten/silu/CompositeImplicitAutograd")
        assert where == torch.library.__file__
        assert identity.library_kernels() == ["aten::silu/CompositeImplicitAutograd"]
        assert identity.cache_name(split_table(None)).table is None
    finally:
        made._destroy()
        torch.library._keep_alive.remove(made)
    assert identity.library_kernels() == []


# --- a custom op's CompositeImplicitAutograd kernel from Python -----------------------


class _Scaled(nn.Module):
    def forward(self, x):
        return torch.ops.epass_kernels_test.scaled(x) + 1


def test_a_custom_ops_kernel_replaced_in_process_gets_torchs_graph():
    definition = torch.library.Library("epass_kernels_test", "FRAGMENT")
    definition.define("scaled(Tensor x) -> Tensor")
    definition.impl("scaled", _times_two, "CompositeImplicitAutograd")
    replaced = torch.library.Library("epass_kernels_test", "IMPL")
    try:
        ep = torch.export.export(_Scaled(), (torch.ones(2),))
        first = Decompose(method="incremental")(ep)
        assert first_difference(first.program, ep.run_decompositions()) is None
        # Another kernel for the same key: torch.library holds as many keys as before.
        replaced.impl("scaled", lambda x: x * 3, "CompositeImplicitAutograd")
        second = Decompose(method="incremental")(ep)
        ref = ep.run_decompositions()
        assert first_difference(second.program, ref) is None
        x = torch.ones(2)
        assert second.program.module()(x).tolist() == ref.module()(x).tolist() == [4.0, 4.0]
        for result in (first, second):
            assert "epass_kernels_test::scaled (registered from" in result.notes["cache"]
    finally:
        replaced._destroy()
        definition._destroy()


def test_a_custom_ops_kernel_registered_without_a_dispatch_key_is_judged():
    # A library made without a dispatch key registers a kernel given none as
    # CompositeImplicitAutograd; torch.library records it under an empty key.
    from epass._decomp import kernels

    lib = torch.library.Library("epass_kernels_test", "DEF")
    lib.define("bare(Tensor x) -> Tensor")
    lib.impl("bare", _times_two)
    try:
        assert "epass_kernels_test/bare/" in operators.library_impls()
        why = dict(kernels.registered().unkept)["epass_kernels_test::bare"]
        assert why == f"registered from {__file__}"
        ep = torch.export.export(_Bare(), (torch.ones(2),))
        result = Decompose(method="incremental")(ep)
        assert "epass_kernels_test::bare (registered from" in result.notes["cache"]
    finally:
        lib._destroy()
    assert "epass_kernels_test::bare" not in dict(kernels.registered().unkept)


class _Bare(nn.Module):
    def forward(self, x):
        return torch.ops.epass_kernels_test.bare(x) + 1


# Decomposes silu of the custom op ``{namespace}::scaled`` (defined above it in the
# script) with torch's default table; prints the output, torch's, the cache note and
# the disk counters.
_DECOMPOSE_SCALED = """

class Scaled(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(torch.ops.{namespace}.scaled(x))


ep = torch.export.export(Scaled(), (torch.ones(2),))
result = Decompose(method="incremental")(ep)
x = torch.ones(2)
print(json.dumps({{
    "ours": result.program.module()(x).tolist(),
    "torch": ep.run_decompositions().module()(x).tolist(),
    "note": result.notes.get("cache"),
    "disk": disk.info(),
}}))
"""


def _assert_each_process_gets_torchs_numbers(runs: list[dict], op: str) -> None:
    """Two processes, each with its own kernel for ``op``, sharing one disk cache."""
    assert [run["ours"] for run in runs] == [run["torch"] for run in runs]
    assert runs[0]["ours"] != runs[1]["ours"]
    assert all(op in run["note"] for run in runs)
    # silu's template, whose trace runs no such kernel, is still kept on disk.
    assert runs[0]["disk"]["writes"] >= 1 and runs[1]["disk"]["hits"] >= 1


# Defines a custom op whose Python kernel multiplies by EPASS_TEST_SCALE, then
# decomposes as _DECOMPOSE_SCALED does.
_CUSTOM_OP = textwrap.dedent(
    """
    import json, os
    import torch
    from epass import Decompose
    from epass._decomp import disk

    lib = torch.library.Library("epass_kernels_test", "FRAGMENT")
    lib.define("scaled(Tensor x) -> Tensor")
    SCALE = float(os.environ["EPASS_TEST_SCALE"])
    lib.impl("scaled", lambda x: x * SCALE, "CompositeImplicitAutograd")

    """
) + _DECOMPOSE_SCALED.format(namespace="epass_kernels_test")


def test_a_custom_ops_kernel_changed_between_processes_gets_torchs_numbers(tmp_path):
    runs = [
        run_script(_CUSTOM_OP, tmp_path / "cache", env={"EPASS_TEST_SCALE": scale})
        for scale in ("2.0", "3.0")
    ]
    _assert_each_process_gets_torchs_numbers(runs, "epass_kernels_test::scaled")


# --- a custom op's CompositeImplicitAutograd kernel from C++ --------------------------

_CXX_SOURCE = """
#include <ATen/ATen.h>
#include <torch/library.h>

static at::Tensor scaled(const at::Tensor& x) { return x * SCALE; }

TORCH_LIBRARY(epass_cxx_test, m) {
  m.def("scaled(Tensor x) -> Tensor");
  m.impl("scaled", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(scaled));
}
"""

# Builds and loads a C++ extension whose custom op's CompositeImplicitAutograd kernel
# multiplies by EPASS_TEST_SCALE (compiled in), then decomposes as _DECOMPOSE_SCALED does.
_CXX_OP = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch.utils import cpp_extension
    from epass import Decompose
    from epass._decomp import disk

    folder, scale = sys.argv[1], os.environ["EPASS_TEST_SCALE"]
    cpp_extension.load(
        name="epass_cxx_test_" + scale.replace(".", "_"),
        sources=[os.path.join(folder, "ext.cpp")],
        extra_cflags=["-DSCALE=" + scale, "-O0"],
        is_python_module=False,
        build_directory=folder,
    )

    """
) + _DECOMPOSE_SCALED.format(namespace="epass_cxx_test")


@pytest.mark.slow
def test_a_cxx_custom_ops_kernel_changed_between_processes_gets_torchs_numbers(tmp_path):
    # The kernel is C++, registered outside torch's source tree: the operator's name
    # does not name it, and another build of the extension computes something else.
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("building a C++ extension needs a C++ compiler and ninja")
    runs = []
    for scale in ("2.0", "3.0"):
        folder = tmp_path / f"build-{scale}"
        folder.mkdir()
        (folder / "ext.cpp").write_text(_CXX_SOURCE)
        env = {"EPASS_TEST_SCALE": scale}
        runs.append(run_script(_CXX_OP, tmp_path / "cache", str(folder), env=env))
    _assert_each_process_gets_torchs_numbers(
        runs, "epass_cxx_test::scaled runs a C++ kernel registered at"
    )


def test_torchs_own_cxx_kernels_are_torchs(tmp_path):
    # Every C++ CompositeImplicitAutograd kernel of a torch without extensions lies in
    # its source tree, but for its test operators, registered where nothing says.
    script = (
        "import json\n"
        "from epass._decomp import kernels\n"
        "print(json.dumps([kernels._build_root(), dict(kernels.registered().unkept)]))\n"
    )
    root, unkept = run_script(script, tmp_path / "cache")
    assert root is not None
    assert {name.partition("::")[0] for name in unkept} <= {"_test"}, unkept


def test_the_build_root_is_read_only_off_torchs_generated_registrations(monkeypatch):
    # An extension that replaced linear's kernel would otherwise name its own tree
    # torch's, and its custom ops' kernels with it.
    from epass._decomp import kernels

    where = operators.registered_from("aten/linear/CompositeImplicitAutograd")
    assert kernels._build_root() is not None and where.startswith(kernels._build_root())
    for replaced in ("/ext/aten/src/ATen/native/linear.cpp", "/ext/linear.cpp", ""):
        monkeypatch.setattr(operators, "registered_from", lambda key, w=replaced: w)
        assert kernels._build_root() is None, replaced


def test_every_kernel_of_a_library_is_registered_from_the_file_that_made_it():
    # The kernel walk asks the dispatcher once a library: torch.library hands the
    # library's birthplace to the dispatcher, and each kernel carries it.
    lib = _made_elsewhere()
    lib.impl("silu", _times_two, "CompositeImplicitAutograd")
    lib.impl("gelu", _times_two, "CompositeImplicitAutograd")
    try:
        for key_set in operators.library_key_sets():
            files = {operators.registered_from(k) for k in list(key_set)}
            assert len(files) <= 1, (sorted(key_set)[:3], files)
        assert operators.registered_from("aten/gelu/CompositeImplicitAutograd") == (
            textwrap.__file__
        )
        assert identity.library_kernels() == [
            "aten::gelu/CompositeImplicitAutograd",
            "aten::silu/CompositeImplicitAutograd",
        ]
    finally:
        lib._destroy()
    assert identity.library_kernels() == []


def _made_elsewhere():
    """An ``aten`` library made by code of another file (the standard library's)."""
    made_in = {"torch": torch}
    code = compile("lib = torch.library.Library('aten', 'IMPL')", textwrap.__file__, "exec")
    exec(code, made_in)
    return made_in["lib"]

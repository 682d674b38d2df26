"""``epass._decomp.made`` and ``installed``: an installed library's decomposition is
named by its version, its files exactly as installed, and the values of what it reads,
and has no name when any of those is not so."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from decomp_helpers import run_script
from installed_library import NAME, install

from epass._decomp import identity, installed, made
from epass._decomp.table import split_table

aten = torch.ops.aten


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A function to import the library installed in a site directory of its own
    (``install``'s options), forgotten after the test."""

    def load(**options):
        site = tmp_path / "site"
        package = install(site, **options)
        monkeypatch.syspath_prepend(str(site))
        return importlib.import_module(NAME), package

    yield load
    for name in [n for n in sys.modules if n == NAME or n.startswith(f"{NAME}.")]:
        del sys.modules[name]


class _Scale:
    def __getitem__(self, index):
        return 2.0


def _name(fn):
    return identity.name_of(fn, aten.silu.default)


def test_an_installed_librarys_function_is_named_by_its_version_and_what_it_reads(library):
    lib, _ = library()
    name = _name(lib.silu)
    assert name.startswith(f"made:{NAME}==1.0:{NAME}.silu:")
    assert _name(lib.silu) == name
    assert identity.cache_name(split_table({aten.silu.default: lib.silu})).table is not None
    lib.SCALE = 3.0  # a global it reads, rebound
    assert _name(lib.silu) != name
    configured = _name(lib.configured)
    lib.settings.FACTOR = 3.0  # an attribute it reads of its own module
    assert _name(lib.configured) != configured


def test_state_a_library_function_reads_through_an_instance_or_a_function_is_named(library):
    # a class attribute read through an instance, an attribute set on a function
    lib, _ = library()
    for fn, holder, field in (
        (lib.through_an_instance, lib.Options, "scale"),
        (lib.through_a_function, lib.helper, "factor"),
    ):
        name = _name(fn)
        setattr(holder, field, 5.0)
        assert _name(fn) != name, fn.__name__


def test_a_library_function_reading_attributes_by_name_has_no_name(library):
    lib, _ = library()
    with pytest.raises(identity.Unnamed, match="getattr"):
        _name(lib.by_name)


def test_a_library_function_reading_a_mutable_or_a_users_object_has_no_name(library):
    lib, _ = library()
    with pytest.raises(identity.Unnamed, match=r"it reads a builtins\.list, which can change"):
        _name(lib.from_list)
    with pytest.raises(identity.Unnamed, match=r"it reads a builtins\.list"):
        _name(lib.scaled([2.0]))  # a closure over the caller's list
    with pytest.raises(identity.Unnamed, match=r"module test_made: .*test_made\.py is no"):
        _name(lib.scaled(_Scale()))  # an object of the caller's
    two, three = _name(lib.scaled((2.0,))), _name(lib.scaled((3.0,)))
    assert two != three and two.startswith(f"made:{NAME}==1.0:{NAME}.scaled.<locals>.silu:")


def test_a_file_changed_after_installing_has_no_name(library):
    lib, package = library()
    named = _name(lib.silu)
    source = package / "__init__.py"
    source.write_text(source.read_text() + "# edited\n")
    installed.clear()  # a new process, or a file not yet judged
    assert (
        "differs from the file epass_fakelib 1.0 installed"
        in installed.lookup(lib.silu.__code__.co_filename).reason
    )
    with pytest.raises(identity.Unnamed, match=r"differs from the file epass_fakelib 1\.0"):
        _name(lib.silu)
    installed.clear()
    source.write_text(source.read_text().removesuffix("# edited\n"))
    assert _name(lib.silu) == named


def test_a_file_edited_in_a_running_process_is_judged_again(library):
    # edited and reloaded under a process that named it before: its functions must not
    # keep the installed file's name (a template traced from them would be stored
    # under it, for every later process to read)
    import os

    lib, package = library()
    _name(lib.silu)
    source = package / "__init__.py"
    text = source.read_text()
    source.write_text(text.replace("SCALE = 2.0", "SCALE = 17.0"))
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    lib = importlib.reload(lib)
    with pytest.raises(identity.Unnamed, match=r"differs from the file epass_fakelib 1\.0"):
        _name(lib.silu)


def test_an_editable_install_has_no_name(library):
    lib, _ = library(editable=True)
    with pytest.raises(identity.Unnamed, match="an editable install of epass_fakelib"):
        _name(lib.silu)


def test_a_function_in_no_installed_file_has_no_name():
    def silu(x):
        return aten.mul.Tensor(x, aten.sigmoid.default(x))

    with pytest.raises(made.NotMade, match=r"test_made\.py is no installed distribution's file"):
        made.library_name(silu)


# Decomposes a SiLU with the installed library's decomposition; prints the cache note,
# the first difference from torch's retrace and the disk counters.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import epass_fakelib
    from epass import Decompose
    from epass._decomp import disk
    from epass._decomp.check import first_difference

    ep = torch.export.export(torch.nn.SiLU(), (torch.randn(2, 3),))
    table = {torch.ops.aten.silu.default: epass_fakelib.silu}
    result = Decompose(table=table, method="incremental")(ep)
    difference = first_difference(result.program, ep.run_decompositions(table))
    print(json.dumps([result.notes.get("cache"), difference, disk.info()]))
    """
)


@pytest.mark.slow
def test_a_second_process_takes_a_librarys_decomposition_from_disk(tmp_path: Path):
    install(tmp_path / "site")
    runs = [run_script(_SCRIPT, tmp_path / "cache", str(tmp_path / "site")) for _ in "ab"]
    for note, difference, _ in runs:
        assert note is None and difference is None
    first, second = (run[2] for run in runs)
    assert first["writes"] == 1 and first["hits"] == 0
    assert second["hits"] == 1 and second["misses"] == 0 and second["bypassed"] == 0


def _torch_coded(value):
    """A function with the code of one of torch's closures, closing over ``value``:
    torch's code in every respect but what it reads."""
    from torch._prims_common import wrappers

    code = wrappers.out_wrapper()(lambda x: x).__code__
    cells = tuple(type((lambda: value).__closure__[0])(value) for _ in code.co_freevars)
    return type(_torch_coded)(code, wrappers.__dict__, "coded", None, cells)


def test_a_function_met_after_freed_temporaries_is_still_judged():
    # Walking each function makes short-lived lists; a later one reusing a freed
    # one's address must not pass as met before.
    for goods in range(6):
        judged = (*[_torch_coded(1) for _ in range(goods)], _torch_coded(_Scale()))
        assert not made.torch_made(judged), goods
    assert made.torch_made(tuple(_torch_coded(1) for _ in range(6)))


def test_a_function_met_in_a_walk_that_found_torchs_alone_is_settled_with_it():
    inner, outer = _torch_coded(2), _torch_coded(None)
    assert made.torch_made((outer, inner))
    assert made._VERDICTS[id(inner)] == (inner, True)
    stranger = _torch_coded(_Scale())
    assert not made.torch_made((stranger, _torch_coded(3)))
    assert made._VERDICTS.get(id(stranger)) is None  # a walk that failed settles nothing


def test_torchs_own_custom_ops_run_torchs_code_alone():
    # The prims torch defines through torch.library.custom_op: their kernels hold
    # their CustomOpDef, and with it its library's handle on the dispatcher.
    from torch._library import custom_ops

    prims = [q for q in custom_ops.OPDEFS if q.startswith("prims::")]
    assert prims
    for qualname in prims:
        definition = custom_ops.OPDEFS[qualname]
        assert made.torch_made(definition), qualname

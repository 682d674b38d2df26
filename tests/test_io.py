"""``epass.io``: hostile .pt2 archives run nothing; saves are atomic; loads are thread-safe."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import epass
from epass.cli import main
from epass.errors import EpassError, LoadError, SaveError, UnsafeArchiveError

ROOT = Path(__file__).resolve().parent.parent


class Small(torch.nn.Module):
    """Parameters, a buffer and a lifted tensor constant: every state member kind."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.offset = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.offset


@pytest.fixture(scope="module")
def program_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("io") / "small.pt2"
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(Small(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, path)
    return path


@pytest.fixture
def quiet_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty temp directory for everything tempfile creates in the test."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("TMPDIR", str(temp))
    return temp


# --- hostile archives ------------------------------------------------------------------


class _Marker:
    """Unpickling this creates a file: the stand-in for arbitrary code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


class TouchTensor(torch.Tensor):
    """A tensor subclass whose unpickling creates a file (``__setstate__`` runs)."""

    def __setstate__(self, state: Any) -> None:
        Path(state[0]["marker"] if isinstance(state, tuple) else state["marker"]).touch()


def _rewrite(
    source: Path, dest: Path, edit: Callable[[str, bytes], bytes | None], extra: dict[str, bytes]
) -> Path:
    """Copy an archive, letting ``edit`` change (or drop, with None) each member."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w") as zout:
        root = zin.namelist()[0].split("/")[0]
        for item in zin.infolist():
            data = edit(item.filename.split("/", 1)[1], zin.read(item.filename))
            if data is not None:
                zout.writestr(item, data)
        for name, data in extra.items():
            zout.writestr(name if name.startswith("/") or ".." in name else f"{root}/{name}", data)
    return dest


def _torch_save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _config_entry(path_name: str, use_pickle: bool) -> dict[str, Any]:
    return {
        "path_name": path_name,
        "is_param": False,
        "use_pickle": use_pickle,
        "tensor_meta": None,
    }


def _with_config_entry(
    source: Path, dest: Path, config: str, key: str, entry: dict[str, Any], extra: dict[str, bytes]
) -> Path:
    def edit(name: str, data: bytes) -> bytes:
        if name == config:
            parsed = json.loads(data)
            parsed["config"][key] = entry
            return json.dumps(parsed).encode()
        return data

    return _rewrite(source, dest, edit, extra)


def _native_library(directory: Path, marker: Path) -> bytes:
    """A shared library whose constructor creates ``marker``, built with gcc."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the hostile library")
    source = directory / "evil.c"
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void run(void) {\n"
        f'    FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n'
        "}\n"
    )
    library = directory / "evil.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    data = library.read_bytes()
    library.unlink()
    source.unlink()
    return data


def _native(src: Path, dest: Path, marker: Path) -> Path:
    members = {
        "data/aotinductor/model/x.wrapper.so": _native_library(dest.parent, marker),
        "data/aotinductor/model/x.wrapper.cpp": b"// nothing",
        "data/aotinductor/model/x.wrapper_metadata.json": b'{"AOTI_DEVICE_KEY": "cpu"}',
    }
    return _rewrite(src, dest, lambda n, d: d, members)


def _uppercase(src: Path, dest: Path, marker: Path) -> Path:
    payload = pickle.dumps(_Marker(str(marker)))
    return _with_config_entry(
        src, dest, "data/constants/model_constants_config.json", "evil",
        _config_entry("opaque_obj_0", True), {"data/constants/OPAQUE_OBJ_0": payload},
    )  # fmt: skip


def _sample_inputs(src: Path, dest: Path, marker: Path) -> Path:
    payload = pickle.dumps(((_Marker(str(marker)),), {}))
    return _rewrite(
        src, dest, lambda n, d: payload if n == "data/sample_inputs/model.pt" else d, {}
    )


def _constants(src: Path, dest: Path, marker: Path) -> Path:
    payload = _torch_save(_Marker(str(marker)))
    config = json.dumps({"config": {"offset": _config_entry("tensor_0", True)}}).encode()

    def edit(name: str, data: bytes) -> bytes:
        if name == "data/constants/tensor_0":
            return payload
        return config if name == "data/constants/model_constants_config.json" else data

    return _rewrite(src, dest, edit, {})


def _subclass_weights(src: Path, dest: Path, marker: Path) -> Path:
    evil = torch.ones(4).as_subclass(TouchTensor)
    evil.marker = str(marker)  # type: ignore[attr-defined]
    payload = _torch_save(evil)
    with zipfile.ZipFile(src) as z:
        config = json.loads(z.read(f"{src.stem}/data/weights/model_weights_config.json"))
    config["config"]["scale"]["use_pickle"] = True
    weight = "data/weights/" + config["config"]["scale"]["path_name"]

    def edit(name: str, data: bytes) -> bytes:
        if name == weight:
            return payload
        if name == "data/weights/model_weights_config.json":
            return json.dumps(config).encode()
        return data

    return _rewrite(src, dest, edit, {})


def _zip_bomb(src: Path, dest: Path, marker: Path) -> Path:
    shutil.copy(src, dest)
    with (
        zipfile.ZipFile(dest, "a", compression=zipfile.ZIP_DEFLATED) as z,
        z.open(f"{src.stem}/extra/bomb.txt", "w", force_zip64=True) as member,
    ):
        zeros = bytes(1 << 20)
        for _ in range(256):  # 256 MiB of zeros in a few hundred KiB
            member.write(zeros)
    return dest


def _path_traversal(src: Path, dest: Path, marker: Path) -> Path:
    escape = "../" * 12 + str(marker).lstrip("/")
    return _rewrite(
        src, dest, lambda n, d: d, {f"{src.stem}/data/aotinductor/model/{escape}": b"x"}
    )


def _sympy_code(src: Path, dest: Path, marker: Path) -> Path:
    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        text = data.decode()
        start = text.index('"expr_str": "') + len('"expr_str": "')
        code = f"__import__('pathlib').Path('{marker}').touch() or "
        return (text[:start] + code + text[start:]).encode()

    return _rewrite(src, dest, edit, {})


def _guard_code(src: Path, dest: Path, marker: Path) -> Path:
    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        program = json.loads(data)
        program["guards_code"] = [f"__import__('pathlib').Path('{marker}').touch() is None"]
        return json.dumps(program).encode()

    return _rewrite(src, dest, edit, {})


def _graph_target(src: Path, dest: Path, marker: Path) -> Path:
    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        program = json.loads(data)
        program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.hub.load"
        return json.dumps(program).encode()

    return _rewrite(src, dest, edit, {})


def _sympy_line_continuation(src: Path, dest: Path, marker: Path) -> Path:
    """Python sees ``Symbol('s0')`` and a comment; sympy, which drops newlines before it
    parses, sees an escaped quote and then a call."""

    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        program = json.loads(data)
        code = f"Symbol('s0\\\n') # ', __import__('pathlib').Path('{marker}').touch())\n"
        program["graph_module"]["graph"]["nodes"][0]["outputs"] = [
            {"as_sym_int": {"as_expr": {"expr_str": code, "hint": None}}}
        ]
        return json.dumps(program).encode()

    return _rewrite(src, dest, edit, {})


def _guard_message(src: Path, dest: Path, marker: Path) -> Path:
    """Guard code that is harmless on its own, but whose quoted key closes the string
    literal torch pastes the guard into when ExportedProgram.module() builds its checks."""

    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        program = json.loads(data)
        key = f" + str(__import__('pathlib').Path('{marker}').touch()) + "
        program["guards_code"] = [f'1 == 1 or L["{key}"]']
        return json.dumps(program).encode()

    return _rewrite(src, dest, edit, {})


class WithMode(torch.nn.Module):
    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        return x * 2 if mode == "a" else x


def _string_input(src: Path, dest: Path, marker: Path) -> Path:
    """A string input's value becomes guard code (``mode == '<value>'``)."""
    plain = dest.parent / "with_mode.pt2"
    torch.export.save(torch.export.export(WithMode(), (torch.randn(2), "a")), plain)
    value = f"' + str(__import__('pathlib').Path('{marker}').touch()) + '"

    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        return data.replace(b'"as_string": "a"', b'"as_string": ' + json.dumps(value).encode())

    return _rewrite(plain, dest, edit, {})


class DictInput(torch.nn.Module):
    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["a"] * 2


def _sample_input_key(src: Path, dest: Path, marker: Path) -> Path:
    """Sample inputs the weights-only unpickler accepts, whose dict key closes the
    string literal torch pastes input paths into when module() builds its checks."""
    plain = dest.parent / "dict_input.pt2"
    torch.export.save(torch.export.export(DictInput(), ({"a": torch.randn(2)},)), plain)
    key = f"+str(__import__('pathlib').Path('{marker}').touch())+"
    inputs = _torch_save((({key: torch.randn(2)},), {}))
    assert not torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(inputs))
    return _rewrite(
        plain, dest, lambda n, d: inputs if n == "data/sample_inputs/model.pt" else d, {}
    )


def _value_name(src: Path, dest: Path, marker: Path) -> Path:
    """A graph value renamed to code: torch writes value names into the ``forward`` it
    generates while loading."""

    def edit(name: str, data: bytes) -> bytes:
        if name != "models/model.json":
            return data
        program = json.loads(data)
        calls = program["graph_module"]["module_call_graph"]
        code = json.dumps(f"y=__import__('pathlib').Path('{marker}').touch()")
        renamed = json.loads(json.dumps(program).replace('"x"', code))
        renamed["graph_module"]["module_call_graph"] = calls
        return json.dumps(renamed).encode()

    return _rewrite(src, dest, edit, {})


HOSTILE = {
    "value-name": _value_name,
    "sample-input-key": _sample_input_key,
    "sympy-line-continuation": _sympy_line_continuation,
    "guard-message": _guard_message,
    "string-input": _string_input,
    "native-library": _native,
    "uppercase-member": _uppercase,
    "sample-inputs-pickle": _sample_inputs,
    "constants-pickle": _constants,
    "tensor-subclass-weights": _subclass_weights,
    "zip-bomb": _zip_bomb,
    "path-traversal": _path_traversal,
    "sympy-expression-code": _sympy_code,
    "guard-code": _guard_code,
    "graph-target": _graph_target,
}


@pytest.mark.parametrize("command", ["inspect", "run"])
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_archive_is_refused_before_anything_runs(
    kind: str,
    command: str,
    program_file: Path,
    tmp_path: Path,
    quiet_tmp: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    marker = tmp_path / "executed"
    evil = HOSTILE[kind](program_file, tmp_path / "evil.pt2", marker)
    argv = [command, str(evil)] + (["-p", "dce", "--check-numerics"] if command == "run" else [])
    code = main(["--plain", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("epass: error: "), err
    assert "refused member" in lines[0] or "not a .pt2" in lines[0], lines[0]
    assert not marker.exists()
    assert list(quiet_tmp.iterdir()) == []  # nothing extracted, nothing left behind
    with pytest.raises(UnsafeArchiveError) as info:
        epass.load(evil)
    assert info.value.member and isinstance(info.value, EpassError)


@pytest.mark.parametrize(
    "kind",
    ["uppercase-member", "sample-inputs-pickle", "constants-pickle", "tensor-subclass-weights",
     "sympy-expression-code", "value-name"],
)  # fmt: skip
def test_torch_export_load_alone_runs_the_hostile_payload(
    kind: str, program_file: Path, tmp_path: Path
) -> None:
    """The archives above are really hostile: plain torch.export.load runs their code,
    wherever this torch reads the member that carries it."""
    marker = tmp_path / "executed"
    evil = HOSTILE[kind](program_file, tmp_path / "evil.pt2", marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(Exception):
            torch.export.load(evil)
    assert marker.exists() is _torch_reads_member(kind)


def _torch_reads_member(kind: str) -> bool:
    """Pickled opaque objects (``OPAQUE_OBJ_<n>`` members) came to the .pt2 format in
    torch 2.13; an older torch's loader does not know the member and never unpickles it.
    epass refuses the member either way (test_hostile_archive_is_refused_before_anything_runs)."""
    from torch.export.pt2_archive import constants

    return kind != "uppercase-member" or hasattr(constants, "OPAQUE_OBJ_FILENAME_PREFIX")


def test_torch_export_load_alone_runs_the_native_library(
    program_file: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "executed"
    evil = _native(program_file, tmp_path / "evil.pt2", marker)
    # In a child process: the library stays loaded in whoever loads it.
    code = f"import torch\ntry: torch.export.load({str(evil)!r})\nexcept Exception: pass\n"
    subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert marker.exists()


@pytest.mark.parametrize("kind", ["guard-message", "string-input", "sample-input-key"])
def test_module_of_a_hostile_program_runs_the_payload(
    kind: str, program_file: Path, tmp_path: Path
) -> None:
    """Those two run nothing while loading: the code runs when the program is called."""
    marker = tmp_path / "executed"
    evil = HOSTILE[kind](program_file, tmp_path / "evil.pt2", marker)
    ep = torch.export.load(evil)
    assert not marker.exists()
    args = {
        "guard-message": (torch.randn(3, 4),),
        "string-input": (torch.randn(2), "a"),
        "sample-input-key": ({"a": torch.randn(2)},),
    }[kind]
    with contextlib.suppress(AssertionError):  # the guard itself may fail afterwards
        ep.module()(*args)
    assert marker.exists()


def _central_directory_elsewhere(src: Path, dest: Path, marker: Path) -> Path:
    """One file, two archives: Python reads the central directory just before the end
    record (a benign program); torch's reader reads the one at the offset that the end
    record states, placed earlier in the file, whose members hold a pickled payload."""
    payload = _torch_save(_Marker(str(marker)))

    def zipped(edit: Callable[[str, bytes], bytes]) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
            for item in zin.infolist():
                entry = zipfile.ZipInfo(item.filename, date_time=item.date_time)
                zout.writestr(entry, edit(item.filename.split("/", 1)[1], zin.read(item)))
        return out.getvalue()

    def evil_edit(name: str, data: bytes) -> bytes:
        if name == "data/constants/tensor_0":
            return payload
        if name == "data/constants/model_constants_config.json":
            config = json.loads(data)
            config["config"]["offset"]["use_pickle"] = True
            return json.dumps(config).encode()
        return data

    def padded(name: str, data: bytes) -> bytes:  # JSON allows trailing blanks
        return data + b" " * len(payload) if name == "models/model.json" else data

    evil, benign = zipped(evil_edit), zipped(padded)

    def directory(z: bytes) -> tuple[int, int]:  # (size, offset) from the end record
        end = z.rindex(b"PK\x05\x06")
        return struct.unpack("<LL", z[end + 12 : end + 20])

    (evil_size, evil_offset), (size, offset) = directory(evil), directory(benign)
    assert evil_size == size and evil_offset <= offset
    prefix = (
        evil[:evil_offset] + bytes(offset - evil_offset) + evil[evil_offset : evil_offset + size]
    )
    dest.write_bytes(prefix + benign)
    return dest


def test_central_directory_torch_alone_would_read_is_never_loaded(
    program_file: Path, tmp_path: Path, quiet_tmp: Path
) -> None:
    marker = tmp_path / "executed"
    evil = _central_directory_elsewhere(program_file, tmp_path / "evil.pt2", marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.load(evil)  # torch's reader sees the hostile members
    assert marker.exists()
    marker.unlink()
    ep = epass.load(evil)  # loads a copy of exactly the members that were screened
    assert not marker.exists()
    torch.testing.assert_close(ep.constants["offset"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert list(quiet_tmp.iterdir()) == []


def test_file_changed_after_screening_is_not_what_loads(
    program_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer (or a network file system) changing the file between the screen and
    torch's read of it must not get the change loaded."""
    marker = tmp_path / "executed"
    target = tmp_path / "model.pt2"
    shutil.copy(program_file, target)
    hostile = _constants(program_file, tmp_path / "hostile.pt2", marker).read_bytes()
    screen = epass.io.screen

    def screen_then_swap(file: Any, *, name: str = "<archive>") -> None:
        screen(file, name=name)
        with open(target, "r+b") as f:  # in place: same inode, same open handles
            f.write(hostile)
            f.truncate()

    monkeypatch.setattr(epass.io, "screen", screen_then_swap)
    with contextlib.suppress(EpassError):
        epass.load(target)
    assert not marker.exists()


def test_bytes_rewritten_after_screening_are_not_what_torch_reads(
    program_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once screened, the directories, headers and program text torch reads are the
    screened bytes; only raw tensor data, which the screen never reads, comes from
    the disk afterwards (here zeros: the file was wiped in place)."""
    target = tmp_path / "model.pt2"
    shutil.copy(program_file, target)
    screen = epass.io.screen

    def screen_then_wipe(file: Any, *, name: str = "<archive>") -> None:
        screen(file, name=name)
        size = target.stat().st_size
        with open(target, "r+b") as f:  # in place: same inode, same open handles
            f.write(bytes(size))

    monkeypatch.setattr(epass.io, "screen", screen_then_wipe)
    ep = epass.load(target)
    reference = torch.export.load(program_file)
    assert [n.target for n in ep.graph.nodes] == [n.target for n in reference.graph.nodes]
    assert sorted(ep.state_dict) == sorted(reference.state_dict)
    # Raw tensor data comes from the disk after the wipe (zeros), or, where torch's zip
    # reader has no record-size call (torch 2.11, 2.12) and each record is read whole to
    # tell its size, from the bytes the view kept from that read: never anything else.
    wiped = [not v.any() for v in ep.state_dict.values()]
    screened = [torch.equal(v, reference.state_dict[k]) for k, v in ep.state_dict.items()]
    assert all(wiped) or all(screened), (wiped, screened)


def test_the_view_keeps_no_tensor_data_where_torch_reads_records_to_size_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before torch 2.13 its zip reader tells a record's size only by reading it; the
    readers' agreement check then reads every tensor, and the view must not keep
    those bytes (a second copy of the weights in memory). Simulated on any release."""
    from epass._screen import read_once
    from epass._torch import archives

    def read_whole(reader: Any, name: str) -> int:
        return len(reader.get_record(name))

    monkeypatch.setattr(archives, "record_size", read_whole)
    views: list[read_once.ReadOnce] = []

    class Recorded(read_once.ReadOnce):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            views.append(self)

    monkeypatch.setattr(epass.io, "ReadOnce", Recorded)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    torch.export.save(torch.export.export(model, (torch.randn(2, 512),)), tmp_path / "m.pt2")
    ep = epass.load(tmp_path / "m.pt2")
    weights = sum(t.nbytes for t in ep.state_dict.values())
    kept = sum(len(chunk) for chunk in views[0]._chunks)
    assert weights > 2 << 20 and kept < weights // 20, (kept, weights)
    reference = torch.export.load(tmp_path / "m.pt2")
    assert all(torch.equal(v, reference.state_dict[k]) for k, v in ep.state_dict.items())


def test_screen_refuses_members_torch_finds_elsewhere(program_file: Path, tmp_path: Path) -> None:
    """Loading canonicalizes such a file (above); screening it as it is refuses it."""
    evil = _central_directory_elsewhere(program_file, tmp_path / "evil.pt2", tmp_path / "m")
    with open(evil, "rb") as f, pytest.raises(UnsafeArchiveError, match="disagree"):
        epass.io.screen(f, name=str(evil))
    with open(evil, "rb") as f:
        assert not epass._screen.readers_agree(f)
    with open(program_file, "rb") as f:
        assert epass._screen.readers_agree(f)


def test_trusted_load_is_torch_export_load(program_file: Path) -> None:
    ep = epass.load(program_file, trust=True)
    assert isinstance(ep, torch.export.ExportedProgram)


def test_legitimate_programs_still_load(program_file: Path, tmp_path: Path) -> None:
    ep = epass.load(program_file)
    assert sorted(ep.state_dict) == ["lin.bias", "lin.weight", "scale"]
    assert sorted(ep.constants) == ["offset"]
    x = torch.randn(5, 4)  # the dynamic batch survived the round trip
    expected = torch.export.load(program_file).module()(x)
    torch.testing.assert_close(ep.module()(x), expected)
    lowered = epass.PassManager.from_text("lower").run(ep)
    epass.save(lowered, tmp_path / "lowered.pt2")
    assert len(epass.load(tmp_path / "lowered.pt2").graph.nodes) == len(lowered.graph.nodes)


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_zoo_programs_load_screened(dynamic: bool, tmp_path: Path) -> None:
    import hf_models
    import models

    for name in models.CASES:
        _, ep, _ = models.export(name, dynamic=dynamic)
        torch.export.save(ep, tmp_path / f"{name}.pt2")
        assert len(epass.load(tmp_path / f"{name}.pt2").graph.nodes) == len(ep.graph.nodes)
    for name in hf_models.ZOO:
        _, ep, _ = hf_models.export(name, dynamic=dynamic)
        torch.export.save(ep, tmp_path / f"{name}.pt2")
        assert len(epass.load(tmp_path / f"{name}.pt2").graph.nodes) == len(ep.graph.nodes)


def test_screen_names_the_member_in_one_line(program_file: Path, tmp_path: Path) -> None:
    evil = _rewrite(program_file, tmp_path / "e.pt2", lambda n, d: d, {"data/notes.bin": b"?"})
    with pytest.raises(UnsafeArchiveError) as info:
        epass.load(evil)
    assert info.value.member == "small/data/notes.bin"
    assert "\n" not in str(info.value)


def test_load_errors_are_load_errors(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="no such file"):
        epass.load(tmp_path / "missing.pt2")
    (tmp_path / "text.pt2").write_text("not a zip")
    with pytest.raises(LoadError, match=r"not a \.pt2 archive"):
        epass.load(tmp_path / "text.pt2")


@pytest.mark.parametrize("trust", [False, True])
def test_loading_a_fifo_fails_at_once_instead_of_waiting_for_a_writer(
    tmp_path: Path, trust: bool
) -> None:
    fifo = tmp_path / "pipe.pt2"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            epass.load(fifo, trust=trust)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        with open(fifo, "wb"):  # let the reader go
            pass
        pytest.fail("epass.load waited on a FIFO")
    assert len(errors) == 1 and isinstance(errors[0], LoadError), errors
    assert "not a regular file" in str(errors[0])


# --- threads ---------------------------------------------------------------------------


class _Config:
    """A plain object: loading it needs ``torch.load(weights_only=False)``."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_trusted_torch_load_in_threads_is_unaffected_by_io_load(
    program_file: Path, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "config.pt"
    torch.save({"config": _Config(7), "t": torch.ones(2)}, checkpoint)
    real_load = torch.load
    failures: list[BaseException] = []
    loaded: list[int] = []
    stop = threading.Event()

    def trusted() -> None:
        while not stop.is_set():
            try:
                loaded.append(torch.load(checkpoint, weights_only=False)["config"].value)
            except BaseException as exc:
                failures.append(exc)

    def screened() -> None:
        for _ in range(3):
            try:
                epass.load(program_file)
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=trusted) for _ in range(4)]
    loaders = [threading.Thread(target=screened) for _ in range(3)]
    for t in threads + loaders:
        t.start()
    for t in loaders:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    assert failures == []
    assert len(loaded) > 0 and set(loaded) == {7}
    assert torch.load is real_load  # nothing process-global was swapped


# --- saving ----------------------------------------------------------------------------


class Unpicklable(torch.Tensor):
    """A tensor subclass that refuses to be pickled: torch.export.save fails half-way."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("this tensor refuses to be saved")


def test_failed_save_leaves_the_target_as_it_was(tmp_path: Path) -> None:
    ep = torch.export.export(Small(), (torch.randn(3, 4),))
    target = tmp_path / "out.pt2"
    target.write_bytes(b"previous contents")
    broken = epass.prune(ep)
    broken.state_dict["scale"] = broken.state_dict["scale"].as_subclass(Unpicklable)
    with pytest.raises(SaveError, match="refuses to be saved"):
        epass.save(broken, target)
    assert target.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pt2"]  # no temp file left
    epass.save(ep, target)
    assert sorted(epass.load(target).state_dict) == sorted(ep.state_dict)
    assert oct(target.stat().st_mode & 0o777) != oct(0o600)  # the umask, not mkstemp's 0600


@pytest.mark.parametrize("where", ["same-file-system", "/dev/shm"])
def test_output_symlink_is_replaced_not_followed(where: str, tmp_path: Path) -> None:
    """The temporary file goes beside the link, so the rename replaces the link, never
    writes through it, and never crosses file systems after the work is done."""
    if where == "same-file-system":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
    else:
        if not os.path.isdir(where) or os.stat(where).st_dev == tmp_path.stat().st_dev:
            pytest.skip(f"{where} is not a separate file system here")
        elsewhere = Path(tempfile.mkdtemp(dir=where))
    try:
        link = tmp_path / "out.pt2"
        link.symlink_to(elsewhere / "target.pt2")
        ep = torch.export.export(Small(), (torch.randn(3, 4),))
        epass.save(ep, link)
        assert not link.is_symlink() and sorted(epass.load(link).state_dict) == sorted(
            ep.state_dict
        )
        assert list(elsewhere.iterdir()) == []  # no target written, no temp file left
    finally:
        shutil.rmtree(elsewhere)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists descriptors in /proc")
def test_saving_over_a_large_file_replaces_it_and_keeps_no_descriptor(tmp_path: Path) -> None:
    """The replaced file is held open across the rename and closed by a thread: the
    close must happen, and the new file is in place when save returns."""
    target = tmp_path / "big.pt2"
    target.write_bytes(b"old" * (1 << 23))  # 24 MiB: large enough to be held
    ep = torch.export.export(Small(), (torch.randn(3, 4),))
    before = len(os.listdir("/proc/self/fd"))
    with open(target, "rb") as reader:  # a reader of the old file keeps reading it
        epass.save(ep, target)
        assert reader.read(3) == b"old"
    assert zipfile.is_zipfile(target)
    for thread in threading.enumerate():
        if thread.name == "epass-release":
            thread.join()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("swap", [True, False], ids=["swapped", "renamed"])
def test_save_over_a_file_swaps_it_in_and_names_the_archive_as_torch_does(
    swap: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Linux an existing output is swapped with the new file (no flush at the
    rename); where the swap is not available, a rename does the same. Either way the
    archive's root folder is named after the output, as torch.export.save names it,
    and nothing is left beside it."""
    from epass import io as epass_io

    calls: list[bytes] = []
    found = epass_io._renameat2()
    if swap and found is None:
        pytest.skip("renameat2 is not available here")

    def counted(*args: Any) -> int:
        calls.append(args[3])
        return found(*args)  # type: ignore[misc]

    monkeypatch.setattr(epass_io, "_renameat2", lambda: counted if swap else None)
    ep = torch.export.export(Small(), (torch.randn(3, 4),))
    target = tmp_path / "model.pt2"
    target.write_bytes(b"previous contents")
    with open(target, "rb") as reader:
        epass.save(ep, target)
        assert reader.read() == b"previous contents"  # a reader keeps the old file
    assert calls == ([os.fsencode(target)] if swap else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2"]
    with zipfile.ZipFile(target) as z:
        assert {name.split("/")[0] for name in z.namelist()} == {"model"}
    assert sorted(epass.load(target).state_dict) == sorted(ep.state_dict)
    epass.save(ep, tmp_path / "new.pt2")  # nothing to swap with: a plain rename
    assert calls == ([os.fsencode(target)] if swap else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt2", "new.pt2"]


def test_save_checks_the_path_first(tmp_path: Path) -> None:
    ep = torch.export.export(Small(), (torch.randn(3, 4),))
    with pytest.raises(SaveError, match=r"must end in \.pt2"):
        epass.save(ep, tmp_path / "out.zip")
    with pytest.raises(SaveError, match="does not exist"):
        epass.save(ep, tmp_path / "missing" / "out.pt2")


def test_inspect_is_the_data_the_cli_prints(program_file: Path) -> None:
    info = epass.inspect(epass.load(program_file))
    assert info["state"]["parameters"] == {"count": 2, "bytes": 80}
    assert info["state"]["constants"]["count"] == 1
    assert info["signature"]["user_inputs"] == ["x"]


def test_private_loader_is_pinned(program_file: Path) -> None:
    """``_pt2.read_program`` leans on torch's archive loader; fail loudly if it moves."""
    from torch.export.pt2_archive import _package

    from epass import _pt2

    assert callable(_package.load_pt2)
    with open(program_file, "rb") as f:
        contents = _package.load_pt2(f)
    assert set(contents.exported_programs) == {"model"}
    with open(program_file, "rb") as f:
        assert isinstance(_pt2.read_program(f), torch.export.ExportedProgram)
    # The screen compares torch's zip reader's members and data offsets with Python's.
    with open(program_file, "rb") as f:
        records = _pt2.archive_records(f)
    with zipfile.ZipFile(program_file) as z:
        assert set(records) == {i.filename.split("/", 1)[1] for i in z.infolist()}
        info = z.infolist()[0]
        offset, size = records[info.filename.split("/", 1)[1]]
        with open(program_file, "rb") as f:
            f.seek(offset)
            assert f.read(size) == z.read(info)
    # Why loads are serialized: torch's deserializer refuses to overlap with itself.
    from torch._export.serde import serialize

    assert hasattr(serialize, "_CURRENT_DESERIALIZER")
    # The static pickle check the screen relies on.
    assert torch.serialization.get_unsafe_globals_in_checkpoint(
        io.BytesIO(_torch_save(_Marker("x")))
    )


def test_python_dash_m_epass_runs_the_command(program_file: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "epass", "inspect", str(program_file), "--json"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["signature"]["user_inputs"] == ["x"]


class Shapes(torch.nn.Module):
    """Backed and unbacked symbols, float shape arithmetic and guards between inputs."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        nonzero = x.nonzero()
        return x[: y.shape[0]] * 2, nonzero.shape[0] * 1.5, y.sum()


def test_symbolic_expressions_and_guards_of_real_programs_pass_the_screen(
    tmp_path: Path,
) -> None:
    n, m = torch.export.Dim("n", min=4, max=64), torch.export.Dim("m", max=32)
    ep = torch.export.export(
        Shapes(), (torch.randn(8, 4), torch.randn(3, 4)), dynamic_shapes=({0: n}, {0: m})
    )
    torch.export.save(ep, tmp_path / "shapes.pt2")
    with zipfile.ZipFile(tmp_path / "shapes.pt2") as z:
        text = z.read("shapes/models/model.json").decode()
    assert "ToFloat(" in text and "LessThan(" in text and "guards_code" in text
    loaded = epass.load(tmp_path / "shapes.pt2")
    assert str(loaded.range_constraints) == str(ep.range_constraints)

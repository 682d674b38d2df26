"""``epass._decomp.disk``: the files of the template cache on disk, private, bounded,
safe against whatever lies in its directory, shared by concurrent processes, and
read by ``epass cache`` without torch."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import models
import pytest
import torch
from decomp_helpers import ROOT, entry_paths

import epass
from epass import Decompose
from epass._decomp import disk, templates

aten = torch.ops.aten


def test_cache_directory_is_private_and_entries_are_data(cache):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache / f"templates-v{disk.FORMAT}").st_mode) == 0o700
    entries = entry_paths(cache)
    assert entries
    for path in entries:
        entry = json.loads(path.read_text())
        assert entry["format"] == disk.FORMAT
        assert entry["key"]["torch"] == torch.__version__


def test_an_empty_cache_dir_setting_turns_the_disk_cache_off(cache, monkeypatch):
    monkeypatch.setenv("EPASS_CACHE_DIR", "")
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    assert not cache.exists()
    assert epass.cache_info()["disk"]["enabled"] is False


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("EPASS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk.directory() == tmp_path / "epass"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert disk.directory() == Path.home() / ".cache" / "epass"


def test_eviction_drops_the_least_recently_used_entries(cache):
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    entries = entry_paths(cache)
    for age, path in enumerate(entries):
        os.utime(path, (1000 + age, 1000 + age))
    sizes = [p.stat().st_size for p in entries]
    removed = disk.prune(sum(sizes[2:]))
    assert removed == 2
    assert [p.exists() for p in entries] == [False, False] + [True] * (len(entries) - 2)


def test_a_hit_refreshes_the_entry_for_eviction(cache):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    for path in entry_paths(cache):
        os.utime(path, (1000, 1000))
    templates.clear_memory()
    Decompose(method="incremental")(ep)
    assert all(p.stat().st_mtime > 1000 for p in entry_paths(cache))


@pytest.mark.parametrize("value", ["lots", "-5", "1e9x", "64 M B", "0x10"])
def test_a_cache_size_that_is_not_a_size_warns_once_naming_it_and_keeps_the_default(
    cache, monkeypatch, value
):
    monkeypatch.setattr(disk, "BAD_SIZES", set(), raising=False)
    monkeypatch.setenv("EPASS_CACHE_SIZE", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert disk.limit() == 64 * 1024 * 1024
        assert disk.info()["max_bytes"] == 64 * 1024 * 1024
    assert len(caught) == 1
    assert f"EPASS_CACHE_SIZE={value!r}" in str(caught[0].message)


@pytest.mark.parametrize(
    ("value", "size"),
    [("100000", 100000), ("32M", 32 << 20), ("32MiB", 32 << 20), ("32mb", 32 << 20),
     ("1G", 1 << 30), ("1.5g", 3 << 29), ("512 K", 512 << 10), ("10B", 10), ("0", 0)],
)  # fmt: skip
def test_a_cache_size_takes_bytes_or_binary_units(monkeypatch, value, size):
    monkeypatch.setenv("EPASS_CACHE_SIZE", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk.limit() == size


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in entry_paths(folder))


def test_a_small_cache_stays_within_its_bound_over_many_writes(cache, monkeypatch):
    monkeypatch.setenv("EPASS_CACHE_SIZE", "16K")
    monkeypatch.setattr(disk, "KNOWN", {}, raising=False)
    scans = []
    files = disk.entry_files
    monkeypatch.setattr(disk, "entry_files", lambda d: scans.append(d) or files(d))
    writes = 0
    for session in range(30):  # as the decomposition engine does: writes, then prune_soon
        for i in range(10):
            assert disk.save({"session": session, "i": i}, {"pad": "x" * 900})
            writes += 1
            assert _disk_bytes(cache) <= 16 * 1024, (session, i)
        disk.prune_soon()
    assert _disk_bytes(cache) > 16 * 1024 * 0.7  # pruned to fit, not emptied
    assert len(scans) < writes / 3  # no directory scan per write


def test_an_entry_larger_than_the_bound_is_not_written_and_evicts_nothing(cache, monkeypatch):
    monkeypatch.setenv("EPASS_CACHE_SIZE", "4K")
    assert disk.save({"small": 1}, {"pad": "x"})
    assert not disk.save({"large": 1}, {"pad": "x" * 5000})
    assert [json.loads(p.read_text())["key"] for p in entry_paths(cache)] == [{"small": 1}]
    monkeypatch.setenv("EPASS_CACHE_SIZE", "0")  # keeps nothing
    assert not disk.save({"small": 2}, {"pad": "x"})


# Writes COUNT entries of about 1 kB from START, calling prune_soon every 10 as the
# decomposition engine does after a program; stdlib only, so processes start fast.
_WRITER = textwrap.dedent(
    """
    import sys
    from epass._decomp import disk
    start, count = int(sys.argv[1]), int(sys.argv[2])
    for i in range(start, start + count):
        assert disk.save({"writer": i}, {"pad": "x" * 900})
        if i % 10 == 9:
            disk.prune_soon()
    """
)


def test_processes_writing_one_small_cache_keep_it_bounded(tmp_path):
    cache = tmp_path / "cache"
    bound = 16 * 1024
    env = {**os.environ, "EPASS_CACHE_DIR": str(cache), "EPASS_CACHE_SIZE": str(bound)}
    env["PYTHONPATH"] = str(ROOT)

    def writer(start: int, count: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(start), str(count)], cwd=ROOT, env=env, text=True
        )

    for start in (0, 200):  # one after the other: each finds what the last one left
        assert writer(start, 200).wait(timeout=120) == 0
        assert _disk_bytes(cache) <= bound
    both = [writer(start, 200) for start in (1000, 2000)]  # at once
    assert [p.wait(timeout=120) for p in both] == [0, 0]
    # Each keeps its own writes within the bound; the other's show at its next scan.
    assert _disk_bytes(cache) <= 2 * bound
    assert writer(3000, 1).wait(timeout=120) == 0  # a later writer's first write scans
    assert _disk_bytes(cache) <= bound


def test_cache_command_starts_without_torch(cache):
    env = {**os.environ, "EPASS_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    script = (
        "import sys, epass.cli\n"
        "sys.argv = ['epass', 'cache', 'info', '--json']\n"
        "code = epass.cli.main()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["directory"] == str(cache)
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    assert entry_paths(cache)
    done = subprocess.run(
        [sys.executable, "-m", "epass", "cache", "clear"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout and not entry_paths(cache)


def test_a_cache_directory_others_can_write_is_not_used(cache):
    # Another user could plant entries there; created by epass it is 0700.
    cache.mkdir()
    os.chmod(cache, 0o777)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert disk.save({"k": 1}, {"inputs": []}) is False
        assert disk.load({"k": 1}) is None
    assert any("writable by other users" in str(w.message) for w in caught)
    assert not (cache / f"templates-v{disk.FORMAT}").exists() or not entry_paths(cache)
    os.chmod(cache, 0o700)
    (cache / f"templates-v{disk.FORMAT}").mkdir(exist_ok=True)
    os.chmod(cache / f"templates-v{disk.FORMAT}", 0o757)
    assert disk.save({"k": 1}, {"inputs": []}) is False


def test_an_entry_that_is_a_fifo_or_a_symlink_is_ignored_without_blocking(cache, tmp_path):
    import threading

    key = {"k": 1}
    assert disk.save(key, {"inputs": []})
    path = cache / f"templates-v{disk.FORMAT}" / f"{disk.digest(key)[1]}.json"
    results: list = []

    def load():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append((disk.load(key), [str(w.message) for w in caught]))

    path.unlink()
    os.mkfifo(path)  # opening it for reading would wait for a writer forever
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        with open(path, "wb"):  # let the reader go, then fail
            pass
        pytest.fail("reading a FIFO entry blocked")
    assert results[0][0] is None and results[0][1]
    other = tmp_path / "elsewhere.json"
    other.write_text(path.read_text() if path.is_file() else "{}")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.symlink(other, path)
    load()
    assert results[1][0] is None
    assert other.exists()  # what the link points at is left alone
    assert disk.save(key, {"inputs": []})  # and the entry is rebuilt
    assert path.is_file() and not path.is_symlink()


def test_cache_info_and_clear_report_an_unusable_directory_as_empty(monkeypatch, tmp_path):
    # A name the file system refuses (too long): stat raises, not just "missing".
    monkeypatch.setenv("EPASS_CACHE_DIR", str(tmp_path / ("x" * 300)))
    info = disk.info()
    assert info["enabled"] is True and info["entries"] == 0
    assert disk.clear()[0] == 0
    assert disk.save({"k": 1}, {"inputs": []}) is False
    assert disk.load({"k": 1}) is None


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epass", "--plain", *argv],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "value",
    ["1" + "0" * 400, "9" * 5000 + "T", "1." + "5" * 400 + "G", "0" * 40 + "5M"],
    ids=["400-digits", "5000-digits", "long-fraction", "leading-zeros"],
)
def test_any_cache_size_is_taken_without_a_crash(cache, monkeypatch, value):
    monkeypatch.setenv(disk.SIZE_ENV, value)
    assert disk.limit() > 0
    done = _cli("cache", "info", env={"EPASS_CACHE_DIR": str(cache), "EPASS_CACHE_SIZE": value})
    assert done.returncode == 0 and "limit:" in done.stdout, done.stderr
    _, ep, _ = models.export("mlp")
    result = Decompose()(ep)
    assert result.notes["method"] == "incremental" and disk.info()["entries"] > 0


def test_an_error_inside_the_disk_cache_costs_the_entry_not_the_incremental_path(
    cache, monkeypatch
):
    def broken(*args, **kwargs):
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(disk, "limit", broken)
    templates.clear_memory()
    _, ep, _ = models.export("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Decompose(method="auto")(ep)
    assert result.notes["method"] == "incremental"
    assert any("OverflowError" in str(w.message) for w in caught)


def _look_alikes(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "a" * 64 + ".json": b"not an entry",
        "b" * 64 + ".json": json.dumps({"format": 1, "key": 1, "sha256": "x"}).encode(),
        "notes.txt": b"the user's own file",
        "." + "c" * 64 + ".x.bak": b"a look-alike of a temporary file",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def test_cache_clear_follows_no_symbolic_link_and_says_what_it_left(cache, tmp_path):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    entries = cache / f"templates-v{disk.FORMAT}"
    genuine = sorted(p.name for p in entries.glob("*.json"))
    assert genuine
    # Files of the entries folder this cache did not write stay.
    files = _look_alikes(entries)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (entries / ("d" * 64 + ".json")).symlink_to(outside)
    done = _cli("cache", "clear", env={"EPASS_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr
    assert f"removed {len(genuine)} entries" in done.stdout
    assert "left 5 that this cache did not write" in done.stdout
    assert "not a regular file" in done.stdout and "not named as an entry" in done.stdout
    for name, data in files.items():
        assert (entries / name).read_bytes() == data
    assert outside.read_text() == "{}" and (entries / ("d" * 64 + ".json")).is_symlink()
    assert not any((entries / name).exists() for name in genuine)


def test_cache_clear_leaves_a_linked_entries_folder_and_what_it_points_to(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    files = _look_alikes(elsewhere)
    (elsewhere / ("e" * 64 + ".json")).write_text("{}")
    (cache / f"templates-v{disk.FORMAT}").symlink_to(elsewhere)
    done = _cli("cache", "clear", env={"EPASS_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr
    assert "removed 0 entries" in done.stdout and "symbolic link, not followed" in done.stdout
    assert all((elsewhere / name).read_bytes() == data for name, data in files.items())
    assert (elsewhere / ("e" * 64 + ".json")).exists()
    # Nor do lookups and writes use it.
    monkeypatch.setenv(disk.DIR_ENV, str(cache))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert disk.save({"k": 1}, {"inputs": []}) is False
    assert not list(elsewhere.glob("*.tmp"))

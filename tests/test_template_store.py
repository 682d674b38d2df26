"""The template cache on disk: reused by new processes with the same result as the
retrace, safe against whatever lies in its directory, shared by concurrent processes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import models
import pytest
import torch

import epass
from epass import Decompose, _decomp, _template_store
from epass.passes import decompose as decompose_module

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten

# Decomposes zoo programs and prints, per program, the first difference from the
# retrace and the decomposed graph's code, plus this process's disk cache counters.
_ZOO_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, "tests")
    import models
    from epass import Decompose, _decomp, _template_store
    result = {}
    for name in sys.argv[1].split(","):
        for dynamic in (False, True):
            _, ep, _ = models.export(name, dynamic=dynamic)
            out = Decompose()(ep)
            ref = _decomp.run_decompositions(ep)
            result[f"{name}/{dynamic}"] = [
                out.notes["method"], _decomp.first_difference(out.program, ref),
                out.program.graph_module.code,
            ]
    print(json.dumps({"programs": result, "disk": _template_store.info()}))
    """
)


def _run(script: str, cache: Path, *args: str) -> dict:
    env = {**os.environ, "EPASS_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_zoo(names: str, cache: Path) -> None:
    cold = _run(_ZOO_SCRIPT, cache, names)
    assert cold["disk"]["writes"] > 0 and cold["disk"]["hits"] == 0
    warm = _run(_ZOO_SCRIPT, cache, names)
    assert warm["disk"]["hits"] > 0 and warm["disk"]["rejected"] == 0
    for key, (method, difference, code) in warm["programs"].items():
        assert difference is None, key  # disk-loaded templates give torch's program
        assert cold["programs"][key][0] == method, key
        assert cold["programs"][key][2] == code, key  # and the in-memory path's


def test_templates_loaded_in_a_new_process_give_the_retrace(tmp_path):
    _check_zoo("mlp,transformer", tmp_path / "cache")


@pytest.mark.slow
def test_every_zoo_program_from_disk_equals_the_retrace(tmp_path):
    _check_zoo(",".join(models.CASES), tmp_path / "cache")


def test_two_processes_filling_one_directory_leave_it_sound(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "EPASS_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ZOO_SCRIPT, "transformer,convbn"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        for key, (_, difference, _) in json.loads(out.splitlines()[-1])["programs"].items():
            assert difference is None, key
    assert not [n for n in os.listdir(cache / "templates-v1") if n.endswith(".tmp")]
    third = _run(_ZOO_SCRIPT, cache, "transformer,convbn")
    assert third["disk"]["rejected"] == 0 and third["disk"]["writes"] == 0
    assert third["disk"]["hits"] > 0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("EPASS_CACHE_DIR", str(folder))
    monkeypatch.setattr(_template_store, "_WARNED", False)
    _decomp.clear_cache()
    yield folder
    _decomp.clear_cache()


def _entries(folder: Path) -> list[Path]:
    return sorted((folder / "templates-v1").glob("*.json"))


def test_cache_directory_is_private_and_entries_are_data(cache):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache / "templates-v1").st_mode) == 0o700
    entries = _entries(cache)
    assert entries
    for path in entries:
        entry = json.loads(path.read_text())
        assert entry["format"] == _template_store.FORMAT
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
    assert _template_store.directory() == tmp_path / "epass"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _template_store.directory() == Path.home() / ".cache" / "epass"


def _rewrite(path: Path, change) -> None:
    entry = json.loads(path.read_text())
    change(entry)
    body = json.dumps(entry["template"], sort_keys=True, separators=(",", ":"))
    entry["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    path.write_text(json.dumps(entry))


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hostile_and_broken_entries_are_ignored_with_one_warning(cache, tmp_path):
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    entries = _entries(cache)
    assert len(entries) >= 8
    marker = tmp_path / "marker"

    def target(name):
        def change(entry):
            entry["template"]["nodes"][0]["target"] = name

        return change

    entries[0].write_bytes(pickle.dumps(_Marker(str(marker))))
    entries[1].write_text(entries[1].read_text()[:40])  # truncated
    _rewrite(entries[2], lambda e: e.update(format=0))
    _rewrite(entries[3], lambda e: e["key"].update(op="aten.add.Tensor"))
    _rewrite(entries[4], target("aten.no_such_op.default"))
    _rewrite(entries[5], target("builtins.exec"))
    _rewrite(entries[6], target("os.system"))

    def save(entry):
        node = entry["template"]["nodes"][0]
        node.update(target="aten.save.default", args={"tuple": [{"ref": 0}, str(marker)]})

    _rewrite(entries[7], save)  # would write the marker if called
    _decomp.clear_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = Decompose(method="incremental")(ep).program
    mine = [w for w in caught if "template cache" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert not marker.exists()  # nothing in the entries ran
    assert _decomp.first_difference(out, _decomp.run_decompositions(ep)) is None
    assert _template_store.info()["rejected"] == 8
    # Rejected entries were rebuilt: the next process finds sound ones.
    for path in entries[:8]:
        assert json.loads(path.read_text())["format"] == _template_store.FORMAT


def test_eviction_drops_the_least_recently_used_entries(cache):
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    entries = _entries(cache)
    for age, path in enumerate(entries):
        os.utime(path, (1000 + age, 1000 + age))
    sizes = [p.stat().st_size for p in entries]
    removed = _template_store.prune(sum(sizes[2:]))
    assert removed == 2
    assert [p.exists() for p in entries] == [False, False] + [True] * (len(entries) - 2)


def test_a_hit_refreshes_the_entry_for_eviction(cache):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    for path in _entries(cache):
        os.utime(path, (1000, 1000))
    _decomp.clear_cache()
    Decompose(method="incremental")(ep)
    assert all(p.stat().st_mtime > 1000 for p in _entries(cache))


@pytest.mark.parametrize("value", ["lots", "-5", "1e9x", "64 M B", "0x10"])
def test_a_cache_size_that_is_not_a_size_warns_once_naming_it_and_keeps_the_default(
    cache, monkeypatch, value
):
    monkeypatch.setattr(_template_store, "_BAD_SIZES", set(), raising=False)
    monkeypatch.setenv("EPASS_CACHE_SIZE", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _template_store.limit() == 64 * 1024 * 1024
        assert _template_store.info()["max_bytes"] == 64 * 1024 * 1024
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
        assert _template_store.limit() == size


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in _entries(folder))


def test_a_small_cache_stays_within_its_bound_over_many_writes(cache, monkeypatch):
    monkeypatch.setenv("EPASS_CACHE_SIZE", "16K")
    monkeypatch.setattr(_template_store, "_KNOWN", {}, raising=False)
    scans = []
    files = _template_store._files
    monkeypatch.setattr(_template_store, "_files", lambda d: scans.append(d) or files(d))
    writes = 0
    for session in range(30):  # as the decomposition engine does: writes, then prune_soon
        for i in range(10):
            assert _template_store.store({"session": session, "i": i}, {"pad": "x" * 900})
            writes += 1
            assert _disk_bytes(cache) <= 16 * 1024, (session, i)
        _template_store.prune_soon()
    assert _disk_bytes(cache) > 16 * 1024 * 0.7  # pruned to fit, not emptied
    assert len(scans) < writes / 3  # no directory scan per write


def test_an_entry_larger_than_the_bound_is_not_written_and_evicts_nothing(cache, monkeypatch):
    monkeypatch.setenv("EPASS_CACHE_SIZE", "4K")
    assert _template_store.store({"small": 1}, {"pad": "x"})
    assert not _template_store.store({"large": 1}, {"pad": "x" * 5000})
    assert [json.loads(p.read_text())["key"] for p in _entries(cache)] == [{"small": 1}]
    monkeypatch.setenv("EPASS_CACHE_SIZE", "0")  # keeps nothing
    assert not _template_store.store({"small": 2}, {"pad": "x"})


# Writes COUNT entries of about 1 kB from START, calling prune_soon every 10 as the
# decomposition engine does after a program; stdlib only, so processes start fast.
_WRITER = textwrap.dedent(
    """
    import sys
    from epass import _template_store
    start, count = int(sys.argv[1]), int(sys.argv[2])
    for i in range(start, start + count):
        assert _template_store.store({"writer": i}, {"pad": "x" * 900})
        if i % 10 == 9:
            _template_store.prune_soon()
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


def _closure_table(value, key=None):
    def silu(x):
        return aten.mul.Tensor(aten.sigmoid.default(x), value)

    if key is not None:
        silu.cache_key = key
    return {aten.silu.default: silu}


def _name(table):
    return _decomp.cache_name(_decomp.split_table(table))


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


def test_public_cache_info_and_clear_cover_memory_and_disk(cache):
    _, ep, _ = models.export("mlp")
    Decompose(method="incremental")(ep)
    info = epass.cache_info()
    assert info["memory"]["size"] > 0 and info["disk"]["entries"] > 0
    assert info["disk"]["directory"] == str(cache)
    epass.clear_cache()
    info = epass.cache_info()
    assert info["memory"]["size"] == 0 and info["disk"]["entries"] == 0


def test_auto_decomposes_a_cold_program_incrementally_with_one_batch(cache):
    _, ep, _ = models.export("transformer")
    tables = _decomp.split_table(None)
    batched, alone, nodes = _decomp.template_work(ep, tables)
    assert batched > 1 and alone == 0 and nodes == len(ep.graph.nodes)
    result = Decompose()(ep)  # a batched trace costs less than the retrace
    assert result.notes["method"] == "incremental"
    decision = result.notes["decision"]
    assert decision.startswith(f"incremental: {batched} templates to trace ({batched} in one")
    assert f"against a retrace of {nodes} nodes" in decision
    assert _decomp.missing_templates(ep, tables)[0] == 0


def test_auto_says_why_it_went_either_way_and_only_when_it_weighed(cache):
    _, ep, _ = models.export("mlp")
    for method in ("incremental", "retrace"):  # nothing to weigh
        assert "decision" not in Decompose(method=method)(ep).notes
    again = Decompose()(ep)  # the incremental run traced every template
    assert again.notes["method"] == "incremental"
    assert again.notes["decision"] == (
        "incremental: every template it needs is in memory or on disk"
    )


def test_auto_retraces_when_tracing_would_cost_more_and_fills_what_fits(cache, monkeypatch):
    _, ep, _ = models.export("transformer")
    tables = _decomp.split_table(None)
    missing, nodes = _decomp.missing_templates(ep, tables)
    assert missing > 3 and nodes == len(ep.graph.nodes)
    # A batch of every template costs far more than the retrace's estimate, of which
    # the retrace leaves about 3 templates' worth for the fill.
    monkeypatch.setattr(decompose_module, "_SESSION_SECONDS", 0.0)
    monkeypatch.setattr(decompose_module, "_BATCH_SECONDS", 0.0)
    monkeypatch.setattr(decompose_module, "_BATCH_TEMPLATE_SECONDS", 100.0)
    monkeypatch.setattr(decompose_module, "_RETRACE_SECONDS", 350.0)
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    decision = result.notes["decision"]
    assert decision.startswith(f"retrace: {missing} templates to trace ({missing} in one batch")
    assert f"then traced 3 of {missing} templates for next time" in decision
    assert _decomp.missing_templates(ep, tables)[0] == missing - 3


def test_auto_fills_nothing_when_the_retrace_leaves_no_time(cache, monkeypatch):
    _, ep, _ = models.export("transformer")
    tables = _decomp.split_table(None)
    missing, _ = _decomp.missing_templates(ep, tables)
    with monkeypatch.context() as m:
        m.setattr(decompose_module, "_BATCH_TEMPLATE_SECONDS", 1000.0)
        m.setattr(decompose_module, "_RETRACE_SECONDS", 0.0)
        m.setattr(decompose_module, "_RETRACE_NODE_SECONDS", 0.0)
        result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "traced nothing for next time" in result.notes["decision"]
    assert _decomp.missing_templates(ep, tables)[0] == missing  # nothing was traced
    again = Decompose()(ep)  # with the real estimates the batch is cheaper
    assert again.notes["method"] == "incremental"
    assert again.notes["decision"].startswith(f"incremental: {missing} templates to trace")


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
    assert _entries(cache)
    done = subprocess.run(
        [sys.executable, "-m", "epass", "cache", "clear"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "removed" in done.stdout and not _entries(cache)


def test_auto_keeps_the_fallback_reason_of_a_program_it_cannot_rewrite(cache, monkeypatch):
    _, ep, _ = models.export("seed")  # a buffer mutated in place
    monkeypatch.setattr(decompose_module, "_TRACE_SECONDS", 1000.0)
    result = Decompose()(ep)
    assert result.notes["method"] == "retrace"
    assert "mutating op" in result.notes["fallback"]
    assert "decision" not in result.notes  # nothing to weigh: the fallback says why


def test_a_cache_directory_others_can_write_is_not_used(cache):
    # Another user could plant entries there; created by epass it is 0700.
    cache.mkdir()
    os.chmod(cache, 0o777)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _template_store.store({"k": 1}, {"inputs": []}) is False
        assert _template_store.load({"k": 1}) is None
    assert any("writable by other users" in str(w.message) for w in caught)
    assert not (cache / "templates-v1").exists() or not _entries(cache)
    os.chmod(cache, 0o700)
    (cache / "templates-v1").mkdir(exist_ok=True)
    os.chmod(cache / "templates-v1", 0o757)
    assert _template_store.store({"k": 1}, {"inputs": []}) is False


def test_an_entry_that_is_a_fifo_or_a_symlink_is_ignored_without_blocking(cache, tmp_path):
    import threading

    key = {"k": 1}
    assert _template_store.store(key, {"inputs": []})
    path = cache / "templates-v1" / f"{_template_store.digest(key)[1]}.json"
    results: list = []

    def load():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append((_template_store.load(key), [str(w.message) for w in caught]))

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
    assert _template_store.store(key, {"inputs": []})  # and the entry is rebuilt
    assert path.is_file() and not path.is_symlink()


def test_an_entry_whose_result_does_not_match_the_operator_is_rejected_and_rebuilt(cache):
    # Well-formed, with the right checksum, but not what the operator returns: its
    # result has another structure, or another shape than the operator's.
    _, ep, _ = models.export("transformer")
    Decompose(method="incremental")(ep)
    ops = {p: json.loads(p.read_text())["key"]["op"] for p in _entries(cache)}
    linear = next(p for p, op in ops.items() if op == "aten.linear.default")
    transpose = next(p for p, op in ops.items() if op == "aten.transpose.int")
    _rewrite(linear, lambda e: e["template"].update(output={"ref": 1}))  # the weight
    _rewrite(transpose, lambda e: e["template"].update(output={"list": []}))
    _decomp.clear_cache()
    before = _template_store.info()["rejected"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Decompose(method="incremental")(ep)
    assert len([w for w in caught if "template cache" in str(w.message)]) == 1
    assert _template_store.info()["rejected"] - before == 2
    assert result.notes["method"] == "incremental"
    assert _decomp.first_difference(result.program, _decomp.run_decompositions(ep)) is None
    for path in (linear, transpose):  # rebuilt
        assert json.loads(path.read_text())["template"]["output"] != {"list": []}


def test_cache_info_and_clear_report_an_unusable_directory_as_empty(monkeypatch, tmp_path):
    # A name the file system refuses (too long): stat raises, not just "missing".
    monkeypatch.setenv("EPASS_CACHE_DIR", str(tmp_path / ("x" * 300)))
    info = _template_store.info()
    assert info["enabled"] is True and info["entries"] == 0
    assert _template_store.clear()[0] == 0
    assert _template_store.store({"k": 1}, {"inputs": []}) is False
    assert _template_store.load({"k": 1}) is None


@pytest.mark.parametrize("name", ["mlp", "transformer", "convbn"])
def test_a_filled_cache_serves_torchs_default_table_without_building_its_split(cache, name):
    # Building torch's split walks every operator torch knows; a process whose
    # templates are all on disk has no trace to run and so no use for it.
    _, ep, _ = models.export(name)
    first = Decompose()(ep)
    _decomp.clear_cache()  # a new process: templates and splits forgotten, disk kept
    again = Decompose()(ep)
    assert again.notes["method"] == "incremental"
    assert Decompose()._tables().cia._split.built is None
    assert _decomp.first_difference(again.program, first.program) is None


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
    monkeypatch.setenv(_template_store.SIZE_ENV, value)
    assert _template_store.limit() > 0
    done = _cli("cache", "info", env={"EPASS_CACHE_DIR": str(cache), "EPASS_CACHE_SIZE": value})
    assert done.returncode == 0 and "limit:" in done.stdout, done.stderr
    _, ep, _ = models.export("mlp")
    result = Decompose()(ep)
    assert result.notes["method"] == "incremental" and _template_store.info()["entries"] > 0


def test_an_error_inside_the_disk_cache_costs_the_entry_not_the_incremental_path(
    cache, monkeypatch
):
    def broken(*args, **kwargs):
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(_template_store, "limit", broken)
    _decomp.clear_cache()
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
    entries = cache / f"templates-v{_template_store.FORMAT}"
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
    (cache / f"templates-v{_template_store.FORMAT}").symlink_to(elsewhere)
    done = _cli("cache", "clear", env={"EPASS_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr
    assert "removed 0 entries" in done.stdout and "symbolic link, not followed" in done.stdout
    assert all((elsewhere / name).read_bytes() == data for name, data in files.items())
    assert (elsewhere / ("e" * 64 + ".json")).exists()
    # Nor do lookups and writes use it.
    monkeypatch.setenv(_template_store.DIR_ENV, str(cache))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert _template_store.store({"k": 1}, {"inputs": []}) is False
    assert not list(elsewhere.glob("*.tmp"))

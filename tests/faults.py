"""Planted faults: each one breaks epass at run time in one known way, and names the
tests that must catch it. ``python -m tests.faults`` plants them one at a time.

A fault is planted by monkeypatching epass when a pytest session starts (this module
is a pytest plugin: ``-p tests.faults``, with the fault's name in the environment
variable ``EPASS_PLANTED_FAULT``); epass's source is never edited. Each patched
function is found by its name on whichever epass module or class defines it, so a
fault still plants after the code moves between modules; one that finds nothing
fails the run instead of passing it.

The runner runs exactly a fault's named tests, in a fresh pytest process with the
fault planted, and fails unless each of them fails (or errors) and the fault was
reached while it ran: a named test that passes, skips, is an expected failure, or
fails without ever reaching the fault does not catch it.

Usage::

    python -m tests.faults                 # every fault
    python -m tests.faults splice-raises   # one
    python -m tests.faults --list
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

__all__ = ["FAULTS", "Fault", "main"]

FAULT_ENV = "EPASS_PLANTED_FAULT"
REPORT_ENV = "EPASS_FAULT_REPORT"
ROOT = Path(__file__).resolve().parents[1]


class PlantingError(RuntimeError):
    """A fault found nothing to patch, or a patched call it could not read."""


# --- how a fault finds what it patches ---------------------------------------------


def _epass_modules() -> list[Any]:
    """Every importable module of epass (command-line entry points aside), imported."""
    import epass

    for info in pkgutil.walk_packages(epass.__path__, "epass."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        with contextlib.suppress(ImportError):  # an optional extra's module
            importlib.import_module(info.name)
    return [m for n, m in sorted(sys.modules.items()) if n == "epass" or n.startswith("epass.")]


def _replace(name: str, make: Callable[[Any], Any], *, module: str = "") -> list[str]:
    """Replace the epass function ``name`` (defined in a module whose name contains
    ``module``) by ``make(original)`` wherever epass binds it: module globals (its
    definition and every ``from ... import``) and class attributes (a static or class
    method keeps its kind). Returns where it was replaced."""
    modules = _epass_modules()

    def defined_here(value: Any) -> bool:
        func = getattr(value, "__func__", value)
        return (
            callable(func)
            and getattr(func, "__name__", None) == name
            and module in str(getattr(func, "__module__", ""))
            and str(getattr(func, "__module__", "")).startswith("epass")
        )

    replaced: dict[int, Any] = {}

    def replacement(original: Any) -> Any:
        if id(original) not in replaced:
            replaced[id(original)] = make(original)
        return replaced[id(original)]

    where = []
    for mod in modules:
        for attr, value in list(vars(mod).items()):
            if attr == name and defined_here(value):
                setattr(mod, attr, replacement(value))
                where.append(f"{mod.__name__}.{attr}")
            elif isinstance(value, type) and value.__module__ == mod.__name__:
                raw = vars(value).get(name)
                if raw is None or not defined_here(raw):
                    continue
                kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
                new = replacement(raw.__func__ if kind else raw)
                setattr(value, name, kind(new) if kind else new)
                where.append(f"{mod.__name__}.{value.__qualname__}.{name}")
    if not where:
        raise PlantingError(f"no epass function named {name!r} (in a module matching {module!r})")
    return where


def _find_class(name: str) -> Any:
    for mod in _epass_modules():
        value = vars(mod).get(name)
        if isinstance(value, type) and value.__module__.startswith("epass"):
            return value
    raise PlantingError(f"no epass class named {name!r}")


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], having: str) -> Any:
    """The argument of a patched call that has attribute ``having``."""
    for value in (*args, *kwargs.values()):
        if hasattr(value, having):
            return value
    raise PlantingError(f"no argument with {having!r} among {args!r} {kwargs!r}")


# --- the faults ----------------------------------------------------------------------

Hit = Callable[[], None]


def _splice_raises(hit: Hit) -> list[str]:
    """The incremental splice raises on every call: every Decompose falls back to
    torch's retrace (and says so only in its notes)."""

    def make(original: Any) -> Any:
        def decompose(*args: Any, **kwargs: Any) -> Any:
            hit()
            raise RuntimeError("planted fault: the incremental splice raises")

        return decompose

    return _replace("decompose", make, module="splice")


def _template_ignores_device(hit: Hit) -> list[str]:
    """The template key of a tensor names no device: a template traced for the CPU
    serves a CUDA program, and the reverse."""
    import torch

    from epass._decomp import keys

    # Where a key holds the device: the one entry in which the keys of two tensors
    # that differ only in their device differ.
    cpu, meta = torch.empty(()), torch.empty((), device="meta")
    on_cpu, on_meta = keys.tensor_key(cpu, False), keys.tensor_key(meta, False)
    (where,) = [i for i, (a, b) in enumerate(zip(on_cpu, on_meta, strict=True)) if a != b]

    def make(original: Any) -> Any:
        def tensor_key(t: Any, *args: Any, **kwargs: Any) -> Any:
            key = original(t, *args, **kwargs)
            if key[where] == on_cpu[where]:
                return key
            hit()
            return (*key[:where], on_cpu[where], *key[where + 1 :])

        return tensor_key

    return _replace("tensor_key", make, module="keys")


def _graph_copy_shares_meta(hit: Hit) -> list[str]:
    """A copy of a graph module (a pass's view, a built-in pass's copy) gives each
    node a new ``meta`` dict over the source node's own nested containers
    (``nn_module_stack``, ``custom``...): an edit of one through the copy reaches the
    source."""
    import torch

    def make(original: Any) -> Any:
        def copy_module(gm: Any, *args: Any, **kwargs: Any) -> Any:
            new = original(gm, *args, **kwargs)
            sources = dict(gm.named_modules())
            for name, module in new.named_modules():
                source = sources.get(name)
                if not isinstance(module, torch.fx.GraphModule) or source is None:
                    continue
                for mine, theirs in zip(module.graph.nodes, source.graph.nodes, strict=True):
                    mine.meta = dict(theirs.meta)
            hit()
            return new

        return copy_module

    # The program view's copy, and the one built-in and fx passes edit.
    where = _replace("copy_graph_module", make)
    with contextlib.suppress(PlantingError):
        where += _replace("_copy_module", make)
    return where


def _every_program_owned(hit: Hit) -> list[str]:
    """The manager takes every program as the run's own: a pass gets no copy and a
    built-in pass a lease, whoever else holds the program (the user, an instrument, a
    pass that memoized it)."""
    lease_type = _find_class("Lease")

    def make(original: Any) -> Any:
        def ownership(*args: Any, **kwargs: Any) -> Any:
            copy_graph, lease, in_place = original(*args, **kwargs)
            model = _argument(args, kwargs, "changes_input")
            run = _argument(args, kwargs, "current")
            current = run.current.graph_module
            if model.takes_lease and (lease is None or lease.graph_module is not current):
                lease = lease_type(current)
            owned = (False, lease, bool(model.changes_input) or lease is not None)
            if owned != (copy_graph, lease, in_place):
                hit()
            return owned

        return ownership

    return _replace("_ownership", make)


def _mark_always_holds(hit: Hit) -> list[str]:
    """A program's validation mark is believed after an edit: whatever changed since
    ``validate()`` passed, the manager and ``verify_program`` skip it."""

    def make(original: Any) -> Any:
        def still_validated(*args: Any, **kwargs: Any) -> bool:
            if not original(*args, **kwargs):
                hit()
            return True

        return still_validated

    return _replace("still_validated", make)


@dataclass(frozen=True)
class Fault:
    """A way to break epass and the tests that must catch it."""

    plant: Callable[[Hit], list[str]]
    tests: tuple[str, ...]

    @property
    def doc(self) -> str:
        return " ".join((self.plant.__doc__ or "").split())


_SPLICE = "tests/decomp/test_splice.py::"
_REGIONS = "tests/decomp/test_regions.py::"
_WRITES = "tests/decomp/test_writes_random.py::"
_GPU = "tests/test_gpu.py::"
_LEASE = "tests/test_lease.py::"
_OWNERSHIP = "tests/test_properties_ownership.py::"
_GUARANTEES = "tests/test_guarantees.py::"
_PROGRAM = "tests/test_program.py::"
_PROPERTIES = "tests/test_properties_guarantees.py::"

FAULTS: dict[str, Fault] = {
    "splice-raises": Fault(
        _splice_raises,
        (
            _SPLICE + "test_random_modules_and_tables_match_torch",
            _SPLICE + "test_random_multi_output_and_complex_ops_match_torch",
            _SPLICE + "test_explicit_table_and_keep_match_torch",
            _REGIONS + "test_a_body_whose_code_changed_is_traced_again",
            _REGIONS + "test_the_bodys_nodes_carry_the_frames_the_retrace_records",
            _WRITES + "test_a_view_made_again_after_a_write_is_dropped_with_a_dynamic_batch_as_"
            "torch_drops_it[reads0]",
            _WRITES + "test_a_view_made_again_after_a_write_is_dropped_with_a_dynamic_batch_as_"
            "torch_drops_it[reads1]",
            _GPU + "test_a_template_for_one_device_never_serves_the_other[cpu-fake-cuda]",
            _GPU + "test_a_template_for_one_device_never_serves_the_other[cuda-fake-cuda]",
        ),
    ),
    "template-ignores-device": Fault(
        _template_ignores_device,
        (
            _GPU + "test_a_template_for_one_device_never_serves_the_other[cpu-fake-cuda]",
            _GPU + "test_a_template_for_one_device_never_serves_the_other[cuda-fake-cuda]",
            _GPU + "test_a_tensors_template_key_names_its_device",
        ),
    ),
    "graph-copy-shares-meta": Fault(
        _graph_copy_shares_meta,
        (
            _GUARANTEES + "test_nested_meta_edits_do_not_reach_the_input[program pass]",
            _GUARANTEES + "test_nested_meta_edits_do_not_reach_the_input[FxPass]",
            _GUARANTEES + "test_copy_graph_module_copies_nested_meta_and_shares_fake_values",
            _PROPERTIES + "test_random_in_place_passes_in_threads_keep_the_users_program",
        ),
    ),
    "lease-of-an-escaped-program": Fault(
        _every_program_owned,
        (
            _LEASE + "test_no_program_an_instrument_was_shown_changes_afterwards",
            _LEASE + "test_a_program_a_pass_holds_is_copied_by_the_passes_after_it",
            _LEASE + "test_a_program_a_pass_memoized_is_never_edited_by_the_passes_after_it",
            _LEASE + "test_no_program_a_nested_pipelines_instrument_was_shown_changes_afterwards",
            _GUARANTEES + "test_in_place_pass_after_a_memoized_program_leaves_that_program_alone",
            _PROPERTIES + "test_random_in_place_passes_in_threads_keep_the_users_program",
            _OWNERSHIP + "test_hostile_pipelines_never_edit_what_user_code_has_seen",
            _OWNERSHIP + "test_a_memoized_result_is_never_edited_by_the_passes_after_it",
        ),
    ),
    "mark-trusted-after-an-edit": Fault(
        _mark_always_holds,
        (
            _GUARANTEES + "test_a_pass_that_edits_in_place_and_says_unmodified_is_verified",
            _PROGRAM + "test_a_program_new_program_built_counts_as_validated_until_it_changes",
            _PROGRAM + "test_a_program_relabelled_to_another_dialect_is_validated_again",
        ),
    ),
}


# --- the plugin: plants the fault named in the environment, reports what ran ---------

_HITS = [0]
_HITS_LOCK = threading.Lock()
_PLANTED: list[str] = []
_RESULTS: dict[str, dict[str, Any]] = {}


def _hit() -> None:
    with _HITS_LOCK:
        _HITS[0] += 1


def _hypothesis_profile() -> None:
    # Under a fault a property test fails at its first example; shrinking the failure
    # would only spend time, so the runner's profile does not shrink.
    with contextlib.suppress(ImportError):
        from hypothesis import Phase, settings

        settings.register_profile(
            "faults",
            derandomize=True,
            database=None,
            deadline=None,
            print_blob=False,
            phases=(Phase.explicit, Phase.reuse, Phase.generate),
        )


_hypothesis_profile()


def pytest_configure(config: Any) -> None:
    name = os.environ.get(FAULT_ENV)
    if not name:
        return
    if name not in FAULTS:
        raise PlantingError(f"{FAULT_ENV}={name!r} names no fault; known: {sorted(FAULTS)}")
    _PLANTED.extend(FAULTS[name].plant(_hit))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    before = _HITS[0]
    _RESULTS.setdefault(item.nodeid, {"outcome": "passed", "hits": 0})
    yield
    _RESULTS[item.nodeid]["hits"] = _HITS[0] - before


def pytest_runtest_logreport(report: Any) -> None:
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": "passed", "hits": 0})
    if hasattr(report, "wasxfail"):
        entry["outcome"] = "xfailed" if report.skipped else "xpassed"
    elif report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps({"planted": _PLANTED, "results": _RESULTS}))


# --- the runner ------------------------------------------------------------------------


def _run(tests: tuple[str, ...], fault: str | None, verbose: bool) -> dict[str, Any]:
    """Run ``tests`` in a fresh pytest process, with ``fault`` planted (None: none);
    each test's outcome and how often it reached the fault."""
    with tempfile.TemporaryDirectory(prefix="epass-fault-") as folder:
        report = Path(folder) / "report.json"
        env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        env[REPORT_ENV] = str(report)
        if fault is not None:
            env[FAULT_ENV] = fault
        plugins = ["-p", "tests.faults", "-p", "no:cacheprovider"]
        options = ["--hypothesis-profile=faults", "-q", "--no-header"]
        command = [sys.executable, "-m", "pytest", *plugins, *options, *tests]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if verbose:
            print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
        if not report.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise PlantingError("pytest wrote no report:\n" + "\n".join(tail))
        return json.loads(report.read_text())["results"]  # type: ignore[no-any-return]


@dataclass
class Row:
    test: str
    outcome: str  # with the fault planted
    hits: int  # how often the test reached the fault
    control: str | None  # without it (--control)

    @property
    def caught(self) -> bool:
        return self.outcome in ("failed", "error") and self.hits > 0


@dataclass
class Outcome:
    fault: str
    rows: list[Row]
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(row.caught for row in self.rows)


def run_fault(name: str, *, control: bool = False, verbose: bool = False) -> Outcome:
    """Run ``name``'s tests with it planted, and with ``control`` without it too."""
    tests = FAULTS[name].tests
    began = time.perf_counter()
    try:
        planted = _run(tests, name, verbose)
        plain = _run(tests, None, verbose) if control else {}
    except PlantingError as exc:
        return Outcome(name, [], time.perf_counter() - began, str(exc))
    rows = []
    for test in tests:
        entry = planted.get(test, {"outcome": "not run", "hits": 0})
        without = plain.get(test, {"outcome": "not run"})["outcome"] if control else None
        rows.append(Row(test, entry["outcome"], entry["hits"], without))
    return Outcome(name, rows, time.perf_counter() - began)


def _table(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        lines.append(f"{o.fault}: {'caught' if o.ok else 'MISSED'} ({o.seconds:.0f} s)")
        if o.error:
            lines.append("  " + o.error.replace("\n", "\n  "))
        for row in o.rows:
            reached = f"reached {row.hits}x" if row.hits else "never reached"
            control = "" if row.control is None else f"{'without it: ' + row.control:23} "
            mark = "ok  " if row.caught else "MISS"
            lines.append(f"  {mark} {row.outcome:8} {reached:14} {control}{row.test}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("faults", nargs="*", help="faults to plant (default: all)")
    parser.add_argument("--list", action="store_true", help="list the faults and their tests")
    parser.add_argument(
        "--control", action="store_true", help="run the tests without the fault as well"
    )
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    args = parser.parse_args(argv)
    if args.list:
        for name, fault in FAULTS.items():
            print(f"{name}: {fault.doc}")
            print("".join(f"  {t}\n" for t in fault.tests), end="")
        return 0
    names = args.faults or list(FAULTS)
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {sorted(FAULTS)}")
    began = time.perf_counter()

    def run(name: str) -> Outcome:
        return run_fault(name, control=args.control, verbose=args.verbose)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outcomes = list(pool.map(run, names))
    print(_table(outcomes))
    missed = [o.fault for o in outcomes if not o.ok]
    total = time.perf_counter() - began
    print(f"{len(names) - len(missed)} of {len(names)} planted faults caught in {total:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

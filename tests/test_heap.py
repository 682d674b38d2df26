"""The cyclic garbage collector while a pipeline runs: the objects older than the
pipeline are left out of its collections, and the collector is as it was after."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import models
import pytest

from epass import Decompose, PassManager, _heap
from epass.passes import CSE, DeadCodeElimination


def test_a_pipeline_leaves_older_objects_out_of_collections_and_thaws_them() -> None:
    ep = models.export("mlp")[1]
    seen: list[int] = []

    def counting(program: Any) -> Any:
        seen.append(gc.get_freeze_count())
        return program

    nested = PassManager([counting])
    PassManager([counting, nested, CSE()])(ep)
    assert len(seen) == 2 and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0


def test_the_collector_is_thawed_when_a_pass_fails() -> None:
    def failing(program: Any) -> Any:
        raise RuntimeError("boom")

    with pytest.raises(Exception, match="boom"):
        PassManager([failing]).run(models.export("mlp")[1])
    assert gc.get_freeze_count() == 0


def test_objects_the_caller_froze_stay_frozen() -> None:
    gc.freeze()
    try:
        PassManager([DeadCodeElimination()])(models.export("mlp")[1])
        assert gc.get_freeze_count() > 0  # not thawed by the pipeline
    finally:
        gc.unfreeze()


def test_a_disabled_collector_stays_untouched() -> None:
    gc.disable()
    try:
        with _heap.old_objects_frozen():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_last_of_overlapping_pipelines_in_threads_thaws() -> None:
    inside, release = threading.Barrier(2), threading.Event()

    def hold() -> None:
        with _heap.old_objects_frozen():
            inside.wait()
            release.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    with _heap.old_objects_frozen():
        inside.wait()
    assert gc.get_freeze_count() > 0  # the other thread's block still runs
    release.set()
    thread.join()
    assert gc.get_freeze_count() == 0


def test_what_a_decomposition_made_inside_a_pipeline_is_frozen_with_the_old() -> None:
    ep = models.export("mlp")[1]
    seen: list[int] = []

    def counting(program: Any) -> Any:
        seen.append(gc.get_freeze_count())
        return program

    PassManager([counting, Decompose(method="incremental"), counting])(ep)
    before, after = seen
    assert after > before  # the decomposed program's objects joined the frozen ones
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_a_decomposition_outside_a_pipeline_freezes_nothing() -> None:
    ep = models.export("mlp")[1]
    assert Decompose(method="incremental")(ep).notes["method"] == "incremental"
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_cyclic_garbage_made_while_paused_is_collected_before_the_freeze() -> None:
    class Cycle:
        pass

    collected: list[str] = []
    with _heap.old_objects_frozen():
        with _heap.collector_paused():
            for _ in range(3):
                a, b = Cycle(), Cycle()
                a.other, b.other = b, a
                weakref.finalize(a, collected.append, "a")
            del a, b
        assert len(collected) == 3
    assert gc.get_freeze_count() == 0


def test_overlapping_pauses_turn_the_collector_on_once_the_last_one_ends() -> None:
    inside, leave = threading.Event(), threading.Event()
    states = []

    def other() -> None:
        with _heap.collector_paused():
            inside.set()
            leave.wait(10)

    assert gc.isenabled()
    thread = threading.Thread(target=other)
    with _heap.collector_paused():
        thread.start()
        assert inside.wait(10)
    states.append(gc.isenabled())  # the other thread's block still runs
    leave.set()
    thread.join(10)
    states.append(gc.isenabled())
    assert states == [False, True]


def test_a_failing_block_turns_the_collector_back_on() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"), _heap.collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()

"""The cyclic garbage collector while a pipeline runs: the objects older than the
pipeline are left out of its collections, and the collector is as it was after."""

from __future__ import annotations

import gc
import threading
from typing import Any

import models
import pytest

from epass import PassManager, _heap
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

"""Loading under a paused garbage collector (runtime.loading_heap).

A load allocates about a million long-lived objects, and Python's collector would walk all of them
again each time the heap grows by a quarter. These tests count collections instead of timing them:
none may start inside the pause, what the load kept must end up frozen (never walked again), and the
collector's state before the load must come back, also when the load fails.
"""

from __future__ import annotations

import gc

import pytest

from omnidraft.runtime import loading_heap


def _full_collections_while(fn) -> int:
    """How many full (generation 2) collections start while ``fn`` runs."""
    count = 0

    def watch(phase: str, info: dict) -> None:
        nonlocal count
        if phase == "start" and info["generation"] == 2:
            count += 1

    gc.callbacks.append(watch)
    try:
        fn()
    finally:
        gc.callbacks.remove(watch)
    return count


def _load_like() -> list:
    """Many small long-lived container objects, as a vocabulary parsed from JSON is."""
    return [{"token": i, "pieces": [i, i + 1]} for i in range(300_000)]


def test_a_load_like_allocation_triggers_full_collections_without_the_pause():
    # the premise: otherwise the pause would guard against nothing
    kept = []
    assert gc.isenabled()
    assert _full_collections_while(lambda: kept.append(_load_like())) > 0


def test_no_collection_starts_inside_the_pause_and_what_was_loaded_is_frozen():
    kept = []
    frozen_before = gc.get_freeze_count()

    def load() -> None:
        with loading_heap():
            assert not gc.isenabled()
            kept.append(_load_like())

    # settle_heap's own gc.collect() at the end is the one full collection allowed
    assert _full_collections_while(load) == 1
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen_before + len(kept[0])


def test_the_collector_comes_back_when_the_load_fails():
    with pytest.raises(RuntimeError):
        with loading_heap():
            raise RuntimeError("the load failed")
    assert gc.isenabled()


def test_a_caller_that_paused_the_collector_keeps_it_paused():
    gc.disable()
    try:
        with loading_heap():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

"""glm53.runtime.heap: the startup heap leaves the collector's walk; the collector stays on."""
from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from glm53.runtime.durations import Durations
from glm53.runtime.heap import collector_pauses, freeze_startup_heap
from glm53.serving.front.metrics import Metrics


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the suite runs with an ordinary heap


def test_objects_alive_at_the_freeze_leave_the_walk_and_later_cycles_are_still_collected(unfrozen_after: None) -> None:
    startup = Node()
    startup_garbage = Node()
    startup_garbage.other = startup_garbage  # a cycle only the collector frees
    dropped = weakref.ref(startup_garbage)
    del startup_garbage

    frozen = freeze_startup_heap()

    assert dropped() is None  # startup's garbage was collected first, not frozen
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is startup for o in gc.get_objects())  # no collection walks it

    later = Node()
    later.other = later
    freed = weakref.ref(later)
    del later
    gc.collect()
    assert freed() is None


def test_durations_count_each_value_under_the_first_bound_that_holds_it() -> None:
    d = Durations((0.001, 0.01))
    for seconds in (0.0005, 0.001, 0.002, 0.01, 3.0):
        d.observe(seconds)
    snap = d.snapshot()
    assert snap["buckets"] == [("0.001", 2), ("0.01", 4), ("+Inf", 5)]  # Prometheus' le: at most the bound
    assert snap["count"] == 5 and snap["sum"] == pytest.approx(3.0135)


def test_collections_are_counted_by_generation_and_shown_in_metrics() -> None:
    pauses = collector_pauses()
    before = pauses.snapshot()[2]["count"]
    gc.collect()
    after = pauses.snapshot()[2]
    assert after["count"] == before + 1 and after["sum"] > 0
    text = Metrics(lambda: 0, None, pauses.snapshot).render()
    assert f'glm53_gc_pause_seconds_count{{generation="2"}} {float(before + 1)}' in text
    assert 'glm53_gc_pause_seconds_bucket{generation="0",le="+Inf"}' in text

"""glm53.runtime.heap: the startup heap leaves the collector's walk; the collector stays on."""
from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from glm53.runtime.heap import freeze_startup_heap


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

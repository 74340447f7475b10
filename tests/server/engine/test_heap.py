"""engine/heap.py: startup's objects frozen out of the collector's walks, and given back when a server ends."""

from __future__ import annotations

import gc
import weakref

from linserve.server.engine import heap


def walked(thing) -> bool:
    """Whether the collector's generations hold `thing` (frozen objects are in none of them)."""
    return any(tracked is thing for tracked in gc.get_objects())


class Node:
    def __init__(self) -> None:
        self.other = self


def test_freezing_collects_startups_garbage_and_keeps_what_lives_out_of_later_collections():
    garbage = Node()  # a cycle only the collector frees
    dead = weakref.ref(garbage)
    del garbage
    kept = Node()
    try:
        frozen = heap.freeze_startup_objects("test")
        assert dead() is None  # collected before freezing: startup's garbage is not kept for good
        # frozen objects still go when their last reference does (another thread's, between the two counts): the
        # permanent generation can shrink, never grow without another freeze
        assert frozen > 1000 and 0 < gc.get_freeze_count() <= frozen and gc.is_tracked(kept)
        assert not walked(kept)  # in the permanent generation: no collection walks it
        later = Node()  # what serving makes is still collected
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    finally:
        heap.unfreeze()
    assert gc.get_freeze_count() == 0 and walked(kept)

"""The collector's heap after start-up: frozen, so full collections skip the model's objects."""

from __future__ import annotations

import gc
import weakref

from radixkv.engine import freeze_startup_heap, release_heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_frozen_objects_are_skipped_until_released() -> None:
    gc.unfreeze()
    survivor = Cycle()
    alive = weakref.ref(survivor)
    assert freeze_startup_heap() == gc.get_freeze_count() > 0
    assert not any(o is survivor for o in gc.get_objects())  # in no generation a collection walks
    del survivor
    gc.collect()
    assert alive() is not None  # a frozen cycle is not collected ...
    release_heap()
    assert gc.get_freeze_count() == 0
    assert alive() is None  # ... until the heap is released

"""A stage process freezes its start-up heap (omni_runtime/stages/heap.py): what is alive when
it starts serving is left out of every later collection, so a full collection on the KV
receiver's thread does not walk torch's and NIXL's objects in the middle of a read."""

from __future__ import annotations

import gc

import pytest

from omni_runtime.stages.heap import freeze_startup_heap


@pytest.fixture
def unfreeze():
    yield
    gc.unfreeze()  # this test process keeps collecting as before


def test_what_is_alive_at_start_up_is_frozen_out_of_collections(unfreeze):
    started = [object() for _ in range(3)]  # a tracked container, alive "since start-up"
    frozen = freeze_startup_heap()
    # Frozen objects may still die (other threads of this test process free theirs), so the
    # count can only have gone down since.
    assert frozen > 0 and 0 < gc.get_freeze_count() <= frozen
    assert not any(o is started for o in gc.get_objects())  # no generation holds it now
    later = [object()]  # created while serving: collected as usual
    assert any(o is later for o in gc.get_objects())

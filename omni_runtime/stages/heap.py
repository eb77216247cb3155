"""The Python heap of a stage process once it has started.

A process that imported torch and set up NIXL holds hundreds of thousands of objects that live
as long as it does. Python's full (generation 2) collection walks all of them whenever enough
young objects survive, on whichever thread allocates at that moment: on the KV receiver's
thread, in the middle of a transfer's reads, a collection long enough to nearly double a
round's hand-off to ack (docs/stages.md, "Receiving stage"). Frozen, they are left
out of every collection. vLLM does the same for its engine core (``freeze_gc_heap`` after
start-up), which covers a stage that is a vLLM engine; this is for the processes we start
ourselves.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Move every object alive now to the oldest generation and freeze it there; call once
    the process has started serving. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

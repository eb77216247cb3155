"""Registered host memory that a transfer's reads land in, and that its payload keeps.

On the host, the receiver stores a payload as its blocks were read (per layer and plane, the
transfer's blocks in order: :class:`~.assemble.StagedKV`) and turns it into
``[layers, 2, H, seq_len, D]`` when a consumer takes it: the ack waits for the bytes to be
here, not for a layout conversion that costs a CPU about as much again as the read
(docs/connector.md). So a read lands in the payload's own memory, which NIXL must know:
slabs registered once and re-used, as :class:`~.memory.PayloadPool` re-uses its own (fresh
memory faults in page by page; registering costs too).

Threading: :meth:`LandingPool.take`, :meth:`~LandingPool.collect` and
:meth:`~LandingPool.retire` run on the receiver thread, the NIXL agent's only user. A slab
comes back from whichever thread drops the last view of its array (the consumer's, after
the payload was assembled), through a queue the receiver thread drains: registering and
deregistering stay on that thread.

Invariants: a slab is registered from :meth:`take` until it is deregistered in
:meth:`collect` (more free than ``max_free_bytes``) or at close; a slab is handed out again
only after every view of its previous array is gone; a retired slab (a read into it could
not be released: the backend may still write it) is never handed out or unmapped.
"""

from __future__ import annotations

import logging
import mmap
import queue
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_runtime.kv.transport.memory import FreeSlabs, empty_huge
from omni_runtime.kv.transport.nixl_agent import KVAgent

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class LandingSlab:
    memory: mmap.mmap
    size: int
    addr: int
    registration: Any = field(repr=False, default=None)
    finalizer: Any = field(repr=False, default=None)  # of the array handed out, while out


class LandingPool:
    """Registered host slabs for reads to land in. ``max_free_bytes``: free slabs kept
    registered for re-use (beyond that a returned slab is deregistered and unmapped)."""

    def __init__(self, agent: KVAgent, max_free_bytes: int) -> None:
        self._agent = agent
        self.max_free_bytes = max_free_bytes
        self._free = FreeSlabs()
        self._returned: queue.SimpleQueue[LandingSlab] = queue.SimpleQueue()
        self._retired: list[LandingSlab] = []
        self._closed = False
        self.registered = 0  # slabs registered so far (tests and benchmarks read it)
        self.reused = 0

    def take(self, nbytes: int) -> tuple[LandingSlab, np.ndarray]:
        """A registered slab of at least ``nbytes`` and a uint8 array of ``nbytes`` on it;
        the slab comes back when the array and every view of it are gone."""
        self.collect()
        slab = self._free.take(nbytes)
        if slab is not None:
            self.reused += 1
        else:
            memory = empty_huge(nbytes)
            array = np.frombuffer(memory, dtype=np.uint8)
            slab = LandingSlab(memory, nbytes, array.ctypes.data)
            del array
            slab.registration = self._agent.register([(slab.addr, nbytes, 0)], "DRAM")
            self.registered += 1
        root = np.frombuffer(slab.memory, dtype=np.uint8, count=nbytes)
        slab.finalizer = weakref.finalize(root, self._give_back, slab)
        return slab, root

    def _give_back(self, slab: LandingSlab) -> None:
        # Any thread. After close the slab is left to the garbage collector (the agent's
        # close deregisters it).
        if not self._closed:
            self._returned.put(slab)

    def retire(self, slab: LandingSlab) -> None:
        """Never hand ``slab`` out again, nor unmap it: a read into it may still land."""
        if slab.finalizer is not None:
            slab.finalizer.detach()
            slab.finalizer = None
        self._retired.append(slab)
        logger.error("KV receiver: a %d-byte landing slab retired (a read into it could not "
                     "be released); %d retired", slab.size, len(self._retired))

    def collect(self) -> None:
        """Take back the slabs whose arrays are gone; unmap what exceeds ``max_free_bytes``
        (largest first: the fewest deregistrations)."""
        while True:
            try:
                slab = self._returned.get_nowait()
            except queue.Empty:
                break
            slab.finalizer = None
            self._free.put(slab.size, slab)
        while self._free.bytes > self.max_free_bytes:
            self._unmap(self._free.pop_largest())

    def close(self) -> None:
        """Deregister and unmap the free slabs; slabs still in payloads stay mapped (their
        arrays keep them) and are deregistered by the agent's close."""
        self.collect()
        self._closed = True
        while (slab := self._free.pop_largest()) is not None:
            self._unmap(slab)

    @property
    def free_bytes(self) -> int:
        return self._free.bytes

    def _unmap(self, slab: LandingSlab) -> None:
        try:
            self._agent.deregister(slab.registration)
        except Exception as exc:  # the agent keeps it; unmapping would free registered memory
            logger.warning("KV receiver: deregistering a landing slab failed (%s); it stays "
                           "mapped", exc)
            self._retired.append(slab)
            return
        slab.memory.close()

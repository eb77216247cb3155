"""Host memory for payloads: huge pages where the kernel offers them, and re-used.

A payload's memory is written once, by the receiver's assembly, then read by its consumer.
Fresh memory is expensive to write the first time: every page faults in (the kernel zeroes
it; on a virtual machine the host may fault it in too): on this project's VM ten to twenty
times the time of writing memory written before (docs/connector.md, "Figures behind the
design"). So payload memory comes from a :class:`PayloadPool`: a payload's array is a view of a pooled
slab, and when the last view of it is gone (the consumer dropped it), the slab goes back to
the pool for the next payload. Slabs are mapped on transparent huge pages where the kernel
offers them (``madvise`` mode, the common default): a fault per 2 MiB instead of per 4 KiB.

The pool keeps at most ``max_bytes`` of free slabs (beyond that a slab is unmapped when it
comes back); memory in use is bounded elsewhere (the inbox's ``max_bytes``).
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref

import numpy as np

HUGE_PAGE_BYTES = 2 << 20


def empty_huge(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of ``nbytes``, advised onto huge pages when it can be."""
    memory = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE_BYTES:
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no THP here: plain pages
            pass
    return memory


class FreeSlabs:
    """Free slabs by size, for re-use: the rule both pools of this transport keep (this
    module's payload memory, landing.py's registered landing memory). Not thread-safe: its
    pool holds it under its own discipline."""

    def __init__(self) -> None:
        self._free: list[tuple[int, int, object]] = []  # (size, id, slab), by size
        self.bytes = 0

    def take(self, nbytes: int) -> object | None:
        """The smallest free slab that fits ``nbytes``, if it is not more than twice that
        size (a larger one would hold memory a smaller payload does not use); else None."""
        i = bisect.bisect_left(self._free, (nbytes,))
        if i < len(self._free) and self._free[i][0] <= 2 * nbytes:
            size, _, slab = self._free.pop(i)
            self.bytes -= size
            return slab
        return None

    def put(self, size: int, slab: object) -> None:
        bisect.insort(self._free, (size, id(slab), slab))
        self.bytes += size

    def pop_largest(self) -> object | None:
        """The largest free slab, taken out (None when there is none)."""
        if not self._free:
            return None
        size, _, slab = self._free.pop()
        self.bytes -= size
        return slab


class PayloadPool:
    """Arrays for payloads, on re-used slabs. Thread-safe: a slab may come back from any
    thread (whichever drops the last view of its array). ``pinned``: slabs in page-locked
    memory (a receiver assembling on a GPU copies each payload to the host: pinned, that copy
    runs at the bus's speed, pageable it is staged by the driver), pinned once per slab."""

    def __init__(self, max_bytes: int = 1 << 30, *, pinned: bool = False) -> None:
        self.max_bytes = max_bytes
        self.pinned = pinned
        self._lock = threading.Lock()
        self._free = FreeSlabs()
        self.reused = 0
        self.mapped = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised array; its slab returns to the pool when the array and every
        view of it are gone."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes < HUGE_PAGE_BYTES:
            return np.empty(shape, dtype)  # small: the allocator's own re-use is enough
        slab = self._take(nbytes)
        if self.pinned:
            root = slab.numpy()[:nbytes].view(dtype)
        else:
            root = np.frombuffer(slab, dtype=dtype, count=nbytes // dtype.itemsize)
        weakref.finalize(root, self._give_back, slab)
        return root.reshape(shape)

    def _take(self, nbytes: int):
        with self._lock:
            slab = self._free.take(nbytes)
            if slab is not None:
                self.reused += 1
                return slab
            self.mapped += 1
        if self.pinned:
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return empty_huge(nbytes)

    def _give_back(self, slab) -> None:
        size = slab.numel() if self.pinned else len(slab)
        with self._lock:
            if self._free.bytes + size <= self.max_bytes:
                self._free.put(size, slab)
                return
        if not self.pinned:
            slab.close()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free.bytes

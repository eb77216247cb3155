"""The AR's KV cache on the host, moved onto transparent huge pages before it is registered.

A receiving stage reads each transfer's blocks straight out of the AR's KV cache with NIXL; on
the host, UCX's ``cma`` transport does it with ``process_vm_readv``, which pins the AR's pages
one by one as it copies. vLLM's CPU KV cache is plain ``malloc``ed memory, on 4 KiB pages
wherever transparent huge pages are in their common ``madvise`` mode: a 7B request's KV is
tens of thousands of pages to pin, and the copy ran slower than the same READs a moment
later. On 2 MiB pages it is a few dozen, and the copy runs at the memory's speed
(docs/connector.md, "Figures behind the design"). The engine's own attention reads the same cache through fewer TLB misses.

:func:`collapse_into_huge_pages` asks the kernel for that on an existing range: ``madvise``
``MADV_HUGEPAGE`` (new faults and khugepaged use huge pages from now on), then
``MADV_COLLAPSE`` (Linux 6.1+) huge page by huge page: the pages already there are moved onto
huge pages now, in the calling thread (seconds for a cache of hundreds of MB, growing with
its size; docs/connector.md). It never raises: where THP is off, or ``MADV_COLLAPSE`` is missing or refused,
the outcome says why and how much was moved.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
_THP = Path("/sys/kernel/mm/transparent_hugepage")


@dataclass(frozen=True)
class HugePageOutcome:
    """What :func:`collapse_into_huge_pages` did: ``bytes`` of the range moved onto huge pages
    (of its huge-page-aligned interior), in ``seconds``; ``why_not`` when it moved none or
    not all of it; ``unsupported`` when this kernel or its settings cannot do it at all."""

    bytes: int = 0
    seconds: float = 0.0
    why_not: str = ""
    unsupported: bool = False


def huge_page_size() -> int:
    """The transparent huge page size (``hpage_pmd_size``), 0 where there are none."""
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0


def _thp_disabled() -> bool:
    try:
        return "[never]" in (_THP / "enabled").read_text()
    except OSError:
        return False


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def collapse_into_huge_pages(addr: int, nbytes: int) -> HugePageOutcome:
    """Back the huge-page-aligned interior of ``[addr, addr + nbytes)`` (memory of this
    process, populated or not) with transparent huge pages; see the module docstring."""
    size = huge_page_size()
    if not size:
        return HugePageOutcome(why_not="this kernel offers no transparent huge pages",
                               unsupported=True)
    if _thp_disabled():
        return HugePageOutcome(why_not="transparent huge pages are disabled (enabled: never)",
                               unsupported=True)
    lo = (addr + size - 1) // size * size
    hi = (addr + nbytes) // size * size
    if hi <= lo:
        return HugePageOutcome(why_not=f"smaller than one {size >> 20} MiB huge page")
    try:
        madvise = _madvise()
    except (OSError, AttributeError) as e:
        return HugePageOutcome(why_not=f"no madvise: {e}", unsupported=True)
    started = time.perf_counter()
    if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
        return HugePageOutcome(why_not=f"madvise(MADV_HUGEPAGE): {os.strerror(ctypes.get_errno())}")
    # The kernel checks the advice before it returns early for an empty range: EINVAL here
    # means MADV_COLLAPSE is unknown to it, and nothing else.
    if madvise(lo, 0, MADV_COLLAPSE) != 0:
        return HugePageOutcome(
            seconds=time.perf_counter() - started, unsupported=True,
            why_not="this kernel has no MADV_COLLAPSE (Linux 6.1+): the range is on huge pages "
                    "only as khugepaged collapses it")
    moved, why = 0, ""
    for page in range(lo, hi, size):  # page by page: a refusal costs one page, not the rest
        for _ in range(2):  # EAGAIN (a page briefly busy) is worth one more try
            if madvise(page, size, MADV_COLLAPSE) == 0:
                moved += size
                break
            err = ctypes.get_errno()
            if err != errno.EAGAIN:
                break
        if moved < page + size - lo and not why:
            why = f"madvise(MADV_COLLAPSE): {os.strerror(err)}"
    return HugePageOutcome(bytes=moved, seconds=time.perf_counter() - started,
                           why_not=why if moved < hi - lo else "")


def huge_page_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """``AnonHugePages`` of this process's mappings that overlap any of ``ranges`` ((address,
    length) pairs), each mapping counted once (madvise splits a mapping where its advice
    changes, so one range may span several; a mapping's figure may include huge pages just
    outside the ranges)."""
    ranges = list(ranges)
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, _, hi = head.partition("-")
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                inside = False
                continue
            inside = any(start < addr + n and addr < end for addr, n in ranges)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total

"""A Linux CPU list (``"3"``, ``"2-3,6"``): the KV transport's ``ioCpus`` of a stage, which the
operator checks before anything is created and the runtime again where the transport runs.

The CRD's pattern for ``kvTransfer.ioCpus`` refuses what is not a list of ids and ranges (the
API server's check); this module states the rest: the ranges' order and the ids' bound.
"""

from __future__ import annotations

import re

#: The highest CPU id a list may name. No Linux kernel supports this many CPUs (NR_CPUS is
#: at most 8192); the bound keeps a typo such as "0-9999999999" from building a set of ten
#: billion ids in the engine, or in a config check, before anything can refuse it.
MAX_CPU_ID = 65535

_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3} (spaces ignored, as the kernel's lists may hold them); raises
    ValueError naming the item and the fix for anything else (a descending range, an id
    above :data:`MAX_CPU_ID`)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        m = _ITEM.fullmatch(part)
        if m is None:
            raise ValueError(f"not a CPU list item: {part!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"descending CPU range {part!r}: write it low-high, {hi}-{lo}")
        if hi > MAX_CPU_ID:
            raise ValueError(f"CPU id above {MAX_CPU_ID}: {part!r}")
        cpus.update(range(lo, hi + 1))
    return cpus

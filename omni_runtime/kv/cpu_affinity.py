"""Which CPUs the KV transport's threads run on, apart from the engine's OpenMP threads.

vLLM's CPU worker binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``, which
the multiprocessing executor turns into ``OMP_PLACES`` / ``GOMP_CPU_AFFINITY`` /
``KMP_AFFINITY`` in the worker's environment). A thread started later by the worker's main
thread inherits the main thread's binding: without this module the sender's I/O thread and
ZeroMQ's own I/O thread would run on the core of the engine's OpenMP master thread. An
OpenMP parallel region ends at a barrier that waits for its slowest thread, so every core
the transport takes from the engine delays every parallel region of the step, not only
the step that hands a transfer off (measured: docs/connector.md, "Measured").

``kv_connector_extra_config.io_cpus`` names the transport's CPUs (``"3"``, ``"2-3,6"`` or a
list of ints). Absent (or ``"auto"``): the CPUs this process may use that the engine's
OpenMP threads are not bound to, as vLLM's own auto binding leaves them (it reserves CPUs
for the engine core and for a KV connector when it can); when the OpenMP binding is unknown
or takes every CPU, all of this process's CPUs (never only the master's core).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from omni_contract.cpu_list import MAX_CPU_ID, parse_cpu_list

FIELD = "kv_transfer_config.kv_connector_extra_config.io_cpus"


class CPUListError(ValueError):
    """A CPU list setting that cannot be used (the message names the field and the fix)."""


def available_cpus() -> set[int]:
    """The CPUs this process may use, whatever its main thread is bound to: the cgroup's
    cpuset when readable, else the online CPUs."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                cpus = parse_cpu_list(f.read().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def omp_bound_cpus(environ: Mapping[str, str]) -> set[int] | None:
    """The CPUs the engine's OpenMP threads are bound to, from the variables vLLM's CPU
    executor sets for its workers; None when unbound or unknown. With an explicit
    ``VLLM_CPU_OMP_THREADS_BIND`` ("0-3|4-7", one list per rank) every rank's CPUs count: a
    tensor-parallel worker's transport must not land on another rank's cores either."""
    own = _own_omp_cpus(environ)
    ranks = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if ranks not in ("", "auto", "nobind"):
        try:
            every = set().union(*(parse_cpu_list(r) for r in ranks.split("|")))
        except ValueError:
            every = set()
        if every:
            return every | (own or set())
    return own


def _own_omp_cpus(environ: Mapping[str, str]) -> set[int] | None:
    places = environ.get("OMP_PLACES", "")
    if places and environ.get("OMP_PROC_BIND", "").lower() not in ("", "false"):
        # vLLM writes "{0,1,2}"; also accept "{0},{1}" and "{0:4}" (4 CPUs from 0).
        cpus: set[int] = set()
        for body in re.findall(r"\{([^}]*)\}", places):
            if re.fullmatch(r"\d+:\d+", body):
                start, count = map(int, body.split(":"))
                cpus.update(range(start, start + count))
            else:
                try:
                    cpus |= parse_cpu_list(body)
                except ValueError:
                    return None
        return cpus or None
    gomp = environ.get("GOMP_CPU_AFFINITY", "")
    if gomp:
        try:
            return parse_cpu_list(gomp.replace(" ", ",")) or None
        except ValueError:
            return None
    m = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
    if m:
        try:
            return parse_cpu_list(m.group(1)) or None
        except ValueError:
            return None
    return None


def requested_cpus(setting: object, field: str = FIELD) -> set[int] | None:
    """The CPUs an ``io_cpus`` setting names, None for "auto" (or absent): its syntax only,
    not whether this process may use them (:func:`transport_cpus` checks that where the
    transport runs). Raises :class:`CPUListError` naming ``field`` for a malformed or empty
    setting; the stage config checks its ``kvTransfer.ioCpus`` with this before vLLM starts."""
    if setting is None or setting == "auto":
        return None
    try:
        if isinstance(setting, str):
            cpus = parse_cpu_list(setting)
        elif isinstance(setting, (list, tuple)) and all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_CPU_ID
            for c in setting
        ):
            cpus = set(setting)
        else:
            raise ValueError(f"a string like \"2-3\" or a list of CPU ids, not {setting!r}")
    except ValueError as exc:
        raise CPUListError(f"{field}: {exc}; use e.g. \"3\", \"2-3,6\", [2, 3] or \"auto\"") \
            from None
    if not cpus:
        raise CPUListError(f"{field} is empty: name at least one CPU, or \"auto\"")
    return cpus


def transport_cpus(setting: object, environ: Mapping[str, str] | None = None,
                   available: Iterable[int] | None = None) -> set[int]:
    """The CPUs for the transport's threads, from the ``io_cpus`` setting (see the module
    docstring). Raises :class:`CPUListError` for a setting that cannot be honoured."""
    allowed = set(available) if available is not None else available_cpus()
    cpus = requested_cpus(setting)
    if cpus is None:
        engine = omp_bound_cpus(os.environ if environ is None else environ)
        rest = allowed - engine if engine else set()
        return rest or allowed
    outside = cpus - allowed
    if outside:
        raise CPUListError(
            f"{FIELD} names CPUs {sorted(outside)} this process cannot use (it may use "
            f"{sorted(allowed)}): pick from those, or \"auto\""
        )
    return cpus


def disjoint_from_engine(cpus: Iterable[int], environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``cpus`` share no CPU with the engine's OpenMP binding (False when unknown)."""
    engine = omp_bound_cpus(os.environ if environ is None else environ)
    return engine is not None and not (set(cpus) & engine)

"""Whether the KV transport's threads run: ``omni_kv_transport_thread_up``.

One gauge family, labels ``stage``, ``model_name`` and ``thread`` (``sender``: the AR stage's
KVSender I/O thread; ``receiver``: a receiving stage's KVReceiver thread; nothing else, so the
label stays bounded). 1 while the thread runs, 0 once it ended; a stage whose thread died sets
0 and its ``/health`` fails (docs/connector.md, "When a thread dies"). The thread itself reports
both values (through the transport's callbacks), so the value is right in prometheus_client's
multiprocess mode too, where the sender's process is not the one serving ``/metrics``: the
gauge uses ``livemostrecent``, so a dead process's value drops out instead of lingering.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from omni_contract.metrics import TRANSPORT_THREAD_UP as FAMILY
from omni_runtime.observability.metrics import GAUGE_MODE

THREADS: tuple[str, ...] = ("sender", "receiver")

_gauges: weakref.WeakKeyDictionary[CollectorRegistry, Gauge] = weakref.WeakKeyDictionary()
_unregistered: list[Gauge] = []


def _gauge(registry: CollectorRegistry | None) -> Gauge:
    if registry is None:
        if not _unregistered:
            _unregistered.append(Gauge(FAMILY.name, FAMILY.help, FAMILY.labels, registry=None,
                                       multiprocess_mode=GAUGE_MODE))
        return _unregistered[0]
    gauge = _gauges.get(registry)
    if gauge is None:
        gauge = _gauges[registry] = Gauge(FAMILY.name, FAMILY.help, FAMILY.labels,
                                          registry=registry, multiprocess_mode=GAUGE_MODE)
    return gauge


def thread_up_setter(*, stage: str, model_name: str, thread: str,
                     registry: CollectorRegistry | None = REGISTRY) -> Callable[[bool], None]:
    """``set(up)`` for the thread's series; pass it to ``KVSender(on_thread_state=...)`` (the
    receiver's ReceiverMetrics uses it itself). Never raises."""
    if thread not in THREADS:
        raise ValueError(f"thread must be one of {THREADS}, not {thread!r}")
    gauge = _gauge(registry)

    def set_up(up: bool) -> None:
        # The series appears at the thread's first report, not at 0 before it started.
        gauge.labels(stage, model_name, thread).set(1.0 if up else 0.0)

    return set_up

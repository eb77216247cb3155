"""Prometheus metrics of a receiving stage's KV connector (receiver and inbox).

Same style as the metric contract (omni_runtime/observability/metrics.py): prefix ``omni_``, base units,
``_total`` counters, labels ``stage`` and ``model_name`` plus bounded labels (``outcome``,
``reason``, and ``from_stage`` on the per-edge families); never a request id.

Per edge: ``omni_kv_received_total`` and ``omni_kv_received_bytes`` carry ``from_stage``, the
sending stage, one value per input of the stage (``from_stages``, known at start-up from the
stage config's ``inputs``), plus ``unknown`` for a transfer whose sender is not one of them or
was not named (a malformed frame, or a caller that does not pass it). When the stage has exactly
one input, a transfer the caller does not attribute is that input's. Every child is bound at construction, so every
series exists (at 0) from the first scrape. Gauges are set to absolute values read from the
inbox and use the ``livemostrecent`` multiprocess mode, so a restarted process's values
supersede a dead one's; counters and histograms are summed over processes (see
docs/metrics.md, "multiprocess mode").

The sender side's ``omni_kv_transfer_bytes`` is the contract's family in
omni_runtime/observability/metrics.py (``TransferMetrics.observe_transfer_bytes``); the sender takes that
method as its ``observe_bytes`` callback rather than defining the family twice.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry

from omni_contract.kv_wire import REJECT_CODES
from omni_contract.metrics import (
    FROM_STAGE_LABELS,
    RECEIVED,
    RECEIVED_BYTES,
    RECEIVER_BUFFERED_BYTES,
    RECEIVER_BUFFERED_PAYLOADS,
    RECEIVER_EVICTED,
    RECEIVER_FAMILIES,
    RECEIVER_REJECTED,
    RECEIVER_WAIT,
    Family,
)
from omni_runtime.observability.metrics import BYTES_BUCKETS, register
from omni_runtime.observability.transport_metrics import thread_up_setter

RECEIVE_OUTCOMES: tuple[str, ...] = ("delivered", "rejected")
EVICTION_REASONS: tuple[str, ...] = ("expired", "replaced", "abandoned")
WAIT_OUTCOMES: tuple[str, ...] = ("found", "timeout")

#: inbox.get() wait (seconds): the consumer usually asks just before or after arrival.
WAIT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

#: ``from_stage`` of a transfer not attributed to one of the stage's inputs.
UNKNOWN_FROM_STAGE = "unknown"
EDGE_LABELS: tuple[str, ...] = FROM_STAGE_LABELS

FAMILIES: tuple[Family, ...] = RECEIVER_FAMILIES


class _Families:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.registry = registry
        self.received = register(RECEIVED, registry)
        self.rejected = register(RECEIVER_REJECTED, registry)
        self.received_bytes = register(RECEIVED_BYTES, registry, BYTES_BUCKETS)
        self.payloads = register(RECEIVER_BUFFERED_PAYLOADS, registry)
        self.bytes = register(RECEIVER_BUFFERED_BYTES, registry)
        self.evicted = register(RECEIVER_EVICTED, registry)
        self.wait = register(RECEIVER_WAIT, registry, WAIT_BUCKETS)


# One set of families per registry (several receivers in one process, tests re-creating
# them) instead of "Duplicated timeseries".
_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_unregistered: list[_Families] = []


def _families_for(registry: CollectorRegistry | None) -> _Families:
    if registry is None:
        if not _unregistered:
            _unregistered.append(_Families(None))
        return _unregistered[0]
    fams = _families.get(registry)
    if fams is None:
        fams = _families[registry] = _Families(registry)
    return fams


class ReceiverMetrics:
    """The receiver families for one stage, children bound once (thread-safe: the receiver
    thread and consumer threads call it).

    ``from_stages``: the stage's inputs (the bounded ``from_stage`` values); their series
    exist from construction, at 0 (``unknown``'s too when there is none)."""

    def __init__(self, *, stage: str, model_name: str = "", from_stages: Iterable[str] = (),
                 registry: CollectorRegistry | None = REGISTRY) -> None:
        fams = _families_for(registry)
        base = (stage, model_name)
        self._fams, self._base = fams, base
        self.from_stages = tuple(dict.fromkeys(s for s in from_stages if s != UNKNOWN_FROM_STAGE))
        self._lock = threading.Lock()
        # from_stage -> ({outcome: counter child}, bytes child); `unknown` added on first use.
        self._edges: dict[str, tuple[dict[str, object], object]] = {}
        for name in self.from_stages or (UNKNOWN_FROM_STAGE,):
            self._edge(name)
        self._rejected = {c: fams.rejected.labels(*base, c) for c in REJECT_CODES}
        self._payloads = fams.payloads.labels(*base)
        self._buffered = fams.bytes.labels(*base)
        self._evicted = {r: fams.evicted.labels(*base, r) for r in EVICTION_REASONS}
        self._wait = {o: fams.wait.labels(*base, o) for o in WAIT_OUTCOMES}
        self._thread_up = thread_up_setter(stage=stage, model_name=model_name,
                                           thread="receiver", registry=registry)
        self.set_inbox(0, 0)  # also supersedes a dead process's gauge values

    def _edge(self, from_stage: str | None) -> tuple[dict[str, object], object]:
        if from_stage is None and len(self.from_stages) == 1:
            from_stage = self.from_stages[0]
        if from_stage not in self.from_stages:
            from_stage = UNKNOWN_FROM_STAGE
        edge = self._edges.get(from_stage)
        if edge is None:
            with self._lock:
                edge = self._edges.get(from_stage)
                if edge is None:
                    labels = (*self._base, from_stage)
                    edge = ({o: self._fams.received.labels(*labels, o) for o in RECEIVE_OUTCOMES},
                            self._fams.received_bytes.labels(*labels))
                    self._edges[from_stage] = edge
        return edge

    def delivered(self, nbytes: int, from_stage: str | None = None) -> None:
        """A transfer from ``from_stage`` was stored and acked (``nbytes``: its payload)."""
        counters, size = self._edge(from_stage)
        counters["delivered"].inc()
        size.observe(nbytes)

    def rejected(self, code: str, from_stage: str | None = None) -> None:
        """A transfer (from ``from_stage``, when its header named one) was refused with ``code``."""
        self._edge(from_stage)[0]["rejected"].inc()
        self._rejected[code].inc()

    def set_inbox(self, payloads: int, nbytes: int) -> None:
        self._payloads.set(payloads)
        self._buffered.set(nbytes)

    def evicted(self, reason: str) -> None:
        self._evicted[reason].inc()

    def observe_wait(self, seconds: float, found: bool) -> None:
        self._wait["found" if found else "timeout"].observe(seconds)

    def thread_up(self, up: bool) -> None:
        self._thread_up(up)


def build_registry(*, stage: str = "stage", model_name: str = "model",
                   from_stages: Iterable[str] = ("previous",),
                   ) -> tuple[CollectorRegistry, ReceiverMetrics]:
    """A private registry with every receiver family (series at zero), for tools that check
    dashboard and alert queries against the real names."""
    registry = CollectorRegistry()
    metrics = ReceiverMetrics(stage=stage, model_name=model_name, from_stages=from_stages,
                              registry=registry)
    metrics.thread_up(True)  # the thread-state series exists once a receiver thread runs
    return registry, metrics

"""The operator's own Prometheus metrics, in a registry of their own (served on --metrics-port)."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omni_contract.metrics import OPERATOR_PIPELINES, OPERATOR_RECONCILES, PIPELINE_PHASES as PHASES


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            OPERATOR_RECONCILES.registered_name, OPERATOR_RECONCILES.help,
            list(OPERATOR_RECONCILES.labels), registry=self.registry)
        self.duration = Histogram(
            "omni_operator_reconcile_duration_seconds", "Time to reconcile one OmniPipeline.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.pipelines = Gauge(
            OPERATOR_PIPELINES.registered_name, OPERATOR_PIPELINES.help,
            list(OPERATOR_PIPELINES.labels), registry=self.registry)
        self.api_calls = Counter(
            "omni_operator_api_requests_total", "Kubernetes API requests made, by verb and kind.",
            ["verb", "kind"], registry=self.registry)
        self._phases: dict[tuple[str, str], str] = {}
        self._counts: dict[str, int] = {p: 0 for p in PHASES}
        self._lock = threading.Lock()
        for phase in PHASES:
            self.pipelines.labels(phase).set(0)

    def api_call(self, verb: str, kind: str) -> None:
        self.api_calls.labels(verb, kind).inc()

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Record a pipeline's phase (None: the pipeline is gone) and refresh the gauge.

        Counted as phases change, not recounted: this runs at every reconcile, and a recount
        would cost each reconcile a pass over every pipeline."""
        with self._lock:
            key = (namespace, name)
            old = self._phases.pop(key, None) if phase is None else self._phases.get(key)
            if old == phase:
                return
            if phase is not None:
                self._phases[key] = phase
            for value, step in ((old, -1), (phase, 1)):
                if value is not None:
                    self._counts[value] = self._counts.get(value, 0) + step
                    self.pipelines.labels(value).set(self._counts[value])

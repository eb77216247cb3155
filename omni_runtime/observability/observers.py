"""Builds the observers (metrics, tracing) that the scheduler attaches to its ledger.

Imports neither prometheus_client nor OpenTelemetry at import time: each is imported only
when a scheduler builds its observers, in the engine-core process.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omni_runtime.observability.multiproc import MULTIPROC_ENV
from omni_runtime.transfers.ledger import TransferObserver

logger = logging.getLogger(__name__)


def downstream_stages(vllm_config: Any) -> list[str]:
    """The downstream stages of this stage's KV connector: the keys of its
    ``kv_connector_extra_config.endpoints`` (``{stage: address}``), also as a child of vLLM's
    MultiConnector (``connectors``); none without one."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, dict):
        return []
    configs = [extra] + [c.get("kv_connector_extra_config") or {} for c in extra.get("connectors") or []
                         if isinstance(c, dict)]
    for config in configs:
        endpoints = config.get("endpoints") if isinstance(config, dict) else None
        if isinstance(endpoints, dict) and endpoints:
            return [str(name) for name in endpoints]
    return []


def build_observers(
    *, stage: str, model_name: str, timeout_seconds: float, vllm_config: Any = None
) -> list[TransferObserver]:
    """Metrics always; tracing only when something asks for traces (else no observer, no
    cost). Called once per scheduler, in the engine-core process. Their reports are written
    off the step, by the process's writer threads (writer_thread.py)."""
    from omni_runtime.observability.metrics import TransferMetrics
    from omni_runtime.observability.tracing import TransferTracing, resolve_tracer
    from omni_runtime.observability.writer_thread import metrics_thread, span_thread

    if MULTIPROC_ENV not in os.environ:
        # Fine with an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0); with vLLM's
        # default engine-core process the API server's /metrics will not show omni_ families.
        logger.warning(
            "%s is not set: omni_ KV transfer metrics are only visible from this process "
            "(see docs/metrics.md)", MULTIPROC_ENV)
    observers: list[TransferObserver] = [
        TransferMetrics(stage=stage, model_name=model_name, deadline_seconds=timeout_seconds,
                        writer_thread=metrics_thread())
    ]
    # The per-edge families' series, one set per downstream stage, exist from start-up (at 0).
    # With one downstream stage the ledger feeds them (the transfer's fate is its edge's);
    # a stage that fans out needs the data path (edge_metrics.data_path_edge_metrics).
    to_stages = downstream_stages(vllm_config)
    if to_stages:
        from omni_runtime.observability.edge_metrics import EdgeMetrics, LedgerEdgeObserver

        edges = EdgeMetrics(stage=stage, model_name=model_name, to_stages=to_stages,
                            deadline_seconds=timeout_seconds)
        if len(edges.to_stages) == 1:
            observers.append(LedgerEdgeObserver(edges, writer_thread=metrics_thread()))
    tracer = resolve_tracer(vllm_config)
    if tracer is not None:
        observers.append(TransferTracing(tracer, stage=stage, model_name=model_name,
                                         writer_thread=span_thread()))
    return observers

"""A test-only KV connector on the omni connector's stats API (omni_runtime/kv/stats.py),
while the real connector's data plane is being rewritten: it moves no KV and, on its worker
side, records one made-up resolution per finished request through the same recorder the real
worker half uses. Everything from there on is vLLM's own: the stats travel with the model
runner's output, the engine core aggregates them, the API server logs ``reduce()`` and feeds
``/metrics`` through ``build_prom_metrics``.

Deterministic, so that a test can assert exact values: every resolution is ``NBYTES`` bytes
and ``SECONDS`` from hand-off to answer, to the first stage of ``endpoints``; every
``fail_every``-th one (kv_connector_extra_config, 0: none) fails. ``record_on``
(kv_connector_extra_config): ``worker`` (default: in the step after the request finished, as
vLLM tells the worker) or ``scheduler`` (in ``request_finished``, inside the scheduler's
``update_from_output``, whose end collects the scheduler-side connector's stats).
Loaded by vLLM from this directory (tests/procs.py and the tests put it on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from omni_runtime.kv.stats import OmniKVStatsMixin

NBYTES = 3 << 20
SECONDS = 0.2


class StatsTestConnector(OmniKVStatsMixin, KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._to_stage = next(iter(extra.get("endpoints") or {"next": None}))
        self._fail_every = int(extra.get("fail_every", 0))
        self._record_on = extra.get("record_on", "worker")
        self._resolved = 0

    def _record_one(self) -> None:
        self._resolved += 1
        failed = self._fail_every and self._resolved % self._fail_every == 0
        self.omni_kv_stats.record("failed" if failed else "acked", NBYTES, SECONDS,
                                  self._to_stage)

    # Scheduler side: nothing to load, nothing held.
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]):
        if self._record_on == "scheduler":
            self._record_one()
        return False, None

    # Worker side: no KV moves.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]):
        # The step after a request finished tells the worker (vLLM runs that step even when
        # nothing else is scheduled): one resolution each, drained by get_kv_connector_stats
        # in the same step.
        if self._record_on == "worker":
            for _ in finished_req_ids:
                self._record_one()
        return None, None

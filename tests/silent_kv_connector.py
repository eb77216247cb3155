"""A stand-in for a hung KV data path: ``OmniKVConnector``'s scheduler side as it is, its
worker side never sending nor answering.

Used where a test needs transfers that nobody acknowledges (stuck, held and expiring
transfers, the stuck-transfer alert) and the scheduler's own deadline to end them: the real
worker side gives up just before the deadline (reporting them ``expired`` itself), and there
is no deterministic way to hang the real one inside vLLM's worker. A mock, therefore, of the
worker half only; the scheduler, the ledger, the metrics and vLLM are real.
Loaded by vLLM from this directory (tests/procs.py puts it on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

from omni_runtime.kv.connector import OmniKVConnector


class SilentOmniKVConnector(OmniKVConnector):
    def register_kv_caches(self, kv_caches: Any) -> None:
        return None  # no NIXL agent, no sender: nothing is ever offered

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        # Keep vLLM's bookkeeping of the metadata; offer nothing.
        super(OmniKVConnector, self).bind_connector_metadata(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def build_connector_worker_meta(self) -> None:
        return None

"""A stand-in for a KV connector that saves asynchronously and so delays the free of every
finished request's blocks until its worker reports ``finished_sending`` (what vLLM's NIXL
and offloading connectors do; neither runs on this CPU-only machine, hence this stand-in).
Only its scheduler side is used: the scheduler tests hand-make the workers' reports."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class DelayingConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]):
        return True, None  # an asynchronous save: free only on finished_sending

    # Worker side: never runs in the scheduler tests.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None

"""Metric and label names the mixin queries, in one place so that a rename is one edit.

The `omni_kv_*` names are fixed by the metric contract in ARCHITECTURE.md; the receiver and
operator names follow the runtime's and the operator's registries (tests check every name a
rule or panel queries against those registries and vLLM's own).
"""
from __future__ import annotations

# Runtime (stage) metrics: the ARCHITECTURE.md metric contract.
KV_TRANSFERS = "omni_kv_transfers"  # gauge, label state
KV_HELD_BLOCKS = "omni_kv_held_blocks"  # gauge
KV_OLDEST_START = "omni_kv_transfer_oldest_start_timestamp_seconds"  # gauge, label state
KV_STARTED = "omni_kv_transfers_started_total"  # counter, label trigger
KV_RESOLVED = "omni_kv_transfers_resolved_total"  # counter, label outcome
KV_DURATION = "omni_kv_transfer_duration_seconds"  # histogram, label outcome
KV_HOLD_DURATION = "omni_kv_hold_duration_seconds"  # histogram
KV_BYTES = "omni_kv_transfer_bytes"  # histogram (worker side)
# Per edge of the pipeline graph (label to_stage, the downstream stage): one transfer to two
# stages resolves once in the families above and once per edge in these.
KV_EDGE_ACTIVE = "omni_kv_edge_transfers_active"  # gauge, label to_stage
KV_EDGE_OLDEST_START = "omni_kv_edge_oldest_active_start_timestamp_seconds"  # gauge, to_stage
KV_EDGE_HELD_BLOCKS = "omni_kv_edge_held_blocks"  # gauge, to_stage: finished requests' blocks kept for it
KV_EDGE_RESOLVED = "omni_kv_edge_transfers_resolved_total"  # counter, labels to_stage, outcome
KV_EDGE_DURATION = "omni_kv_edge_transfer_duration_seconds"  # histogram, to_stage, outcome
KV_EDGE_BYTES = "omni_kv_edge_transfer_bytes"  # histogram, to_stage
# Receiving stage: transfers answered, labels from_stage (the sender) and outcome.
KV_RECEIVED = "omni_kv_received_total"
# Receiving stage: transfers it refused (bad payload, unknown request, full), label reason.
KV_RECEIVER_REJECTED = "omni_kv_receiver_rejected_total"
# Either stage: 1 while the KV transport's thread runs, label thread = sender, receiver.
KV_TRANSPORT_THREAD_UP = "omni_kv_transport_thread_up"

# Operator metrics.
OPERATOR_RECONCILES = "omni_operator_reconciles_total"  # counter, label result

# vLLM's own metrics on the same /metrics page.
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_REQUEST_SUCCESS = "vllm:request_success_total"
VLLM_E2E_LATENCY = "vllm:e2e_request_latency_seconds"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"

# Labels that the scrape adds (the operator's PodMonitor, the chart's ServiceMonitor or a
# plain scrape_config): the stage's Kubernetes namespace and pod, the OmniPipeline's name,
# and the pipeline revision the pod runs (during a rollout two revisions' pods are scraped).
# Together with the metrics' own `stage` and `model_name` they identify a stage.
SCRAPE_LABELS = ("namespace", "pod", "pipeline", "stage", "revision")
STAGE_LABELS = ("namespace", "pipeline", "stage", "model_name")
# The bounded labels that name an edge of the pipeline graph (one value per edge, fixed at
# start-up): the downstream stage on the sending side, the upstream one on the receiving side.
EDGE_LABELS = ("to_stage", "from_stage")

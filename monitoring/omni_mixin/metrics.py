"""Metric and label names the mixin queries, in one place so that a rename is one edit.

The `omni_kv_*` names are the metric contract's (ARCHITECTURE.md), read from
omni_contract/metrics.py, which the runtime registers them from; the operator's names follow
its registry (tests check every name a rule or panel queries against those registries and
vLLM's own).
"""
from __future__ import annotations

from omni_contract import metrics as contract

# Runtime (stage) metrics: the metric contract's families (omni_contract/metrics.py).
KV_TRANSFERS = contract.TRANSFERS.name  # gauge, label state
KV_HELD_BLOCKS = contract.HELD_BLOCKS.name  # gauge
KV_OLDEST_START = contract.OLDEST_START.name  # gauge, label state
KV_STARTED = contract.STARTED.name  # counter, label trigger
KV_RESOLVED = contract.RESOLVED.name  # counter, label outcome
KV_DURATION = contract.DURATION.name  # histogram, label outcome
KV_HOLD_DURATION = contract.HOLD_DURATION.name  # histogram
KV_BYTES = contract.TRANSFER_BYTES.name  # histogram (worker side)
# Per edge of the pipeline graph (label to_stage, the downstream stage): one transfer to two
# stages resolves once in the families above and once per edge in these.
KV_EDGE_ACTIVE = contract.EDGE_ACTIVE.name  # gauge, label to_stage
KV_EDGE_OLDEST_START = contract.EDGE_OLDEST_ACTIVE.name  # gauge, to_stage
KV_EDGE_HELD_BLOCKS = contract.EDGE_HELD_BLOCKS.name  # gauge, to_stage: finished requests' blocks kept for it
KV_EDGE_RESOLVED = contract.EDGE_RESOLVED.name  # counter, labels to_stage, outcome
KV_EDGE_DURATION = contract.EDGE_DURATION.name  # histogram, to_stage, outcome
KV_EDGE_BYTES = contract.EDGE_BYTES.name  # histogram, to_stage
# Receiving stage: transfers answered, labels from_stage (the sender) and outcome.
KV_RECEIVED = contract.RECEIVED.name
# Receiving stage: transfers it refused (bad payload, unknown request, full), label reason.
KV_RECEIVER_REJECTED = contract.RECEIVER_REJECTED.name
KV_RECEIVER_BUFFERED_PAYLOADS = contract.RECEIVER_BUFFERED_PAYLOADS.name
KV_RECEIVER_BUFFERED_BYTES = contract.RECEIVER_BUFFERED_BYTES.name
KV_RECEIVER_EVICTED = contract.RECEIVER_EVICTED.name
KV_RECEIVER_WAIT = contract.RECEIVER_WAIT.name
# Either stage: 1 while the KV transport's thread runs, label thread = sender, receiver.
KV_TRANSPORT_THREAD_UP = contract.TRANSPORT_THREAD_UP.name
# A streamed edge, at either end (labels from_stage and to_stage; `stage` is the end that
# reports: the producer's series have stage == from_stage, the consumer's stage == to_stage).
KV_STREAMS = contract.STREAMS.name  # gauge, label state: open, held (producer), open, waiting (consumer)
KV_STREAM_OLDEST_WAIT = contract.STREAM_OLDEST_WAIT.name  # gauge: unix time; 0 when none waits
KV_STREAM_CHUNKS = contract.STREAM_CHUNKS.name  # counter, label outcome: acked, failed, expired
KV_STREAMS_RESOLVED = contract.STREAMS_RESOLVED.name  # counter, label outcome
KV_STREAM_FIRST_CHUNK = contract.STREAM_FIRST_CHUNK.name  # histogram
KV_STREAM_CHUNK_HOP = contract.STREAM_CHUNK_HOP.name  # histogram (consumer)
KV_STREAM_CHUNK_GAP = contract.STREAM_CHUNK_GAP.name  # histogram (consumer)
KV_STREAM_CREDIT_EXHAUSTED = contract.STREAM_CREDIT_EXHAUSTED.name  # counter, seconds

# Operator metrics.
OPERATOR_RECONCILES = contract.OPERATOR_RECONCILES.name  # counter, label result
OPERATOR_PIPELINES = contract.OPERATOR_PIPELINES.name  # gauge, label phase
#: The phases of a pipeline whose stages have run (their pods were ready), as a PromQL regex.
RUNNING_PHASES = f'phase=~"{"|".join(contract.RUNNING_PHASES)}"'
#: The results of a reconcile that failed or left its pipeline unapplied (not "invalid": a
#: spec the user must fix, reported in its status), as a PromQL regex.
FAILED_RECONCILES = 'result=~"error|rejected|conflict"'


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

"""The metric contract's families (ARCHITECTURE.md): names, types, labels and help, stated once.

The runtime registers each family from its entry here (omni_runtime/observability/); the
operator's health reader and local status read the families by these names, and the
monitoring mixin (monitoring/omni_mixin/metrics.py) queries them. A rename is one edit.

Names are as exposed: a counter's with its ``_total`` (prometheus_client appends it when it
registers :attr:`Family.registered_name`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every omni_kv_* series carries its stage and its model.
STAGE_LABELS: tuple[str, ...] = ("stage", "model_name")
#: An edge of the pipeline graph: the downstream stage on the sending side, the upstream one
#: on the receiving side (bounded: the stages the configuration names).
TO_STAGE_LABELS: tuple[str, ...] = STAGE_LABELS + ("to_stage",)
FROM_STAGE_LABELS: tuple[str, ...] = STAGE_LABELS + ("from_stage",)
#: A streamed edge, named whole on both of its ends: ``stage`` says which end reports (the
#: producer's series have ``stage == from_stage``, the consumer's ``stage == to_stage``), so one
#: family serves a stage that consumes one stream and produces another.
EDGE_LABELS: tuple[str, ...] = STAGE_LABELS + ("from_stage", "to_stage")


@dataclass(frozen=True)
class Family:
    """One metric family of the contract, as exposed (counter names with ``_total``)."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str

    @property
    def registered_name(self) -> str:
        """The name to register under (prometheus_client appends a counter's ``_total``)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


# ---------------------------------------------------------------- a sending stage's ledger
TRANSFERS = Family("omni_kv_transfers", "gauge", STAGE_LABELS + ("state",),
                   "KV transfers in each state now (held transfers are also pending or active).")
HELD_BLOCKS = Family("omni_kv_held_blocks", "gauge", STAGE_LABELS,
                     "KV blocks kept allocated for finished requests whose transfer is "
                     "unresolved.")
OLDEST_START = Family("omni_kv_transfer_oldest_start_timestamp_seconds", "gauge",
                      STAGE_LABELS + ("state",),
                      "Unix time at which the oldest transfer now in the state entered it; 0 "
                      "when none.")
STARTED = Family("omni_kv_transfers_started_total", "counter", STAGE_LABELS + ("trigger",),
                 "KV transfers marked, by trigger.")
RESOLVED = Family("omni_kv_transfers_resolved_total", "counter", STAGE_LABELS + ("outcome",),
                  "KV transfers resolved, by outcome.")
DURATION = Family("omni_kv_transfer_duration_seconds", "histogram", STAGE_LABELS + ("outcome",),
                  "Time from marking a KV transfer to its resolution.")
HOLD_DURATION = Family("omni_kv_hold_duration_seconds", "histogram", STAGE_LABELS,
                       "Time from a request finishing to its held KV blocks being freed.")
TRANSFER_BYTES = Family("omni_kv_transfer_bytes", "histogram", STAGE_LABELS,
                        "Payload size of delivered KV transfers (observed by the omni KV "
                        "connector's worker side).")
#: Measured only on vLLM's connector-stats path (omni_runtime/kv/stats.py), with vLLM's own
#: labels (``model_name``, ``engine``) before the edge's and the outcome.
HANDOFF_ANSWER_DURATION = Family("omni_kv_handoff_answer_duration_seconds", "histogram",
                                 ("model_name", "engine", "stage", "to_stage", "outcome"),
                                 "Time from handing a KV transfer to the omni KV connector to its "
                                 "answer (ack or failure), as the connector measured it.")
LEDGER_FAMILIES: tuple[Family, ...] = (TRANSFERS, HELD_BLOCKS, OLDEST_START, STARTED, RESOLVED,
                                       DURATION, HOLD_DURATION, TRANSFER_BYTES)

# ---------------------------------------------------------------- per edge, sending side
EDGE_ACTIVE = Family("omni_kv_edge_transfers_active", "gauge", TO_STAGE_LABELS,
                     "KV transfers handed to the data path whose edge to to_stage has not "
                     "resolved yet.")
EDGE_OLDEST_ACTIVE = Family("omni_kv_edge_oldest_active_start_timestamp_seconds", "gauge",
                            TO_STAGE_LABELS,
                            "Unix time at which the oldest transfer still unresolved toward "
                            "to_stage was handed to the data path; 0 when none.")
EDGE_HELD = Family("omni_kv_edge_transfers_held", "gauge", TO_STAGE_LABELS,
                   "KV transfers unresolved toward to_stage whose request has finished: its KV "
                   "blocks stay allocated until every edge has answered.")
EDGE_HELD_BLOCKS = Family("omni_kv_edge_held_blocks", "gauge", TO_STAGE_LABELS,
                          "KV blocks of finished requests kept allocated for transfers "
                          "unresolved toward to_stage.")
EDGE_OLDEST_HELD = Family("omni_kv_edge_oldest_held_start_timestamp_seconds", "gauge",
                          TO_STAGE_LABELS,
                          "Unix time at which the request of the oldest transfer held for "
                          "to_stage finished; 0 when none.")
EDGE_RESOLVED = Family("omni_kv_edge_transfers_resolved_total", "counter",
                       TO_STAGE_LABELS + ("outcome",),
                       "KV transfer edges resolved, by downstream stage and outcome.")
EDGE_DURATION = Family("omni_kv_edge_transfer_duration_seconds", "histogram",
                       TO_STAGE_LABELS + ("outcome",),
                       "Time from a transfer's hand-off to the data path to its resolution "
                       "toward to_stage.")
EDGE_BYTES = Family("omni_kv_edge_transfer_bytes", "histogram", TO_STAGE_LABELS,
                    "Payload size of KV transfers delivered to to_stage.")
EDGE_FAMILIES: tuple[Family, ...] = (EDGE_ACTIVE, EDGE_OLDEST_ACTIVE, EDGE_HELD, EDGE_HELD_BLOCKS,
                                     EDGE_OLDEST_HELD, EDGE_RESOLVED, EDGE_DURATION, EDGE_BYTES)

# ---------------------------------------------------------------- a receiving stage
RECEIVED = Family("omni_kv_received_total", "counter", FROM_STAGE_LABELS + ("outcome",),
                  "Incoming KV transfers answered, by sending stage: delivered (stored and "
                  "acked) or rejected.")
RECEIVER_REJECTED = Family("omni_kv_receiver_rejected_total", "counter",
                           STAGE_LABELS + ("reason",),
                           "Incoming KV transfers rejected, by reason.")
RECEIVED_BYTES = Family("omni_kv_received_bytes", "histogram", FROM_STAGE_LABELS,
                        "Payload size of delivered incoming KV transfers, by sending stage.")
RECEIVER_BUFFERED_PAYLOADS = Family("omni_kv_receiver_buffered_payloads", "gauge", STAGE_LABELS,
                                    "KV payloads stored in the inbox, not yet consumed.")
RECEIVER_BUFFERED_BYTES = Family("omni_kv_receiver_buffered_bytes", "gauge", STAGE_LABELS,
                                 "Bytes of KV payloads stored in the inbox, not yet consumed.")
RECEIVER_EVICTED = Family("omni_kv_receiver_evicted_total", "counter", STAGE_LABELS + ("reason",),
                          "Stored KV payloads dropped unconsumed: expired (TTL), replaced "
                          "(same request) or abandoned (a tensor-parallel attempt another of "
                          "whose shards was refused).")
RECEIVER_WAIT = Family("omni_kv_receiver_wait_seconds", "histogram", STAGE_LABELS + ("outcome",),
                       "Time a consumer waited in inbox.get(), by outcome (found, timeout).")
RECEIVER_FAMILIES: tuple[Family, ...] = (RECEIVED, RECEIVER_REJECTED, RECEIVED_BYTES,
                                         RECEIVER_BUFFERED_PAYLOADS, RECEIVER_BUFFERED_BYTES,
                                         RECEIVER_EVICTED, RECEIVER_WAIT)

# ---------------------------------------------------------------- either stage
TRANSPORT_THREAD_UP = Family("omni_kv_transport_thread_up", "gauge", STAGE_LABELS + ("thread",),
                             "1 while the KV transport's thread runs (sender: the AR stage's I/O "
                             "thread, receiver: the receiving stage's), 0 once it ended.")

# ---------------------------------------------------------------- streamed edges, either end
STREAMS = Family("omni_kv_streams", "gauge", EDGE_LABELS + ("state",),
                 "Streams now: open (sending, producer), held (producer out of credit), waiting "
                 "(consumer waiting for the next chunk).")
STREAM_OLDEST_WAIT = Family("omni_kv_stream_oldest_wait_start_timestamp_seconds", "gauge",
                            EDGE_LABELS,
                            "Unix time at which the stream waiting longest now began to wait "
                            "(for a chunk, an ack or a credit); 0 when none.")
STREAM_CHUNKS = Family("omni_kv_stream_chunks_total", "counter", EDGE_LABELS + ("outcome",),
                       "Stream chunks resolved, by outcome (acked, failed, expired).")
STREAMS_RESOLVED = Family("omni_kv_streams_resolved_total", "counter", EDGE_LABELS + ("outcome",),
                          "Streams resolved, by outcome (finished, producer_error, "
                          "consumer_error, expired, aborted).")
STREAM_FIRST_CHUNK = Family("omni_kv_stream_first_chunk_seconds", "histogram", EDGE_LABELS,
                            "From a stream's start to its first chunk consumable downstream.")
STREAM_CHUNK_HOP = Family("omni_kv_stream_chunk_hop_seconds", "histogram", EDGE_LABELS,
                          "From a chunk produced to consumable downstream.")
STREAM_CHUNK_GAP = Family("omni_kv_stream_chunk_gap_seconds", "histogram", EDGE_LABELS,
                          "Between two chunks of a stream.")
STREAM_CREDIT_EXHAUSTED = Family("omni_kv_stream_credit_exhausted_seconds_total", "counter",
                                 EDGE_LABELS,
                                 "Time producers' streams spent out of credit (holding chunks "
                                 "or a new stream back).")
STREAM_FAMILIES: tuple[Family, ...] = (STREAMS, STREAM_OLDEST_WAIT, STREAM_CHUNKS,
                                       STREAMS_RESOLVED, STREAM_FIRST_CHUNK, STREAM_CHUNK_HOP,
                                       STREAM_CHUNK_GAP, STREAM_CREDIT_EXHAUSTED)

# The operator's own families (its --metrics-port), which the monitoring mixin alerts on.
#: A pipeline's phase as the operator reports it (status.phase).
PIPELINE_PHASES: tuple[str, ...] = ("Progressing", "Ready", "Degraded", "Failed")
#: The phases of a pipeline whose stages have run (their pods were ready).
RUNNING_PHASES: tuple[str, ...] = ("Ready", "Degraded")
OPERATOR_RECONCILES = Family("omni_operator_reconciles_total", "counter", ("result",),
                             "OmniPipeline reconciles, by result.")
OPERATOR_PIPELINES = Family("omni_operator_pipelines", "gauge", ("phase",),
                            "OmniPipelines known to the operator, by phase.")

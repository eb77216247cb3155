"""The two dashboards: "Omni KV transfers" and "Omni pipelines"."""
from __future__ import annotations

from typing import Any

from . import metrics as m
from .config import Config
from .grafana import Panel, Row, dashboard, query_variable

SEL = 'namespace=~"$namespace", pipeline=~"$pipeline", stage=~"$stage"'
RATE = "$__rate_interval"


def _variables(metric: str, matchers: str = "") -> list[dict[str, Any]]:
    """namespace, pipeline and stage, each narrowed by the ones before it."""
    first = f"{matchers}, " if matchers else ""
    return [
        query_variable("namespace", "Namespace", f"{metric}{{{matchers}}}" if matchers else metric),
        query_variable("pipeline", "Pipeline", f'{metric}{{{first}namespace=~"$namespace"}}'),
        query_variable(
            "stage", "Stage", f'{metric}{{{first}namespace=~"$namespace", pipeline=~"$pipeline"}}'
        ),
    ]


def _quantiles(histogram: str, by: str, extra: str = "") -> list[tuple[str, str]]:
    # By pipeline too, as every other panel: two pipelines' stages of one name stay apart.
    matchers = SEL + (", " + extra if extra else "")
    return [
        (
            f"histogram_quantile({q}, sum by (le, pipeline, {by}) "
            f"(rate({histogram}_bucket{{{matchers}}}[{RATE}])))",
            f"p{int(q * 100)} {{{{pipeline}}}}/{{{{{by}}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def _oldest_age(state: str) -> str:
    # 0 means "none in this state": drop it, or the panel would show 50 years.
    return (
        f'max by (pipeline, stage) (time() - ({m.KV_OLDEST_START}{{{SEL}, state="{state}"}} > 0))'
    )


def kv_transfers(cfg: Config = Config()) -> dict[str, Any]:
    by_stage = "{{pipeline}}/{{stage}}"
    rows = [
        Row(
            "Transfers now",
            [
                Panel(
                    "Transfers by state",
                    "Pending (marked, not yet handed to the runner), active (handed over, "
                    "not yet resolved) and held (request finished, blocks still allocated; "
                    "also counted as pending or active) transfers per stage.",
                    [(
                        f"sum by (pipeline, stage, state) ({m.KV_TRANSFERS}{{{SEL}}})",
                        by_stage + " {{state}}",
                    )],
                    width=8,
                ),
                Panel(
                    "Held KV blocks",
                    "KV-cache blocks kept allocated for finished requests whose transfer "
                    "has not resolved: memory new requests cannot use.",
                    [(f"sum by (pipeline, stage) ({m.KV_HELD_BLOCKS}{{{SEL}}})", by_stage)],
                    width=8,
                ),
                Panel(
                    "Age of the oldest active transfer",
                    "Time since the oldest transfer still active entered that state. The "
                    "red line is OmniKVTransferStuck's threshold.",
                    [(_oldest_age("active"), by_stage)],
                    unit="s",
                    width=8,
                    threshold=float(cfg.stuck_transfer_seconds),
                ),
                Panel(
                    "Age of the oldest held transfer",
                    "Time since the oldest held transfer's request finished. The red line "
                    "is OmniKVBlocksHeldTooLong's threshold.",
                    [(_oldest_age("held"), by_stage)],
                    unit="s",
                    width=8,
                    threshold=float(cfg.held_too_long_seconds),
                ),
            ],
        ),
        Row(
            "Throughput and outcomes",
            [
                Panel(
                    "Transfers started by trigger",
                    "Transfers marked per second, by what triggered them.",
                    [(
                        f"sum by (pipeline, stage, trigger) (rate({m.KV_STARTED}{{{SEL}}}[{RATE}]))",
                        by_stage + " {{trigger}}",
                    )],
                    unit="ops",
                    width=8,
                ),
                Panel(
                    "Resolutions by outcome",
                    "Transfers resolved per second: acked (delivered), failed, expired "
                    "(deadline passed) or cancelled (request aborted before hand-off).",
                    [(
                        f"sum by (pipeline, stage, outcome) (rate({m.KV_RESOLVED}{{{SEL}}}[{RATE}]))",
                        by_stage + " {{outcome}}",
                    )],
                    unit="ops",
                    width=8,
                    stack=True,
                ),
                Panel(
                    "Transfer duration",
                    "Marking to resolution, all outcomes: p50, p95 and p99.",
                    _quantiles(m.KV_DURATION, "stage"),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Transfer bytes per second",
                    "Payload bytes of delivered transfers, measured by the worker.",
                    [(
                        f"sum by (pipeline, stage) (rate({m.KV_BYTES}_sum{{{SEL}}}[{RATE}]))",
                        by_stage,
                    )],
                    unit="Bps",
                    width=8,
                ),
                Panel(
                    "Hold duration",
                    "Request finished to its KV blocks freed: p50, p95 and p99.",
                    _quantiles(m.KV_HOLD_DURATION, "stage"),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Receiver rejections",
                    "Incoming transfers a receiving stage refused, by reason.",
                    [(
                        f"sum by (pipeline, stage, reason) (rate({m.KV_RECEIVER_REJECTED}{{{SEL}}}[{RATE}]))",
                        by_stage + " {{reason}}",
                    )],
                    unit="ops",
                    width=8,
                ),
            ],
        ),
    ]
    rows.append(Row(
        "Receiving stages: the inbox",
        [
            Panel(
                "Payloads waiting in the inbox",
                "KV payloads a receiving stage has stored and its consumer has not taken yet.",
                [(
                    f"sum by (pipeline, stage) ({m.KV_RECEIVER_BUFFERED_PAYLOADS}{{{SEL}}})",
                    by_stage,
                )],
                width=6,
            ),
            Panel(
                "Bytes waiting in the inbox",
                "The bytes of those payloads (bounded by the inbox's memory limit).",
                [(
                    f"sum by (pipeline, stage) ({m.KV_RECEIVER_BUFFERED_BYTES}{{{SEL}}})",
                    by_stage,
                )],
                unit="bytes",
                width=6,
            ),
            Panel(
                "Payloads dropped unconsumed",
                "Stored payloads no consumer took, per second: expired (their TTL passed), "
                "replaced (the same request again) or abandoned (a tensor-parallel attempt "
                "another of whose shards was refused).",
                [(
                    f"sum by (pipeline, stage, reason) (rate({m.KV_RECEIVER_EVICTED}{{{SEL}}}[{RATE}]))",
                    by_stage + " {{reason}}",
                )],
                unit="ops",
                width=6,
                stack=True,
            ),
            Panel(
                "Consumer wait for a payload",
                "Time a consumer waited for a payload, p50 and p99, by outcome (found, timeout).",
                [(
                    f"histogram_quantile({q}, sum by (le, pipeline, stage, outcome) "
                    f"(rate({m.KV_RECEIVER_WAIT}_bucket{{{SEL}}}[{RATE}])))",
                    f"p{int(q * 100)} " + by_stage + " {{outcome}}",
                ) for q in (0.5, 0.99)],
                unit="s",
                width=6,
            ),
        ],
    ))
    by_edge = "{{pipeline}}/{{stage}} -> {{to_stage}}"
    rows.append(Row(
        "Per edge (sending stage -> to_stage)",
        [
            Panel(
                "Transfers in flight per edge",
                "Transfers handed off and not yet answered by each downstream stage. A "
                "transfer to two stages is in flight on each edge until that edge answers.",
                [(
                    f"sum by (pipeline, stage, to_stage) ({m.KV_EDGE_ACTIVE}{{{SEL}}})",
                    by_edge,
                )],
                width=8,
            ),
            Panel(
                "Age of the oldest unanswered transfer per edge",
                "Time since the oldest transfer still unanswered by the downstream stage was "
                "handed off. The red line is OmniKVEdgeTransferStuck's threshold.",
                [(
                    f"max by (pipeline, stage, to_stage) (time() - ({m.KV_EDGE_OLDEST_START}{{{SEL}}} > 0))",
                    by_edge,
                )],
                unit="s",
                width=8,
                threshold=float(cfg.stuck_transfer_seconds),
            ),
            Panel(
                "Failed or expired share per edge",
                "Of the transfers each edge resolved, the share that failed or expired. "
                "OmniKVEdgeFailureRateHigh fires above its ratio.",
                [(
                    f'sum by (pipeline, stage, to_stage) (rate({m.KV_EDGE_RESOLVED}{{{SEL}, outcome=~"failed|expired"}}[{RATE}]))'
                    f" / sum by (pipeline, stage, to_stage) (rate({m.KV_EDGE_RESOLVED}{{{SEL}}}[{RATE}]))",
                    by_edge,
                )],
                unit="percentunit",
                width=8,
                threshold=float(cfg.failure_ratio),
            ),
            Panel(
                "Resolutions per edge by outcome",
                "Edges resolved per second: acked (that stage stored it), failed, expired.",
                [(
                    f"sum by (pipeline, stage, to_stage, outcome) (rate({m.KV_EDGE_RESOLVED}{{{SEL}}}[{RATE}]))",
                    by_edge + " {{outcome}}",
                )],
                unit="ops",
                width=8,
                stack=True,
            ),
            Panel(
                "Delivered transfer duration per edge (p95)",
                "Hand-off to the downstream stage's ack, p95 per edge.",
                [(
                    f"histogram_quantile(0.95, sum by (le, pipeline, stage, to_stage) "
                    f'(rate({m.KV_EDGE_DURATION}_bucket{{{SEL}, outcome="acked"}}[{RATE}])))',
                    by_edge,
                )],
                unit="s",
                width=8,
            ),
            Panel(
                "KV blocks held per edge",
                "KV blocks of finished requests kept allocated because the downstream stage "
                "has not answered their transfer yet: the edge that holds memory names itself "
                "(a transfer to two stages holds its blocks until both answered).",
                [(
                    f"sum by (pipeline, stage, to_stage) ({m.KV_EDGE_HELD_BLOCKS}{{{SEL}}})",
                    by_edge,
                )],
                width=8,
            ),
            Panel(
                "Received per upstream stage",
                "Transfers a receiving stage answered per second, by the stage that sent "
                "them (from_stage) and outcome.",
                [(
                    f"sum by (pipeline, stage, from_stage, outcome) (rate({m.KV_RECEIVED}{{{SEL}}}[{RATE}]))",
                    "{{pipeline}}/{{from_stage}} -> {{stage}} {{outcome}}",
                )],
                unit="ops",
                width=8,
            ),
        ],
    ))
    rows.append(_streams_row(cfg))
    return dashboard(
        "omni-kv-transfers",
        "Omni KV transfers",
        "KV-cache transfers between the stages of omni pipelines (omni_kv_* metrics).",
        _variables("up", 'pipeline!=""'),
        rows,
    )


STREAM_EDGE = "pipeline, from_stage, to_stage"


def _stream_quantiles(histogram: str, quantiles: tuple[float, ...] = (0.5, 0.99)) -> list[tuple[str, str]]:
    return [(
        f"histogram_quantile({q}, sum by (le, {STREAM_EDGE}) (rate({histogram}_bucket{{{SEL}}}[{RATE}])))",
        f"p{int(q * 100)} {{{{pipeline}}}}/{{{{from_stage}}}} -> {{{{to_stage}}}}",
    ) for q in quantiles]


def _streams_row(cfg: Config) -> Row:
    """A streamed edge's figures, one series per edge (from_stage -> to_stage). A gauge or a
    counter is reported by each end (`stage`): the producer's open and held streams, the
    consumer's open and waiting ones, each end's chunks and streams by outcome; the
    hop and gap are the consumer's."""
    by_end = "{{pipeline}}/{{from_stage}} -> {{to_stage}} at {{stage}}"
    return Row(
        "Streams (per streamed edge: from_stage -> to_stage)",
        [
            Panel(
                "Streams open and held per edge",
                "Streams now, as each end reports them: open (the producer sending, the consumer "
                "taking) and held (the producer out of credit: the consumer has not acked enough "
                "chunks).",
                [(
                    f'sum by (pipeline, stage, from_stage, to_stage, state) ({m.KV_STREAMS}{{{SEL}, state=~"open|held"}})',
                    by_end + " {{state}}",
                )],
                width=8,
            ),
            Panel(
                "Streams waiting per edge",
                "Streams whose consumer waits for the next chunk.",
                [(
                    f'sum by (pipeline, stage, from_stage, to_stage) ({m.KV_STREAMS}{{{SEL}, state="waiting"}})',
                    by_end,
                )],
                width=8,
            ),
            Panel(
                "Age of the oldest stream wait per edge",
                "Time since the stream waiting longest (for a chunk, an ack or a credit) began to "
                "wait, at either end. The red line is OmniStreamStalled's threshold.",
                [(
                    f"max by (pipeline, stage, from_stage, to_stage) (time() - ({m.KV_STREAM_OLDEST_WAIT}{{{SEL}}} > 0))",
                    by_end,
                )],
                unit="s",
                width=8,
                threshold=float(cfg.stalled_stream_seconds),
            ),
            Panel(
                "Time to first chunk per edge",
                "A stream's start on the producer to its first chunk consumable downstream: p50 "
                "and p99 (what makes speech feel live).",
                _stream_quantiles(m.KV_STREAM_FIRST_CHUNK),
                unit="s",
                width=8,
            ),
            Panel(
                "Chunk hop per edge",
                "A chunk produced to consumable downstream, measured by the consumer: p50 and p99.",
                _stream_quantiles(m.KV_STREAM_CHUNK_HOP),
                unit="s",
                width=8,
            ),
            Panel(
                "Gap between chunks per edge",
                "Between two chunks of one stream at the consumer: p50 and p99 (its deadline is "
                "the edge's gapSeconds).",
                _stream_quantiles(m.KV_STREAM_CHUNK_GAP),
                unit="s",
                width=8,
            ),
            Panel(
                "Chunks per edge by outcome",
                "Chunks resolved per second at each end: acked, failed, expired. "
                "OmniStreamSendFailures and OmniStreamDeadlineRate watch the last two.",
                [(
                    f"sum by (pipeline, stage, from_stage, to_stage, outcome) (rate({m.KV_STREAM_CHUNKS}{{{SEL}}}[{RATE}]))",
                    by_end + " {{outcome}}",
                )],
                unit="ops",
                width=8,
                stack=True,
            ),
            Panel(
                "Streams per edge by outcome",
                "Streams resolved per second at each end: finished, producer_error, "
                "consumer_error, expired, aborted.",
                [(
                    f"sum by (pipeline, stage, from_stage, to_stage, outcome) (rate({m.KV_STREAMS_RESOLVED}{{{SEL}}}[{RATE}]))",
                    by_end + " {{outcome}}",
                )],
                unit="ops",
                width=8,
                stack=True,
            ),
            Panel(
                "Time out of credit per edge",
                "Share of the time the producer's streams spent out of credit (summed over its "
                "streams: 2 means two streams held all the time).",
                [(
                    f"sum by (pipeline, stage, from_stage, to_stage) (rate({m.KV_STREAM_CREDIT_EXHAUSTED}{{{SEL}}}[{RATE}]))",
                    by_end,
                )],
                width=8,
            ),
        ],
    )


def pipelines(cfg: Config = Config()) -> dict[str, Any]:
    by_stage = "{{pipeline}}/{{stage}}"
    up = f"up{{{SEL}}}"
    rows = [
        Row(
            "Stages",
            [
                Panel(
                    "Stage readiness",
                    "Fraction of each stage's pods that Prometheus scrapes successfully.",
                    [(
                        f"sum by (pipeline, stage) ({up}) / count by (pipeline, stage) ({up})",
                        by_stage,
                    )],
                    unit="percentunit",
                    kind="stat",
                    width=24,
                    height=4,
                    threshold=1,
                    extra_defaults={
                        "thresholds": {
                            "mode": "absolute",
                            "steps": [
                                {"color": "red", "value": None},
                                {"color": "green", "value": 1},
                            ],
                        }
                    },
                ),
            ],
        ),
        Row(
            "Requests (vLLM)",
            [
                Panel(
                    "Request rate",
                    "Finished requests per second, by finish reason.",
                    [(
                        f"sum by (pipeline, stage, finished_reason) "
                        f"(rate({m.VLLM_REQUEST_SUCCESS}{{{SEL}}}[{RATE}]))",
                        by_stage + " {{finished_reason}}",
                    )],
                    unit="reqps",
                ),
                Panel(
                    "Requests running and waiting",
                    "Requests in the engine's batch and in its queue.",
                    [
                        (
                            f"sum by (pipeline, stage) ({m.VLLM_REQUESTS_RUNNING}{{{SEL}}})",
                            by_stage + " running",
                        ),
                        (
                            f"sum by (pipeline, stage) ({m.VLLM_REQUESTS_WAITING}{{{SEL}}})",
                            by_stage + " waiting",
                        ),
                    ],
                ),
                Panel(
                    "End-to-end request latency",
                    "Request arrival to last token: p50, p95 and p99.",
                    _quantiles(m.VLLM_E2E_LATENCY, "stage"),
                    unit="s",
                ),
                Panel(
                    "Time to first token",
                    "p50, p95 and p99.",
                    _quantiles(m.VLLM_TTFT, "stage"),
                    unit="s",
                ),
                Panel(
                    "KV-cache usage",
                    "Fraction of the KV cache in use (held transfer blocks included).",
                    [(f"max by (pipeline, stage) ({m.VLLM_KV_CACHE_USAGE}{{{SEL}}})", by_stage)],
                    unit="percentunit",
                    width=24,
                    extra_defaults={"max": 1},
                ),
            ],
        ),
        Row(
            "Operator",
            [
                Panel(
                    "Reconciles by result",
                    "Reconciles of OmniPipeline resources per second, by result, over all "
                    "operator replicas.",
                    [(
                        f"sum by (result) (rate({m.OPERATOR_RECONCILES}[{RATE}]))",
                        "{{result}}",
                    )],
                    unit="ops",
                ),
                Panel(
                    "Reconcile errors",
                    "Reconciles per second that failed (API errors, retried), whose child the "
                    "API server refused, or whose child's name another object holds (reported "
                    "once per resync until it changes); "
                    "OmniOperatorReconcileErrors fires when this stays above zero.",
                    [(
                        f'sum by (namespace, pod) (rate({m.OPERATOR_RECONCILES}{{{m.FAILED_RECONCILES}}}[{RATE}]))',
                        "{{namespace}}/{{pod}}",
                    )],
                    unit="ops",
                ),
            ],
        ),
    ]
    return dashboard(
        "omni-pipelines",
        "Omni pipelines",
        "Stages of omni pipelines: readiness, vLLM requests and KV cache, and the operator.",
        _variables("up", 'pipeline!=""'),
        rows,
    )


# File name (in dashboards/ and the chart) -> builder.
DASHBOARDS = {
    "omni-kv-transfers.json": kv_transfers,
    "omni-pipelines.json": pipelines,
}

"""The stream families (observability/stream_metrics.py) as a scrape shows them, fed by the
stream ledger on both ends of an edge, one stage consuming one stream and producing another."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omni_contract.edges import StreamSettings
from omni_contract.metrics import STREAM_FAMILIES
from omni_runtime.observability.stream_metrics import StreamMetrics
from omni_runtime.transfers.streams import ConsumerStreams, ProducerStreams, StreamOutcome

S = StreamSettings(first_chunk_tokens=2, chunk_tokens=4, gap_seconds=5, chunks_in_flight=1)


def scrape(registry):
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_a_stage_between_two_streamed_edges_exports_both_ends_of_every_family():
    registry = CollectorRegistry()
    metrics = StreamMetrics("talker", "m", registry,
                            to_stages={"code2wav": StreamSettings(gap_seconds=5)},
                            from_stages={"thinker": StreamSettings(gap_seconds=3)})
    samples = scrape(registry)
    names = {name for name, _ in samples}
    for family in STREAM_FAMILIES:
        assert any(n.startswith(family.name) for n in names), family.name
    down = dict(stage="talker", model_name="m", from_stage="talker", to_stage="code2wav")
    up = dict(stage="talker", model_name="m", from_stage="thinker", to_stage="talker")
    assert value(samples, "omni_kv_streams", **down, state="held") == 0
    assert value(samples, "omni_kv_streams", **up, state="waiting") == 0
    assert value(samples, "omni_kv_stream_oldest_wait_start_timestamp_seconds", **up) == 0

    producer, consumer = ProducerStreams(), ConsumerStreams()
    producer.add_observer(metrics)
    consumer.add_observer(metrics)
    t0 = time.monotonic()
    out = producer.open("r", "code2wav", S, t0)
    sent = producer.cut(out, 6, False, t0, time.time())          # chunk 0 sent, 1 queued
    assert [c.seq for c in sent] == [0]
    _, ready = consumer.arrive("r", "thinker", 0, False, time.time() - 0.004, S, t0)
    consumer.applied(consumer.get("r", "thinker"), 0, t0 + 0.01)
    metrics.refresh(producer, consumer, now=t0 + 1.0)
    samples = scrape(registry)
    assert value(samples, "omni_kv_streams", **down, state="open") == 1
    assert value(samples, "omni_kv_streams", **down, state="held") == 1
    assert value(samples, "omni_kv_streams", **up, state="waiting") == 1
    oldest = value(samples, "omni_kv_stream_oldest_wait_start_timestamp_seconds", **up)
    assert abs(oldest - (time.time() - 0.99)) < 0.5  # began to wait at t0 + 0.01
    assert value(samples, "omni_kv_stream_chunk_hop_seconds_count", **up) == 1
    assert value(samples, "omni_kv_stream_chunk_hop_seconds_sum", **up) >= 0.004

    producer.ack(out, 0, t0 + 2.0)     # chunk 1 goes
    producer.cut(out, 6, True, t0 + 2.0, time.time())
    producer.ack(out, 1, t0 + 2.1)
    producer.ack(out, 2, t0 + 2.2)
    consumer.resolve("r", StreamOutcome.PRODUCER_ERROR, "thinker failed", t0 + 3.0)
    metrics.refresh(producer, consumer, now=t0 + 3.0)
    samples = scrape(registry)
    assert value(samples, "omni_kv_streams_resolved_total", **down, outcome="finished") == 1
    assert value(samples, "omni_kv_streams_resolved_total", **up, outcome="producer_error") == 1
    assert value(samples, "omni_kv_stream_chunks_total", **down, outcome="acked") == 3
    # Out of credit 0 -> 2.0 (chunk 1 behind chunk 0), then 2.0 -> 2.1 (the last behind 1).
    assert abs(value(samples, "omni_kv_stream_credit_exhausted_seconds_total", **down) - 2.1) < 1e-6
    assert value(samples, "omni_kv_stream_first_chunk_seconds_count", **down) == 1
    # Measured where the stream opens with its request (the producer): a consumer's stream
    # opens at its first chunk, and its ~0 s would drag the edge's quantiles down.
    assert value(samples, "omni_kv_stream_first_chunk_seconds_count", **up) == 0
    for state in ("open", "held"):
        assert value(samples, "omni_kv_streams", **down, state=state) == 0
    assert value(samples, "omni_kv_stream_oldest_wait_start_timestamp_seconds", **up) == 0


def test_two_ledgers_of_other_deadlines_in_one_registry_both_keep_their_series():
    """A stage that consumes and produces streams, its engine in-process, makes two
    StreamMetrics on one registry with other deadlines: the second once re-registered the
    families, and the first's series then wrote nowhere (an outside review)."""
    registry = CollectorRegistry()
    producing = StreamMetrics("talker", "m", registry, to_stages={"code2wav": StreamSettings(gap_seconds=10)})
    consuming = StreamMetrics("talker", "m", registry, from_stages={"thinker": StreamSettings(gap_seconds=20)})
    producer, consumer = ProducerStreams(), ConsumerStreams()
    producer.add_observer(producing)
    consumer.add_observer(consuming)
    t0 = time.monotonic()
    out = producer.open("r", "code2wav", S, t0)
    producer.cut(out, 6, False, t0, time.time())
    producing.refresh(producer, now=t0 + 1.0)
    consumer.arrive("r", "thinker", 0, False, time.time(), S, t0)
    consuming.refresh(consumer, now=t0 + 1.0)
    samples = scrape(registry)
    down = dict(stage="talker", model_name="m", from_stage="talker", to_stage="code2wav")
    up = dict(stage="talker", model_name="m", from_stage="thinker", to_stage="talker")
    assert value(samples, "omni_kv_streams", **down, state="open") == 1
    assert value(samples, "omni_kv_streams", **up, state="open") == 1

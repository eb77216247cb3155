"""The ``omni.kv_stream`` span (observability/stream_tracing.py): one per stream on the
producer, in the producing request's trace, an event per chunk, its outcome."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from omni_contract.edges import StreamSettings
from omni_runtime.observability.stream_tracing import StreamTracing
from omni_runtime.transfers.streams import ProducerStreams, StreamOutcome

TRACE = "0af7651916cd43dd8448eb211c80319c"
HEADERS = {"traceparent": f"00-{TRACE}-b7ad6b7169203331-01"}


def test_each_stream_is_one_span_in_its_requests_trace_with_an_event_per_chunk():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ledger = ProducerStreams()
    ledger.add_observer(StreamTracing(provider.get_tracer("t"), stage="thinker", model_name="m"))
    settings = StreamSettings(first_chunk_tokens=2, chunk_tokens=2, chunks_in_flight=8)
    now = time.monotonic()
    ok = ledger.open("r1", "talker", settings, now, HEADERS)
    for chunk in ledger.cut(ok, 5, True, now, time.time()):
        ledger.ack(ok, chunk.seq, now + 0.01)
    bad = ledger.open("r2", "talker", settings, now)
    ledger.cut(bad, 2, False, now, time.time())
    ledger.fail(bad, 0, "over max-model-len", now + 0.02)
    first, second = exporter.get_finished_spans()
    assert first.name == "omni.kv_stream" and first.attributes["gen_ai.request.id"] == "r1"
    assert format(first.context.trace_id, "032x") == TRACE  # the producing request's trace
    assert first.attributes["omni.kv_stream.outcome"] == "finished"
    assert [e.attributes["omni.kv_stream.seq"] for e in first.events] == [0, 1, 2]
    assert first.status.status_code is not StatusCode.ERROR
    assert second.attributes["omni.kv_stream.outcome"] == StreamOutcome.CONSUMER_ERROR.value
    assert second.status.status_code is StatusCode.ERROR
    assert "over max-model-len" in second.attributes["omni.kv_stream.reason"]
    assert format(second.context.trace_id, "032x") != TRACE  # no headers: a trace of its own

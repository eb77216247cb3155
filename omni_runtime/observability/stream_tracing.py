"""OpenTelemetry spans of streams: one ``omni.kv_stream`` span per stream, on the producer.

The span runs from the stream's open to its resolution, a child of the producing request's
trace when the request came with W3C trace headers (the consumer's request joins the same
trace: each chunk carries the headers, and the consuming stage passes them to vLLM), with an
event per chunk resolved (its number and outcome) and the outcome and reason as attributes.
Ids, counts and enum values only, never tokens or text. Built whole when the stream
resolves, as the transfer spans are (tracing.py): a span is exported only once it ends.
The tracer is tracing.py's :func:`~omni_runtime.observability.tracing.resolve_tracer`'s
(none: no observer, no cost).
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omni_runtime.observability.tracing import (ATTR_MODEL_NAME, ATTR_REQUEST_ID, ATTR_STAGE,
                                                MAX_REASON_CHARS)
from omni_runtime.transfers.streams import (Chunk, ChunkOutcome, Stream, StreamObserver,
                                            StreamOutcome, _Streams)

SPAN_NAME = "omni.kv_stream"
ATTR_TO_STAGE = "omni.kv_stream.to_stage"
ATTR_OUTCOME = "omni.kv_stream.outcome"
ATTR_REASON = "omni.kv_stream.reason"
ATTR_CHUNKS = "omni.kv_stream.chunks"
ATTR_SEQ = "omni.kv_stream.seq"
ATTR_CHUNK_OUTCOME = "omni.kv_stream.chunk_outcome"
EVENT_CHUNK = "chunk"

_propagator = TraceContextTextMapPropagator()


class StreamTracing(StreamObserver):
    """Records each stream of a producer's ledger as an ``omni.kv_stream`` span."""

    def __init__(self, tracer: Tracer, *, stage: str, model_name: str) -> None:
        self._tracer = tracer
        self._stage = stage
        self._model_name = model_name
        #: Per open stream: its chunks' (unix ns, seq, outcome).
        self._events: dict[tuple[str, str], list[tuple[int, int, str]]] = {}

    @staticmethod
    def _unix_ns(monotonic_time: float) -> int:
        return time.time_ns() - int((time.monotonic() - monotonic_time) * 1e9)

    def on_opened(self, end: _Streams, stream: Stream) -> None:
        self._events[stream.key] = []

    def on_chunk(self, end: _Streams, stream: Stream, chunk: Chunk, outcome: ChunkOutcome,
                 now: float) -> None:
        events = self._events.get(stream.key)
        if events is not None:
            events.append((self._unix_ns(now), chunk.seq, outcome.value))

    def on_resolved(self, end: _Streams, stream: Stream, now: float) -> None:
        events = self._events.pop(stream.key, [])
        parent: Any = None
        if stream.trace_headers:
            parent = _propagator.extract(carrier=dict(stream.trace_headers))
        attributes = {ATTR_REQUEST_ID: stream.request_id, ATTR_STAGE: self._stage,
                      ATTR_MODEL_NAME: self._model_name, ATTR_TO_STAGE: stream.peer,
                      ATTR_OUTCOME: stream.outcome.value, ATTR_CHUNKS: len(events)}
        if stream.reason:
            attributes[ATTR_REASON] = stream.reason[:MAX_REASON_CHARS]
        span = self._tracer.start_span(
            SPAN_NAME, context=parent if parent is not None else otel_context.Context(),
            kind=SpanKind.PRODUCER, attributes=attributes,
            start_time=self._unix_ns(stream.opened_at))
        for at, seq, outcome in events:
            span.add_event(EVENT_CHUNK, {ATTR_SEQ: seq, ATTR_CHUNK_OUTCOME: outcome},
                           timestamp=at)
        if stream.outcome is not StreamOutcome.FINISHED:
            span.set_status(Status(StatusCode.ERROR, (stream.reason or "")[:MAX_REASON_CHARS]))
        span.end(end_time=self._unix_ns(now))

"""OpenTelemetry spans of KV transfers: one ``omni.kv_transfer`` span per transfer.

The span runs from marking to resolution (timestamps are the ledger's, mapped to unix time),
with an event per state change (hand-off, hold, resolution), and is a child of the request's trace when the request came
with W3C trace headers (vLLM hands them to the engine core as ``Request.trace_headers``).
Attributes carry ids, counts and enum values only: never prompt text.

Which tracer (see docs/tracing.md), decided once at start-up by :func:`resolve_tracer`:
1. a tracer provider someone already installed globally (vLLM does in the engine-core process
   when ``--otlp-traces-endpoint`` is given): use it, never install a second one over it;
2. otherwise, when vLLM's ``otlp_traces_endpoint`` or the standard
   ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` ask for export: a
   private provider (not installed globally) exporting only our spans;
3. otherwise none: no observer is attached at all, so tracing costs nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omni_runtime.observability.writer_thread import (WriterThread, WritesOffStep,
                                                      register_exit_flush, span_thread)
from omni_runtime.observability.span_writer import EventSpec, SpanSpec, span_writer
from omni_runtime.transfers.ledger import (VALUES, Batch, Outcome, Transfer, TransferLedger,
                                           TransferObserver)

logger = logging.getLogger(__name__)

SPAN_NAME = "omni.kv_transfer"
INSTRUMENTATION_NAME = "omni_runtime.kv_transfer"

# Attribute keys. The request id uses vLLM's key, so one search finds vLLM's request span too.
ATTR_REQUEST_ID = "gen_ai.request.id"
ATTR_STAGE = "omni.stage"
ATTR_MODEL_NAME = "omni.model_name"
ATTR_TRIGGER = "omni.kv_transfer.trigger"
ATTR_SEQ_LEN = "omni.kv_transfer.seq_len"
ATTR_BLOCKS = "omni.kv_transfer.blocks"
ATTR_HELD_BLOCKS = "omni.kv_transfer.held_blocks"
ATTR_OUTCOME = "omni.kv_transfer.outcome"
ATTR_REASON = "omni.kv_transfer.reason"

EVENT_HANDED_OFF = "handed_off"
EVENT_HELD = "held"
EVENT_RESOLVED = "resolved"

#: Reasons come from our code or the worker; cap them so a span stays small.
MAX_REASON_CHARS = 256

_ERROR_OUTCOMES = frozenset((Outcome.FAILED, Outcome.EXPIRED))
_propagator = TraceContextTextMapPropagator()


class TransferTracing(WritesOffStep, TransferObserver):
    """Ledger observer that records each transfer as an ``omni.kv_transfer`` span.

    The span is built whole once the transfer has resolved, from what the ledger recorded
    (marking, hand-off and hold times, block counts): an OpenTelemetry span is exported only
    once it ends, so nothing is lost by not opening it at marking, and one call with every
    attribute at once costs about half of opening it early and adding to it at each change
    (the SDK validates attributes per call). Hand-off and hold cost nothing here.

    Off the step: a report hands its resolved transfers (final: the ledger never changes a
    resolved transfer again) to the process's span thread (writer_thread.py), which builds
    their spans and writes them together (span_writer.py: ``write_many`` on the SDK's own
    tracer, straight to its processors). The step pays for the hand-over only. A span given
    no parent (no trace headers) takes the span current on the step at the report, as the
    SDK would there. The thread starts on them when the scheduler has handed its step to the
    model runner (:meth:`on_engine_wait`), while the engine waits for the forward pass;
    :meth:`flush` waits until they are written.
    """

    batched = True

    def __init__(self, tracer: Tracer, *, stage: str, model_name: str,
                 writer_thread: WriterThread | None = None) -> None:
        self._writer = span_writer(tracer)
        #: The thread that writes the spans: the process's one unless given (tests).
        self._writer_thread = writer_thread if writer_thread is not None else span_thread()
        # The tracer's provider exists now: the queue is written at exit before it shuts down.
        register_exit_flush()
        self._stage = stage
        self._model_name = model_name

    def on_batch(self, ledger: TransferLedger, batch: Batch) -> None:
        resolved = batch.resolved  # the ledger starts a new list for the next batch
        if resolved:
            # The step's current context, only when it holds a span (never under vLLM's
            # engine loop): the span thread's own context holds none.
            context = (otel_context.get_current()
                       if trace.get_current_span().get_span_context().is_valid else None)
            # Refused (the thread stalled behind a blocking exporter, or none at shutdown):
            # the spans are dropped, counted and logged by the thread, not written on the step.
            self._writer_thread.submit(len(resolved), self._write, resolved,
                                       ledger.wall_time(0.0), context)
            if not ledger.has_unresolved():
                # The last in flight: the engine may step no more (no kick would come).
                self._writer_thread.kick()

    def _write(self, resolved: list[Transfer], offset: float, context: Any) -> None:
        """On the span thread: the transfers' spans; ``offset``: unix time less ledger
        time; ``context``: the step's current context at the report, or None."""
        token = otel_context.attach(context) if context is not None else None
        try:
            self._writer.write_many([self._span(t, offset) for t in resolved])
        finally:
            if token is not None:
                otel_context.detach(token)

    def _span(self, transfer: Transfer, offset: float) -> SpanSpec:
        """The transfer's span; ``offset``: unix time less ledger time."""
        headers = transfer.trace_headers
        outcome = transfer.outcome
        attributes: dict[str, Any] = {
            ATTR_REQUEST_ID: transfer.request_id,
            ATTR_STAGE: self._stage,
            ATTR_MODEL_NAME: self._model_name,
            ATTR_TRIGGER: VALUES[transfer.trigger],
            ATTR_SEQ_LEN: transfer.seq_len,
            ATTR_BLOCKS: len(transfer.block_ids),
            ATTR_OUTCOME: VALUES[outcome],
        }
        events: list[EventSpec] = []
        if transfer.handed_off_at is not None:
            events.append((EVENT_HANDED_OFF, None, int((transfer.handed_off_at + offset) * 1e9)))
        held_since = transfer.held_since
        if held_since is not None:
            attributes[ATTR_HELD_BLOCKS] = transfer.held_blocks
            events.append((EVENT_HELD, None, int((held_since + offset) * 1e9)))
        end = int((transfer.resolved_at + offset) * 1e9)
        reason = transfer.reason[:MAX_REASON_CHARS] if transfer.reason else None
        events.append((EVENT_RESOLVED, {ATTR_REASON: reason} if reason else None, end))
        return (SPAN_NAME,
                # No headers: a root span (extract() of nothing would give the same, slower).
                _propagator.extract(headers) if headers else None,
                SpanKind.INTERNAL, attributes, events,
                Status(StatusCode.ERROR, reason) if outcome in _ERROR_OUTCOMES else None,
                int((transfer.marked_at + offset) * 1e9), end)


# ---------------------------------------------------------------------- tracer resolution
def _global_provider_is_set() -> bool:
    provider = trace.get_tracer_provider()
    # The API's placeholders until someone calls set_tracer_provider().
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _vllm_endpoint(vllm_config: Any) -> str | None:
    observability = getattr(vllm_config, "observability_config", None)
    return getattr(observability, "otlp_traces_endpoint", None)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def _make_private_provider(endpoint: str | None) -> Any:
    """A TracerProvider that is never installed globally, exporting by OTLP.

    ``endpoint`` None lets the SDK exporter apply the standard OTEL_EXPORTER_OTLP_* rules
    (including the ``/v1/traces`` suffix on a generic HTTP endpoint). The protocol follows
    vLLM's rule, so our spans and vLLM's go the same way: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    (or OTEL_EXPORTER_OTLP_PROTOCOL), ``grpc`` by default, or ``http/protobuf``.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    kwargs = {} if endpoint is None else {"endpoint": endpoint}
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if endpoint is not None:
            kwargs["insecure"] = endpoint.startswith("http://") or "://" not in endpoint
        exporter = OTLPSpanExporter(**kwargs)
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(**kwargs)
    else:
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (grpc or http/protobuf)")
    # Resource.create() reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "omni-pipeline"),
                                "process.pid": os.getpid()})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    atexit.register(provider.shutdown)  # flush what is buffered
    return provider


def resolve_tracer(vllm_config: Any = None) -> Tracer | None:
    """The tracer for transfer spans, or None when nothing asks for traces (see module doc)."""
    if _env_true("OTEL_SDK_DISABLED"):
        return None
    if _global_provider_is_set():
        return trace.get_tracer(INSTRUMENTATION_NAME)
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    endpoint = _vllm_endpoint(vllm_config)
    if endpoint is None and not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                                 or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    provider = _make_private_provider(endpoint)
    logger.info("KV transfer spans exported by a private OTLP tracer provider")
    return provider.get_tracer(INSTRUMENTATION_NAME)

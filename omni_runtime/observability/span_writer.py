"""Writing a span that is already over: every field known at once (name, parent, times,
attributes, events, status), as :class:`~omni_runtime.observability.tracing.TransferTracing`
records a transfer once it has resolved.

Two ways, chosen per span by :func:`span_writer`:

* :class:`SdkSpanWriter`, for the OpenTelemetry SDK's own tracer when every span processor
  behind it does nothing when a span starts or is ending (the SDK's batch and simple
  processors): it does what the SDK's ``Tracer.start_span``, ``Span.add_event`` and
  ``Span.end`` do for such a span (the tracer's enabled switch, the provider's id generator
  and sampler with the parent's context, the trace flags, the span limits, the SDK's own span
  metrics) and hands the finished :class:`ReadableSpan` to the processors' ``on_end``, as
  ``Span.end`` does. A root span under the SDK's ALWAYS_ON or default ParentBased(ALWAYS_ON)
  sampler skips the sampler call, whose answer is then known (sample, the attributes as
  given, no trace state). What it leaves out is what a span that is still open needs: its lock, a
  mutable attribute map validated per call, an event list appended under the lock, and the
  processors' ``on_start``/``_on_ending``, which these processors ignore: a fraction of the
  SDK path's time (docs/tracing.md, "Cost"; benchmarks/scheduler_overhead.py counts it per transfer;
  tests prove the two give the same span). ``write_many`` writes several spans as ``write`` would one by one, reading what is
  the same for all of them once (the processors, the tracer's switch, sampler, id generator
  and limits, the current context's span).
* :class:`ApiSpanWriter` otherwise (another SDK's tracer, a processor that acts on start or
  ending, a tracer the SDK's internals do not look as expected): the public API, span by span.

It reads SDK attributes that are not public API (``Tracer._span_limits``, ``_is_enabled``,
``_tracer_metrics``, ``_instrumentation_scope``, a multi-processor's ``_span_processors``):
they are checked once, when the writer is made, and the API writer is used when any is
missing, so an SDK that changes them costs speed, never a span.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

#: (name, attributes or None, timestamp in ns) of one span event.
EventSpec = tuple[str, Mapping[str, Any] | None, int]
#: One span over, as :meth:`SdkSpanWriter.write` takes it: (name, parent context or None for
#: the current one's span, kind, attributes, events, status or None, start ns, end ns).
SpanSpec = tuple[str, "Context | None", SpanKind, dict[str, Any], Sequence[EventSpec],
                 "Status | None", int, int]


class ApiSpanWriter:
    """Through the public tracing API: start the span, add its events, end it."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def write(self, name: str, parent: Context | None, kind: SpanKind,
              attributes: dict[str, Any], events: Sequence[EventSpec], status: Status | None,
              start_ns: int, end_ns: int) -> None:
        span = self._tracer.start_span(name, context=parent, kind=kind, start_time=start_ns,
                                       attributes=attributes)
        for event_name, event_attributes, timestamp in events:
            span.add_event(event_name, event_attributes, timestamp=timestamp)
        if status is not None:
            span.set_status(status)
        span.end(end_time=end_ns)

    def write_many(self, spans: Iterable[SpanSpec]) -> None:
        for spec in spans:
            self.write(*spec)


class SdkSpanWriter:
    """Straight to the SDK's span processors (see the module docstring for what and why)."""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan, SynchronousMultiSpanProcessor
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.sdk.util import BoundedList

        self._tracer = tracer
        self._bounded = BoundedList.from_seq
        self._event = Event
        self._readable = ReadableSpan
        self._limits = tracer._span_limits
        self._processor = tracer.span_processor
        self._api = ApiSpanWriter(tracer)
        self._unset = Status(StatusCode.UNSET)
        # Immutable, so one serves every event without attributes.
        self._no_attributes = BoundedAttributes(immutable=True)
        # Whether the sampler samples every root span, whatever its attributes (the SDK's
        # ALWAYS_ON, or its default ParentBased(ALWAYS_ON)): a span with no parent then needs
        # no call to it (the SDK's answer would be: record and sample, the attributes given,
        # no trace state).
        self._sample = Decision.RECORD_AND_SAMPLE
        self._sampler = tracer.sampler
        self._roots_always_sampled = _samples_every_root(self._sampler)
        # The processors last looked at, and whether they all ignore a span's start and its
        # ending. A processor may be added to the provider at any time: the multi-processor
        # then holds a new tuple, looked at on the next write.
        self._seen_processors: Any = None
        self._quiet = False
        # The SDK's synchronous multi-processor only calls each processor's on_end in turn.
        self._in_turn = type(self._processor).on_end is SynchronousMultiSpanProcessor.on_end

    def _attributes(self, attributes: Any) -> Any:
        """The span's attributes as the SDK would keep them. Plain values within the limits
        (the SDK's checks would change nothing): a plain dict, which the exported span shows
        read-only as the SDK's does; else the SDK's bounded map, which cleans and bounds."""
        limits = self._limits
        most, longest = limits.max_span_attributes, limits.max_span_attribute_length
        if most is None or len(attributes) <= most:
            plain = _PLAIN
            for key, value in attributes.items():
                if type(value) not in plain or not key or type(key) is not str or (
                        longest is not None and type(value) is str and len(value) > longest):
                    break
            else:
                return dict(attributes)
        return BoundedAttributes(most, attributes, immutable=True, max_value_len=longest)

    def write(self, name: str, parent: Context | None, kind: SpanKind,
              attributes: dict[str, Any], events: Sequence[EventSpec], status: Status | None,
              start_ns: int, end_ns: int) -> None:
        self.write_many(((name, parent, kind, attributes, events, status, start_ns, end_ns),))

    def write_many(self, spans: Iterable[SpanSpec]) -> None:
        """The spans, one after the other, as :meth:`write` would one by one: what is the
        same for all of them is read once, as of the call (the processors, the tracer's
        switch, its sampler, id generator and limits, and the current context's span,
        parent of the spans given none: nothing here changes the current context, and a
        processor's ``on_end`` that attached a context without detaching it would be a
        bug of its own)."""
        processors = self._processor._span_processors
        if processors is not self._seen_processors:
            self._seen_processors, self._quiet = processors, _ignore_start_and_ending(processors)
        if not self._quiet:
            self._api.write_many(spans)
            return
        tracer = self._tracer
        if not tracer._is_enabled():
            return
        if tracer.sampler is not self._sampler:  # replaced: the SDK reads it per span
            self._sampler = tracer.sampler
            self._roots_always_sampled = _samples_every_root(self._sampler)
        sampler, roots_always_sampled = self._sampler, self._roots_always_sampled
        ids = tracer.id_generator
        new_trace_id, new_span_id = ids.generate_trace_id, ids.generate_span_id
        start_span_metrics = tracer._tracer_metrics.start_span
        limits = self._limits
        max_events, max_event_attributes = limits.max_events, limits.max_event_attributes
        max_attribute_length = limits.max_attribute_length
        no_attributes, event, readable = self._no_attributes, self._event, self._readable
        flags_of, sample, unset = _FLAGS, self._sample, self._unset
        resource, scope = tracer.resource, tracer._instrumentation_scope
        info = tracer.instrumentation_info
        # The SDK's synchronous multi-processor calls each processor in turn: so do we,
        # from the tuple read above; any other (the concurrent one), its own on_end.
        on_ends = ([processor.on_end for processor in processors] if self._in_turn
                   else [self._processor.on_end])
        current = _NOT_LOOKED_UP  # the current context's span context, looked up once
        for name, parent, kind, attributes, events, status, start_ns, end_ns in spans:
            # As the SDK: no parent given means the current context's span, if any.
            if parent is None:
                if current is _NOT_LOOKED_UP:
                    current = trace_api.get_current_span().get_span_context()
                parent_span = current
            else:
                parent_span = trace_api.get_current_span(parent).get_span_context()
            if parent_span is None or not parent_span.is_valid:
                parent_span = None
                trace_id = new_trace_id()
            else:
                trace_id = parent_span.trace_id
            if parent_span is None and roots_always_sampled:
                decision, span_attributes, trace_state = sample, attributes, None
            else:
                sampling = sampler.should_sample(parent, trace_id, name, kind, attributes, ())
                decision, span_attributes = sampling.decision, sampling.attributes
                trace_state = sampling.trace_state
            # The id generator asked per root, after the sampler, as the SDK does.
            random_trace_id = (ids.is_trace_id_random() if parent_span is None
                               else parent_span.trace_flags.random_trace_id)
            context = trace_api.SpanContext(
                trace_id, new_span_id(), is_remote=False,
                trace_flags=flags_of[decision.is_sampled(), bool(random_trace_id)],
                trace_state=trace_state)
            record_end_metrics = start_span_metrics(parent_span, decision)
            if not decision.is_recording():
                continue
            span_events: Sequence[Any] = tuple([
                event(event_name, no_attributes if not event_attributes else BoundedAttributes(
                    max_event_attributes, event_attributes, max_value_len=max_attribute_length,
                    immutable=True), timestamp)
                for event_name, event_attributes, timestamp in events])
            if max_events is not None and len(span_events) > max_events:
                # The SDK's bounded list: keeps the newest, counts what it dropped.
                span_events = self._bounded(max_events, span_events)
            span = readable(
                name=name, context=context, parent=parent_span, resource=resource,
                attributes=self._attributes(span_attributes),
                events=span_events, links=(), kind=kind, status=status or unset,
                start_time=start_ns, end_time=end_ns,
                instrumentation_info=info, instrumentation_scope=scope)
            if record_end_metrics:
                record_end_metrics()
            for on_end in on_ends:
                on_end(span)


_NOT_LOOKED_UP: Any = object()

#: The trace flags by (sampled, random trace id): the SDK makes one per span; they are ints.
_FLAGS = {
    (sampled, random_id): trace_api.TraceFlags(
        (trace_api.TraceFlags.SAMPLED if sampled else trace_api.TraceFlags.DEFAULT)
        | (trace_api.TraceFlags.RANDOM_TRACE_ID if random_id else 0))
    for sampled in (False, True) for random_id in (False, True)
}

_PLAIN = frozenset((str, int, float, bool))


def _samples_every_root(sampler: Any) -> bool:
    """Whether ``sampler`` decides as the SDK's ALWAYS_ON, or as its ParentBased with an
    ALWAYS_ON root (the SDK's default, DEFAULT_ON, and its entry-point twins): the SDK's own
    ``should_sample`` of those classes, not overridden by a subclass, which may decide
    otherwise."""
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler

    if isinstance(sampler, ParentBased) and type(sampler).should_sample is ParentBased.should_sample:
        sampler = getattr(sampler, "_root", None)
    return (isinstance(sampler, StaticSampler)
            and type(sampler).should_sample is StaticSampler.should_sample
            and getattr(sampler, "_decision", None) is Decision.RECORD_AND_SAMPLE)


def _ignore_start_and_ending(processors: Sequence[Any]) -> bool:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    quiet = (SpanProcessor, BatchSpanProcessor, SimpleSpanProcessor)
    starts = {cls.on_start for cls in quiet}
    endings = {cls._on_ending for cls in quiet}
    return all(type(p).on_start in starts and type(p)._on_ending in endings for p in processors)


def span_writer(tracer: Tracer) -> SdkSpanWriter | ApiSpanWriter:
    """The SDK writer where the tracer is the SDK's and everything it needs is there and
    quiet on start; else the API writer."""
    try:
        from opentelemetry.sdk.trace import (ConcurrentMultiSpanProcessor,
                                             SynchronousMultiSpanProcessor)
        from opentelemetry.sdk.trace import Tracer as SdkTracer

        if not isinstance(tracer, SdkTracer) or not isinstance(
                tracer.span_processor, (SynchronousMultiSpanProcessor,
                                        ConcurrentMultiSpanProcessor)):
            return ApiSpanWriter(tracer)
        writer = SdkSpanWriter(tracer)
        for needed in ("_is_enabled", "_tracer_metrics", "_instrumentation_scope",
                       "id_generator", "sampler", "resource", "instrumentation_info"):
            getattr(tracer, needed)
        for limit in ("max_span_attributes", "max_span_attribute_length", "max_events",
                      "max_event_attributes", "max_attribute_length"):
            getattr(writer._limits, limit)
    except (ImportError, AttributeError):
        return ApiSpanWriter(tracer)
    return writer

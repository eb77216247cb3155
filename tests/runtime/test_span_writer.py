"""The SDK span writer (omni_runtime/observability/span_writer.py) gives the span the SDK's own
start/add_event/end path gives, field for field, under the provider's id generator, sampler,
span limits and resource; and it steps aside (the API path) for processors that act on a
span's start or ending. Real SDK providers and processors; ids from a counting generator so
that both paths draw the same ones."""

from __future__ import annotations

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import (ALWAYS_OFF, ALWAYS_ON, Decision, ParentBased,
                                              Sampler, SamplingResult, TraceIdRatioBased)
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omni_runtime.observability.span_writer import ApiSpanWriter, SdkSpanWriter, span_writer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class Counting(IdGenerator):
    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        return (7 << 64) + self.n


class Collect(SpanProcessor):
    """Keeps every span it is given at its end, sampled or not (on_start is the base's)."""

    def __init__(self) -> None:
        self.spans = []

    def on_end(self, span) -> None:
        self.spans.append(span)


class ActsOnStart(Collect):
    def __init__(self) -> None:
        super().__init__()
        self.started = 0

    def on_start(self, span, parent_context=None) -> None:
        self.started += 1
        span.set_attribute("seen.on_start", True)


def provider(sampler=ALWAYS_ON, limits=None):
    p = TracerProvider(sampler=sampler, id_generator=Counting(), span_limits=limits,
                       resource=Resource.create({"service.name": "omni-test"}))
    collect = Collect()
    p.add_span_processor(collect)
    return p, collect


def parent(flags: str = "01"):
    return TraceContextTextMapPropagator().extract(
        {"traceparent": f"00-{TRACE_ID}-{PARENT}-{flags}"})


SPANS = [  # (parent, attributes, events, status)
    (None, {"a": 1, "b": "two", "c": 3.5, "d": True},
     [("handed_off", None, 1_000_100), ("resolved", None, 1_000_900)], None),
    (parent(), {"gen_ai.request.id": "req-1", "omni.kv_transfer.seq_len": 1024},
     [("handed_off", None, 1_000_100), ("held", None, 1_000_200),
      ("resolved", {"omni.kv_transfer.reason": "no answer within 5s"}, 1_000_900)],
     Status(StatusCode.ERROR, "no answer within 5s")),
    (None, {"list": [1, 2], "none": None, "tuple": ("a", "b"), "": 1, "ok": 0.5}, [], None),
    (None, {"long": "x" * 40, "n": 5, "o": 6, "p": 7},
     [(f"e{i}", {"k": "v" * 30, "k2": 2, "k3": 3}, 1_000_000 + i) for i in range(5)], None),
]


def write_all(writer, together: bool = False) -> None:
    """Every span of SPANS: one ``write`` each, or one ``write_many`` for them all."""
    specs = [("omni.kv_transfer", ctx, SpanKind.INTERNAL, dict(attributes), events, status,
              1_000_000, 1_001_000) for ctx, attributes, events, status in SPANS]
    if together:
        writer.write_many(specs)
    else:
        for spec in specs:
            writer.write(*spec)


def view(span) -> tuple:
    return (span.to_json(), int(span.context.trace_flags), span.dropped_attributes,
            span.dropped_events, [dict(e.attributes) for e in span.events])


@pytest.mark.parametrize("limits", [None, SpanLimits(max_span_attributes=3,
                                                      max_span_attribute_length=8,
                                                      max_events=2, max_event_attributes=1,
                                                      max_attribute_length=4)],
                         ids=["default-limits", "tight-limits"])
@pytest.mark.parametrize("sampler", [ALWAYS_ON, ParentBased(ALWAYS_ON)],
                         ids=["always-on", "parent-based"])
@pytest.mark.parametrize("together", [False, True], ids=["write", "write_many"])
def test_the_sdk_writer_gives_the_sdks_own_span(limits, sampler, together):
    sdk_provider, sdk_spans = provider(sampler, limits=limits)
    api_provider, api_spans = provider(sampler, limits=limits)
    sdk = span_writer(sdk_provider.get_tracer("t", "1.0"))
    assert isinstance(sdk, SdkSpanWriter)
    write_all(sdk, together)
    write_all(ApiSpanWriter(api_provider.get_tracer("t", "1.0")))
    assert len(sdk_spans.spans) == len(SPANS)
    assert [view(s) for s in sdk_spans.spans] == [view(s) for s in api_spans.spans]
    child = sdk_spans.spans[1]
    assert format(child.context.trace_id, "032x") == TRACE_ID
    assert child.parent.is_remote and format(child.parent.span_id, "016x") == PARENT


@pytest.mark.parametrize("sampler,flags,expected", [
    (ParentBased(ALWAYS_ON), "00", 0),  # the request's trace was not sampled
    (ParentBased(ALWAYS_ON), "01", 3),
    (TraceIdRatioBased(0.0), "01", 0),
])
def test_the_providers_sampler_decides_as_for_the_sdk(sampler, flags, expected):
    sdk_provider, sdk_spans = provider(sampler)
    api_provider, api_spans = provider(sampler)
    for writer, _ in ((span_writer(sdk_provider.get_tracer("t")), sdk_spans),
                      (ApiSpanWriter(api_provider.get_tracer("t")), api_spans)):
        for _ in range(3):
            writer.write("s", parent(flags), SpanKind.INTERNAL, {"a": 1}, [], None, 1, 2)
    assert len(sdk_spans.spans) == len(api_spans.spans) == expected
    assert [view(s) for s in sdk_spans.spans] == [view(s) for s in api_spans.spans]


def test_only_the_sdks_own_always_on_samplers_skip_the_sampler_for_root_spans():
    from opentelemetry.sdk.trace.sampling import _ParentBasedAlwaysOn

    class Mine(ParentBased):  # a subclass that decides otherwise: asked every time
        def should_sample(self, *args, **kwargs):
            return ALWAYS_OFF.should_sample(*args, **kwargs)

    for sampler in (ALWAYS_ON, ParentBased(ALWAYS_ON), _ParentBasedAlwaysOn(None)):
        assert span_writer(provider(sampler)[0].get_tracer("t"))._roots_always_sampled, sampler
    for sampler in (Mine(ALWAYS_ON), ParentBased(TraceIdRatioBased(0.5)), RecordOnly(),
                    ALWAYS_OFF):
        assert not span_writer(provider(sampler)[0].get_tracer("t"))._roots_always_sampled


def test_a_sampler_replaced_on_the_tracer_decides_from_then_on():
    sdk_provider, sdk_spans = provider(ALWAYS_ON)
    tracer = sdk_provider.get_tracer("t")
    writer = span_writer(tracer)
    writer.write("s", None, SpanKind.INTERNAL, {"a": 1}, [], None, 1, 2)
    tracer.sampler = ALWAYS_OFF
    writer.write("s", None, SpanKind.INTERNAL, {"a": 1}, [], None, 1, 2)
    assert len(sdk_spans.spans) == 1


class RecordOnly(Sampler):
    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None,
                      links=None, trace_state=None):
        return SamplingResult(Decision.RECORD_ONLY, {**(attributes or {}), "sampler": "mine"})

    def get_description(self) -> str:
        return "RecordOnly"


def test_a_recorded_unsampled_span_reaches_the_processors_unsampled_with_the_samplers_attributes():
    sdk_provider, sdk_spans = provider(RecordOnly())
    exporter = InMemorySpanExporter()
    sdk_provider.add_span_processor(SimpleSpanProcessor(exporter))
    api_provider, api_spans = provider(RecordOnly())
    span_writer(sdk_provider.get_tracer("t")).write("s", None, SpanKind.INTERNAL, {"a": 1}, [],
                                                    None, 1, 2)
    ApiSpanWriter(api_provider.get_tracer("t")).write("s", None, SpanKind.INTERNAL, {"a": 1},
                                                      [], None, 1, 2)
    (span,) = sdk_spans.spans
    assert not span.context.trace_flags.sampled
    assert dict(span.attributes) == {"a": 1, "sampler": "mine"}
    assert view(span) == view(api_spans.spans[0])
    assert exporter.get_finished_spans() == ()  # exporters see sampled spans only


def test_a_processor_that_acts_on_start_gets_the_sdk_path_even_when_added_later():
    p, collect = provider()
    p.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    writer = span_writer(p.get_tracer("t"))
    writer.write("s", None, SpanKind.INTERNAL, {"a": 1}, [], None, 1, 2)
    assert "seen.on_start" not in collect.spans[0].attributes
    acting = ActsOnStart()
    p.add_span_processor(acting)
    writer.write("s", None, SpanKind.INTERNAL, {"a": 1}, [], None, 1, 2)
    assert acting.started == 1
    assert acting.spans[0].attributes["seen.on_start"] is True
    assert len(collect.spans) == 2
    p.shutdown()


def test_a_tracer_that_is_not_the_sdks_is_written_through_the_api():
    assert isinstance(span_writer(trace_api.NoOpTracer()), ApiSpanWriter)
    span_writer(trace_api.NoOpTracer()).write("s", None, SpanKind.INTERNAL, {}, [], None, 1, 2)


def test_without_a_parent_the_current_contexts_span_is_the_parent_as_for_the_sdk():
    sdk_provider, sdk_spans = provider()
    api_provider, api_spans = provider()
    outer = sdk_provider.get_tracer("t").start_span("outer")
    with trace_api.use_span(outer, end_on_exit=False):
        span_writer(sdk_provider.get_tracer("t")).write("s", None, SpanKind.INTERNAL, {}, [],
                                                        None, 1, 2)
    outer_api = api_provider.get_tracer("t").start_span("outer")
    with trace_api.use_span(outer_api, end_on_exit=False):
        ApiSpanWriter(api_provider.get_tracer("t")).write("s", None, SpanKind.INTERNAL, {}, [],
                                                          None, 1, 2)
    assert sdk_spans.spans[0].parent == outer.get_span_context()
    assert view(sdk_spans.spans[0]) == view(api_spans.spans[0])


def test_write_many_under_a_current_span_gives_the_sdks_spans_roots_and_children_alike():
    """write_many reads the current context's span once for the spans given no parent: the
    same parent the SDK finds for each; a span with its own parent keeps it."""
    sdk_provider, sdk_spans = provider(ParentBased(ALWAYS_ON))
    api_provider, api_spans = provider(ParentBased(ALWAYS_ON))
    specs = [("s", ctx, SpanKind.INTERNAL, {"i": i}, [("e", None, 5)], None, 1, 2)
             for i, ctx in enumerate([None, parent(), None, parent("00"), None])]
    outer = sdk_provider.get_tracer("t").start_span("outer")
    with trace_api.use_span(outer, end_on_exit=False):
        span_writer(sdk_provider.get_tracer("t")).write_many(specs)
    outer_api = api_provider.get_tracer("t").start_span("outer")
    with trace_api.use_span(outer_api, end_on_exit=False):
        ApiSpanWriter(api_provider.get_tracer("t")).write_many(specs)
    # 3: its parent's trace is not sampled, so ParentBased drops it (not even recorded).
    assert [s.attributes["i"] for s in sdk_spans.spans] == [0, 1, 2, 4]
    assert [view(s) for s in sdk_spans.spans] == [view(s) for s in api_spans.spans]
    roots = [sdk_spans.spans[i] for i in (0, 2, 3)]
    assert [s.parent for s in roots] == [outer.get_span_context()] * 3
    assert format(sdk_spans.spans[1].parent.span_id, "016x") == PARENT


def test_the_concurrent_multi_processor_gets_each_span_through_its_own_on_end():
    """Under the SDK's concurrent multi-processor, the writer hands each span to it (which
    runs its processors in parallel), not to its processors one by one."""
    from opentelemetry.sdk.trace import ConcurrentMultiSpanProcessor

    multi = ConcurrentMultiSpanProcessor(num_threads=2)
    handed = []
    original = multi.on_end
    multi.on_end = lambda span: (handed.append(span), original(span))
    p = TracerProvider(id_generator=Counting(), active_span_processor=multi)
    collect = Collect()
    p.add_span_processor(collect)
    writer = span_writer(p.get_tracer("t"))
    assert isinstance(writer, SdkSpanWriter)
    writer.write_many([("s", None, SpanKind.INTERNAL, {"i": i}, [], None, 1, 2)
                       for i in range(3)])
    assert [s.attributes["i"] for s in handed] == [0, 1, 2]
    assert collect.spans == handed
    p.shutdown()


def test_the_id_generator_and_the_sampler_are_asked_as_the_sdk_asks_them():
    """Per span, in the SDK's order: a root's trace id, the sampler, whether the trace id
    is random (roots only), the span id; a custom generator or sampler sees the same calls."""

    def traced(calls):
        class Ids(Counting):
            def generate_trace_id(self) -> int:
                calls.append("trace")
                return super().generate_trace_id()

            def generate_span_id(self) -> int:
                calls.append("span")
                return super().generate_span_id()

            def is_trace_id_random(self) -> bool:
                calls.append("random")
                return len(calls) % 2 == 0  # answers vary: the flag follows each answer

        class Asking(Sampler):
            def should_sample(self, *args, **kwargs):
                calls.append("sample")
                return ALWAYS_ON.should_sample(*args, **kwargs)

            def get_description(self) -> str:
                return "Asking"

        p = TracerProvider(sampler=Asking(), id_generator=Ids())
        collect = Collect()
        p.add_span_processor(collect)
        return p.get_tracer("t"), collect

    sdk_calls, our_calls = [], []
    (sdk_tracer, sdk_spans), (our_tracer, our_spans) = traced(sdk_calls), traced(our_calls)
    specs = [("s", ctx, SpanKind.INTERNAL, {"a": 1}, [], None, 1, 2)
             for ctx in (None, parent(), None, None)]
    ApiSpanWriter(sdk_tracer).write_many(specs)
    writer = span_writer(our_tracer)
    assert isinstance(writer, SdkSpanWriter)
    writer.write_many(specs)
    assert our_calls == sdk_calls
    assert sdk_calls[:4] == ["trace", "sample", "random", "span"]
    assert [view(s) for s in our_spans.spans] == [view(s) for s in sdk_spans.spans]

"""Unit tests of the tracing observer against a real TransferLedger with the SDK's in-memory
span exporter, and of how the tracer is chosen."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from omni_runtime.observability import tracing
from omni_runtime.observability.metrics import TransferMetrics
from omni_runtime.observability.observers import build_observers
from omni_runtime.observability.tracing import SPAN_NAME, TransferTracing, resolve_tracer
from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

REPO = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


class FakeClock:
    def __init__(self, t: float = 500.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def setup():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clock = FakeClock()
    observer = TransferTracing(provider.get_tracer("test"), stage="ar", model_name="tiny")
    ledger = TransferLedger(5.0, clock=clock, observers=[observer])
    yield ledger, clock, exporter
    provider.shutdown()


def written(ledger: TransferLedger, exporter: InMemorySpanExporter) -> tuple:
    """The spans exported once the span thread has written what it was handed (the ledger's
    flush: reports, then waits for the observers)."""
    assert ledger.flush(timeout=10)
    return exporter.get_finished_spans()


def ns(ledger: TransferLedger, t: float) -> int:
    return int(ledger.wall_time(t) * 1e9)


def test_one_span_from_marking_to_resolution_with_events_and_attributes(setup):
    ledger, clock, exporter = setup
    ledger.mark("req-1", Trigger.SPECIAL_TOKEN, 37, [3, 4, 5], trace_headers={"traceparent": TRACEPARENT})
    assert written(ledger, exporter) == ()  # exported once resolved
    clock.t += 1
    ledger.hand_off_pending()
    clock.t += 2
    ledger.request_finished("req-1", 6, aborted=False)
    clock.t += 3
    ledger.expire_due()
    (span,) = written(ledger, exporter)
    assert span.name == SPAN_NAME
    assert span.start_time == ns(ledger, 500.0)
    assert span.end_time == ns(ledger, 506.0)
    assert dict(span.attributes) == {
        "gen_ai.request.id": "req-1",
        "omni.stage": "ar",
        "omni.model_name": "tiny",
        "omni.kv_transfer.trigger": "special_token",
        "omni.kv_transfer.seq_len": 37,
        "omni.kv_transfer.blocks": 3,
        "omni.kv_transfer.outcome": "expired",
        "omni.kv_transfer.held_blocks": 6,
    }
    events = [(e.name, e.timestamp) for e in span.events]
    assert events == [("handed_off", ns(ledger, 501.0)), ("held", ns(ledger, 503.0)),
                      ("resolved", ns(ledger, 506.0))]
    assert "no answer within 5s" in span.events[2].attributes["omni.kv_transfer.reason"]
    assert span.status.status_code is StatusCode.ERROR


def test_span_is_a_child_of_the_requests_w3c_trace(setup):
    ledger, _, exporter = setup
    ledger.mark("req-1", Trigger.PREFILL_FINISHED, 8, [0], trace_headers={"traceparent": TRACEPARENT})
    ledger.resolve("req-1", Outcome.ACKED)
    (span,) = written(ledger, exporter)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.parent.is_remote
    assert span.status.status_code is StatusCode.UNSET


def test_without_trace_headers_each_transfer_is_its_own_root_span(setup):
    ledger, _, exporter = setup
    for rid in ("a", "b"):
        ledger.mark(rid, Trigger.REQUEST_FINISHED, 8, [0])
        ledger.request_finished(rid, 1, aborted=True)  # pending + abort = cancelled
    spans = written(ledger, exporter)
    assert [s.parent for s in spans] == [None, None]
    assert spans[0].context.trace_id != spans[1].context.trace_id
    assert [s.attributes["omni.kv_transfer.outcome"] for s in spans] == ["cancelled"] * 2
    assert [e.name for e in spans[0].events] == ["resolved"]  # never handed off or held


def test_failed_reason_is_capped_and_marks_the_span_as_error(setup):
    ledger, _, exporter = setup
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.hand_off_pending()
    ledger.resolve("a", Outcome.FAILED, "x" * 5000)
    (span,) = written(ledger, exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert len(span.events[-1].attributes["omni.kv_transfer.reason"]) == tracing.MAX_REASON_CHARS


def test_written_on_the_span_thread_a_root_still_takes_the_steps_current_span(setup):
    """The SDK gives a span started with no parent the current span as its parent: the span
    thread writes under the context current on the step when the report was made."""
    ledger, _, exporter = setup
    tracer = TracerProvider().get_tracer("outer")
    with tracer.start_as_current_span("engine step") as outer:
        ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])
        ledger.resolve("a", Outcome.ACKED)  # outside a batch: reported now
    ledger.mark("b", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.resolve("b", Outcome.ACKED)
    spans = {s.attributes["gen_ai.request.id"]: s for s in written(ledger, exporter)}
    assert spans["a"].parent.span_id == outer.get_span_context().span_id
    assert spans["a"].context.trace_id == outer.get_span_context().trace_id
    assert spans["b"].parent is None


def test_the_schedulers_shutdown_writes_the_spans_it_ends():
    from omni_runtime.devtools.sched_harness import make_request, make_scheduler, make_vllm_config, step
    from omni_runtime.sched.scheduler import OmniARScheduler

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sched = make_scheduler(OmniARScheduler, make_vllm_config(
        {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"}}))
    sched.transfer_ledger.remove_observers()
    sched.transfer_ledger.add_observer(
        TransferTracing(provider.get_tracer("test"), stage="ar", model_name="tiny"))
    for i in range(3):
        sched.add_request(make_request(8, max_tokens=4, request_id=f"r{i}"))
    step(sched)
    step(sched)  # marked, handed off, never answered
    assert sched.transfer_ledger.num_active == 3
    sched.shutdown()
    spans = exporter.get_finished_spans()  # no flush here: the shutdown waited for them
    assert sorted(s.attributes["gen_ai.request.id"] for s in spans) == ["r0", "r1", "r2"]
    assert {s.attributes["omni.kv_transfer.outcome"] for s in spans} == {"failed"}


# ---------------------------------------------------------------------- which tracer
@pytest.fixture
def clean_otel_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    assert not tracing._global_provider_is_set(), "a test installed a global tracer provider"


def test_nothing_asks_for_traces_so_no_tracing_observer_is_attached(clean_otel_env):
    assert resolve_tracer(None) is None
    observers = build_observers(stage="ar", model_name="tiny", timeout_seconds=5)
    assert [type(o) for o in observers] == [TransferMetrics]


def test_standard_env_gives_a_private_provider_never_a_global_one(clean_otel_env, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    observers = build_observers(stage="ar", model_name="tiny", timeout_seconds=5)
    assert [type(o) for o in observers] == [TransferMetrics, TransferTracing]
    assert not tracing._global_provider_is_set()


def test_vllm_endpoint_asks_for_traces(clean_otel_env):
    class Observability:
        otlp_traces_endpoint = "http://127.0.0.1:1"

    class Config:
        observability_config = Observability()

    assert resolve_tracer(Config()) is not None
    assert not tracing._global_provider_is_set()


def test_sdk_disabled_wins(clean_otel_env, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert resolve_tracer(None) is None


def test_unknown_protocol_is_an_error(clean_otel_env, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier-pigeon"):
        resolve_tracer(None)


_GLOBAL = textwrap.dedent("""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from omni_runtime.observability import tracing
    from omni_runtime.observability.observers import build_observers
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    # What vLLM's init_tracer does in the engine-core process.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    made = []
    tracing._make_private_provider = lambda endpoint: made.append(endpoint)
    ledger = TransferLedger(5, observers=build_observers(
        stage="ar", model_name="tiny", timeout_seconds=5))
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.resolve("a", Outcome.ACKED)
    assert trace.get_tracer_provider() is provider
    assert made == [], made
    assert ledger.flush(timeout=10)
    print([s.name for s in exporter.get_finished_spans()])
""")


def test_a_global_provider_set_by_vllm_is_used_and_no_second_one_made():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://127.0.0.1:1"  # as vLLM leaves it
    out = subprocess.run([sys.executable, "-c", _GLOBAL], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['omni.kv_transfer']"

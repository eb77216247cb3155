"""The batched observers (metrics, per-edge families, spans) write once per batch (a scheduler
step's half) what they wrote per change before: a ledger whose operations run in batches and
one whose every operation is a batch of its own end each batch with the same samples and the
same spans. With a report interval, what they write at each report is that too, and between
reports nothing changes for longer than the interval while a transfer is unresolved."""

from __future__ import annotations

import math
import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from omni_runtime.observability.edge_metrics import EdgeMetrics, LedgerEdgeObserver
from omni_runtime.observability.metrics import TransferMetrics
from omni_runtime.observability.tracing import TransferTracing
from omni_runtime.observability.writer_thread import WriterThread
from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Observed:
    """A ledger with every observer, on a private registry and span exporter, and fake clocks."""

    def __init__(self, clock: Clock, wall: Clock, report_interval: float = 0.0, *,
                 threaded: bool = False) -> None:
        # Threaded: the metric families' reports written by a writer thread of their own, as
        # a stage's are (observers.build_observers); else on the step, as they come.
        self.thread = WriterThread(what="test metrics", max_delay=3600) if threaded else None
        self.registry = CollectorRegistry()
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracing = TransferTracing(provider.get_tracer("test"), stage="ar", model_name="tiny")
        edges = EdgeMetrics(stage="ar", model_name="tiny", to_stages=["next"], deadline_seconds=5,
                            registry=self.registry, clock=wall, monotonic=clock)
        self.ledger = TransferLedger(5.0, clock=clock, observers=[
            TransferMetrics(stage="ar", model_name="tiny", deadline_seconds=5,
                            registry=self.registry, writer_thread=self.thread),
            LedgerEdgeObserver(edges, writer_thread=self.thread),
            self.tracing,
        ], report_interval=report_interval)
        self.ledger._wall_offset = wall.t - clock.t  # both ledgers map to the same wall time

    def samples(self) -> dict:
        # What was handed to the writer thread, once written (without reporting anything).
        assert self.thread is None or self.thread.flush(timeout=10)
        # (Not the _created samples: the real time each child was made.)
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in self.registry.collect() for s in family.samples
                if not s.name.endswith("_created")}

    def spans(self) -> list:
        # What was handed to the span thread, once written (without reporting anything).
        assert self.tracing.flush(timeout=10)
        return sorted((s.attributes["gen_ai.request.id"], s.name, dict(s.attributes),
                       s.start_time, s.end_time, s.status.status_code,
                       [(e.name, dict(e.attributes or {}), e.timestamp) for e in s.events])
                      for s in self.exporter.get_finished_spans())


def _operations(rng: random.Random, ledger: TransferLedger, n: int):
    """A random stream of the scheduler's operations on ``ledger`` (as thunks)."""
    live: list[str] = []
    for i in range(n):
        rid = f"r{i}"
        yield lambda rid=rid: ledger.mark(rid, rng.choice(list(Trigger)), 32, [1, 2])
        live.append(rid)
        if rng.random() < 0.4:
            yield ledger.hand_off_pending
        for other in rng.sample(live, min(len(live), 2)):
            choice = rng.random()
            if choice < 0.3:
                yield lambda o=other: ledger.resolve(o, Outcome.ACKED, only_active=True)
            elif choice < 0.4:
                yield lambda o=other: ledger.resolve(o, Outcome.FAILED, "receiver busy")
            elif choice < 0.6:
                yield lambda o=other: ledger.request_finished(o, 3, aborted=rng.random() < 0.3)
        yield ledger.expire_due


def _in_batches(batched: Observed, single: Observed, clock: Clock, wall: Clock, seed: int,
                n: int, max_size: int, steps: tuple[float, ...]):
    """The same random stream of ``n`` transfers' operations on both ledgers, ``batched``'s
    in batches of 1 to ``max_size`` operations (``single``'s each a batch of its own), the
    clocks advancing by one of ``steps`` after each operation; yields after each batch ends."""
    rng_b, rng_s, rng_batches = random.Random(seed), random.Random(seed), random.Random(seed + 7)
    ops_b = _operations(rng_b, batched.ledger, n)
    ops_s = _operations(rng_s, single.ledger, n)
    done = False
    while not done:
        batched.ledger.begin_batch()
        for _ in range(rng_batches.randint(1, max_size)):
            op_b, op_s = next(ops_b, None), next(ops_s, None)
            if op_b is None:
                done = True
                break
            op_b()
            op_s()
            step = rng_batches.choice(steps)
            clock.t += step
            wall.t += step
        batched.ledger.end_batch()
        yield


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batches_write_what_each_change_wrote(seed):
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    batched, single = Observed(clock, wall, threaded=True), Observed(clock, wall)
    batches = 0
    for _ in _in_batches(batched, single, clock, wall, seed, 60, 8, (0.0, 0.01, 0.7, 2.0)):
        batches += 1
        got, want = batched.samples(), single.samples()
        assert got.keys() == want.keys()
        for key, value in want.items():
            # A histogram's sum adds a batch's values at once: equal up to rounding.
            assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=1e-9), key
        assert batched.spans() == single.spans()
    assert batches > 10 and single.spans()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_report_interval_writes_the_same_at_each_report_and_nothing_between(seed):
    """Reports at most every interval while a transfer is unresolved, at once when none is,
    and on report(): each report writes exactly what the per-change ledger has written by
    then; between reports the samples and spans stay as the last report left them."""
    interval = 1.0
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    windowed = Observed(clock, wall, report_interval=interval, threaded=True)
    single = Observed(clock, wall)
    reported_at = -math.inf
    last = (windowed.samples(), windowed.spans())
    reports = deferred = 0
    for _ in _in_batches(windowed, single, clock, wall, seed, 80, 4, (0.0, 0.01, 0.2, 0.7)):
        now = (windowed.samples(), windowed.spans())
        want = (single.samples(), single.spans())
        if _same(now, want):
            reported_at, last = clock.t, now
            reports += 1
            continue
        # Not reported: only while a transfer is unresolved, within the interval, and nothing
        # changed since the last report.
        assert windowed.ledger.has_unresolved()
        assert clock.t - reported_at < interval
        assert _same(now, last)
        deferred += 1
    windowed.ledger.report()
    assert _same((windowed.samples(), windowed.spans()), (single.samples(), single.spans()))
    assert reports > 5 and deferred > 5 and single.spans()


def _same(got: tuple, want: tuple) -> bool:
    (got_samples, got_spans), (want_samples, want_spans) = got, want
    return got_samples.keys() == want_samples.keys() and all(
        math.isclose(got_samples[k], v, rel_tol=1e-12, abs_tol=1e-9)
        for k, v in want_samples.items()) and got_spans == want_spans

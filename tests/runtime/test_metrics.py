"""Unit tests of the metrics observer against a real TransferLedger and a private registry."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from omni_runtime.observability.metrics import FAMILIES, TransferMetrics, build_registry, duration_buckets
from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

STAGE, MODEL = "ar", "tiny"
REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(timeout: float = 5.0):
    registry = CollectorRegistry()
    metrics = TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=timeout,
                              registry=registry)
    clock = FakeClock()
    ledger = TransferLedger(timeout, clock=clock, observers=[metrics])
    return registry, ledger, clock


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, {"stage": STAGE, "model_name": MODEL, **labels})
    assert v is not None, f"no sample {name}{labels}"
    return v


def assert_gauges_match(registry: CollectorRegistry, ledger: TransferLedger) -> None:
    counts = {"pending": ledger.num_pending, "active": ledger.num_active, "held": ledger.num_held}
    for state, n in counts.items():
        assert value(registry, "omni_kv_transfers", state=state) == n, state
        entered = ledger.oldest_entered(state)
        expected = 0.0 if entered is None else ledger.wall_time(entered)
        got = value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state=state)
        assert got == pytest.approx(expected, abs=1e-6), state
    assert value(registry, "omni_kv_held_blocks") == ledger.num_held_blocks


# ---------------------------------------------------------------------- off the step
def test_off_the_step_the_gauges_are_the_ledger_as_the_report_left_it():
    """With a writer thread, a report's gauge values are read on the step: written later,
    they are still the ledger as that report left it, not as it is when the thread runs."""
    from omni_runtime.observability.writer_thread import WriterThread

    thread = WriterThread(what="test metrics", max_delay=3600)
    registry = CollectorRegistry()
    metrics = TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=5,
                              registry=registry, writer_thread=thread)
    clock = FakeClock()
    ledger = TransferLedger(5, clock=clock, observers=[metrics])
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])  # outside a batch: reported now
    assert value(registry, "omni_kv_transfers", state="pending") == 0  # handed over, unwritten
    clock.t += 1
    ledger.begin_batch()  # changes after the report, not reported yet
    ledger.mark("b", Trigger.PREFILL_FINISHED, 8, [1])
    ledger.hand_off_pending()
    assert thread.flush(timeout=10)
    assert value(registry, "omni_kv_transfers", state="pending") == 1
    assert value(registry, "omni_kv_transfers", state="active") == 0
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 1
    assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state="pending") \
        == pytest.approx(ledger.wall_time(1000.0))
    ledger.end_batch()
    assert ledger.flush(timeout=10)
    assert_gauges_match(registry, ledger)
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 2


def test_off_the_step_an_idle_stages_figures_are_exact_at_once():
    """When nothing is left in flight the ledger reports at once and the engine may step no
    more (no kick would come): that report is written on the step, after the queued ones, so
    a scrape right after the last response is exact (tests/runtime/test_soak.py relies on
    it: counters and gauges of the same moment)."""
    from omni_runtime.observability.writer_thread import WriterThread

    thread = WriterThread(what="test metrics", max_delay=3600)
    registry = CollectorRegistry()
    metrics = TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=5,
                              registry=registry, writer_thread=thread)
    ledger = TransferLedger(5, clock=FakeClock(), observers=[metrics])
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])  # in flight: to the thread, unkicked
    ledger.hand_off_pending()
    ledger.resolve("a", Outcome.ACKED)  # none left: the queue, then this, on the step
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 1
    assert value(registry, "omni_kv_transfers_resolved_total", outcome="acked") == 1
    assert_gauges_match(registry, ledger)


def test_a_report_the_thread_refuses_is_written_on_the_step(monkeypatch):
    import threading

    from omni_runtime.observability.writer_thread import WriterThread

    monkeypatch.setattr(threading.Thread, "start",
                        lambda self: (_ for _ in ()).throw(RuntimeError("no threads")))
    registry = CollectorRegistry()
    metrics = TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=5,
                              registry=registry, writer_thread=WriterThread(what="t"))
    ledger = TransferLedger(5, clock=FakeClock(), observers=[metrics])
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.resolve("a", Outcome.ACKED)
    # No thread could take them: written on the step, no count lost.
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 1
    assert value(registry, "omni_kv_transfers_resolved_total", outcome="acked") == 1
    assert_gauges_match(registry, ledger)


# ---------------------------------------------------------------------- families and labels
def test_exposed_families_types_and_label_sets_are_exactly_the_contract():
    registry, _ = build_registry(stage=STAGE, model_name=MODEL)
    exposed = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.endswith("_created"):
                continue  # prometheus_client's counter creation time; not a family of ours
            labels = set(sample.labels) - {"le"}
            exposed.setdefault(metric.name, (metric.type, set()))[1].add(frozenset(labels))
    expected = {}
    for family in FAMILIES:
        name = family.name.removesuffix("_total") if family.type == "counter" else family.name
        expected[name] = (family.type, {frozenset(family.labels)})
    assert exposed == expected
    assert {f.name for f in FAMILIES} == {
        "omni_kv_transfers", "omni_kv_held_blocks",
        "omni_kv_transfer_oldest_start_timestamp_seconds", "omni_kv_transfers_started_total",
        "omni_kv_transfers_resolved_total", "omni_kv_transfer_duration_seconds",
        "omni_kv_hold_duration_seconds", "omni_kv_transfer_bytes",
    }


def test_every_series_exists_at_zero_before_any_transfer():
    registry, _, _ = make()
    for state in ("pending", "active", "held"):
        assert value(registry, "omni_kv_transfers", state=state) == 0
        assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state=state) == 0
    for trigger in ("prefill_finished", "special_token", "request_finished"):
        assert value(registry, "omni_kv_transfers_started_total", trigger=trigger) == 0
    for outcome in ("acked", "failed", "expired", "cancelled"):
        assert value(registry, "omni_kv_transfers_resolved_total", outcome=outcome) == 0
        assert value(registry, "omni_kv_transfer_duration_seconds_count", outcome=outcome) == 0
    assert value(registry, "omni_kv_hold_duration_seconds_count") == 0
    assert value(registry, "omni_kv_transfer_bytes_count") == 0


def test_buckets_include_alert_thresholds_and_the_deadline():
    buckets = duration_buckets(7.5)
    for b in (1, 5, 10, 30, 60, 120, 300, 7.5):
        assert b in buckets
    assert list(buckets) == sorted(set(buckets))
    registry, ledger, clock = make(timeout=7.5)
    ledger.mark("r", Trigger.PREFILL_FINISHED, 4, [0])
    clock.t += 7.5
    ledger.expire_due()
    # Expiring exactly at the deadline lands in the deadline's own bucket, not the next one.
    assert value(registry, "omni_kv_transfer_duration_seconds_bucket", outcome="expired",
                 le="7.5") == 1
    assert value(registry, "omni_kv_transfer_duration_seconds_bucket", outcome="expired",
                 le="5.0") == 0


def test_request_ids_never_become_label_values_and_series_do_not_grow():
    registry, ledger, clock = make()
    before = generate_latest(registry).decode().count("\n")
    for i in range(200):
        ledger.mark(f"req-{i}", Trigger.SPECIAL_TOKEN, 16, [i, i + 1])
        ledger.hand_off_pending()
        ledger.request_finished(f"req-{i}", 3, aborted=False)
        clock.t += 0.01
        ledger.resolve(f"req-{i}", Outcome.ACKED)
    text = generate_latest(registry).decode()
    assert "req-" not in text
    assert text.count("\n") == before
    assert value(registry, "omni_kv_transfers_resolved_total", outcome="acked") == 200


# ---------------------------------------------------------------------- values follow the ledger
def test_lifecycle_active_held_then_expired():
    registry, ledger, clock = make(timeout=5.0)
    ledger.mark("a", Trigger.PREFILL_FINISHED, 40, [1, 2, 3])
    clock.t += 1
    ledger.mark("b", Trigger.SPECIAL_TOKEN, 9, [4])
    assert value(registry, "omni_kv_transfers", state="pending") == 2
    assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state="pending") \
        == pytest.approx(ledger.wall_time(1000.0))
    clock.t += 1
    ledger.hand_off_pending()
    clock.t += 1
    assert ledger.request_finished("a", 7, aborted=False)
    assert_gauges_match(registry, ledger)
    assert value(registry, "omni_kv_transfers", state="active") == 2
    assert value(registry, "omni_kv_transfers", state="held") == 1
    assert value(registry, "omni_kv_held_blocks") == 7
    assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state="active") \
        == pytest.approx(ledger.wall_time(1002.0))
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 1
    assert value(registry, "omni_kv_transfers_started_total", trigger="special_token") == 1

    clock.t = 1005.0  # a's deadline; b's is at 1006
    ledger.expire_due()
    assert_gauges_match(registry, ledger)
    assert value(registry, "omni_kv_transfers", state="active") == 1
    assert value(registry, "omni_kv_transfers", state="held") == 0
    assert value(registry, "omni_kv_held_blocks") == 0
    assert value(registry, "omni_kv_hold_duration_seconds_count") == 1
    assert value(registry, "omni_kv_hold_duration_seconds_sum") == pytest.approx(2.0)
    clock.t = 1006.0
    ledger.expire_due()
    assert_gauges_match(registry, ledger)
    assert value(registry, "omni_kv_transfers_resolved_total", outcome="expired") == 2
    assert value(registry, "omni_kv_transfer_duration_seconds_sum", outcome="expired") \
        == pytest.approx(10.0)
    assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state="active") == 0


def test_oldest_moves_to_the_next_oldest_when_the_oldest_resolves():
    registry, ledger, clock = make(timeout=60)
    ledger.mark("a", Trigger.PREFILL_FINISHED, 4, [0])
    ledger.hand_off_pending()
    clock.t += 3
    ledger.mark("b", Trigger.PREFILL_FINISHED, 4, [1])
    ledger.hand_off_pending()
    ledger.resolve("a", Outcome.ACKED)
    assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state="active") \
        == pytest.approx(ledger.wall_time(1003.0))
    assert value(registry, "omni_kv_transfer_duration_seconds_count", outcome="acked") == 1


def test_abort_before_hand_off_counts_cancelled_and_clears_pending():
    registry, ledger, _ = make()
    ledger.mark("a", Trigger.REQUEST_FINISHED, 4, [0])
    assert not ledger.request_finished("a", 2, aborted=True)
    assert value(registry, "omni_kv_transfers_resolved_total", outcome="cancelled") == 1
    assert value(registry, "omni_kv_transfers", state="pending") == 0
    assert value(registry, "omni_kv_held_blocks") == 0
    assert value(registry, "omni_kv_hold_duration_seconds_count") == 0


def test_transfer_bytes_are_observed_for_the_worker():
    registry, _ = build_registry(stage=STAGE, model_name=MODEL)
    metrics = TransferMetrics(stage=STAGE, model_name=MODEL, registry=registry)
    metrics.observe_transfer_bytes(5 * 2**20)
    assert value(registry, "omni_kv_transfer_bytes_count") == 1
    assert value(registry, "omni_kv_transfer_bytes_sum") == 5 * 2**20


def test_second_instance_on_one_registry_reuses_families_and_new_deadline_rebuckets():
    registry = CollectorRegistry()
    TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=5, registry=registry)
    # vLLM re-creating an in-process engine builds a second scheduler in the same process.
    TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=5, registry=registry)
    TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=42, registry=registry)
    assert value(registry, "omni_kv_transfer_duration_seconds_bucket", outcome="acked",
                 le="42.0") == 0


ops = st.lists(
    st.one_of(
        st.tuples(st.just("mark"), st.integers(0, 7), st.sampled_from(list(Trigger))),
        st.tuples(st.just("hand_off")),
        st.tuples(st.just("finish"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("resolve"), st.integers(0, 7),
                  st.sampled_from([Outcome.ACKED, Outcome.FAILED])),
        st.tuples(st.just("tick"), st.floats(0.0, 4.0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_gauges_and_counters_follow_the_ledger_after_every_operation(sequence):
    registry, ledger, clock = make(timeout=5.0)
    marks = resolved = 0
    for op in sequence:
        if op[0] == "mark":
            rid = f"r{op[1]}"
            if not ledger.has_triggered(rid) and ledger.get(rid) is None:
                ledger.mark(rid, op[2], 8, [op[1]])
                marks += 1
        elif op[0] == "hand_off":
            ledger.hand_off_pending()
        elif op[0] == "finish":
            rid = f"r{op[1]}"
            t = ledger.get(rid)
            if t is not None and not t.held:
                before = ledger.num_pending + ledger.num_active
                ledger.request_finished(rid, op[1] + 1, aborted=op[2])
                resolved += before - (ledger.num_pending + ledger.num_active)
        elif op[0] == "resolve":
            if ledger.resolve(f"r{op[1]}", op[2]) is not None:
                resolved += 1
        else:
            clock.t += op[1]
            resolved += len(ledger.expire_due())
        assert_gauges_match(registry, ledger)
        started = sum(value(registry, "omni_kv_transfers_started_total", trigger=t.value)
                      for t in Trigger)
        done = sum(value(registry, "omni_kv_transfers_resolved_total", outcome=o.value)
                   for o in Outcome)
        assert (started, done) == (marks, resolved)
        durations = sum(value(registry, "omni_kv_transfer_duration_seconds_count",
                              outcome=o.value) for o in Outcome)
        assert durations == resolved
        assert not math.isnan(value(registry, "omni_kv_transfer_duration_seconds_sum",
                                    outcome="expired"))


# ---------------------------------------------------------------------- multiprocess mode
_WRITER = textwrap.dedent("""
    import sys
    from omni_runtime.observability.metrics import TransferMetrics
    from omni_runtime.transfers.ledger import TransferLedger, Trigger
    ledger = TransferLedger(30, observers=[TransferMetrics(stage="ar", model_name="tiny")])
    for i in range(int(sys.argv[1])):
        ledger.mark(f"r{i}", Trigger.PREFILL_FINISHED, 8, [i])
    ledger.hand_off_pending()
    for i in range(int(sys.argv[1])):
        ledger.request_finished(f"r{i}", 4, aborted=False)
    print(__import__("os").getpid())
""")


def _run_writer(mp_dir: Path, n: int) -> int:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    out = subprocess.run([sys.executable, "-c", _WRITER, str(n)], env=env, cwd=REPO,
                         check=True, capture_output=True, text=True, timeout=60)
    return int(out.stdout.strip())


def _read(mp_dir: Path) -> CollectorRegistry:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))
    return registry


def test_multiprocess_values_of_a_dead_engine_process_are_superseded_by_its_restart(tmp_path):
    # The engine-core process writes, another process (the API server) reads the files.
    first = _run_writer(tmp_path, 3)
    registry = _read(tmp_path)
    assert value(registry, "omni_kv_transfers", state="active") == 3
    assert value(registry, "omni_kv_held_blocks") == 12
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 3
    # The process died without cleanup; a restarted one (new pid) has no transfers yet.
    second = _run_writer(tmp_path, 0)
    assert second != first
    registry = _read(tmp_path)
    assert value(registry, "omni_kv_transfers", state="active") == 0
    assert value(registry, "omni_kv_transfers", state="held") == 0
    assert value(registry, "omni_kv_held_blocks") == 0
    assert value(registry, "omni_kv_transfer_oldest_start_timestamp_seconds", state="active") == 0
    # Counters stay monotonic across the restart.
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 3


def test_multiprocess_gauges_of_a_process_marked_dead_disappear(tmp_path):
    pid = _run_writer(tmp_path, 2)
    assert value(_read(tmp_path), "omni_kv_transfers", state="active") == 2
    multiprocess.mark_process_dead(pid, str(tmp_path))
    registry = _read(tmp_path)
    assert registry.get_sample_value(
        "omni_kv_transfers", {"stage": STAGE, "model_name": MODEL, "state": "active"}) is None
    assert value(registry, "omni_kv_transfers_started_total", trigger="prefill_finished") == 2


_BYTES_WRITER = textwrap.dedent("""
    from omni_runtime.observability.metrics import transfer_bytes_observer
    observe = transfer_bytes_observer(stage="ar", model_name="tiny")
    observe(3 * 2**20)
""")


def test_the_shipping_process_records_bytes_without_hiding_the_schedulers_gauges(tmp_path):
    _run_writer(tmp_path, 3)  # the scheduler's process: 3 active transfers
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _BYTES_WRITER], env=env, cwd=REPO, check=True,
                   timeout=60)  # the worker / connector process, later
    registry = _read(tmp_path)
    assert value(registry, "omni_kv_transfers", state="active") == 3
    assert value(registry, "omni_kv_held_blocks") == 12
    assert value(registry, "omni_kv_transfer_bytes_count") == 1
    assert value(registry, "omni_kv_transfer_bytes_sum") == 3 * 2**20


def test_bytes_observer_reuses_the_families_of_its_registry():
    registry = CollectorRegistry()
    TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=7, registry=registry)
    from omni_runtime.observability.metrics import transfer_bytes_observer

    transfer_bytes_observer(stage=STAGE, model_name=MODEL, registry=registry)(4096)
    assert value(registry, "omni_kv_transfer_bytes_count") == 1
    # The deadline's bucket survived: the families were reused, not re-registered.
    assert value(registry, "omni_kv_transfer_duration_seconds_bucket", outcome="acked",
                 le="7.0") == 0


def test_prepare_multiproc_dir_empties_it_and_sets_the_variable(tmp_path, monkeypatch):
    from omni_runtime.observability.multiproc import prepare_prometheus_multiproc_dir

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    target = tmp_path / "metrics"
    target.mkdir()
    (target / "counter_123.db").write_bytes(b"stale")
    assert prepare_prometheus_multiproc_dir(target) == target
    assert list(target.iterdir()) == []
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(target)
    # Never under a process that is already writing there.
    (target / "gauge_livemostrecent_1.db").write_bytes(b"live")
    with pytest.raises(RuntimeError, match="live"):
        prepare_prometheus_multiproc_dir(target)
    assert (target / "gauge_livemostrecent_1.db").exists()

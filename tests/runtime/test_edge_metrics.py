"""The per-edge families: the AR side's EdgeMetrics (to_stage) and the receiver's from_stage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from omni_runtime.observability.edge_metrics import EDGE_OUTCOMES, FAMILIES, EdgeMetrics, build_registry
from omni_runtime.observability.observers import downstream_stages
from omni_runtime.observability.receiver_metrics import ReceiverMetrics

STAGE, MODEL = "thinker", "tiny"
REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(to_stages=("talker", "vocoder")):
    registry = CollectorRegistry()
    wall, mono = Clock(5000.0), Clock(10.0)
    edges = EdgeMetrics(stage=STAGE, model_name=MODEL, to_stages=to_stages, deadline_seconds=7,
                        registry=registry, clock=wall, monotonic=mono)
    return registry, edges, wall, mono


def advance(wall: Clock, mono: Clock, seconds: float) -> None:
    wall.t += seconds
    mono.t += seconds


def value(registry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, {"stage": STAGE, "model_name": MODEL, **labels})
    assert v is not None, f"no sample {name}{labels}"
    return v


def test_every_edge_series_exists_at_zero_with_bounded_labels():
    registry, _ = build_registry(stage=STAGE, model_name=MODEL, to_stages=("talker", "vocoder"))
    label_sets = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if not sample.name.endswith("_created"):
                label_sets.setdefault(metric.name, set()).add(frozenset(set(sample.labels) - {"le"}))
    expected = {f.name.removesuffix("_total") if f.type == "counter" else f.name: {frozenset(f.labels)}
                for f in FAMILIES}
    assert label_sets == expected
    for to_stage in ("talker", "vocoder"):
        assert value(registry, "omni_kv_edge_transfers_active", to_stage=to_stage) == 0
        assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage=to_stage) == 0
        assert value(registry, "omni_kv_edge_transfers_held", to_stage=to_stage) == 0
        assert value(registry, "omni_kv_edge_held_blocks", to_stage=to_stage) == 0
        assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage=to_stage) == 0
        for outcome in EDGE_OUTCOMES:
            assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage=to_stage, outcome=outcome) == 0
            assert value(registry, "omni_kv_edge_transfer_duration_seconds_bucket", to_stage=to_stage,
                         outcome=outcome, le="+Inf") == 0
        assert value(registry, "omni_kv_edge_transfer_bytes_count", to_stage=to_stage) == 0


def test_a_fan_out_transfer_resolves_per_edge_with_its_own_duration_and_bytes():
    registry, edges, wall, mono = make()
    edges.started(("r1", 0))
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 1
    assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="vocoder") == 5000.0
    advance(wall, mono, 0.2)
    edges.resolved(("r1", 0), "talker", "acked", nbytes=4096)
    # The talker's edge is done; the vocoder's is still in flight.
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="vocoder") == 1
    advance(wall, mono, 7.5)
    edges.resolved(("r1", 0), "vocoder", "expired")
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome="acked") == 1
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="vocoder", outcome="expired") == 1
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="vocoder", outcome="acked") == 0
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_sum", to_stage="talker",
                 outcome="acked") == pytest.approx(0.2)
    # The deadline (7 s) is a bucket of its own: the expiry lands past it.
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_bucket", to_stage="vocoder",
                 outcome="expired", le="7.0") == 0
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_bucket", to_stage="vocoder",
                 outcome="expired", le="10.0") == 1
    assert value(registry, "omni_kv_edge_transfer_bytes_sum", to_stage="talker") == 4096
    assert value(registry, "omni_kv_edge_transfer_bytes_count", to_stage="vocoder") == 0
    assert edges.in_flight("talker") == edges.in_flight("vocoder") == 0


def test_a_held_transfer_is_held_on_each_edge_until_that_edge_answers():
    """A finished request's blocks stay allocated until every edge has answered: each edge
    still owing an answer counts the transfer and its blocks held, so the edge keeping them
    names itself; one that answered stops counting it."""
    registry, edges, wall, mono = make()
    edges.started(("r1", 0))
    edges.started(("r2", 0), held=(4990.0, 3))  # its request had finished before the hand-off
    advance(wall, mono, 1)
    edges.held(("r1", 0), 7)  # r1's request finishes now (5001)
    edges.held(("gone", 0), 9)  # on no edge: nothing to hold
    for to_stage in ("talker", "vocoder"):
        assert value(registry, "omni_kv_edge_transfers_held", to_stage=to_stage) == 2
        assert value(registry, "omni_kv_edge_held_blocks", to_stage=to_stage) == 10
        assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage=to_stage) == 4990.0
    edges.resolved(("r2", 0), "talker", "acked", nbytes=1)
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 1
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 7
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == 5001.0
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="vocoder") == 10
    edges.resolved_many("vocoder", [(("r1", 0), "acked", 0.5), (("r2", 0), "failed", 0.5)])
    edges.dropped(("r1", 0))  # superseded on the talker's edge
    for to_stage in ("talker", "vocoder"):
        assert value(registry, "omni_kv_edge_transfers_held", to_stage=to_stage) == 0
        assert value(registry, "omni_kv_edge_held_blocks", to_stage=to_stage) == 0
        assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage=to_stage) == 0
        assert edges.held_toward(to_stage) == edges.in_flight(to_stage) == 0


def test_the_oldest_hold_follows_finishes_in_any_order_and_the_bookkeeping_stays_bounded():
    """An edge that stopped answering holds thousands: the held blocks are a running sum and the
    oldest hold is a heap's top, so each update costs O(log n); holds reported out of order
    (a finished request handed off late carries its older finish) still give the oldest; the
    heap's entries of transfers no longer held are bounded by the ones still held."""
    registry, edges, _, _ = make(("talker",))
    n = 3000
    finish = {i: 5000.0 + (i * 7919) % n for i in range(n)}  # a permutation of 5000..7999
    for i in range(n):
        edges.started(i)
        edges.held(i, 2, at=finish[i])
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == n
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 2 * n
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == 5000.0
    by_finish = sorted(range(n), key=finish.get)
    edges.resolved(by_finish[0], "talker", "acked")  # the oldest leaves: the next one is the oldest
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == 5001.0
    keep = by_finish[1]
    edges.resolved_many("talker", [(i, "failed", 1.0) for i in by_finish[2:]])
    edge = edges._edges["talker"]
    assert len(edge.held_heap) <= 2 * len(edge.held) + 64
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == 5001.0
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 2
    edges.dropped(keep)
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == 0
    assert edge.held_heap == [] and edge.held_block_count == 0


def test_the_oldest_timestamp_moves_to_the_next_oldest_and_started_at_is_honoured():
    registry, edges, wall, mono = make(("talker",))
    edges.started("a")
    advance(wall, mono, 1)
    edges.started("b")
    edges.started("c", at=4000.0)  # handed off earlier than it was reported: now the oldest
    assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="talker") == 4000.0
    edges.resolved("c", "talker", "failed")
    assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="talker") == 5000.0
    edges.resolved("a", "talker", "acked")
    assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="talker") == 5001.0
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 1
    # The failed one's duration counts from its own start (1001 s before "now").
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_sum", to_stage="talker",
                 outcome="failed") == pytest.approx(1001.0)


def test_a_superseded_attempt_is_dropped_without_counting():
    registry, edges, _, _ = make()
    edges.started(("r", 0))
    edges.dropped(("r", 0))
    edges.started(("r", 1))
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 1
    for outcome in EDGE_OUTCOMES:
        assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome=outcome) == 0


def test_record_counts_an_edge_tracked_by_the_data_path_itself():
    registry, edges, _, _ = make()
    edges.record("vocoder", "acked", 0.05, nbytes=1 << 20)
    edges.record("vocoder", "failed", None)
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="vocoder", outcome="acked") == 1
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="vocoder", outcome="failed") == 1
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_count", to_stage="vocoder", outcome="failed") == 0
    assert value(registry, "omni_kv_edge_transfer_bytes_sum", to_stage="vocoder") == 1 << 20


def test_unknown_edges_and_outcomes_never_raise_and_never_add_series(caplog):
    registry, edges, _, _ = make(("talker",))
    before = {(s.name, tuple(sorted(s.labels.items()))) for m in registry.collect() for s in m.samples}
    edges.started("x", ["talker", "someone-else"])
    edges.resolved("x", "someone-else", "acked")
    edges.resolved("x", "talker", "vanished")
    edges.record("req-123", "acked", 1.0)  # a request id passed as a stage name
    after = {(s.name, tuple(sorted(s.labels.items()))) for m in registry.collect() for s in m.samples}
    assert {k for k, _ in before} == {k for k, _ in after} and len(before) == len(after)
    assert "someone-else" in caplog.text and "vanished" in caplog.text
    assert edges.in_flight("talker") == 1  # the bad outcome resolved nothing


def test_threads_resolving_edges_concurrently_leave_exact_counts():
    registry, edges, _, _ = make()
    n = 2000
    for i in range(n):
        edges.started(i)

    def resolve(to_stage, outcome):
        for i in range(n):
            edges.resolved(i, to_stage, outcome)

    threads = [threading.Thread(target=resolve, args=a) for a in (("talker", "acked"), ("vocoder", "failed"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome="acked") == n
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="vocoder", outcome="failed") == n
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 0


def test_downstream_stages_come_from_the_connectors_endpoints_plain_or_composed():
    plain = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"endpoints": {"talker": "tcp://a:1", "vocoder": "tcp://b:2"}}))
    composed = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"connectors": [
        {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {}},
        {"kv_connector": "OmniKVConnector", "kv_connector_extra_config": {"endpoints": {"talker": "tcp://a:1"}}},
    ]}))
    assert downstream_stages(plain) == ["talker", "vocoder"]
    assert downstream_stages(composed) == ["talker"]
    assert downstream_stages(SimpleNamespace(kv_transfer_config=None)) == []
    assert downstream_stages(None) == []


_SCHEDULER_PROCESS = textwrap.dedent("""
    from types import SimpleNamespace
    from omni_runtime.observability.observers import build_observers
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"endpoints": {"talker": "tcp://a:1", "vocoder": "tcp://b:2"}}),
        observability_config=None)
    build_observers(stage="thinker", model_name="tiny", timeout_seconds=30, vllm_config=cfg)
""")
_WORKER_PROCESS = textwrap.dedent("""
    from omni_runtime.observability.edge_metrics import EdgeMetrics
    edges = EdgeMetrics(stage="thinker", model_name="tiny", to_stages=["talker", "vocoder"], deadline_seconds=30)
    edges.started("r1")
    edges.started("r2")
    edges.resolved("r1", "talker", "acked", nbytes=8192)
    edges.resolved("r1", "vocoder", "acked", nbytes=8192)
    edges.resolved("r2", "talker", "acked", nbytes=8192)
""")


def test_series_exist_from_the_schedulers_start_and_the_data_paths_values_win(tmp_path):
    """Multiprocess mode: the scheduler's process creates every edge series at 0 at start-up;
    the data path's process (the worker) writes later, and its values are what /metrics shows."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _SCHEDULER_PROCESS], env=env, cwd=REPO, check=True, timeout=60)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="vocoder") == 0
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome="failed") == 0
    subprocess.run([sys.executable, "-c", _WORKER_PROCESS], env=env, cwd=REPO, check=True, timeout=60)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="vocoder") == 1
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="vocoder") > 0
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome="acked") == 2
    assert value(registry, "omni_kv_edge_transfer_bytes_sum", to_stage="vocoder") == 8192


# ---------------------------------------------------------------------- receiving side
def rvalue(registry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, {"stage": "talker", "model_name": MODEL, **labels})
    assert v is not None, f"no sample {name}{labels}"
    return v


def test_receiver_families_carry_from_stage_with_series_for_every_input():
    registry = CollectorRegistry()
    metrics = ReceiverMetrics(stage="talker", model_name=MODEL, from_stages=["thinker", "vision"], registry=registry)
    for src in ("thinker", "vision"):
        assert rvalue(registry, "omni_kv_received_total", from_stage=src, outcome="delivered") == 0
        assert rvalue(registry, "omni_kv_received_bytes_count", from_stage=src) == 0
    metrics.delivered(1024, from_stage="vision")
    metrics.rejected("malformed", from_stage="thinker")
    metrics.delivered(10, from_stage="req-42")  # not an input: never a label value of its own
    metrics.rejected("malformed")  # a message that named no stage
    assert rvalue(registry, "omni_kv_received_total", from_stage="vision", outcome="delivered") == 1
    assert rvalue(registry, "omni_kv_received_bytes_sum", from_stage="vision") == 1024
    assert rvalue(registry, "omni_kv_received_total", from_stage="thinker", outcome="rejected") == 1
    assert rvalue(registry, "omni_kv_received_total", from_stage="unknown", outcome="delivered") == 1
    assert rvalue(registry, "omni_kv_received_total", from_stage="unknown", outcome="rejected") == 1
    assert rvalue(registry, "omni_kv_receiver_rejected_total", reason="malformed") == 2
    values = {s.labels.get("from_stage") for m in registry.collect() for s in m.samples if "from_stage" in s.labels}
    assert values == {"thinker", "vision", "unknown"}


def test_a_receiver_with_one_input_attributes_unnamed_transfers_to_it():
    registry = CollectorRegistry()
    metrics = ReceiverMetrics(stage="talker", model_name=MODEL, from_stages=["thinker"], registry=registry)
    metrics.delivered(64)
    assert rvalue(registry, "omni_kv_received_total", from_stage="thinker", outcome="delivered") == 1
    assert registry.get_sample_value("omni_kv_received_total", {
        "stage": "talker", "model_name": MODEL, "from_stage": "unknown", "outcome": "delivered"}) is None


def test_a_receiver_without_known_inputs_counts_under_unknown_from_the_start():
    registry = CollectorRegistry()
    metrics = ReceiverMetrics(stage="talker", model_name=MODEL, registry=registry)
    assert rvalue(registry, "omni_kv_received_total", from_stage="unknown", outcome="delivered") == 0
    metrics.delivered(64, from_stage="thinker")
    assert rvalue(registry, "omni_kv_received_total", from_stage="unknown", outcome="delivered") == 1


# ---------------------------------------------------------------------- fed by the ledger (one edge)
def test_a_single_edge_follows_its_ledger_and_a_fan_out_is_left_to_the_data_path():
    from omni_runtime.observability.edge_metrics import LedgerEdgeObserver, data_path_edge_metrics
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    registry = CollectorRegistry()
    mono = Clock(100.0)
    edges = EdgeMetrics(stage=STAGE, model_name=MODEL, to_stages=["talker"], deadline_seconds=5,
                        registry=registry)
    ledger = TransferLedger(5, clock=mono, observers=[LedgerEdgeObserver(edges)])
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.mark("b", Trigger.PREFILL_FINISHED, 8, [1])
    ledger.mark("c", Trigger.PREFILL_FINISHED, 8, [2])
    ledger.resolve("c", Outcome.CANCELLED)  # before hand-off: no edge was tried
    ledger.hand_off_pending()
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 2
    oldest = value(registry, "omni_kv_edge_oldest_active_start_timestamp_seconds", to_stage="talker")
    assert oldest == pytest.approx(ledger.wall_time(100.0))
    mono.t += 0.25
    ledger.resolve("a", Outcome.ACKED)
    mono.t += 10
    assert [t.request_id for t in ledger.expire_due()] == ["b"]
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome="acked") == 1
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker", outcome="expired") == 1
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_sum", to_stage="talker",
                 outcome="acked") == pytest.approx(0.25)
    for outcome in EDGE_OUTCOMES:  # the cancelled one counted on no edge
        assert value(registry, "omni_kv_edge_transfer_duration_seconds_count", to_stage="talker",
                     outcome=outcome) == (1 if outcome in ("acked", "expired") else 0)
    # One downstream stage: the data path gets no EdgeMetrics (nothing counted twice); several: it does.
    assert data_path_edge_metrics(stage=STAGE, model_name=MODEL, endpoints={"talker": "x"},
                                  registry=CollectorRegistry()) is None
    fan_out = data_path_edge_metrics(stage=STAGE, model_name=MODEL, endpoints={"talker": "x", "vocoder": "y"},
                                     registry=CollectorRegistry())
    assert fan_out is not None and fan_out.to_stages == ("talker", "vocoder")
    with pytest.raises(ValueError):
        LedgerEdgeObserver(fan_out)


def test_a_single_edge_counts_held_from_its_ledger_whenever_the_request_finished():
    """One downstream stage: the ledger's holds are its edge's, whether the request finished
    before the hand-off (the request_finished trigger) or while the transfer was in flight."""
    from omni_runtime.observability.edge_metrics import LedgerEdgeObserver
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    registry = CollectorRegistry()
    mono = Clock(100.0)
    edges = EdgeMetrics(stage=STAGE, model_name=MODEL, to_stages=["talker"], deadline_seconds=5,
                        registry=registry)
    ledger = TransferLedger(5, clock=mono, observers=[LedgerEdgeObserver(edges)])
    ledger.mark("early", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.hand_off_pending()
    mono.t += 1
    ledger.mark("last", Trigger.REQUEST_FINISHED, 8, [1, 2])
    assert ledger.request_finished("last", 4, aborted=False)  # held while still pending
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 0  # on no edge yet
    ledger.hand_off_pending()
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 1
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 4
    mono.t += 1
    assert ledger.request_finished("early", 6, aborted=False)  # finished in flight
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 2
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 10
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == \
        pytest.approx(ledger.wall_time(101.0))
    ledger.resolve("last", Outcome.ACKED)
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 6
    ledger.resolve("early", Outcome.FAILED, "refused")
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="talker") == 0
    ledger.check_invariants()


def test_off_the_step_a_hold_is_the_edges_as_the_report_saw_it():
    """With a writer thread, which handed-off transfers are held and unresolved is read when
    the report is made: a resolution after it (reported later) does not hide the hold from
    the write of the report that saw it."""
    from omni_runtime.observability.edge_metrics import LedgerEdgeObserver
    from omni_runtime.observability.writer_thread import WriterThread
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    thread = WriterThread(what="test edges", max_delay=3600)
    registry = CollectorRegistry()
    edges = EdgeMetrics(stage=STAGE, model_name=MODEL, to_stages=["talker"], deadline_seconds=5,
                        registry=registry)
    ledger = TransferLedger(5, clock=Clock(100.0), observers=[
        LedgerEdgeObserver(edges, writer_thread=thread)])
    ledger.mark("a", Trigger.REQUEST_FINISHED, 8, [1, 2])
    assert ledger.request_finished("a", 4, aborted=False)  # held while pending
    ledger.hand_off_pending()  # reported: handed off, held
    ledger.begin_batch()
    ledger.resolve("a", Outcome.ACKED)  # after that report, not reported yet
    assert thread.flush(timeout=10)
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 1
    assert value(registry, "omni_kv_edge_held_blocks", to_stage="talker") == 4
    ledger.end_batch()
    assert ledger.flush(timeout=10)
    assert value(registry, "omni_kv_edge_transfers_held", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker",
                 outcome="acked") == 1


def test_a_report_the_thread_refuses_waits_for_the_earlier_ones_then_writes_on_the_step():
    """A writer thread that fell behind (its queue full) refuses a report: written on the
    step, it must not overtake the earlier reports still queued (a resolution before its
    hand-off would leave the transfer in flight on its edge for ever, and the gauges stale)."""
    from omni_runtime.observability.edge_metrics import LedgerEdgeObserver
    from omni_runtime.observability.metrics import TransferMetrics
    from omni_runtime.observability.writer_thread import WriterThread
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    thread = WriterThread(what="test metrics", max_queued=2, max_delay=3600)
    registry = CollectorRegistry()
    edges = EdgeMetrics(stage=STAGE, model_name=MODEL, to_stages=["talker"], deadline_seconds=5,
                        registry=registry)
    metrics = TransferMetrics(stage=STAGE, model_name=MODEL, deadline_seconds=5,
                              registry=registry, writer_thread=thread)
    ledger = TransferLedger(5, clock=Clock(100.0), observers=[
        metrics, LedgerEdgeObserver(edges, writer_thread=thread)])
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])  # two reports queued (unkicked)
    ledger.hand_off_pending()  # refused: the queue is full
    assert thread.dropped > 0
    ledger.resolve("a", Outcome.ACKED)  # refused too
    assert edges.in_flight("talker") == 0  # the step waited for the queue, then wrote in order
    assert value(registry, "omni_kv_edge_transfers_active", to_stage="talker") == 0
    assert value(registry, "omni_kv_edge_transfers_resolved_total", to_stage="talker",
                 outcome="acked") == 1
    assert ledger.flush(timeout=10)
    for state in ("pending", "active", "held"):
        assert registry.get_sample_value("omni_kv_transfers", {
            "stage": STAGE, "model_name": MODEL, "state": state}) == 0
    assert registry.get_sample_value("omni_kv_transfers_resolved_total", {
        "stage": STAGE, "model_name": MODEL, "outcome": "acked"}) == 1


def test_build_observers_feeds_a_single_edge_from_the_ledger_only():
    from omni_runtime.observability.edge_metrics import LedgerEdgeObserver
    from omni_runtime.observability.metrics import TransferMetrics
    from omni_runtime.observability.observers import build_observers
    from omni_runtime.observability.writer_thread import metrics_thread

    def config(endpoints):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"endpoints": endpoints}),
                               observability_config=None)

    one = build_observers(stage="s1", model_name="m", timeout_seconds=5, vllm_config=config({"talker": "tcp://a:1"}))
    assert [type(o) for o in one] == [TransferMetrics, LedgerEdgeObserver]
    # A stage's reports are written off the step, by the process's metrics thread.
    assert all(o._writer_thread is metrics_thread() for o in one)
    two = build_observers(stage="s2", model_name="m", timeout_seconds=5,
                          vllm_config=config({"talker": "tcp://a:1", "vocoder": "tcp://b:1"}))
    assert [type(o) for o in two] == [TransferMetrics]


def test_edge_bytes_observer_records_bytes_only():
    from omni_runtime.observability.edge_metrics import edge_bytes_observer

    registry = CollectorRegistry()
    EdgeMetrics(stage=STAGE, model_name=MODEL, to_stages=["talker"], deadline_seconds=9, registry=registry)
    edge_bytes_observer(stage=STAGE, model_name=MODEL, to_stage="talker", registry=registry)(4096)
    assert value(registry, "omni_kv_edge_transfer_bytes_sum", to_stage="talker") == 4096
    # The families were reused (the deadline's bucket is still there), not re-registered.
    assert value(registry, "omni_kv_edge_transfer_duration_seconds_bucket", to_stage="talker",
                 outcome="acked", le="9.0") == 0


def test_a_receiving_stage_config_names_its_inputs_for_from_stage():
    """The stage config the operator renders gives a receiving stage its inputs: the
    from_stage values ReceiverMetrics(from_stages=config.inputs) creates series for."""
    import yaml

    from omni_operator.local.run import local_stage_configs
    from omni_operator.pipeline.model import parse_pipeline
    from omni_operator.pipeline.stage_config import dump_stage_config
    from omni_runtime.stages.config import StageConfigError, parse_stage_config

    body = {"apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"image": "i", "model": {"name": "m"}, "stages": [
                {"name": "thinker", "role": "ar", "kvTransfer": {"send": True}},
                {"name": "vision", "role": "ar", "kvTransfer": {"send": True}},
                {"name": "talker", "role": "generation", "inputs": ["thinker", "vision"]}]}}
    ports = {s: {"http": 1, "kv": 2} for s in ("thinker", "vision", "talker")}
    configs = local_stage_configs(parse_pipeline(body), ports)
    talker = parse_stage_config(yaml.safe_load(dump_stage_config(configs["talker"])))
    assert talker.inputs == ("thinker", "vision")
    assert parse_stage_config(yaml.safe_load(dump_stage_config(configs["thinker"]))).inputs == ()
    registry = CollectorRegistry()
    ReceiverMetrics(stage=talker.stage, model_name=talker.model_name, from_stages=talker.inputs, registry=registry)
    assert {s.labels["from_stage"] for m in registry.collect() for s in m.samples
            if "from_stage" in s.labels} == {"thinker", "vision"}
    with pytest.raises(StageConfigError, match="inputs"):
        parse_stage_config({**configs["talker"], "inputs": ["thinker", 3]})

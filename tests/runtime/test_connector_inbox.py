"""KVInbox alone: storing, consuming by request id with a timeout, the memory bound (new
payloads refused, stored ones kept), TTL expiry and replacement (counted), gauges."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from omni_runtime.kv.transport import InboxFull, KVInbox, KVPayload
from omni_runtime.observability.receiver_metrics import ReceiverMetrics

STAGE = "talker"


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def payload(rid: str, seq_len: int = 4) -> KVPayload:
    # 2 * 2 * 1 * seq_len * 8 float32 = 128 * seq_len bytes
    return KVPayload(rid, seq_len, np.full((2, 2, 1, seq_len, 8), 1.5, np.float32),
                     from_stage="ar")


def sample(registry, name, **labels):
    v = registry.get_sample_value(name, {"stage": STAGE, "model_name": "", **labels})
    assert v is not None, name
    return v


@pytest.fixture
def setup():
    registry = CollectorRegistry()
    metrics = ReceiverMetrics(stage=STAGE, registry=registry)
    clock = FakeClock()
    inbox = KVInbox(max_bytes=1024, ttl_s=10, clock=clock)
    inbox.bind_metrics(metrics)
    return inbox, clock, registry


def test_get_consumes_and_frees(setup):
    inbox, _, registry = setup
    inbox.put(payload("a"))
    assert len(inbox) == 1 and inbox.bytes == 512 and "a" in inbox
    assert sample(registry, "omni_kv_receiver_buffered_payloads") == 1
    assert sample(registry, "omni_kv_receiver_buffered_bytes") == 512
    assert inbox.get("a", remove=False).request_id == "a"  # peek
    got = inbox.get("a")
    assert got.request_id == "a" and got.received_at is not None
    assert len(inbox) == 0 and inbox.bytes == 0 and inbox.get("a") is None
    assert sample(registry, "omni_kv_receiver_buffered_bytes") == 0
    assert sample(registry, "omni_kv_receiver_wait_seconds_count", outcome="found") == 2
    assert sample(registry, "omni_kv_receiver_wait_seconds_count", outcome="timeout") == 1


def test_full_inbox_refuses_the_new_payload_and_keeps_the_stored_ones(setup):
    inbox, _, registry = setup
    inbox.put(payload("a"))  # 512
    inbox.put(payload("b", 3))  # 384 -> 896
    with pytest.raises(InboxFull, match="do not fit"):
        inbox.put(payload("c", 2))  # 256 -> 1152 > 1024
    assert [s["request_id"] for s in inbox.list()] == ["a", "b"]
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="expired") == 0
    inbox.get("a")
    inbox.put(payload("c", 2))  # fits now
    assert inbox.bytes == 640


def test_a_payload_larger_than_the_whole_inbox_is_refused(setup):
    inbox, _, _ = setup
    with pytest.raises(InboxFull):
        inbox.put(payload("huge", 9))  # 1152 bytes
    assert len(inbox) == 0


def test_same_request_replaces_the_stored_payload_and_counts_it(setup):
    inbox, _, registry = setup
    inbox.put(payload("a", 4))
    inbox.put(payload("a", 6))  # 768: fits because the old 512 are freed
    assert inbox.bytes == 768 and inbox.get("a").seq_len == 6
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="replaced") == 1


def test_ttl_expires_oldest_first_and_counts_each(setup):
    inbox, clock, registry = setup
    inbox.put(payload("a", 1))
    clock.t += 6
    inbox.put(payload("b", 1))
    assert inbox.next_expiry_in() == pytest.approx(4)
    clock.t += 4  # "a" is 10 s old
    assert inbox.expire() == 1
    assert [s["request_id"] for s in inbox.list()] == ["b"]
    clock.t += 6
    assert inbox.get("b") is None  # expired on access too
    assert inbox.next_expiry_in() is None and inbox.bytes == 0
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="expired") == 2


def test_list_summaries_have_the_documented_fields(setup):
    inbox, _, _ = setup
    inbox.put(payload("a", 2))
    (s,) = inbox.list()
    assert s == {"request_id": "a", "external_request_id": None, "seq_len": 2, "bytes": 256, "dtype": "float32",
                 "shape": [2, 2, 1, 2, 8], "received_at": s["received_at"], "from_stage": "ar",
                 "pipeline": ""}
    assert abs(s["received_at"] - time.time()) < 60


def test_get_times_out_with_none_after_waiting_its_timeout():
    inbox = KVInbox(max_bytes=1024)
    start = time.monotonic()
    assert inbox.get("missing", timeout_s=0.2) is None
    assert time.monotonic() - start >= 0.2


def test_get_wakes_when_the_payload_arrives_from_another_thread():
    inbox = KVInbox(max_bytes=4096)
    result: list = []
    started = threading.Event()

    def consumer():
        started.set()
        result.append(inbox.get("late", timeout_s=30))

    t = threading.Thread(target=consumer)
    t.start()
    try:
        assert started.wait(10)
        inbox.put(payload("other"))  # wakes the waiter, which goes back to waiting
        inbox.put(payload("late"))
        t.join(10)
        assert not t.is_alive()
        assert result[0] is not None and result[0].request_id == "late"
        assert "other" in inbox
    finally:
        inbox.put(payload("late"))  # never leave the thread waiting 30 s
        t.join(10)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        KVInbox(max_bytes=0)
    with pytest.raises(ValueError):
        KVInbox(ttl_s=0)

"""KVInbox alone: storing, consuming by request id with a timeout, the memory bound (new
payloads refused, stored ones kept), TTL expiry and replacement (counted), gauges."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from omni_runtime.kv.transport import InboxFull, KVInbox, KVPayload
from omni_runtime.kv.transport.protocol import Rejected
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
                 "pipeline": "", "token_ids": [], "prompt_len": 0}
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


# ---------------------------------------------------------------------- tensor-parallel shards


def shards(rid: str, num_shards: int = 2, *, seq_len: int = 4, attempt: int = 0,
           heads_per_shard: int = 1) -> tuple[np.ndarray, list[KVPayload]]:
    """A whole KV array and its KV-head shards, as the ranks ship them."""
    heads = heads_per_shard * num_shards
    whole = np.arange(2 * 2 * heads * seq_len * 8, dtype=np.float32).reshape(2, 2, heads, seq_len, 8)
    parts = [KVPayload(rid, seq_len, np.ascontiguousarray(
                 whole[:, :, i * heads_per_shard:(i + 1) * heads_per_shard]),
                 from_stage="ar", extra={"attempt": attempt}, shard=i, num_shards=num_shards)
             for i in range(num_shards)]
    return whole, parts


def test_shards_are_assembled_and_delivered_only_when_every_one_is_stored(setup):
    inbox, _, registry = setup
    whole, (s0, s1) = shards("t")
    inbox.put(s1)  # ranks answer in any order
    assert "t" not in inbox and inbox.get("t") is None, "a partial transfer is never seen"
    assert inbox.bytes == whole.nbytes, "the first shard reserves the whole payload"
    assert sample(registry, "omni_kv_receiver_buffered_payloads") == 0
    got = []
    waiter = threading.Thread(target=lambda: got.append(inbox.get("t", timeout_s=10)))
    waiter.start()
    inbox.put(s0)
    waiter.join(10)
    (payload,) = got
    assert (payload.shard, payload.num_shards, payload.seq_len) == (0, 1, 4)
    np.testing.assert_array_equal(payload.kv, whole)
    assert payload.extra == {"attempt": 0} and payload.from_stage == "ar"
    assert inbox.bytes == 0 and len(inbox) == 0


def test_a_resent_shard_overwrites_its_slice_and_a_mismatched_one_is_refused(setup):
    inbox, _, _ = setup
    whole, (s0, s1) = shards("t")
    inbox.put(s0)
    inbox.put(s0)  # a resend (a reconnect): still one shard of two
    assert "t" not in inbox
    _, (other0, _) = shards("t", seq_len=3)
    wrong = KVPayload("t", 3, other0.kv, from_stage="ar", extra={"attempt": 0}, shard=1,
                      num_shards=2)
    with pytest.raises(Rejected) as e:
        inbox.put(wrong)
    assert e.value.code == "shard_mismatch" and "shape (2, 2, 1, 3, 8)" in e.value.reason
    inbox.put(s1)
    np.testing.assert_array_equal(inbox.get("t").kv, whole)


def test_a_newer_attempt_supersedes_an_unfinished_older_one(setup):
    inbox, _, registry = setup
    _, (old0, old1) = shards("t", attempt=1)
    newer, (new0, new1) = shards("t", attempt=2)
    inbox.put(old0)
    inbox.put(new1)  # the older attempt's assembly goes: it fits again
    with pytest.raises(Rejected, match="attempt 2 supersedes it") as e:
        inbox.put(old1)  # a late shard of the older attempt
    assert e.value.code == "shard_mismatch"
    inbox.put(new0)
    np.testing.assert_array_equal(inbox.get("t", remove=False).kv, newer)
    assert inbox.bytes == newer.nbytes, "the older attempt's reservation is released"
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="replaced") == 1


def test_the_first_shard_is_refused_when_the_whole_payload_does_not_fit(setup):
    inbox, _, _ = setup  # 1024 bytes
    whole, (s0, _) = shards("big", seq_len=4, heads_per_shard=2)  # 1024 bytes assembled
    inbox.put(payload("a", seq_len=1))  # 128 bytes
    with pytest.raises(InboxFull):
        inbox.put(s0)
    assert inbox.bytes == 128


def test_an_assembly_whose_shards_never_all_come_expires_and_is_counted(setup):
    inbox, clock, registry = setup
    whole, (s0, _) = shards("t")
    inbox.put(s0)
    assert inbox.next_expiry_in() == 10
    clock.t += 10
    assert inbox.expire() == 1
    assert inbox.bytes == 0
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="expired") == 1


def test_has_room_answers_as_put_would(setup):
    """What the receiver asks before it reads a transfer: the room a started assembly
    reserved and the bytes a replaced payload frees count (put() is the authority)."""
    inbox, _, _ = setup  # 1024 bytes
    inbox.put(payload("a", seq_len=6))  # 768 bytes
    assert inbox.has_room("a", 0, 1, 1024) is True  # replaces a: fits alone
    assert inbox.has_room("b", 0, 1, 257) is False
    assert inbox.has_room("b", 0, 1, 256) is True
    inbox.get("a")
    whole, (s0, s1) = shards("t")  # 512 bytes a shard, 1024 assembled
    assert inbox.has_room("t", 0, 2, s0.nbytes) is True
    inbox.put(s0)  # reserves 1024: full
    assert inbox.has_room("t", 0, 2, s1.nbytes) is True  # in its own reservation
    assert inbox.has_room("t", 1, 2, s1.nbytes) is False  # another attempt has none
    assert inbox.has_room("u", 0, 1, 1) is False
    inbox.put(s1)
    np.testing.assert_array_equal(inbox.get("t").kv, whole)


def test_a_refused_shard_ends_its_attempt_its_assembly_goes_and_later_shards_are_refused(setup):
    """The receiver refused shard 1 (its rank withdrew the transfer, or its read failed)
    after shard 0 was stored: the assembly goes at once, its room back, counted; shard 1 of
    the same attempt, committed later all the same, is refused: nothing is ever assembled
    from an attempt a rank failed or withdrew. A newer attempt assembles as usual."""
    inbox, clock, registry = setup
    _, (s0, s1) = shards("t", attempt=3)
    inbox.put(s0)
    assert inbox.bytes == 1024
    inbox.abandon("t", 3, 2, "deadline: the sender aborted the read")
    assert inbox.bytes == 0 and "t" not in inbox
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="abandoned") == 1
    assert "another shard of this attempt was refused (deadline" in inbox.abandoned("t", 3, 2, 1)
    with pytest.raises(Rejected) as e:
        inbox.put(s1)
    assert e.value.code == "shard_mismatch" and "cannot be assembled" in e.value.reason
    assert inbox.bytes == 0 and "t" not in inbox
    assert inbox.abandoned("t", 4, 2, 0) is None, "another attempt is not ended"
    whole, (n0, n1) = shards("t", attempt=4)
    inbox.put(n1)
    inbox.put(n0)
    np.testing.assert_array_equal(inbox.get("t").kv, whole)
    inbox.abandon("whole", 0, 1, "x")  # a transfer of one shard has nothing to end
    assert inbox.abandoned("whole", 0, 1, 0) is None


def test_ended_attempts_are_remembered_for_the_ttl_and_at_most_max_abandoned(setup,
                                                                              monkeypatch):
    from omni_runtime.kv.transport import inbox as inbox_module

    inbox, clock, _ = setup
    monkeypatch.setattr(inbox_module, "MAX_ABANDONED", 3)
    for i in range(5):
        inbox.abandon(f"r{i}", 0, 2, "x")
    assert [inbox.abandoned(f"r{i}", 0, 2, 0) is not None for i in range(5)] == [
        False, False, True, True, True], "the oldest forgotten first"
    clock.t += 10
    assert all(inbox.abandoned(f"r{i}", 0, 2, 0) is None for i in range(5)), "the TTL"
    assert not inbox._abandoned

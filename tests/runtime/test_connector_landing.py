"""A host receiver's reads land in the payload's own registered memory (landing.py), and
the payload is assembled when a consumer takes it: the ack waits for the bytes, not for the
layout conversion. Real NIXL agents (UCX over this machine's shared memory) throughout."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from omni_runtime.kv.transport.landing import LandingPool
from omni_runtime.kv.transport.nixl_agent import KVAgent

from transport_fixtures import (  # noqa: F401  (fixtures)
    STAGE,
    ar,
    collect,
    make_ar,
    make_receiver,
    make_sender,
    registry,
    rejected_counts,
)


def test_the_ack_leaves_the_payload_as_read_and_get_assembles_it(make_receiver, ar,
                                                                  make_sender):
    receiver = make_receiver()
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("req-1", [5, 6, 9], 10))
    assert collect(sender, 1) == (["req-1"], {})
    stored = receiver.inbox._entries["req-1"].payload  # acked: stored, not assembled yet
    assert stored.kv is None and stored.staged is not None
    assert stored.shape == (2, 2, 2, 10, 8) and stored.nbytes == 2 * 2 * 2 * 10 * 8 * 4
    assert receiver.inbox.list()[0]["shape"] == [2, 2, 2, 10, 8]
    assert receiver.assemble_seconds == 0.0  # nothing assembled on the receiver's thread
    got = receiver.inbox.get("req-1")
    assert got is stored and got.staged is None
    np.testing.assert_array_equal(got.kv, ar.expected([5, 6, 9], 10))


def test_a_consumed_payload_gives_its_landing_memory_back_for_the_next_read(
        make_receiver, ar, make_sender):
    receiver = make_receiver()
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("first", [1, 2], 8))
    assert collect(sender, 1) == (["first"], {})
    receiver.inbox.get("first")  # assembled: the bytes as read are let go, the slab back
    assert receiver._landing.registered == 1
    sender.submit(ar.offer("second", [3, 4], 8))
    assert collect(sender, 1) == (["second"], {})
    assert (receiver._landing.registered, receiver._landing.reused) == (1, 1)
    np.testing.assert_array_equal(receiver.inbox.get("second").kv, ar.expected([3, 4], 8))


def test_a_payload_still_in_the_inbox_keeps_its_memory(make_receiver, ar, make_sender):
    receiver = make_receiver()
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("kept", [1, 2], 8))
    sender.submit(ar.offer("other", [3, 4], 8))
    assert sorted(collect(sender, 2)[0]) == ["kept", "other"]
    assert (receiver._landing.registered, receiver._landing.reused) == (2, 0)
    np.testing.assert_array_equal(receiver.inbox.get("kept").kv, ar.expected([1, 2], 8))
    np.testing.assert_array_equal(receiver.inbox.get("other").kv, ar.expected([3, 4], 8))


def test_readers_of_one_stored_payload_share_one_assembly(make_receiver, ar, make_sender):
    receiver = make_receiver()
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("peeked", [0, 7], 6))
    assert collect(sender, 1) == (["peeked"], {})
    calls = []
    staged = receiver.inbox._entries["peeked"].payload.staged
    into = staged.into
    staged.into = lambda out: (calls.append(1), into(out))
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(
        receiver.inbox.get("peeked", remove=False).kv)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(g is got[0] for g in got)
    np.testing.assert_array_equal(got[0], ar.expected([0, 7], 6))


def test_memory_it_cannot_register_refuses_that_transfer_and_the_receiver_serves_on(
        make_receiver, ar, make_sender, registry):
    receiver = make_receiver()
    take = receiver._landing.take

    def refused(nbytes):  # as NIXL refuses memory it cannot register (a memlock limit)
        raise RuntimeError("registering 1 DRAM regions failed")

    receiver._landing.take = refused
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("refused", [1, 2], 8))
    acked, failed = collect(sender, 1)
    assert acked == [] and "inbox_full" in failed["refused"]
    assert "registering" in failed["refused"] and rejected_counts(registry) == {"inbox_full": 1}
    assert "refused" not in receiver.inbox and receiver._staging.available == receiver.slots
    receiver._landing.take = take
    sender.submit(ar.offer("after", [3, 4], 8))
    assert collect(sender, 1) == (["after"], {})
    np.testing.assert_array_equal(receiver.inbox.get("after").kv, ar.expected([3, 4], 8))


@pytest.fixture
def agent():
    a = KVAgent("landing-test")
    yield a
    a.close()


def test_the_pool_keeps_at_most_max_free_bytes_registered(agent):
    pool = LandingPool(agent, max_free_bytes=3 << 20)
    (_, a), (_, b) = pool.take(2 << 20), pool.take(2 << 20)
    assert pool.registered == 2
    del a, b
    pool.collect()  # 4 MiB came back; 3 MiB may stay: one slab is unmapped
    assert pool.free_bytes == 2 << 20 and len(agent._registrations) == 1
    _, c = pool.take(2 << 20)
    assert (pool.registered, pool.reused) == (2, 1)
    pool.close()  # c's slab is in use: it stays mapped (the agent's close deregisters it)
    c[:] = 1
    assert len(agent._registrations) == 1


def test_a_slab_larger_than_twice_the_request_is_not_handed_out(agent):
    pool = LandingPool(agent, max_free_bytes=64 << 20)
    _, big = pool.take(16 << 20)
    del big
    _, small = pool.take(4 << 20)
    assert (pool.registered, pool.reused) == (2, 0)
    assert small.nbytes == 4 << 20


def test_a_retired_slab_is_never_handed_out_again(agent):
    pool = LandingPool(agent, max_free_bytes=64 << 20)
    slab, array = pool.take(2 << 20)
    pool.retire(slab)  # a read into it could not be released
    del array
    pool.collect()
    assert pool.free_bytes == 0
    other, _ = pool.take(2 << 20)
    assert other is not slab and pool.registered == 2


def test_the_free_slabs_hand_out_the_smallest_that_fits_within_twice_the_size():
    """The re-use rule both of the transport's pools keep (payload memory, landing memory)."""
    from omni_runtime.kv.transport.memory import FreeSlabs

    free = FreeSlabs()
    for size, name in ((8, "eight"), (3, "three"), (5, "five"), (20, "twenty")):
        free.put(size, name)
    assert free.bytes == 36
    assert free.take(4) == "five"       # 3 is too small; 5 is the smallest that fits
    assert free.take(4) == "eight"      # 8 <= 2 x 4
    assert free.take(4) is None         # 20 > 2 x 4: kept for a larger request
    assert free.take(11) == "twenty"
    assert free.bytes == 3
    assert free.pop_largest() == "three" and free.pop_largest() is None and free.bytes == 0

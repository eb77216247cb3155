"""A downstream stage with several replicas: a real sender and real receivers (NIXL agents,
ZeroMQ), the receivers on 127.0.0.2 and 127.0.0.3 at one port, as a headless Service's pods
are at theirs. There is no DNS server here: the name's answers come from the sender's
``resolve`` hook (a stand-in for getaddrinfo of a headless Service's name), which the tests
change as a scale-out or scale-in would; everything else is the real transport."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from omni_runtime.kv.transport.sender import (ChunkOffer, KVSender, _weight, resolve_replicas,
                                              split_address)

from transport_fixtures import (  # noqa: F401  (fixtures)
    STAGE,
    WAIT,
    ar,
    collect,
    make_ar,
    make_receiver,
    make_sender,
    registry,
)

NAME = f"tcp://{STAGE}.ns.svc:{{port}}"
HOSTS = ("127.0.0.2", "127.0.0.3")


def _port_free_on_both() -> int:
    for _ in range(50):
        probe = socket.socket()
        probe.bind((HOSTS[0], 0))
        port = probe.getsockname()[1]
        try:
            other = socket.socket()
            other.bind((HOSTS[1], port))
            other.close()
            return port
        except OSError:
            continue
        finally:
            probe.close()
    raise RuntimeError("no port free on both addresses")


class Names:
    """The answers of the stage's name: a list the test changes."""

    def __init__(self, replicas: list[str]):
        self.replicas = list(replicas)
        self.asked = 0

    def __call__(self, address: str) -> list[str]:
        self.asked += 1
        if not self.replicas:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.replicas)


class Accepting:
    """A replica's stream consumer: takes every chunk, records (request id, seq)."""

    def __init__(self):
        self.receiver = None
        self.got = []

    def __call__(self, message, ticket):
        if getattr(message, "outcome", None) is not None:  # an early end
            return
        self.got.append((message.request_id, message.seq))
        self.receiver.settle(ticket, None)


@pytest.fixture
def replicas(make_receiver):
    """Two receivers of one stage at one port, on two addresses: (the receivers, their
    addresses, the port, their stream consumers)."""
    port = _port_free_on_both()
    receivers, consumers = [], []
    for host in HOSTS:
        consumer = Accepting()
        consumer.receiver = make_receiver(f"tcp://{host}:{port}", streams=consumer)
        receivers.append(consumer.receiver)
        consumers.append(consumer)
    return receivers, [f"tcp://{host}:{port}" for host in HOSTS], port, consumers


def wait_for(predicate, what, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def where(receivers, rid):
    return [i for i, r in enumerate(receivers) if rid in r.inbox]


def test_an_ip_is_its_one_replica_and_a_name_resolves_to_each_address():
    assert resolve_replicas("tcp://127.0.0.1:9600") == ["tcp://127.0.0.1:9600"]
    assert resolve_replicas("tcp://[::1]:9600") == ["tcp://[::1]:9600"]
    assert resolve_replicas("tcp://localhost:9600")[0] in ("tcp://127.0.0.1:9600",
                                                           "tcp://[::1]:9600")
    assert split_address("tcp://[::1]:9600") == ("::1", 9600)
    with pytest.raises(OSError):
        resolve_replicas("tcp://no-such-name.invalid:9600")
    for bad in ("tcp://talker", "talker:0", "tcp://:9600", "tcp://talker:http"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            split_address(bad)


def test_a_malformed_address_is_refused_at_once_naming_it(ar):
    with pytest.raises(ValueError, match="'tcp://talker'"):
        KVSender({STAGE: "tcp://talker"}, hello=ar.hello, agent=ar.agent)


def test_requests_spread_over_the_replicas_each_where_rendezvous_hashing_puts_it(
        replicas, ar, make_sender):
    receivers, addresses, port, consumers = replicas
    names = Names(addresses)
    sender = make_sender(ar, {STAGE: NAME.format(port=port)}, resolve=names)
    rids = [f"r{i}" for i in range(16)]
    for i, rid in enumerate(rids):
        sender.submit(ar.offer(rid, [i % 8 + 1], 4))
    assert collect(sender, len(rids)) == (sorted(rids), {})
    for rid in rids:
        chosen = max(range(2), key=lambda i: _weight(rid, addresses[i]))
        assert where(receivers, rid) == [chosen], rid
    assert all(len(r.inbox) for r in receivers), "both replicas took requests"
    assert sender.replicas() == {STAGE: addresses}


def test_every_tensor_parallel_rank_sends_its_shard_to_the_same_replica(
        replicas, make_ar, make_sender):
    receivers, addresses, port, consumers = replicas
    ranks = [make_ar(heads=2, shard=r, num_shards=2, seed=40 + r) for r in range(2)]
    senders = [make_sender(a, {STAGE: NAME.format(port=port)}, resolve=Names(addresses))
               for a in ranks]
    rids = [f"tp{i}" for i in range(8)]
    for sender, rank in zip(senders, ranks):
        for i, rid in enumerate(rids):
            sender.submit(rank.offer(rid, [i + 1], 4))
    for sender in senders:
        assert collect(sender, len(rids)) == (sorted(rids), {})
    for i, rid in enumerate(rids):
        [at] = where(receivers, rid)  # whole, at one replica
        got = receivers[at].inbox.get(rid)
        want = np.concatenate([ranks[r].expected([i + 1], 4) for r in (0, 1)], axis=2)
        assert np.array_equal(got.kv, want), rid


def test_a_stream_stays_on_its_replica_through_a_scale_in_and_new_ones_go_elsewhere(
        replicas, ar, make_sender):
    receivers, addresses, port, consumers = replicas
    names = Names(addresses)
    sender = make_sender(ar, {STAGE: NAME.format(port=port)}, resolve=names,
                         resolve_interval_s=0.05)
    sender.submit_chunk(ChunkOffer("s", 0, token_ids=(1, 2)), STAGE, timeout_s=WAIT)
    wait_for(lambda: sender.poll_chunks() or None, "the first chunk's ack")
    [home] = [i for i, c in enumerate(consumers) if ("s", 0) in c.got]
    # The stream's replica is scaled in (no longer resolved): it takes no new request, the
    # stream goes on there to its last chunk.
    names.replicas = [addresses[1 - home]]
    wait_for(lambda: sender.replicas()[STAGE] == [addresses[1 - home]], "the re-resolution")
    sender.submit_chunk(ChunkOffer("s", 1, token_ids=(3,)), STAGE, timeout_s=WAIT)
    sender.submit_chunk(ChunkOffer("s", 2, last=True, token_ids=(4,)), STAGE, timeout_s=WAIT)
    answers = []
    wait_for(lambda: answers.extend(sender.poll_chunks()) or len(answers) == 2,
             "the stream's last chunks")
    assert sorted(answers) == [("s", STAGE, 1, None), ("s", STAGE, 2, None)]
    assert consumers[home].got == [("s", 0), ("s", 1), ("s", 2)]
    assert consumers[1 - home].got == []
    rids = [f"after{i}" for i in range(6)]
    for i, rid in enumerate(rids):
        sender.submit(ar.offer(rid, [i + 1], 4))
    assert collect(sender, len(rids)) == (sorted(rids), {})
    assert all(where(receivers, rid) == [1 - home] for rid in rids)
    # The scaled-in replica, its stream over, is closed: its agent is unloaded from the AR's.
    wait_for(lambda: ar.agent.remotes == {receivers[1 - home]._agent.name},
             "the scaled-in replica's agent unloaded")
    # Scaled out again: both take new requests.
    names.replicas = list(addresses)
    wait_for(lambda: sender.replicas()[STAGE] == addresses, "the scale-out")
    rids = [f"again{i}" for i in range(16)]
    for i, rid in enumerate(rids):
        sender.submit(ar.offer(rid, [i % 8 + 1], 4))
    assert collect(sender, len(rids)) == (sorted(rids), {})
    assert {tuple(where(receivers, rid)) for rid in rids} == {(0,), (1,)}


def test_a_name_that_resolves_late_delivers_and_one_that_never_does_fails_naming_it(
        replicas, ar, make_sender):
    receivers, addresses, port, consumers = replicas
    names = Names([])
    sender = make_sender(ar, {STAGE: NAME.format(port=port)}, resolve=names,
                         resolve_interval_s=0.05)
    sender.submit(ar.offer("early", [1], 4))
    wait_for(lambda: names.asked >= 2, "a second look at the name")
    names.replicas = addresses[:1]
    assert collect(sender, 1) == (["early"], {})
    assert where(receivers, "early") == [0]
    sender.close()  # one sender an agent
    nowhere = make_sender(ar, {STAGE: NAME.format(port=port)}, resolve=Names([]),
                          resolve_interval_s=0.05)
    nowhere.submit(ar.offer("lost", [1], 4), timeout_s=0.5)
    acked, failed = collect(nowhere, 1)
    assert acked == [] and "resolved to no replica" in failed["lost"], failed
    assert STAGE in failed["lost"] and "Name or service not known" in failed["lost"]


class Stopping:
    """A replica that is stopping: it refuses every whole hand-off and every new stream's
    first chunk with ``stopping``, as a stage does after SIGTERM."""

    def __init__(self):
        self.receiver = None
        self.refused = 0

    def __call__(self, message, ticket):
        if ticket is None:
            return
        self.refused += 1
        self.receiver.settle(ticket, ("stopping", "stage talker is stopping"))


def test_a_replica_that_is_stopping_sends_its_new_work_to_the_others(make_receiver, ar,
                                                                      make_sender):
    port = _port_free_on_both()
    stopping, taking = Stopping(), Accepting()
    stopping.receiver = make_receiver(f"tcp://{HOSTS[0]}:{port}", consumer=stopping,
                                      streams=stopping)
    taking.receiver = make_receiver(f"tcp://{HOSTS[1]}:{port}", streams=taking)
    addresses = [f"tcp://{host}:{port}" for host in HOSTS]
    names = Names(addresses)
    sender = make_sender(ar, {STAGE: NAME.format(port=port)}, resolve=names,
                         resolve_interval_s=0.05)
    rids = [f"w{i}" for i in range(12)]
    for i, rid in enumerate(rids):
        sender.submit(ar.offer(rid, [i % 8 + 1], 4))
    assert collect(sender, len(rids)) == (sorted(rids), {})  # none lost
    assert all(rid in taking.receiver.inbox for rid in rids)
    # After its first refusal it is sent nothing new (it refused one at most per request
    # in flight when it said so).
    refused = stopping.refused
    assert 1 <= refused
    for i in range(6):  # new streams begin at the replica that takes them
        sender.submit_chunk(ChunkOffer(f"s{i}", 0, token_ids=(i,)), STAGE, timeout_s=WAIT)
    answers = []
    wait_for(lambda: answers.extend(sender.poll_chunks()) or len(answers) == 6, "6 chunks")
    assert all(why is None for *_, why in answers), answers
    assert sorted(taking.got) == sorted((f"s{i}", 0) for i in range(6))
    assert stopping.refused == refused
    # The stopping replica alone: a new transfer is refused at once, naming why, not kept
    # waiting for a replica to its deadline.
    names.replicas = addresses[:1]
    wait_for(lambda: sender.replicas()[STAGE] == addresses[:1], "the scale-in")
    began = time.monotonic()
    sender.submit(ar.offer("alone", [1], 4), timeout_s=60)
    acked, failed = collect(sender, 1, timeout=60)
    assert acked == [] and "stopping: stage talker is stopping" in failed["alone"], failed
    assert time.monotonic() - began < 30, "it waited for its deadline"


class Holding:
    """A replica's consumer that holds every payload's ticket until told (its transfers stay
    in flight)."""

    def __init__(self):
        self.receiver = None
        self.tickets = []

    def __call__(self, payload, ticket):
        self.tickets.append(ticket)

    def settle_all(self):
        for ticket in self.tickets:
            self.receiver.settle(ticket)
        self.tickets.clear()


def hashed_to(address, other, n, prefix):
    """``n`` request ids that rendezvous hashing puts at ``address`` rather than ``other``."""
    found, i = [], 0
    while len(found) < n:
        rid = f"{prefix}{i}"
        i += 1
        if _weight(rid, address) > _weight(rid, other):
            found.append(rid)
    return found


def test_a_replica_scaled_in_gives_its_queued_hand_offs_to_the_others_and_its_lost_ones_too(
        make_receiver, ar, make_sender):
    """Replica A holds one transfer in flight (its consumer has not answered) and more are
    queued behind it (one in flight at a time). Scaled in (no longer resolved): the queued
    ones go to B at once, the one in flight stays A's and is answered there. Then A holds
    another and its connection is lost for good: that one goes to B too. Nothing is lost."""
    port = _port_free_on_both()
    held = Holding()
    held.receiver = make_receiver(f"tcp://{HOSTS[0]}:{port}", consumer=held)
    other = make_receiver(f"tcp://{HOSTS[1]}:{port}")
    a, b = (f"tcp://{host}:{port}" for host in HOSTS)
    names = Names([a, b])
    sender = make_sender(ar, {STAGE: NAME.format(port=port)}, resolve=names,
                         resolve_interval_s=0.05, max_in_flight=1)
    first, *queued = hashed_to(a, b, 4, "q")
    for i, rid in enumerate([first, *queued]):
        sender.submit(ar.offer(rid, [i + 1], 4), timeout_s=60)
    wait_for(lambda: len(held.tickets) == 1, "A to hold the first transfer")
    names.replicas = [b]
    wait_for(lambda: sender.replicas()[STAGE] == [b], "the scale-in")
    acked, failed = collect(sender, len(queued), timeout=30)
    assert (acked, failed) == (sorted(queued), {})
    assert all(rid in other.inbox for rid in queued)
    held.settle_all()  # A answers the one it held: acked there
    assert collect(sender, 1) == ([first], {})
    assert first in held.receiver.inbox
    # A is back, takes one and holds it, then is gone for good (scaled in, its process
    # ended): the one it held goes to B.
    names.replicas = [a, b]
    wait_for(lambda: sender.replicas()[STAGE] == [a, b], "the scale-out")
    [last] = hashed_to(a, b, 1, "last")
    sender.submit(ar.offer(last, [9], 4), timeout_s=60)
    wait_for(lambda: len(held.tickets) == 1, "A to hold the last transfer")
    names.replicas = [b]
    wait_for(lambda: sender.replicas()[STAGE] == [b], "the second scale-in")
    held.receiver.close()
    assert collect(sender, 1, timeout=30) == ([last], {})
    assert last in other.inbox

"""The stream ledger (omni_runtime/transfers/streams.py), without an engine: cadence, credits,
order, deadlines, exactly-once resolution, and nothing left after 10k random streams."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from omni_contract.edges import StreamSettings
from omni_runtime.transfers.streams import (ChunkOutcome, ConsumerStreams, ProducerStreams,
                                            StreamObserver, StreamOutcome)

S = StreamSettings(first_chunk_tokens=4, chunk_tokens=16, first_chunk_seconds=5,
                   gap_seconds=2, stream_seconds=60, chunks_in_flight=2, max_open_streams=2)


class Recorder(StreamObserver):
    def __init__(self):
        self.chunks = Counter()
        self.resolved = []
        self.credit = 0.0

    def on_chunk(self, end, stream, chunk, outcome, now):
        self.chunks[outcome] += 1

    def on_resolved(self, end, stream, now):
        self.resolved.append((stream.key, stream.outcome))

    def on_credit(self, end, stream, seconds):
        self.credit += seconds


def spans(chunks):
    return [(c.seq, c.start, c.end, c.last) for c in chunks]


def test_chunks_follow_the_cadence_and_the_last_takes_the_rest():
    p = ProducerStreams()
    s = p.open("r", "talker", StreamSettings(chunks_in_flight=100), 0.0)
    assert p.cut(s, 3, False, 0.0, 0.0) == []
    assert spans(p.cut(s, 4, False, 0.0, 0.0)) == [(0, 0, 4, False)]
    assert spans(p.cut(s, 37, False, 0.0, 0.0)) == [(1, 4, 20, False), (2, 20, 36, False)]
    assert spans(p.cut(s, 41, True, 0.0, 0.0)) == [(3, 36, 41, True)]
    assert p.cut(s, 50, True, 0.0, 0.0) == []  # nothing after the last chunk


def test_output_ending_on_a_boundary_ends_with_that_chunk_and_no_output_with_an_empty_one():
    p = ProducerStreams()
    s = p.open("r", "talker", StreamSettings(chunks_in_flight=100), 0.0)
    assert spans(p.cut(s, 20, True, 0.0, 0.0)) == [(0, 0, 4, False), (1, 4, 20, True)]
    empty = p.open("e", "talker", S, 0.0)
    assert spans(p.cut(empty, 0, True, 0.0, 0.0)) == [(0, 0, 0, True)]
    rec = Recorder()
    p.add_observer(rec)
    p.ack(empty, 0, 0.1)
    assert rec.resolved == [(("e", "talker"), StreamOutcome.FINISHED)]


def test_out_of_credit_the_producer_holds_and_sends_as_acks_come():
    p = ProducerStreams()
    rec = Recorder()
    p.add_observer(rec)
    s = p.open("r", "talker", S, 0.0)
    sent = p.cut(s, 4 + 16 * 3, False, 0.0, 0.0)
    assert [c.seq for c in sent] == [0, 1] and [c.seq for c in s.queued] == [2, 3]
    assert p.counts() == {"talker": {"open": 1, "held": 1}}
    assert [c.seq for c in p.ack(s, 0, 0.5)] == [2]
    assert [c.seq for c in p.ack(s, 1, 1.0)] == [3]
    assert p.counts() == {"talker": {"open": 1, "held": 0}}
    assert rec.credit == 1.0  # held from 0.0 until the queue drained at 1.0
    assert p.ack(s, 1, 1.1) == []  # a repeated ack changes nothing


def test_an_edge_over_its_open_streams_holds_the_new_one_until_a_slot_frees():
    p = ProducerStreams()
    a, b, c = (p.open(r, "talker", S, 0.0) for r in "abc")
    assert p.cut(c, 4, False, 0.0, 0.0) == []  # held: no slot
    assert p.counts()["talker"] == {"open": 3, "held": 1}
    p.cut(a, 0, True, 0.0, 0.0)
    p.ack(a, 0, 0.2)  # a finishes: its slot goes to c
    [(stream, sent)] = p.take_unblocked(0.2)
    assert stream is c and [ch.seq for ch in sent] == [0]
    p.resolve("b", StreamOutcome.ABORTED, "client went away", 0.3)
    assert p.take_unblocked(0.3) == []
    p.check_invariants()


def test_the_consumer_applies_in_order_and_acks_a_duplicate_without_applying_it():
    c = ConsumerStreams()
    assert c.arrive("r", "thinker", 1, False, 0.0, S, 0.0) == ("early", [])
    verdict, ready = c.arrive("r", "thinker", 0, False, 0.0, S, 0.1)
    assert verdict == "next" and [ch.seq for ch in ready] == [0, 1]
    s = c.get("r", "thinker")
    assert c.arrive("r", "thinker", 0, False, 0.0, S, 0.2) == ("duplicate", [])
    assert c.arrive("r", "thinker", 5, False, 0.0, S, 0.2) == ("refused", [])  # past the credit
    c.applied(s, 0, 0.3)
    c.applied(s, 1, 0.3)
    assert c.counts() == {"thinker": {"open": 1, "waiting": 1}}
    _, [last] = c.arrive("r", "thinker", 2, True, 0.0, S, 0.4)
    c.applied(s, last.seq, 0.5)
    assert len(c) == 0 and s.outcome is StreamOutcome.FINISHED
    # A late copy of a chunk of a resolved stream never opens it again.
    assert c.arrive("r", "thinker", 0, False, 0.0, S, 0.6) == ("refused", [])
    c.expire_due(0.5 + S.stream_seconds)
    assert c.remembered() == 0


def test_each_deadline_expires_a_stream_once_and_frees_what_it_held():
    p, c = ProducerStreams(), ConsumerStreams()
    rec = Recorder()
    p.add_observer(rec)
    first = p.open("first", "talker", S, 0.0)           # no chunk ever taken
    gap = p.open("gap", "talker", S, 0.0)
    p.cut(gap, 4, False, 0.0, 0.0)
    p.ack(gap, 0, 0.5)
    p.cut(gap, 20, False, 1.0, 0.0)                    # chunk 1 never acked
    assert {s.request_id for s in p.expire_due(2.9)} == set()
    assert {s.request_id for s in p.expire_due(3.0)} == {"gap"}
    assert {s.request_id for s in p.expire_due(5.0)} == {"first"}
    assert rec.chunks == Counter({ChunkOutcome.ACKED: 1, ChunkOutcome.EXPIRED: 1})
    assert first.outcome is StreamOutcome.EXPIRED and "first-chunk deadline" in first.reason
    assert p.expire_due(100.0) == [] and len(p) == 0
    c.arrive("r", "thinker", 0, False, 0.0, S, 0.0)
    c.applied(c.get("r", "thinker"), 0, 0.1)
    [waited] = c.expire_due(2.1)
    assert "for its next chunk" in waited.reason and len(c) == 0
    long = ProducerStreams()
    s = long.open("long", "talker", StreamSettings(gap_seconds=10, stream_seconds=12), 0.0)
    for t in range(1, 12):
        long.cut(s, 4 + 16 * (t - 1), False, float(t), 0.0)
        for seq in list(s.in_flight):
            long.ack(s, seq, float(t))
        assert long.expire_due(float(t)) == []
    assert [x.outcome for x in long.expire_due(12.0)] == [StreamOutcome.EXPIRED]


def test_a_wait_begun_before_the_first_ack_is_bound_by_the_gap_once_the_ack_comes():
    # One chunk of credit: chunk 0 waits for its ack past the gap (the first-chunk deadline
    # bounds it until then); once acked, chunk 1 goes and chunk 2 is held, and the stream has
    # waited since chunk 0 was sent: over the gap, so the next look expires it.
    settings = StreamSettings(first_chunk_tokens=1, chunk_tokens=1, first_chunk_seconds=5.0,
                              gap_seconds=1.0, stream_seconds=50.0, chunks_in_flight=1)
    p = ProducerStreams()
    s = p.open("r", "talker", settings, 0.0)
    p.cut(s, 3, False, 0.0, 0.0)
    assert p.expire_due(1.5) == []                      # the first-chunk deadline bounds it
    p.ack(s, 0, 2.0)
    assert [c.seq for c in s.in_flight.values()] == [1] and s.waiting_since == 0.0
    p.check_invariants()
    assert [x.request_id for x in p.expire_due(2.0)] == ["r"]


def test_a_failed_chunk_ends_the_stream_as_the_consumers_error_naming_the_chunk():
    p = ProducerStreams()
    s = p.open("r", "talker", S, 0.0)
    p.cut(s, 4, False, 0.0, 0.0)
    assert p.fail(s, 7, "x", 0.1) is None  # not a chunk in flight
    p.fail(s, 0, "over max-model-len", 0.1)
    assert s.outcome is StreamOutcome.CONSUMER_ERROR
    assert s.reason == "stream of request r (talker, chunk 0): over max-model-len"
    assert p.fail(s, 0, "again", 0.2) is None and len(p) == 0


class Link:
    """Producer -> consumer chunks and consumer -> producer acks, each message dropped,
    duplicated or delayed (reordered) at random."""

    def __init__(self, rng, loss):
        self.rng, self.loss = rng, loss
        self.to_consumer, self.to_producer = [], []

    def send(self, queue, msg):
        roll = self.rng.random()
        if roll < self.loss:
            return
        queue.insert(self.rng.randrange(len(queue) + 1) if roll < 3 * self.loss else len(queue),
                     msg)
        if roll > 1 - self.loss:
            queue.append(msg)


def test_ten_thousand_random_streams_all_resolve_once_and_leave_nothing():
    rng = random.Random(48)
    p, c = ProducerStreams(), ConsumerStreams()
    precs, crecs = Recorder(), Recorder()
    p.add_observer(precs)
    c.add_observer(crecs)
    link = Link(rng, loss=0.01)
    now, opened, live = 0.0, 0, {}
    settings = [StreamSettings(4, 16, 5, 2, 60, 2, 64),
                StreamSettings(first_chunk_tokens=1, chunk_tokens=3, gap_seconds=1,
                               first_chunk_seconds=3, stream_seconds=8, chunks_in_flight=1,
                               max_open_streams=8)]
    while opened < 10_000 or live or len(p) or len(c):
        now += 0.05
        for _ in range(min(rng.randrange(3), 10_000 - opened)):
            rid = f"r{opened}"
            opened += 1
            s = p.open(rid, "talker", rng.choice(settings), now)
            live[rid] = [s, 0, rng.randrange(0, 60)]  # stream, output, max output
        sends = []
        for rid, entry in list(live.items()):
            s, out, cap = entry
            if s.resolved:
                del live[rid]
                continue
            roll = rng.random()
            if roll < 0.0005:
                p.resolve(rid, StreamOutcome.ABORTED, "abort", now)
                link.send(link.to_consumer, ("end", rid))
                continue
            if roll < 0.001:
                p.resolve(rid, StreamOutcome.PRODUCER_ERROR, "engine error", now)
                link.send(link.to_consumer, ("end", rid))
                continue
            entry[1] = out = min(cap, out + rng.randrange(0, 4))
            sends += [(s, ch) for ch in p.cut(s, out, out >= cap, now, now)]
        sends += [(s, ch) for s, chs in p.take_unblocked(now) for ch in chs]
        for s, ch in sends:
            link.send(link.to_consumer, ("chunk", s.request_id, ch.seq, ch.last, s.settings))
        for msg in link.to_consumer[:]:
            link.to_consumer.remove(msg)
            if msg[0] == "end":
                c.resolve(msg[1], StreamOutcome.PRODUCER_ERROR, "producer ended", now)
                continue
            _, rid, seq, last, st_ = msg
            verdict, ready = c.arrive(rid, "thinker", seq, last, now, st_, now)
            if verdict == "duplicate":
                link.send(link.to_producer, ("ack", rid, seq))
            for ch in ready:
                cs = c.get(rid, "thinker")
                if rng.random() < 0.002:
                    c.refused(cs, ch.seq, "over budget", now)
                    link.send(link.to_producer, ("fail", rid, ch.seq))
                    break
                c.applied(cs, ch.seq, now)
                link.send(link.to_producer, ("ack", rid, ch.seq))
        for kind, rid, seq in link.to_producer[:]:
            link.to_producer.remove((kind, rid, seq))
            s = p.get(rid, "talker")
            if s is None:
                continue
            if kind == "ack":
                for ch in p.ack(s, seq, now):
                    link.send(link.to_consumer, ("chunk", rid, ch.seq, ch.last, s.settings))
            else:
                p.fail(s, seq, "refused", now)
        p.expire_due(now)
        c.expire_due(now)
        p.check_expired(now)
        c.check_expired(now)
        p.check_invariants()
        c.check_invariants()
        assert now < 10_000, "streams outlived every deadline"
    assert len(p) == 0 and len(c) == 0
    c.expire_due(now + 60)
    assert c.remembered() == 0
    keys = [key for key, _ in precs.resolved]
    assert len(keys) == len(set(keys)) == 10_000  # every stream resolved, exactly once
    outcomes = Counter(o for _, o in precs.resolved)
    assert outcomes[StreamOutcome.FINISHED] > 8_000  # the rest: a lost chunk or ack, an end
    assert {StreamOutcome.EXPIRED, StreamOutcome.ABORTED, StreamOutcome.PRODUCER_ERROR,
            StreamOutcome.CONSUMER_ERROR} <= set(outcomes)
    assert len({k for k, _ in crecs.resolved}) == len(crecs.resolved)


class StreamMachine(RuleBasedStateMachine):
    """Any order of opens, cuts, acks, failures, ends and time: the producer's invariants
    hold after each, and once time passes every deadline nothing is left."""

    def __init__(self):
        super().__init__()
        self.p = ProducerStreams()
        self.rec = Recorder()
        self.p.add_observer(self.rec)
        self.now = 0.0
        self.n = 0
        self.out = {}

    @rule(first=st.integers(1, 5), chunk=st.integers(1, 5), credit=st.integers(1, 3),
          slots=st.integers(1, 3))
    def open(self, first, chunk, credit, slots):
        rid = f"r{self.n}"
        self.n += 1
        self.p.open(rid, "talker", StreamSettings(first, chunk, 1.0, 0.5, 4.0, credit, slots),
                    self.now)
        self.out[rid] = 0

    @precondition(lambda self: len(self.p))
    @rule(data=st.data(), grow=st.integers(0, 7), finish=st.booleans())
    def cut(self, data, grow, finish):
        s = data.draw(st.sampled_from(list(self.p)))
        self.out[s.request_id] += grow
        self.p.cut(s, self.out[s.request_id], finish, self.now, self.now)

    @precondition(lambda self: any(s.in_flight for s in self.p))
    @rule(data=st.data(), ok=st.booleans())
    def answer(self, data, ok):
        s = data.draw(st.sampled_from([s for s in self.p if s.in_flight]))
        seq = data.draw(st.sampled_from(sorted(s.in_flight)))
        if ok:
            self.p.ack(s, seq, self.now)
        else:
            self.p.fail(s, seq, "refused", self.now)
        self.p.take_unblocked(self.now)

    @precondition(lambda self: len(self.p))
    @rule(data=st.data())
    def end(self, data):
        s = data.draw(st.sampled_from(list(self.p)))
        self.p.resolve(s.request_id, StreamOutcome.ABORTED, "abort", self.now)
        self.p.take_unblocked(self.now)

    @rule(dt=st.floats(0.0, 2.0))
    def tick(self, dt):
        self.now += dt
        self.p.expire_due(self.now)
        self.p.check_expired(self.now)  # the deadline entries miss no stream
        self.p.take_unblocked(self.now)

    @invariant()
    def consistent(self):
        self.p.check_invariants()
        keys = [k for k, _ in self.rec.resolved]
        assert len(keys) == len(set(keys))

    def teardown(self):
        self.p.expire_due(self.now + 10.0)
        assert len(self.p) == 0
        self.p.check_invariants()


StreamMachine.TestCase.settings = hsettings(max_examples=150, stateful_step_count=40,
                                            deadline=None)
TestStreamMachine = StreamMachine.TestCase

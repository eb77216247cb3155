"""A streamed edge's chunks on the KV transport: a real sender and receiver (NIXL agents,
ZeroMQ), chunks to one stage only, acked once the stage's consumer holds them, refused with
its reason, early ends told, and what the wire refuses."""

from __future__ import annotations

import threading
import time

import pytest

from omni_runtime.kv.transport.protocol import (Rejected, StreamChunk, StreamEnd, encode_chunk,
                                                 parse_chunk, parse_message, parse_stream_end)
from omni_runtime.kv.transport.sender import ChunkOffer

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


class Consumer:
    """A stage's stream consumer: records what comes, answers as told."""

    def __init__(self):
        self.receiver = None
        self.got = []
        self.ends = []
        self.refuse = {}
        self.hold = set()
        self.held = []

    def __call__(self, message, ticket):
        if isinstance(message, StreamEnd):
            self.ends.append(message)
            return
        self.got.append(message)
        if message.request_id in self.hold:
            self.held.append(ticket)
            return
        refusal = self.refuse.get(message.seq)
        self.receiver.settle(ticket, ("input_refused", refusal) if refusal else None)


def chunk_answers(sender, n):
    answers = []
    deadline = time.monotonic() + WAIT
    while len(answers) < n:
        assert time.monotonic() < deadline, f"only {answers} of {n} chunk answers"
        sender.wait(deadline - time.monotonic())
        answers += sender.poll_chunks()
    return answers


@pytest.fixture
def streaming(make_receiver, ar, make_sender):
    consumer = Consumer()
    receiver = make_receiver(streams=consumer)
    consumer.receiver = receiver
    other = make_receiver(stage="code2wav")
    sender = make_sender(ar, {STAGE: receiver.endpoint, "code2wav": other.endpoint})
    return consumer, receiver, other, sender


def test_chunks_go_to_their_stage_alone_and_are_acked_once_held(streaming, ar):
    consumer, receiver, other, sender = streaming
    sender.submit_chunk(ChunkOffer("r1", 0, token_ids=(7, 8, 9, 1, 2), prompt_len=3,
                                   produced_at=time.time(), origin={"request_id": "p-1"}),
                        STAGE, timeout_s=5)
    sender.submit_chunk(ChunkOffer("r1", 1, last=True, token_ids=(3,)), STAGE, timeout_s=5)
    assert sorted(chunk_answers(sender, 2)) == [("r1", STAGE, 0, None), ("r1", STAGE, 1, None)]
    first, second = consumer.got
    assert (first.seq, first.token_ids, first.prompt_len, first.origin) == (
        0, (7, 8, 9, 1, 2), 3, {"request_id": "p-1"})
    assert (second.seq, second.last, second.from_stage) == (1, True, ar.hello.from_stage)
    # Not a transfer: nothing in either inbox, no whole transfer answered, code2wav untouched.
    assert receiver.inbox.list() == [] and other.inbox.list() == [] and sender.poll() == {}
    assert receiver.num_delivered == 0 and other.num_delivered == 0


def test_a_refused_chunk_fails_with_the_consumers_reason_and_an_end_is_told(streaming):
    consumer, receiver, _, sender = streaming
    consumer.refuse[0] = "over max-model-len 128"
    sender.submit_chunk(ChunkOffer("r2", 0, token_ids=(1,) * 4), STAGE, timeout_s=5)
    [(rid, stage, seq, reason)] = chunk_answers(sender, 1)
    assert (rid, seq) == ("r2", 0) and "input_refused: over max-model-len 128" in reason
    sender.submit_chunk(ChunkOffer("r3", 0, end="producer_error", reason="engine died"),
                        STAGE, timeout_s=5)
    for _ in range(100):
        if consumer.ends:
            break
        sender.wait(0.05)
    [end] = consumer.ends
    assert (end.request_id, end.outcome, end.reason) == ("r3", "producer_error", "engine died")
    assert sender.poll_chunks() == []  # an end's answer is not a chunk's


def test_a_chunk_its_consumer_does_not_settle_in_time_is_answered_deadline(streaming):
    consumer, receiver, _, sender = streaming
    consumer.hold.add("slow")
    sender.submit_chunk(ChunkOffer("slow", 0, token_ids=(1, 2)), STAGE, timeout_s=0.3)
    [(_, _, _, reason)] = chunk_answers(sender, 1)
    assert reason is not None
    receiver.settle(consumer.held[0])  # late: ignored, the receiver serves on
    sender.submit_chunk(ChunkOffer("next", 0, token_ids=(3,)), STAGE, timeout_s=5)
    assert chunk_answers(sender, 1) == [("next", STAGE, 0, None)]


def test_a_stage_that_takes_no_stream_refuses_chunks_naming_why(make_receiver, ar, make_sender):
    receiver = make_receiver()
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit_chunk(ChunkOffer("r", 0, token_ids=(1,)), STAGE, timeout_s=5)
    [(_, _, _, reason)] = chunk_answers(sender, 1)
    assert "input_refused" in reason and "takes no streamed input" in reason
    sender.submit_chunk(ChunkOffer("r", 0, token_ids=(1,)), "nowhere", timeout_s=5)
    assert chunk_answers(sender, 1) == [("r", "", 0, "no endpoint for stage nowhere")]


def test_a_whole_transfer_goes_only_to_the_stages_it_names(streaming, ar):
    consumer, receiver, other, sender = streaming
    sender.submit(ar.offer("whole", [1, 2], 8), to_stages=["code2wav"])
    assert collect(sender, 1) == (["whole"], {})
    assert [p["request_id"] for p in other.inbox.list()] == ["whole"]
    assert receiver.inbox.list() == []


def body(**change):
    base = StreamChunk(1, "agent", "hash", "r", "", "p", "thinker", "talker", 0, False,
                       (1, 2, 3), 1, 5.0, 1.0, 2.0)
    kind, parsed, rest = parse_message(encode_chunk(base))
    parsed.update(change)
    return parsed, rest


@pytest.mark.parametrize("change, words", [
    ({"seq": -1}, "seq must be in"),
    ({"seq": 1}, "only chunk 0 carries the prompt"),
    ({"last": "yes"}, "last must be a boolean"),
    ({"token_ids": [1, -2]}, "token_ids must be token ids"),
    ({"prompt_len": 9}, "prompt_len must be in"),
    ({"deadline_in_s": float("nan")}, "deadline_in_s"),
    ({"from_stage": ""}, "from_stage must not be empty"),
])
def test_a_malformed_chunk_is_refused_naming_the_field(change, words):
    parsed, rest = body(**change)
    with pytest.raises(Rejected) as err:
        parse_chunk(parsed, rest)
    assert err.value.code == "malformed" and words in err.value.reason
    assert err.value.transfer_id == 1


def test_a_stream_end_names_a_known_outcome():
    with pytest.raises(Rejected, match="outcome must be one of"):
        parse_stream_end({"transfer_id": 1, "agent": "a", "request_id": "r", "pipeline": "p",
                          "from_stage": "t", "to_stage": "u", "outcome": "finished"}, [])
    # The producer gave up waiting for the consumer's answer: the consumer is told so.
    end = parse_stream_end({"transfer_id": 1, "agent": "a", "request_id": "r", "pipeline": "p",
                            "from_stage": "t", "to_stage": "u", "outcome": "consumer_error",
                            "reason": "no ack"}, [])
    assert end.outcome == "consumer_error"


def test_a_stream_stays_with_the_replica_its_first_chunk_reached(make_receiver, ar, make_sender):
    """The endpoint is a Service: a connection is one consumer replica. The replica behind
    it goes and another comes up at the same address (a new connection): the stream begun
    on the old one fails at its next chunk, naming why, and never reaches the new replica;
    a new stream begins there."""
    first = Consumer()
    first.receiver = make_receiver(streams=first)
    address = first.receiver.endpoint
    sender = make_sender(ar, {STAGE: address})
    sender.submit_chunk(ChunkOffer("moving", 0, token_ids=(1, 2, 3), prompt_len=1), STAGE,
                        timeout_s=5)
    assert chunk_answers(sender, 1) == [("moving", STAGE, 0, None)]
    first.receiver.close()  # its replica goes; another takes its place at the same address
    second = Consumer()
    second.receiver = make_receiver(address, streams=second)
    sender.submit_chunk(ChunkOffer("moving", 1, token_ids=(4,)), STAGE, timeout_s=5)
    [(rid, stage, seq, reason)] = chunk_answers(sender, 1)
    assert (rid, stage, seq) == ("moving", STAGE, 1)
    assert "lost in the middle of this stream" in reason and "another replica" in reason
    sender.submit_chunk(ChunkOffer("fresh", 0, token_ids=(5, 6), prompt_len=1), STAGE,
                        timeout_s=5)
    assert chunk_answers(sender, 1) == [("fresh", STAGE, 0, None)]
    assert [c.request_id for c in second.got] == ["fresh"]
    # Pinned to the new connection now: its next chunk goes there too.
    sender.submit_chunk(ChunkOffer("fresh", 1, last=True, token_ids=(7,)), STAGE, timeout_s=5)
    assert chunk_answers(sender, 1) == [("fresh", STAGE, 1, None)]

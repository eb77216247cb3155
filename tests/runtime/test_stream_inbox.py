"""A receiving stage's streamed inputs (stages/stream_inbox.py), without a transport: chunks
in order whatever order they come in, readable as they come, each answered once, every
stream ending once and told."""

from __future__ import annotations

import threading

import pytest

from omni_contract.edges import StreamSettings
from omni_runtime.kv.transport.protocol import StreamChunk, StreamEnd
from omni_runtime.stages.stream_inbox import StreamInbox

S = StreamSettings(first_chunk_tokens=2, chunk_tokens=2, gap_seconds=1.0, chunks_in_flight=3)


def chunk(rid, seq, tokens, last=False, prompt_len=0, stage="talker"):
    return StreamChunk(seq + 1, "agent", "hash", rid, "", "p", stage, "vocoder", seq, last,
                       tuple(tokens), prompt_len, 5.0, 1.0, 2.0,
                       origin={"request_id": "pipe-" + rid, "endpoint": "http://e"})


@pytest.fixture
def inbox():
    now = [0.0]
    settled, ended = [], []
    box = StreamInbox({"talker": S}, settle=lambda t, r: settled.append((t, r)),
                      on_end=ended.append, clock=lambda: now[0])
    return box, settled, ended, now


def test_chunks_are_read_in_order_and_each_answered_once(inbox):
    box, settled, ended, _ = inbox
    box.arrive(chunk("r", 1, [5, 6]), "t1")                     # early: kept, not answered
    assert settled == []
    box.arrive(chunk("r", 0, [1, 2, 3, 4], prompt_len=2), "t0")
    assert settled == [("t0", None), ("t1", None)]
    box.arrive(chunk("r", 0, [1, 2, 3, 4], prompt_len=2), "t0again")  # a repeat: acked only
    assert settled[-1] == ("t0again", None)
    box.arrive(chunk("r", 2, [7], last=True), "t2")
    [record] = ended
    assert record.outcome == "finished" and record.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert record.prompt_len == 2 and record.chunks == 3
    assert box.get("r").summary()["streamed"] is True
    # Also by the id its client knows: the pipeline request's (an outside review: only the
    # producer's internal id, which no client knows in advance, found it).
    assert box.get("pipe-r") is record and box.get("pipe-nobody") is None
    box.arrive(chunk("r", 0, [1]), "late")                        # a resolved stream's chunk
    assert settled[-1][0] == "late" and "cannot be taken" in settled[-1][1][1]


def test_a_reader_gets_the_tokens_as_they_come(inbox):
    box, *_ = inbox
    got, done = [], threading.Event()

    def read():
        for tokens in box.chunks("r", "talker", timeout=10):
            got.append(tokens)
        done.set()

    reader = threading.Thread(target=read)
    reader.start()
    box.arrive(chunk("r", 0, [1, 2]), "t0")
    box.arrive(chunk("r", 1, [3, 4], last=True), "t1")
    reader.join(10)
    assert done.is_set() and sum(got, []) == [1, 2, 3, 4]


def test_an_early_end_a_silence_and_a_whole_edge_are_told(inbox):
    box, settled, ended, now = inbox
    box.arrive(chunk("a", 0, [1, 2]), "a0")
    box.arrive(chunk("a", 2, [9]), "a2")                          # early, then the end comes
    box.end(StreamEnd(9, "agent", "a", "p", "talker", "vocoder", "producer_error", "died"))
    assert ended[-1].outcome == "producer_error" and "died" in ended[-1].reason
    assert settled[-1][0] == "a2" and settled[-1][1][0] == "input_refused"
    box.arrive(chunk("b", 0, [1, 2]), "b0")
    now[0] = 0.5
    box.expire()
    assert ended[-1].request_id == "a"
    now[0] = 1.5
    box.expire()
    assert ended[-1].request_id == "b" and ended[-1].outcome == "expired"
    with pytest.raises(RuntimeError, match="gap deadline"):
        list(box.chunks("b", "talker", timeout=1))
    box.arrive(chunk("c", 0, [1], stage="thinker"), "c0")
    assert "whole, not streamed" in settled[-1][1][1]
    assert len(box.ledger) == 0


def test_a_nan_wait_is_refused_not_waited_on(inbox):
    box = inbox[0]
    with pytest.raises(ValueError, match="nan"):
        box.get("nope", float("nan"))
    with pytest.raises(ValueError, match="nan"):
        next(box.chunks("nope", "talker", float("nan")))

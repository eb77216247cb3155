"""A receiving stage's streamed inputs: each stream's chunks gathered in order, readable as
they come (an iterator) or once whole.

The receiving stage's KV receiver hands each chunk here on its own thread; the stream ledger
(omni_runtime/transfers/streams.py, the consumer's end) puts them in order, acks a repeat,
keeps an early one until its turn and refuses what it must. A chunk is acked once it is in
its stream here (readable). A real generation stage (a vocoder) reads
:meth:`StreamInbox.chunks` in its own process; this stage serves them over HTTP and reports
each finished stream to the pipeline's endpoint.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from omni_contract.edges import StreamSettings
from omni_runtime.pipeline.protocol import ORIGIN_REQUEST_ID
from omni_runtime.transfers.streams import ConsumerStreams, Stream, StreamOutcome

#: Finished streams kept for readers (the oldest goes first), and for how long.
MAX_FINISHED = 1024
FINISHED_TTL_S = 300.0


@dataclass(eq=False)
class StreamRecord:
    """One stream as it arrived: its chunks' tokens in order (chunk 0's prompt first)."""

    request_id: str
    from_stage: str
    origin: dict[str, str] | None
    prompt_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    chunks: int = 0
    started_at: float = 0.0  # unix: its first chunk arrived
    offered_at: float = 0.0  # unix: its first chunk was sent
    outcome: str | None = None
    reason: str | None = None
    ended_at: float = 0.0  # monotonic

    def summary(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "from_stage": self.from_stage,
                "token_ids": list(self.token_ids), "prompt_len": self.prompt_len,
                "chunks": self.chunks, "streamed": True, "outcome": self.outcome,
                "reason": self.reason}


class StreamInbox:
    """``settle(ticket, refusal)``: the receiver's answer for a chunk; ``on_end(record)``:
    told (on the caller's thread) when a stream ends, whatever its outcome."""

    def __init__(self, streams: dict[str, StreamSettings],
                 settle: Callable[[Any, tuple[str, str] | None], None],
                 on_start: Callable[[StreamRecord, Any], None] | None = None,
                 on_end: Callable[[StreamRecord], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = dict(streams)
        self.ledger = ConsumerStreams()
        self._settle = settle
        self._on_start = on_start
        self._on_end = on_end
        self._clock = clock
        self._cond = threading.Condition()
        self._open: dict[tuple[str, str], StreamRecord] = {}
        self._finished: OrderedDict[tuple[str, str], StreamRecord] = OrderedDict()
        #: Chunks ahead of their turn: (request, stage, seq) -> (tokens, ticket).
        self._early: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        #: Set when the stage stops (:meth:`stop_taking`): why a new stream is refused.
        self._refusing: str | None = None
        #: Arrivals whose answers are decided but not yet given to ``settle``.
        self._answering = 0

    def arrive(self, chunk: Any, ticket: Any) -> None:
        """On the receiver's thread: a chunk (protocol.StreamChunk) and its ticket."""
        settings = self.settings.get(chunk.from_stage)
        if settings is None:
            self._settle(ticket, ("input_refused", f"this stage takes {chunk.from_stage}'s "
                                  "output whole, not streamed: both ends must read the same "
                                  "edge"))
            return
        key = (chunk.request_id, chunk.from_stage)
        ended: list[StreamRecord] = []
        with self._cond:
            if self._refusing is not None and self.ledger.get(*key) is None:
                # Stopping: the streams open here run to their end, a new one is not begun.
                refusal = ("stopping", f"chunk {chunk.seq} of the stream of request "
                           f"{chunk.request_id} begins a new stream: {self._refusing}")
                self._cond.notify_all()
            else:
                refusal = None
        if refusal is not None:
            self._settle(ticket, refusal)
            return
        with self._cond:
            verdict, ready = self.ledger.arrive(chunk.request_id, chunk.from_stage, chunk.seq,
                                                chunk.last, chunk.produced_at, settings,
                                                self._clock())
            if verdict == "refused":
                refusal = ("input_refused", f"chunk {chunk.seq} of the stream of request "
                           f"{chunk.request_id} cannot be taken: its stream ended here or it "
                           "is too far ahead")
            else:
                refusal = None
            if verdict == "early":
                self._early[(*key, chunk.seq)] = (chunk, ticket)
                return
            if verdict == "next":
                record = self._open.get(key)
                started = record is None
                if started:
                    record = self._open[key] = StreamRecord(
                        chunk.request_id, chunk.from_stage, chunk.origin,
                        started_at=time.time())
                stream = self.ledger.get(*key)
                answered = []
                for taken in ready:
                    body, its_ticket = (chunk, ticket) if taken.seq == chunk.seq else \
                        self._early.pop((*key, taken.seq))
                    if taken.seq == 0:
                        record.prompt_len = body.prompt_len
                    record.token_ids.extend(body.token_ids)
                    record.chunks += 1
                    self.ledger.applied(stream, taken.seq, self._clock())
                    answered.append(its_ticket)
                if stream.resolved:
                    ended.append(self._close(key, stream))
                self._cond.notify_all()
            # Its answers are given below, out of the lock: until then a drain waits.
            self._answering += 1
        try:
            if verdict == "next":
                if started and self._on_start is not None:
                    self._on_start(record, chunk)
                for its_ticket in answered:
                    self._settle(its_ticket, None)
            else:
                self._settle(ticket, refusal)
            self._ended(ended)
        finally:
            with self._cond:
                self._answering -= 1
                self._cond.notify_all()

    def end(self, end: Any) -> None:
        """On the receiver's thread: the producer ended a stream early (protocol.StreamEnd)."""
        outcome = StreamOutcome(end.outcome) if end.outcome != "producer_error" else \
            StreamOutcome.PRODUCER_ERROR
        ended = []
        with self._cond:
            for stream in self.ledger.resolve(end.request_id, outcome,
                                              f"stage {end.from_stage} ended the stream: "
                                              f"{end.reason}", self._clock(),
                                              peer=end.from_stage):
                ended.append(self._close(stream.key, stream))
            self._cond.notify_all()
        self._ended(ended)

    def expire(self) -> None:
        """Streams past a deadline end (``expired``); finished ones past their time go."""
        ended = []
        now = self._clock()
        with self._cond:
            for stream in self.ledger.expire_due(now):
                ended.append(self._close(stream.key, stream))
            while self._finished:
                key, record = next(iter(self._finished.items()))
                if now - record.ended_at < FINISHED_TTL_S:
                    break
                del self._finished[key]
            self._cond.notify_all()
        self._ended(ended)

    def _close(self, key: tuple[str, str], stream: Stream) -> StreamRecord:
        record = self._open.pop(key, None) or StreamRecord(*key, None)
        record.outcome, record.reason = stream.outcome.value, stream.reason
        record.ended_at = self._clock()
        for early_key in [k for k in self._early if k[:2] == key]:
            _, ticket = self._early.pop(early_key)
            self._settle(ticket, ("input_refused", stream.reason or "the stream ended"))
        self._finished[key] = record
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)
        return record

    def _ended(self, records: list[StreamRecord]) -> None:
        if self._on_end is not None:
            for record in records:
                self._on_end(record)

    def stop_taking(self, why: str) -> None:
        """From now on a chunk that would begin a new stream is refused (``why`` says so);
        the streams open here go on until they end."""
        with self._cond:
            self._refusing = why
            self._cond.notify_all()

    def open_streams(self) -> list[StreamRecord]:
        """The streams begun here and not ended (a stream whose first chunk is still early
        included)."""
        with self._cond:
            return self._open_locked()

    def _open_locked(self) -> list[StreamRecord]:
        # A stream in the ledger has its record here once its next chunk came, else only
        # early chunks (resolving it drops both: _close).
        keys = set(self._open) | {key[:2] for key in self._early}
        return [self._open.get(key) or StreamRecord(*key, None) for key in sorted(keys)]

    def wait_drained(self, timeout: float) -> list[StreamRecord]:
        """Wait until no stream is open here (each ends at its last chunk, its producer's
        end or a deadline: the stage's deadline timer keeps running), at most ``timeout``
        seconds; the streams still open then (empty: drained)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                left = self._open_locked()
                remaining = deadline - time.monotonic()
                if (not left and not self._answering) or remaining <= 0:
                    return left
                self._cond.wait(remaining)

    def get(self, request_id: str, wait: float = 0.0) -> StreamRecord | None:
        """The stream of ``request_id`` (from any stage) once it ended, waiting up to
        ``wait`` seconds; None if it did not. ``request_id``: the producer's request id, or
        the pipeline request's (a client's X-Request-Id: the newest stream of it). A nan
        ``wait`` is refused (it would never end)."""
        if wait != wait:
            raise ValueError("wait must be a number of seconds, not nan")
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                found = next((r for k, r in self._finished.items() if k[0] == request_id), None) or next(
                    (r for r in reversed(self._finished.values())
                     if (r.origin or {}).get(ORIGIN_REQUEST_ID) == request_id), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._cond.wait(left)

    def chunks(self, request_id: str, from_stage: str, timeout: float) -> Iterator[list[int]]:
        """The stream's tokens as they come, a list per arrival (its prompt in the first),
        until it ends; TimeoutError when nothing new comes within ``timeout`` (a nan one is
        refused: it would never end)."""
        if timeout != timeout:
            raise ValueError("timeout must be a number of seconds, not nan")
        key = (request_id, from_stage)
        seen = 0
        while True:
            with self._cond:
                record = None
                while True:
                    record = self._open.get(key) or self._finished.get(key)
                    if record is not None and (len(record.token_ids) > seen or
                                               record.outcome is not None):
                        break
                    if not self._cond.wait(timeout):
                        raise TimeoutError(f"no chunk of the stream of request {request_id} "
                                           f"from {from_stage} within {timeout:g}s")
                new = record.token_ids[seen:]
                done = record.outcome is not None and len(record.token_ids) == seen + len(new)
            if new:
                seen += len(new)
                yield new
            if done:
                if record.outcome != StreamOutcome.FINISHED.value:
                    raise RuntimeError(record.reason or record.outcome)
                return

    def list(self) -> list[dict[str, Any]]:
        with self._cond:
            return [r.summary() for r in (*self._open.values(), *self._finished.values())]

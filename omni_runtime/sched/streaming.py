"""The producer's end of streamed edges, in the omni scheduler.

A request on a stage with streamed edges (``omni_kv_config.streams``) gets one stream per
streamed edge when vLLM first schedules it. After each step's outputs, the stream ledger
(omni_runtime/transfers/streams.py) cuts the request's committed output into chunks by the
edge's cadence; the chunks go to the connector with the step's metadata (rank 0's worker
sends them over the KV transport) and their answers come back with a later step's output.

What is committed: ``request.output_token_ids``, the tokens vLLM has appended from the
model's outputs. Async scheduling's in-flight tokens are placeholders counted apart
(``num_output_placeholders``), never in that list, so a chunk never carries one; and a
preemption recomputes KV without taking a token back, so no chunk is cut (or sent) twice.
A streaming-input session (a stage that is itself fed by a stream) starts each turn with an
empty output list (vLLM folds the turn's output into the prompt), so the tokens are kept
here as they appear, turn after turn, and chunks are cut from that record.
A request that finishes cuts its last chunk (an empty one if all its output went already);
one that is aborted or fails ends its streams with word to the consumer. Imports no vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omni_contract.edges import StreamSettings
from omni_runtime.sched.handoff import ChunkAnswer, ChunkOut
from omni_runtime.transfers.streams import (Chunk, ProducerStreams, Stream, StreamObserver,
                                            StreamOutcome)

logger = logging.getLogger(__name__)

#: The sender gives a chunk up this long before the stream's gap deadline, so its failure,
#: with the reason, reaches the ledger before the deadline does.
SEND_MARGIN = 0.95


class _Producing:
    """A request whose streams are open: its prompt when they opened, its output. A request
    that is a streaming-input session (``resumable``) has its output list start over at
    each turn (vLLM folds the turn into the prompt: ``turn_over``), so every token it has
    had is kept here as it appears (``output``, and how much of the current list was seen);
    any other request's output list only grows, and is read where it is (it stays with the
    request after vLLM frees it). It stays, its streams resolved, until vLLM frees the
    request (``finished``): a request that goes on opens no stream again."""

    __slots__ = ("request", "streams", "prompt", "origin", "session", "output", "seen", "due",
                 "wake_at", "finished", "input_ended")

    def __init__(self, request: Any, streams: list[Stream]) -> None:
        self.request = request
        self.streams = streams
        self.prompt = tuple(request.prompt_token_ids or ())
        origin = (request.kv_transfer_params or {}).get("omni")
        #: Where the request came from (the pipeline's endpoint), for the consumer's answer.
        self.origin = origin if isinstance(origin, dict) else None
        self.session = bool(getattr(request, "resumable", False))
        self.output: list[int] = []
        self.seen = 0
        #: The committed output at which one of its streams has a chunk to cut.
        self.due: float = 0
        #: The step at which its committed output is looked at next (StreamProducer._wake).
        self.wake_at = 0
        #: vLLM has freed the request (StreamProducer.finished).
        self.finished = False
        #: A session whose input ended while it waited for more (vLLM then finishes it as
        #: aborted, though nothing failed: StreamProducer.input_ended).
        self.input_ended = False

    def committed(self) -> int:
        current = self.request.output_token_ids
        if not self.session:
            return len(current)
        if len(current) > self.seen:
            self.output.extend(current[self.seen:])
            self.seen = len(current)
        return len(self.output)

    def turn_over(self) -> None:
        """A session's turn ends and its output list is about to start over: every token of
        it is taken first (the turn's last step's too, which vLLM appends and clears in one
        update when the next input is already queued)."""
        self.committed()
        self.seen = 0

    def tokens(self, start: int, end: int) -> tuple[int, ...]:
        """Output tokens ``[start, end)``."""
        return tuple((self.output if self.session else self.request.output_token_ids)
                     [start:end])


class StreamProducer:
    """``edges``: the streamed edges (consumer stage -> settings); ``send``: takes each
    step's chunks (the connector's ``send_chunks``); ``max_tokens_per_step``: the most
    output one step can append to a request (1, or 1 + the speculative tokens)."""

    def __init__(self, edges: Mapping[str, StreamSettings],
                 send: Callable[[list[ChunkOut]], None],
                 observers: Iterable[StreamObserver] = (),
                 clock: Callable[[], float] = time.monotonic,
                 refresh: Callable[[ProducerStreams], None] | None = None,
                 refresh_interval: float = 0.1, max_tokens_per_step: int = 1) -> None:
        if max_tokens_per_step < 1:
            raise ValueError(f"max_tokens_per_step must be at least 1, not {max_tokens_per_step}")
        self.edges = dict(edges)
        self.ledger = ProducerStreams()
        for observer in observers:
            self.ledger.add_observer(observer)
        #: Sets the gauges from the ledger's counts, at most every ``refresh_interval``.
        self._refresh = refresh
        self._refresh_interval = refresh_interval
        self._refreshed = float("-inf")
        self._send = send
        self._clock = clock
        self._max_tokens_per_step = max_tokens_per_step
        #: The requests whose streams are open, by id.
        self._open: dict[str, _Producing] = {}
        #: Steps stepped so far.
        self._step = 0
        #: Step -> the open requests whose committed output is looked at then. Invariant: a
        #: request (not a session) cannot complete a chunk before its ``wake_at`` step, since
        #: a step appends at most ``max_tokens_per_step`` tokens to its output; so a step
        #: looks at the few requests due (about one in ``chunk_tokens``), not at its batch.
        self._wake: dict[int, list[str]] = {}
        #: The open requests that are streaming-input sessions: looked at in every step that
        #: schedules them (their output list starts over at each turn: its tokens are kept as
        #: they appear).
        self._sessions: set[str] = set()

    def __len__(self) -> int:
        return len(self.ledger)

    def started(self, requests: Iterable[Any]) -> None:
        """Requests vLLM scheduled in this step for the first time (or resumed): each opens
        its streams once."""
        now = self._clock()
        for request in requests:
            rid = request.request_id
            # A request stays in ``_open`` until every stream of it resolved: a session's
            # next turn, or a resumed request, opens nothing again.
            entry = self._open.get(rid)
            if entry is not None:
                if entry.request is not request:
                    # The id of a request whose streams still wait for answers, used again
                    # (vLLM's ids are unique unless their randomisation is turned off).
                    logger.error("request %s: its id is that of an earlier request whose streams "
                                 "are still open; it streams nothing", rid)
                continue
            headers = getattr(request, "trace_headers", None)
            streams = [self.ledger.open(rid, stage, settings, now, headers)
                       for stage, settings in self.edges.items()]
            entry = self._open[rid] = _Producing(request, streams)
            if entry.session:
                self._sessions.add(rid)
            else:
                self._wake_later(rid, entry, entry.committed(), self._step + 1)

    def stepped(self, scheduled: Mapping[str, int]) -> None:
        """After a step's outputs (``scheduled``: the step's requests, vLLM's
        ``num_scheduled_tokens``): the chunks the requests' committed output completes."""
        now = self._clock()
        if self._refresh is not None and now - self._refreshed >= self._refresh_interval:
            self._refreshed = now
            self._refresh(self.ledger)
        self._step += 1
        due = self._wake.pop(self._step, None)
        open_ = self._open
        if not open_ or (due is None and not self._sessions):
            return
        wall = time.time()
        chunks: list[ChunkOut] = []
        step = self._step
        for rid in due or ():
            entry = open_.get(rid)
            if entry is None or entry.wake_at != step:
                continue  # resolved since, or looked at again by a later schedule
            committed = entry.committed()
            if committed >= entry.due:
                chunks += self._cut(entry, committed, now, wall)
            self._wake_later(rid, entry, committed, step + 1)
        if self._sessions:
            for rid in self._sessions & scheduled.keys():
                entry = open_[rid]
                committed = entry.committed()
                if committed >= entry.due:
                    chunks += self._cut(entry, committed, now, wall)
        self._flush(chunks)

    def _cut(self, entry: _Producing, committed: int, now: float, wall: float) -> list[ChunkOut]:
        """The chunks ``committed`` output (at least ``due``) completes."""
        chunks: list[ChunkOut] = []
        for stream in entry.streams:
            chunks += self._out(entry, stream, self.ledger.cut(stream, committed, False, now, wall))
        entry.due = min(map(self.ledger.next_cut, entry.streams))
        return chunks

    def _wake_later(self, rid: str, entry: _Producing, committed: int, earliest: int) -> None:
        """Schedule the next look at a request (not a session) at the first step its output
        could reach ``due``; none once nothing more is cut before its end."""
        if entry.due == float("inf"):
            return
        behind = int(entry.due) - committed
        steps = max(1, -(-behind // self._max_tokens_per_step))
        entry.wake_at = earliest + steps - 1
        self._wake.setdefault(entry.wake_at, []).append(rid)

    def finished(self, request: Any, completed: bool, reason: str = "") -> None:
        """The request finished: completed, its last chunks; else its streams end (the
        consumer told, with ``reason``)."""
        entry = self._open.get(request.request_id)
        if entry is None or entry.request is not request:
            return
        entry.finished = True
        completed = completed or entry.input_ended
        now, wall = self._clock(), time.time()
        chunks: list[ChunkOut] = []
        committed = entry.committed()
        entry.due = float("inf")  # nothing more is cut: a wake still scheduled finds nothing
        for stream in entry.streams:
            if stream.resolved:
                continue
            if completed:
                sent = self.ledger.cut(stream, committed, True, now, wall)
                chunks += self._out(entry, stream, sent)
            else:
                chunks.append(self._end(stream, StreamOutcome.ABORTED,
                                        reason or "the request was aborted", now))
        self._forget_resolved(request.request_id)
        self._flush(chunks)

    def turn_over(self, request: Any) -> None:
        """A session's turn is over (vLLM is about to fold its output into the prompt and
        start the list over): what it said is taken first."""
        entry = self._open.get(request.request_id)
        if entry is not None and entry.request is request and entry.session:
            entry.turn_over()

    def input_ended(self, request: Any) -> None:
        """A waiting session's input ended: vLLM finishes it as aborted, but it completed
        (its last chunks go out; a client's abort does not come this way)."""
        entry = self._open.get(request.request_id)
        if entry is not None and entry.request is request:
            entry.input_ended = True

    def answered(self, answers: list[ChunkAnswer]) -> None:
        """The workers' answers about chunks: acks let queued chunks go; a failure ends the
        stream (the consumer could not take it). One the sender gave up waiting for (the
        consumer hung, stopped, or too slow to answer) is also told to the consumer, which
        may be waiting for the next chunk: it ends its request now, naming itself, rather
        than at its gap deadline blaming the producer."""
        now = self._clock()
        chunks: list[ChunkOut] = []
        for rid, stage, seq, reason, unanswered in answers:
            stream = self.ledger.get(rid, stage)
            if stream is None:
                continue
            if reason is None:
                chunks += self._out(self._request_of(rid), stream,
                                    self.ledger.ack(stream, seq, now))
            elif self.ledger.fail(stream, seq, reason, now) is not None:
                logger.warning("the stream of request %s to %s failed: %s", rid, stage,
                               stream.reason)
                if unanswered:
                    chunks.append(self._out_end(stream, StreamOutcome.CONSUMER_ERROR,
                                                stream.reason or reason))
        for rid, *_ in answers:
            self._forget_resolved(rid)
        self._flush(chunks)

    def expire(self) -> None:
        """Streams past a deadline end (``expired``), the consumer told."""
        now = self._clock()
        expired = self.ledger.expire_due(now)
        if not expired:
            return
        chunks = []
        for stream in expired:
            logger.warning("stream expired: %s", stream.reason)
            chunks.append(self._out_end(stream, StreamOutcome.EXPIRED, stream.reason or ""))
        for stream in expired:
            self._forget_resolved(stream.request_id)
        self._flush(chunks)

    def close(self, reason: str) -> None:
        """Shutdown: every stream ends (``aborted``)."""
        now = self._clock()
        for stream in list(self.ledger):
            if not stream.resolved:
                self.ledger.resolve(stream.request_id, StreamOutcome.ABORTED, reason, now,
                                    peer=stream.peer)
        self._open.clear()
        self._sessions.clear()
        self._wake.clear()
        self._flush([])

    # ------------------------------------------------------------------ helpers
    def _forget_resolved(self, request_id: str) -> None:
        """Once none of a request's streams is open: nothing more is looked at, and the
        request is dropped once vLLM has freed it too (until then its tokens are what its
        queued chunks are cut from; a request that goes on keeps its entry, so that it
        opens no stream again)."""
        entry = self._open.get(request_id)
        if entry is not None and all(s.resolved for s in entry.streams):
            self._sessions.discard(request_id)
            entry.due = float("inf")
            if entry.finished:
                del self._open[request_id]

    def _request_of(self, request_id: str) -> _Producing | None:
        return self._open.get(request_id)

    def _out(self, entry: _Producing | None, stream: Stream,
             chunks: list[Chunk]) -> list[ChunkOut]:
        if not chunks or entry is None:
            return []
        request = entry.request
        give_up = SEND_MARGIN * stream.settings.gap_seconds
        trace_headers = getattr(request, "trace_headers", None)
        outs = []
        for chunk in chunks:
            tokens = entry.tokens(chunk.start, chunk.end)
            prompt_len = 0
            if chunk.seq == 0:
                tokens, prompt_len = entry.prompt + tokens, len(entry.prompt)
            outs.append(ChunkOut(
                request.request_id, stream.peer, chunk.seq, chunk.last, tokens, prompt_len,
                chunk.produced_at, give_up, entry.origin, trace_headers))
        return outs

    def _end(self, stream: Stream, outcome: StreamOutcome, reason: str,
             now: float) -> ChunkOut:
        self.ledger.resolve(stream.request_id, outcome, reason, now, peer=stream.peer)
        return self._out_end(stream, outcome, reason)

    @staticmethod
    def _out_end(stream: Stream, outcome: StreamOutcome, reason: str) -> ChunkOut:
        return ChunkOut(stream.request_id, stream.peer, stream.next_seq, False, (), 0,
                        time.time(), SEND_MARGIN * stream.settings.gap_seconds, end=outcome.value,
                        reason=reason[:1024])

    def _flush(self, chunks: list[ChunkOut]) -> None:
        """Sends the chunks, with those of every held stream that a resolution in this call
        gave an open slot (whichever way it resolved: an ack, a failure, an end, an expiry;
        the producing request may be done and never stepped again)."""
        unblocked = self.ledger.take_unblocked(self._clock())
        for stream, sent in unblocked:
            chunks += self._out(self._request_of(stream.request_id), stream, sent)
        if chunks:
            self._send(chunks)
        if not self.ledger and self._refresh is not None:
            # The last stream resolved: the engine may not step again until new work comes,
            # so the gauges say "none" now, not at the next step.
            self._refreshed = self._clock()
            self._refresh(self.ledger)

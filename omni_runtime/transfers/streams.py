"""The stream ledger: the bookkeeping of every streamed hand-off of one stage, on either end.

A streamed edge (omni_contract/edges.py) carries one **stream** per (request, edge): the
producer cuts the request's committed output into chunks (a first one of
``first_chunk_tokens``, then ``chunk_tokens`` each, the last one whatever is left, possibly
empty), numbered from 0, and sends them; the consumer applies them in order and acks each.
This module imports no vLLM, and takes the time from its callers (``now``, the monotonic
clock of the process), so every rule here is tested without an engine.

Producer (:class:`ProducerStreams`)::

    open ──cut──> chunks queued ──(credit)──> in flight ──ack──> acked
                                                    └──fail──> the stream: consumer_error

Consumer (:class:`ConsumerStreams`)::

    chunk arrives ──> early (buffered) | next (applied, then acked) | duplicate (acked again)

A stream resolves **exactly once**: ``finished`` (its last chunk acked, or applied),
``producer_error``, ``consumer_error``, ``expired`` or ``aborted``; then nothing of it is
left (checked by :meth:`_Streams.check_invariants`).

Deadlines, always on (the contract refuses a setting that would turn one off):
  * first chunk: the producer's chunk 0 acked within ``first_chunk_seconds`` of the open
    (whatever it waits for until then: a slot, a credit, the ack);
  * gap: a producer waits at most ``gap_seconds`` for a chunk's ack or for a credit; a
    consumer waits at most ``gap_seconds`` for its next chunk;
  * the whole stream: ``stream_seconds`` from its open, on both ends.

Credits: at most ``chunks_in_flight`` chunks of a stream sent and not acked; at most
``max_open_streams`` streams of an edge open at once on a producer (a stream over it is
*held*: its chunks queue until a stream of the edge resolves). Out of credit, a producer
holds (its chunks are queued, counted, and bound by the gap deadline), never drops. The
queue cannot grow without bound: a chunk is cut only from output the request already has,
and a request's output is bounded by its ``max_tokens``.

Invariants:
  * an unresolved stream is in ``_streams`` under its key, and (producer) in its edge's
    ``_open`` or ``_held_open`` set, never both;
  * a chunk is queued, in flight, or resolved; ``seq`` values of a stream are 0.. without a
    gap, and no chunk is sent twice (a preempted request's recompute cuts nothing new:
    chunks are cut from committed output, which a recompute does not un-commit);
  * a resolved stream holds no chunk and is in no set.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from omni_contract.edges import StreamSettings


def check_interval(settings: Iterable[StreamSettings]) -> float:
    """How often an end without steps of its own (a consumer's server) looks at its streams'
    deadlines and sets its gauges: a quarter of the shortest gap deadline, so a stream
    expires within a quarter gap of its deadline; at most half a second, the gauges' age."""
    return min(0.5, min(s.gap_seconds for s in settings) / 4)


class EndedStreams:
    """Streams that ended, each remembered until its own moment passes and at most ``limit``
    of them (the oldest forgotten first): a late or repeated chunk of one is refused rather
    than opening it again."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    def add(self, key: tuple[str, str], until: float) -> None:
        self._until[key] = until
        self._until.move_to_end(key)
        if len(self._until) > self.limit:
            self._until.popitem(last=False)

    def discard(self, key: tuple[str, str]) -> None:
        self._until.pop(key, None)

    def forget_due(self, now: float) -> None:
        """Forget those whose moment has passed (from the oldest, up to the first still due)."""
        until = self._until
        while until:
            key, moment = next(iter(until.items()))
            if moment > now:
                break
            del until[key]

    def remembers(self, key: tuple[str, str], now: float) -> bool:
        return self._until.get(key, now) > now

    def __len__(self) -> int:
        return len(self._until)


class StreamOutcome(str, enum.Enum):
    FINISHED = "finished"
    PRODUCER_ERROR = "producer_error"
    CONSUMER_ERROR = "consumer_error"
    EXPIRED = "expired"
    ABORTED = "aborted"


#: The outcomes of a stream at its consumer that are its producer's doing: it stopped sending
#: (a deadline passed waiting for its next chunk) or said it failed. A failure a consumer
#: reports with one of these names the producer's stage as the one at fault.
PRODUCERS_DOING = frozenset({StreamOutcome.EXPIRED, StreamOutcome.PRODUCER_ERROR})


class ChunkOutcome(str, enum.Enum):
    ACKED = "acked"
    FAILED = "failed"
    EXPIRED = "expired"


@dataclass(slots=True, eq=False)
class Chunk:
    """Output tokens ``[start, end)`` of the producer's request (offsets into its output);
    ``last``: nothing follows it. ``produced_at``: unix time it was cut (for the hop time,
    measured where it becomes consumable)."""

    seq: int
    start: int
    end: int
    last: bool
    produced_at: float
    #: Monotonic time it was sent (producer) or arrived (consumer); None while queued.
    sent_at: float | None = None
    #: Consumer: seconds since the stream's previous chunk arrived (None for the first).
    gap: float | None = None


@dataclass(slots=True, eq=False)
class Stream:
    request_id: str
    #: The stage at the edge's other end (the consumer's on a producer, and the reverse).
    peer: str
    settings: StreamSettings
    opened_at: float
    #: Producer: output tokens cut into chunks so far, and whether the last chunk was cut.
    cut: int = 0
    ended: bool = False
    next_seq: int = 0
    queued: deque[Chunk] = field(default_factory=deque)
    in_flight: dict[int, Chunk] = field(default_factory=dict)
    #: Consumer: chunks that arrived ahead of the next one, by seq.
    early: dict[int, Chunk] = field(default_factory=dict)
    #: When it began to wait: for a chunk (consumer), for an ack or a credit (producer);
    #: None while not waiting.
    waiting_since: float | None = None
    #: Consumer: when the latest chunk taken in order arrived.
    last_arrival: float | None = None
    #: When it ran out of credit (producer), for the time spent so.
    held_since: float | None = None
    #: The last chunk's time on this end (consumer: arrival; producer: ack), for the gap.
    last_chunk_at: float | None = None
    first_chunk_at: float | None = None
    outcome: StreamOutcome | None = None
    reason: str | None = None
    #: The producing request's W3C trace headers (its span joins the request's trace).
    trace_headers: Mapping[str, str] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.request_id, self.peer

    @property
    def resolved(self) -> bool:
        return self.outcome is not None

    def describe(self, seq: int | None = None) -> str:
        where = f", chunk {seq}" if seq is not None else ""
        return f"stream of request {self.request_id} ({self.peer}{where})"


class StreamObserver:
    """What the metrics and the spans hear. Every hook is called right after the change."""

    def on_opened(self, end: _Streams, stream: Stream) -> None:
        pass

    def on_chunk(self, end: _Streams, stream: Stream, chunk: Chunk, outcome: ChunkOutcome,
                 now: float) -> None:
        pass

    def on_resolved(self, end: _Streams, stream: Stream, now: float) -> None:
        pass

    def on_credit(self, end: _Streams, stream: Stream, seconds: float) -> None:
        """A producer's stream was out of credit for ``seconds`` (counted when it ends)."""


class _Streams:
    """What both ends share: the streams by key, the deadlines, exactly-once resolution."""

    side = ""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, str], Stream] = {}
        #: Per request id, its unresolved streams by peer (a request's streams without a scan).
        self._by_request: dict[str, dict[str, Stream]] = {}
        self._observers: list[StreamObserver] = []
        #: (deadline, tie, key): for every unresolved stream, an entry no later than each of
        #: its deadlines (the whole stream's, the first chunk's, the gap's), so that a step
        #: looks only at the streams whose time may have come. An entry that surfaces early
        #: (its stream resolved, or no longer waiting since then) is dropped or pushed again
        #: at the stream's next deadline.
        self._deadlines: list[tuple[float, int, tuple[str, str]]] = []
        self._tie = 0

    def add_observer(self, observer: StreamObserver) -> None:
        self._observers.append(observer)

    def get(self, request_id: str, peer: str) -> Stream | None:
        return self._streams.get((request_id, peer))

    def of_request(self, request_id: str) -> list[Stream]:
        return list(self._by_request.get(request_id, {}).values())

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(list(self._streams.values()))

    def _track(self, stream: Stream) -> None:
        self._streams[stream.key] = stream
        self._by_request.setdefault(stream.request_id, {})[stream.peer] = stream
        self._due(stream, stream.opened_at + stream.settings.stream_seconds)
        for observer in self._observers:
            observer.on_opened(self, stream)

    def _due(self, stream: Stream, deadline: float) -> None:
        self._tie += 1
        heapq.heappush(self._deadlines, (deadline, self._tie, stream.key))

    def _wait(self, stream: Stream, since: float | None) -> None:
        """The stream waits from ``since`` (None: it does not wait); its gap deadline is due.
        An entry is pushed only where the stream's next deadline may come earlier than
        before (it did not wait, or waits since earlier): a later one is found by the entry
        already there, which surfaces early and is pushed again."""
        before = stream.waiting_since
        stream.waiting_since = since
        if since is not None and (before is None or since < before):
            self._due(stream, since + stream.settings.gap_seconds)

    def _chunk_resolved(self, stream: Stream, chunk: Chunk, outcome: ChunkOutcome,
                        now: float) -> None:
        for observer in self._observers:
            observer.on_chunk(self, stream, chunk, outcome, now)

    def _resolve(self, stream: Stream, outcome: StreamOutcome, reason: str | None,
                 now: float) -> Stream:
        """Ends ``stream`` once: its chunks not acked resolve with it (failed, or expired
        when the stream expired), and nothing of it stays."""
        assert stream.outcome is None, "a stream resolves once"
        stream.outcome, stream.reason = outcome, reason
        chunk_outcome = ChunkOutcome.EXPIRED if outcome is StreamOutcome.EXPIRED \
            else ChunkOutcome.FAILED
        for chunk in sorted(stream.in_flight.values(), key=lambda c: c.seq):
            self._chunk_resolved(stream, chunk, chunk_outcome, now)
        stream.in_flight.clear()
        stream.queued.clear()
        stream.early.clear()
        self._end_hold(stream, now)
        stream.waiting_since = None
        del self._streams[stream.key]
        peers = self._by_request[stream.request_id]
        del peers[stream.peer]
        if not peers:
            del self._by_request[stream.request_id]
        self._released(stream, now)
        for observer in self._observers:
            observer.on_resolved(self, stream, now)
        return stream

    def _released(self, stream: Stream, now: float) -> None:
        """A stream left: what it held goes back (the producer's open-stream credit)."""

    def _end_hold(self, stream: Stream, now: float) -> None:
        if stream.held_since is not None:
            seconds = now - stream.held_since
            stream.held_since = None
            for observer in self._observers:
                observer.on_credit(self, stream, seconds)

    def resolve(self, request_id: str, outcome: StreamOutcome, reason: str | None,
                now: float, peer: str | None = None) -> list[Stream]:
        """Ends the request's streams (on one edge with ``peer``): an abort, an error of
        this end, or word from the other end that the stream ended."""
        streams = [self._streams[(request_id, peer)]] if peer is not None and \
            (request_id, peer) in self._streams else ([] if peer is not None
                                                      else self.of_request(request_id))
        return [self._resolve(s, outcome, reason, now) for s in streams]

    def expire_due(self, now: float) -> list[Stream]:
        """Resolves (``expired``) every stream past a deadline; returns them. Costs the
        entries due by ``now``, not the open streams."""
        expired: list[Stream] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, key = heapq.heappop(heap)
            stream = self._streams.get(key)
            if stream is None:
                continue
            why = self._overdue(stream, now)
            if why is not None:
                expired.append(self._resolve(stream, StreamOutcome.EXPIRED, why, now))
                continue
            # Early: it stopped waiting, or waits since later. Its next deadline is due
            # again (later than ``now``: ``_overdue`` and ``_next_deadline`` agree).
            self._due(stream, self._next_deadline(stream))
        return expired

    def _next_deadline(self, stream: Stream) -> float:
        deadline = stream.opened_at + stream.settings.stream_seconds
        if stream.waiting_since is not None:
            deadline = min(deadline, stream.waiting_since + stream.settings.gap_seconds)
        return deadline

    def _overdue(self, stream: Stream, now: float) -> str | None:
        s = stream.settings
        if now >= stream.opened_at + s.stream_seconds:
            return f"{stream.describe()} outlived its {s.stream_seconds:g} s deadline"
        if stream.waiting_since is not None and now >= stream.waiting_since + s.gap_seconds:
            return (f"{stream.describe()} waited over its {s.gap_seconds:g} s gap deadline "
                    f"({self._waits_for})")
        return None

    _waits_for = ""

    #: The state this end counts besides ``open``, and the stream's field that puts it there.
    _state = ("", "")

    def counts(self) -> dict[str, dict[str, int]]:
        """Per peer stage, the streams in each state now (the ``omni_kv_streams`` gauge)."""
        state, since = self._state
        counts: dict[str, dict[str, int]] = {}
        for stream in self._streams.values():
            by_state = counts.setdefault(stream.peer, {"open": 0, state: 0})
            by_state["open"] += 1
            if getattr(stream, since) is not None:
                by_state[state] += 1
        return counts

    def oldest_wait(self) -> dict[str, float]:
        """Per peer stage, the monotonic time at which the stream waiting longest began to
        wait (absent: none waits)."""
        oldest: dict[str, float] = {}
        for stream in self._streams.values():
            since = stream.waiting_since
            if since is not None and (stream.peer not in oldest or since < oldest[stream.peer]):
                oldest[stream.peer] = since
        return oldest

    def check_invariants(self) -> None:
        due: dict[tuple[str, str], float] = {}
        for deadline, _, key in self._deadlines:
            due[key] = min(deadline, due.get(key, deadline))
        for key, stream in self._streams.items():
            assert self._by_request[stream.request_id][stream.peer] is stream
            assert due.get(key, float("inf")) <= self._next_deadline(stream), \
                f"no deadline entry due by the stream's next deadline: {key}"
        assert sum(map(len, self._by_request.values())) == len(self._streams)
        self._check_streams()

    def check_expired(self, now: float) -> None:
        """After ``expire_due(now)``: no stream left is past a deadline."""
        for stream in self._streams.values():
            assert self._overdue(stream, now) is None, stream.key

    def _check_streams(self) -> None:
        for key, stream in self._streams.items():
            assert stream.key == key and stream.outcome is None
            seqs = sorted([*(c.seq for c in stream.queued), *stream.in_flight])
            assert len(seqs) == len(set(seqs)), f"a chunk is both queued and in flight: {key}"
            assert all(s < stream.next_seq for s in seqs)


class ProducerStreams(_Streams):
    """A producing stage's streams: cuts chunks by the edge's cadence, sends within the
    credits, resolves on the acks, the deadlines or an end."""

    side = "producer"
    _waits_for = "for an ack or a credit"

    def __init__(self) -> None:
        super().__init__()
        #: Per edge (the consumer's stage), the streams open and the ones held for a slot.
        self._open: dict[str, set[tuple[str, str]]] = {}
        self._held_open: dict[str, deque[tuple[str, str]]] = {}
        #: Streams given an open slot by another's end, whose queued chunks can go now: the
        #: caller takes them with :meth:`take_unblocked` and sends them.
        self._unblocked: list[Stream] = []

    def open(self, request_id: str, to_stage: str, settings: StreamSettings,
             now: float, trace_headers: Mapping[str, str] | None = None) -> Stream:
        """A stream for the request toward ``to_stage``; held (its chunks queued) while the
        edge has ``max_open_streams`` open."""
        assert (request_id, to_stage) not in self._streams, "one stream per (request, edge)"
        stream = Stream(request_id, to_stage, settings, now, trace_headers=trace_headers)
        self._track(stream)
        self._due(stream, now + settings.first_chunk_seconds)
        opened = self._open.setdefault(to_stage, set())
        if len(opened) < settings.max_open_streams:
            opened.add(stream.key)
        else:
            self._held_open.setdefault(to_stage, deque()).append(stream.key)
            self._hold(stream, now)
        return stream

    def _hold(self, stream: Stream, now: float) -> None:
        if stream.held_since is None:
            stream.held_since = now
        if stream.waiting_since is None:
            self._wait(stream, now)

    def is_open(self, stream: Stream) -> bool:
        return stream.key in self._open.get(stream.peer, ())

    def cut(self, stream: Stream, committed: int, finished: bool, now: float,
            wall_now: float) -> list[Chunk]:
        """Cuts what ``committed`` output tokens (and, with ``finished``, the request's end)
        complete into chunks, and returns the chunks to send now (within the credits)."""
        if stream.resolved or stream.ended:
            return []
        s = stream.settings
        cut_before = stream.next_seq
        while True:
            size = s.first_chunk_tokens if stream.next_seq == 0 else s.chunk_tokens
            if committed - stream.cut >= size and not (finished and committed - stream.cut == size):
                end = stream.cut + size
                last = False
            elif finished:
                end, last = committed, True
            else:
                break
            stream.queued.append(Chunk(stream.next_seq, stream.cut, end, last, wall_now))
            stream.next_seq += 1
            stream.cut = end
            if last:
                stream.ended = True
                break
        if stream.next_seq == cut_before:
            # Nothing new: what is queued waits for an ack or a slot, which send it.
            return []
        return self._send(stream, now)

    @staticmethod
    def next_cut(stream: Stream) -> float:
        """The committed output at which the stream's next chunk is complete (infinite once
        its last chunk is cut or it resolved): below it, :meth:`cut` has nothing to cut but
        a request's end."""
        if stream.resolved or stream.ended:
            return float("inf")
        s = stream.settings
        return stream.cut + (s.first_chunk_tokens if stream.next_seq == 0 else s.chunk_tokens)

    def _send(self, stream: Stream, now: float) -> list[Chunk]:
        sent: list[Chunk] = []
        if self.is_open(stream):
            limit = stream.settings.chunks_in_flight
            while stream.queued and len(stream.in_flight) < limit:
                chunk = stream.queued.popleft()
                chunk.sent_at = now
                stream.in_flight[chunk.seq] = chunk
                sent.append(chunk)
        if stream.queued:
            self._hold(stream, now)
        else:
            self._end_hold(stream, now)
            self._wait(stream, min((c.sent_at for c in stream.in_flight.values()),
                                   default=None))
        return sent

    def ack(self, stream: Stream, seq: int, now: float) -> list[Chunk]:
        """Chunk ``seq`` acked (a late or repeated ack changes nothing); returns the chunks
        its credit lets go now. The last chunk's ack finishes the stream."""
        chunk = stream.in_flight.pop(seq, None)
        if chunk is None or stream.resolved:
            return []
        first = stream.first_chunk_at is None
        if first:
            stream.first_chunk_at = now
        stream.last_chunk_at = now
        self._chunk_resolved(stream, chunk, ChunkOutcome.ACKED, now)
        if chunk.last:
            # In order on one connection: every earlier chunk was acked first.
            for earlier in sorted(stream.in_flight.values(), key=lambda c: c.seq):
                self._chunk_resolved(stream, earlier, ChunkOutcome.ACKED, now)
            stream.in_flight.clear()
            self._resolve(stream, StreamOutcome.FINISHED, None, now)
            return []
        sent = self._send(stream, now)
        if first and stream.waiting_since is not None:
            # From now on the gap bounds it, and it may have waited since before the ack.
            self._due(stream, self._next_deadline(stream))
        return sent

    def fail(self, stream: Stream, seq: int, reason: str, now: float) -> Stream | None:
        """Chunk ``seq`` failed on its way or was refused by the consumer: the stream ends
        (``consumer_error``); the consumer's request cannot go on without the chunk."""
        if stream.resolved or seq not in stream.in_flight:
            return None
        return self._resolve(stream, StreamOutcome.CONSUMER_ERROR,
                             f"{stream.describe(seq)}: {reason}", now)

    def _overdue(self, stream: Stream, now: float) -> str | None:
        s = stream.settings
        if stream.first_chunk_at is None:
            # Until its first chunk is taken (a slot, a credit, the ack) the first-chunk
            # deadline is the stream's bound, not the gap.
            if now >= stream.opened_at + s.stream_seconds:
                return f"{stream.describe()} outlived its {s.stream_seconds:g} s deadline"
            if now >= stream.opened_at + s.first_chunk_seconds:
                return (f"{stream.describe(0)} was not taken within its "
                        f"{s.first_chunk_seconds:g} s first-chunk deadline")
            return None
        return super()._overdue(stream, now)

    def _next_deadline(self, stream: Stream) -> float:
        if stream.first_chunk_at is None:
            s = stream.settings
            return stream.opened_at + min(s.first_chunk_seconds, s.stream_seconds)
        return super()._next_deadline(stream)

    def _released(self, stream: Stream, now: float) -> None:
        opened = self._open.get(stream.peer)
        if opened is not None and stream.key in opened:
            opened.discard(stream.key)
            held = self._held_open.get(stream.peer)
            while held and len(opened) < stream.settings.max_open_streams:
                key = held.popleft()
                waiting = self._streams.get(key)
                if waiting is not None:
                    opened.add(key)
                    self._unblocked.append(waiting)
        else:
            held = self._held_open.get(stream.peer)
            if held is not None and stream.key in held:
                held.remove(stream.key)

    def take_unblocked(self, now: float) -> list[tuple[Stream, list[Chunk]]]:
        unblocked, self._unblocked = self._unblocked, []
        return [(s, self._send(s, now)) for s in unblocked if not s.resolved]

    #: Open streams out of credit (a slot or a chunk's) are ``held``.
    _state = ("held", "held_since")

    def _check_streams(self) -> None:
        super()._check_streams()
        for peer, opened in self._open.items():
            held = set(self._held_open.get(peer, ()))
            assert not opened & held
            for key in opened | held:
                assert key in self._streams, f"a resolved stream keeps a slot: {key}"
        for stream in self._streams.values():
            assert self.is_open(stream) or stream.key in self._held_open.get(stream.peer, ())
            assert len(stream.in_flight) <= stream.settings.chunks_in_flight


class ConsumerStreams(_Streams):
    """A consuming stage's streams: takes chunks in order whatever order they arrive in,
    acks a repeated one without applying it again, resolves on the last chunk, the
    deadlines, or an end."""

    side = "consumer"
    _waits_for = "for its next chunk"
    #: Resolved streams remembered at most, so that a late or repeated chunk of one is
    #: refused rather than opening it again (each kept for its ``stream_seconds``).
    MAX_REMEMBERED = 65536

    def __init__(self) -> None:
        super().__init__()
        self._gone = EndedStreams(self.MAX_REMEMBERED)

    def _released(self, stream: Stream, now: float) -> None:
        self._gone.add(stream.key, now + stream.settings.stream_seconds)

    def reopen(self, request_id: str, from_stage: str) -> None:
        """A new stream of ``request_id`` from ``from_stage`` begins (its producer's request is
        a new one): the one of that key resolved here before is no longer remembered."""
        self._gone.discard((request_id, from_stage))

    def expire_due(self, now: float) -> list[Stream]:
        self._gone.forget_due(now)
        return super().expire_due(now)

    def remembered(self) -> int:
        """Resolved streams still remembered (gone after their ``stream_seconds``)."""
        return len(self._gone)

    def arrive(self, request_id: str, from_stage: str, seq: int, last: bool,
               produced_at: float, settings: StreamSettings,
               now: float) -> tuple[str, list[Chunk]]:
        """A chunk arrived: (``"next"``, the chunks to apply now, in order) for the one the
        stream waits for (with the early ones it lets through); (``"early"``, []) for one
        ahead, kept until its turn; (``"duplicate"``, []) for one already applied: ack it
        again, do not apply it; (``"refused"``, []) for one more than a credit ahead, or of a
        stream resolved here (never opened again)."""
        stream = self._streams.get((request_id, from_stage))
        if stream is None:
            if self._gone.remembers((request_id, from_stage), now):
                return "refused", []
            if seq != 0 and not 0 < seq < settings.chunks_in_flight:
                return "refused", []
            stream = Stream(request_id, from_stage, settings, now)
            self._track(stream)
            self._wait(stream, now)
        chunk = Chunk(seq, 0, 0, last, produced_at, now)
        if seq < stream.next_seq:
            return "duplicate", []
        if seq - stream.next_seq >= stream.settings.chunks_in_flight:
            return "refused", []
        if seq > stream.next_seq:
            stream.early[seq] = chunk
            return "early", []
        ready = [chunk]
        stream.next_seq += 1
        while not ready[-1].last and stream.next_seq in stream.early:
            ready.append(stream.early.pop(stream.next_seq))
            stream.next_seq += 1
        for taken in ready:
            if stream.last_arrival is not None:
                taken.gap = max(0.0, taken.sent_at - stream.last_arrival)
            stream.last_arrival = taken.sent_at
            stream.in_flight[taken.seq] = taken
        stream.waiting_since = None
        return "next", ready

    def applied(self, stream: Stream, seq: int, now: float) -> None:
        """Chunk ``seq`` is in the request (its ack goes back); after the last one, the stream
        is finished."""
        chunk = stream.in_flight.pop(seq, None)
        if chunk is None or stream.resolved:
            return
        if stream.first_chunk_at is None:
            stream.first_chunk_at = now
        stream.last_chunk_at = now
        self._chunk_resolved(stream, chunk, ChunkOutcome.ACKED, now)
        if chunk.last:
            self._resolve(stream, StreamOutcome.FINISHED, None, now)
        elif not stream.in_flight:
            self._wait(stream, now)

    def refused(self, stream: Stream, seq: int, reason: str, now: float) -> Stream | None:
        """The request could not take chunk ``seq`` (over its budget, its model's limit): the
        stream ends (``consumer_error``) for that request alone."""
        if stream.resolved:
            return None
        return self._resolve(stream, StreamOutcome.CONSUMER_ERROR,
                             f"{stream.describe(seq)}: {reason}", now)

    #: Open streams waiting for their next chunk are ``waiting``.
    _state = ("waiting", "waiting_since")

    def _check_streams(self) -> None:
        for key, stream in self._streams.items():
            assert stream.key == key and stream.outcome is None
            assert all(seq > stream.next_seq for seq in stream.early)
            assert all(seq < stream.next_seq for seq in stream.in_flight)

"""Prometheus metrics of one stage's streams (the ``omni_kv_stream*`` families of
omni_contract/metrics.py), on either end of a streamed edge, fed by the stream ledger
(omni_runtime/transfers/streams.py).

Each edge's children are bound once, when the edge is named (the stage config names every
edge at start-up, so the ``from_stage``/``to_stage`` values are bounded and every series
exists from the first scrape). Counters and histograms are written by the ledger's hooks;
the gauges (streams by state, the oldest wait) are set from the ledger's own counts by
:meth:`StreamMetrics.refresh`, which the stage calls once per step or tick, never inc/dec'd.
The oldest wait is a unix timestamp, 0 when none waits: stalled is
``time() - (x > 0) > threshold``, as for the transfers.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from types import MappingProxyType

from prometheus_client import CollectorRegistry

from omni_contract.edges import StreamSettings
from omni_contract.metrics import (
    STREAM_CHUNK_GAP,
    STREAM_CHUNK_HOP,
    STREAM_CHUNKS,
    STREAM_CREDIT_EXHAUSTED,
    STREAM_FIRST_CHUNK,
    STREAM_OLDEST_WAIT,
    STREAMS,
    STREAMS_RESOLVED,
)
from omni_runtime.observability.metrics import duration_buckets, register
from omni_runtime.transfers.streams import (
    Chunk,
    ChunkOutcome,
    ConsumerStreams,
    ProducerStreams,
    Stream,
    StreamObserver,
    StreamOutcome,
    _Streams,
)

logger = logging.getLogger(__name__)

#: Seconds buckets of the chunk hop and gap: a chunk's hop is milliseconds, a gap a few
#: decode steps; the deadlines' own values are added.
HOP_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                  2.5, 5.0, 10.0)
STATES = {"producer": ("open", "held"), "consumer": ("open", "waiting")}


class _Edge:
    """One edge's bound children, on this end."""

    def __init__(self, families: StreamMetrics, labels: tuple[str, ...], side: str) -> None:
        f = families
        self.states = {state: f.streams.labels(*labels, state) for state in STATES[side]}
        self.oldest = f.oldest.labels(*labels)
        self.chunks = {o: f.chunks.labels(*labels, o.value) for o in ChunkOutcome}
        self.resolved = {o: f.resolved.labels(*labels, o.value) for o in StreamOutcome}
        self.first = f.first.labels(*labels)
        self.hop = f.hop.labels(*labels)
        self.gap = f.gap.labels(*labels)
        self.credit = f.credit.labels(*labels)
        for child in (*self.states.values(), self.oldest):
            child.set(0)


class _Families:
    """The registered (unbound) stream families of one registry."""

    def __init__(self, registry: CollectorRegistry | None, deadlines: tuple[float | None, float | None]
                 ) -> None:
        self.registry, self.deadlines = registry, deadlines
        first_chunk, gap = deadlines
        self.streams = register(STREAMS, registry)
        self.oldest = register(STREAM_OLDEST_WAIT, registry)
        self.chunks = register(STREAM_CHUNKS, registry)
        self.resolved = register(STREAMS_RESOLVED, registry)
        self.first = register(STREAM_FIRST_CHUNK, registry, duration_buckets(first_chunk))
        buckets = tuple(sorted(set(HOP_BUCKETS) | ({float(gap)} if gap else set())))
        self.hop = register(STREAM_CHUNK_HOP, registry, buckets)
        self.gap = register(STREAM_CHUNK_GAP, registry, buckets)
        self.credit = register(STREAM_CREDIT_EXHAUSTED, registry)


# Process-wide per registry, as the transfer families (metrics.py): a second stream ledger in
# one process (vLLM re-creating an in-process engine, a test's schedulers) reuses them.
_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


def _families_for(registry: CollectorRegistry | None,
                  deadlines: tuple[float | None, float | None]) -> _Families:
    """The registry's families, registered with the buckets of the first deadlines asked for.
    A later ledger with other deadlines (a stage that both consumes and produces streams, its
    engine in-process) writes to the same families: re-registering them would leave the
    earlier one's series writing nowhere; its deadlines then have no bucket of their own."""
    if registry is None:
        return _Families(None, deadlines)
    families = _families.get(registry)
    if families is None:
        families = _families[registry] = _Families(registry, deadlines)
    elif families.deadlines != deadlines:
        logger.info("KV stream metrics keep the histogram buckets of deadlines %s (first chunk, "
                    "gap); %s get none of their own", families.deadlines, deadlines)
    return families


class StreamMetrics(StreamObserver):
    """The stream families of one stage in ``registry``, for the ends it has (a
    :class:`ProducerStreams` toward ``to_stages``, a :class:`ConsumerStreams` from
    ``from_stages``, each edge by its settings). The time histograms reach the longest gap
    deadline of the edges: a wait that long is one the deadline cut."""

    def __init__(self, stage: str, model_name: str, registry: CollectorRegistry | None, *,
                 to_stages: Mapping[str, StreamSettings] = MappingProxyType({}),
                 from_stages: Mapping[str, StreamSettings] = MappingProxyType({})) -> None:
        edges = (*to_stages.values(), *from_stages.values())
        f = _families_for(registry, (max((s.first_chunk_seconds for s in edges), default=None),
                                     max((s.gap_seconds for s in edges), default=None)))
        self.streams, self.oldest, self.chunks, self.resolved = (
            f.streams, f.oldest, f.chunks, f.resolved)
        self.first, self.hop, self.gap, self.credit = f.first, f.hop, f.gap, f.credit
        self._edges: dict[tuple[str, str], _Edge] = {}
        for to_stage in to_stages:
            self._edges[("producer", to_stage)] = _Edge(
                self, (stage, model_name, stage, to_stage), "producer")
        for from_stage in from_stages:
            self._edges[("consumer", from_stage)] = _Edge(
                self, (stage, model_name, from_stage, stage), "consumer")

    def _edge(self, end: _Streams, stream: Stream) -> _Edge | None:
        return self._edges.get((end.side, stream.peer))

    def on_chunk(self, end: _Streams, stream: Stream, chunk: Chunk, outcome: ChunkOutcome,
                 now: float) -> None:
        edge = self._edge(end, stream)
        if edge is None:
            return
        edge.chunks[outcome].inc()
        if outcome is not ChunkOutcome.ACKED:
            return
        if isinstance(end, ProducerStreams):
            if chunk.seq == 0:  # the producer opened the stream at its request's start
                edge.first.observe(max(0.0, now - stream.opened_at))
        else:
            edge.hop.observe(max(0.0, time.time() - chunk.produced_at))
            if chunk.gap is not None:
                edge.gap.observe(chunk.gap)

    def on_resolved(self, end: _Streams, stream: Stream, now: float) -> None:
        edge = self._edge(end, stream)
        if edge is not None:
            edge.resolved[stream.outcome].inc()

    def on_credit(self, end: _Streams, stream: Stream, seconds: float) -> None:
        edge = self._edge(end, stream)
        if edge is not None and seconds > 0:
            edge.credit.inc(seconds)

    def refresh(self, *ends: ProducerStreams | ConsumerStreams, now: float | None = None) -> None:
        """Sets the gauges of each end's edges from the ledger's counts (absolute values)."""
        now = time.monotonic() if now is None else now
        wall = time.time()
        for end in ends:
            counts = end.counts()
            oldest = end.oldest_wait()
            for (side, peer), edge in self._edges.items():
                if side != end.side:
                    continue
                by_state = counts.get(peer, {})
                for state, child in edge.states.items():
                    child.set(by_state.get(state, 0))
                since = oldest.get(peer)
                edge.oldest.set(0 if since is None else wall - (now - since))

"""Per-edge KV-transfer metrics of an AR stage: one series set per downstream stage.

A stage that sends KV ships each transfer to every downstream stage of the pipeline graph (a
thinker fanning out to a talker and a vocoder has two edges). The contract's families in
:mod:`.metrics` resolve a transfer once, overall, from the ledger; these families say what
happened on each edge, with a bounded ``to_stage`` label (one value per downstream stage,
known at start-up from the stage config's ``downstream`` or the connector's ``endpoints``):

==================================================== ========= ===================================
family                                               type      labels (besides stage, model_name)
==================================================== ========= ===================================
``omni_kv_edge_transfers_active``                    gauge     to_stage
``omni_kv_edge_oldest_active_start_timestamp_seconds`` gauge   to_stage (0 when none)
``omni_kv_edge_transfers_held``                      gauge     to_stage
``omni_kv_edge_held_blocks``                         gauge     to_stage
``omni_kv_edge_oldest_held_start_timestamp_seconds`` gauge     to_stage (0 when none)
``omni_kv_edge_transfers_resolved_total``            counter   to_stage, outcome
``omni_kv_edge_transfer_duration_seconds``           histogram to_stage, outcome
``omni_kv_edge_transfer_bytes``                      histogram to_stage
==================================================== ========= ===================================

Held per edge: the active transfers toward ``to_stage`` whose request has finished, so that
vLLM keeps all of its KV blocks until every edge has answered; an edge counts them (and their
blocks) until it answers, so the edge that keeps a finished request's blocks allocated names
itself. A transfer still pending (not handed off) is on no edge yet: ``pending`` stays a
stage's figure (``omni_kv_transfers{state="pending"}``).

``outcome`` per edge is ``acked`` (this stage's receiver stored it), ``failed`` (it refused,
was unreachable, or the send gave up) or ``expired`` (the transfer's deadline passed with this
edge unanswered). A transfer cancelled before hand-off never reached an edge.

Who feeds them (docs/metrics.md, "Per-edge families"):

* a stage with one downstream stage: its ledger (:class:`LedgerEdgeObserver`, attached by
  ``build_observers``): with one edge, the transfer's fate is the edge's; the data path adds
  only the bytes (:func:`edge_bytes_observer`);
* a stage that fans out: the data path, through the :class:`EdgeMetrics` that
  :func:`data_path_edge_metrics` gives it: :meth:`EdgeMetrics.started` when it takes a transfer
  (``held=`` when its request had already finished), :meth:`EdgeMetrics.held` when the request
  of a transfer it has taken finishes (the scheduler says so in the next step's metadata),
  :meth:`EdgeMetrics.resolved` once per edge as that edge answers (or
  :meth:`EdgeMetrics.record` when it tracks the transfer itself), :meth:`EdgeMetrics.dropped`
  for an attempt superseded before its edges answered.

Every method is thread-safe and never raises: the sender's I/O thread and the engine's thread
may both call it. The in-flight state kept here is one entry per unresolved (transfer, edge):
bounded by the transfers in flight.

Multiprocess mode as in :mod:`.metrics`: gauges ``livemostrecent`` (each write supersedes a
dead or earlier process's value), counters and histograms summed over processes. The scheduler
process creates every series at start-up (:func:`omni_runtime.observability.observers.build_observers`),
so they exist, at 0, before the data path's first transfer.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable

from prometheus_client import REGISTRY, CollectorRegistry

from omni_contract.metrics import (
    EDGE_ACTIVE,
    EDGE_BYTES,
    EDGE_DURATION,
    EDGE_FAMILIES,
    EDGE_HELD,
    EDGE_HELD_BLOCKS,
    EDGE_OLDEST_ACTIVE,
    EDGE_OLDEST_HELD,
    EDGE_RESOLVED,
    TO_STAGE_LABELS,
    Family,
)
from omni_runtime.observability.metrics import (
    BYTES_BUCKETS,
    register,
    _Histogram,
    _Latest,
    duration_buckets,
)
from omni_runtime.observability.writer_thread import WriterThread, WritesOffStep
from omni_runtime.transfers.ledger import (
    DEFAULT_TIMEOUT_SECONDS,
    Batch,
    Outcome,
    TransferLedger,
    TransferObserver,
)

logger = logging.getLogger(__name__)

EDGE_LABELS: tuple[str, ...] = TO_STAGE_LABELS
#: What an edge can resolve as (a cancellation happens before any edge is attempted).
EDGE_OUTCOMES: tuple[str, ...] = ("acked", "failed", "expired")

FAMILIES: tuple[Family, ...] = EDGE_FAMILIES
FAMILIES_BY_NAME = {f.name: f for f in FAMILIES}


class _Families:
    def __init__(self, registry: CollectorRegistry | None, buckets: tuple[float, ...]) -> None:
        self.registry = registry
        self.buckets = buckets
        self.active = register(EDGE_ACTIVE, registry)
        self.oldest = register(EDGE_OLDEST_ACTIVE, registry)
        self.held = register(EDGE_HELD, registry)
        self.held_blocks = register(EDGE_HELD_BLOCKS, registry)
        self.oldest_held = register(EDGE_OLDEST_HELD, registry)
        self.resolved = register(EDGE_RESOLVED, registry)
        self.duration = register(EDGE_DURATION, registry, buckets)
        self.bytes = register(EDGE_BYTES, registry, BYTES_BUCKETS)

    def unregister(self) -> None:
        if self.registry is not None:
            for c in (self.active, self.oldest, self.held, self.held_blocks, self.oldest_held,
                      self.resolved, self.duration, self.bytes):
                self.registry.unregister(c)


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_unregistered: dict[tuple[float, ...], _Families] = {}
_families_lock = threading.Lock()


def _families_for(registry: CollectorRegistry | None, buckets: tuple[float, ...]) -> _Families:
    with _families_lock:
        if registry is None:
            fams = _unregistered.get(buckets)
            if fams is None:
                fams = _unregistered[buckets] = _Families(None, buckets)
            return fams
        fams = _families.get(registry)
        if fams is not None and fams.buckets != buckets:
            fams.unregister()  # a new deadline re-buckets the duration histogram
            fams = None
        if fams is None:
            fams = _families[registry] = _Families(registry, buckets)
        return fams


class _Edge:
    """One downstream stage's bound children and its unresolved transfers; ``held`` is the
    part of ``inflight`` whose request has finished (every key of ``held`` is in
    ``inflight``)."""

    __slots__ = ("resolved", "duration", "bytes", "active", "oldest", "inflight", "ordered",
                 "held", "held_block_count", "held_heap", "held_seq", "held_count", "held_blocks",
                 "oldest_held")

    def __init__(self, fams: _Families, base: tuple[str, str], to_stage: str) -> None:
        labels = (*base, to_stage)
        self.resolved = {o: fams.resolved.labels(*labels, o) for o in EDGE_OUTCOMES}
        self.duration = {o: _Histogram(fams.duration.labels(*labels, o)) for o in EDGE_OUTCOMES}
        self.bytes = fams.bytes.labels(*labels)
        self.active = _Latest(fams.active.labels(*labels))
        self.oldest = _Latest(fams.oldest.labels(*labels))
        #: transfer id -> (wall time, monotonic time) it started toward this edge, in start order.
        self.inflight: dict[Hashable, tuple[float, float]] = {}
        self.ordered = True  # inflight's first entry is its oldest
        #: transfer id -> (wall time its request finished, KV blocks it keeps allocated); the
        #: sum of the blocks kept; a heap of (wall time, n, id) whose top, once entries of
        #: transfers no longer held are popped, is the oldest: every update O(log n), so an
        #: edge that stopped answering (thousands held) costs no more per transfer.
        self.held: dict[Hashable, tuple[float, int]] = {}
        self.held_block_count = 0
        self.held_heap: list[tuple[float, int, Hashable]] = []
        self.held_seq = 0
        self.held_count = _Latest(fams.held.labels(*labels))
        self.held_blocks = _Latest(fams.held_blocks.labels(*labels))
        self.oldest_held = _Latest(fams.oldest_held.labels(*labels))

    def hold(self, transfer_id: Hashable, wall: float, blocks: int) -> bool:
        """Count ``transfer_id`` held (it must be in flight); False if it was already."""
        if transfer_id in self.held:
            return False
        self.held[transfer_id] = (wall, blocks)
        self.held_block_count += blocks
        self.held_seq += 1
        heapq.heappush(self.held_heap, (wall, self.held_seq, transfer_id))
        return True

    def forget(self, transfer_id: Hashable) -> tuple[float, float] | None:
        """Drop ``transfer_id`` from the edge (resolved or dropped): when it was in flight.
        The held gauges are then the caller's to refresh (:meth:`refresh_held`)."""
        begun = self.inflight.pop(transfer_id, None)
        if begun is not None and self.held:
            kept = self.held.pop(transfer_id, None)
            if kept is not None:
                self.held_block_count -= kept[1]
        return begun

    def refresh_held(self) -> None:
        held, heap = self.held, self.held_heap
        self.held_count.set(len(held))
        self.held_blocks.set(self.held_block_count)
        if not held:
            heap.clear()
            self.oldest_held.set(0.0)
            return
        if len(heap) > 2 * len(held) + 64:  # entries of transfers no longer held, buried
            heap[:] = [(wall, n, tid) for wall, n, tid in heap if held.get(tid, (None,))[0] == wall]
            heapq.heapify(heap)
        while held.get(heap[0][2], (None,))[0] != heap[0][0]:
            heapq.heappop(heap)
        self.oldest_held.set(heap[0][0])

    def refresh(self) -> None:
        self.active.set(len(self.inflight))
        if not self.inflight:
            self.oldest.set(0.0)
            self.ordered = True
        elif self.ordered:
            self.oldest.set(next(iter(self.inflight.values()))[0])
        else:
            self.oldest.set(min(v[0] for v in self.inflight.values()))


class EdgeMetrics:
    """The per-edge families of one sending stage (see the module docstring).

    ``to_stages``: the downstream stages (the bounded ``to_stage`` values); every series of
    each is created at construction, at 0. A ``to_stage`` outside them is ignored with one
    warning (it would make the label unbounded). ``clock``: wall time (tests pass their own).
    """

    def __init__(
        self,
        *,
        stage: str,
        model_name: str,
        to_stages: Iterable[str],
        deadline_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
        registry: CollectorRegistry | None = REGISTRY,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage = stage
        self.model_name = model_name
        self.to_stages = tuple(dict.fromkeys(to_stages))
        self._clock = clock
        self._monotonic = monotonic
        fams = _families_for(registry, duration_buckets(deadline_seconds))
        self._edges = {s: _Edge(fams, (stage, model_name), s) for s in self.to_stages}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        for edge in self._edges.values():
            edge.refresh()  # writes 0: supersedes a dead process's values
            edge.refresh_held()

    # ------------------------------------------------------------------ the data path's calls
    def started(self, transfer_id: Hashable, to_stages: Iterable[str] | None = None,
                *, at: float | None = None, held: tuple[float, int] | None = None) -> None:
        """The data path took a transfer (one attempt) and will send it to ``to_stages`` (every
        downstream stage by default): each such edge counts it active from now (or from the
        wall time ``at``) until :meth:`resolved` or :meth:`dropped`. ``transfer_id`` is any
        hashable key of the attempt, e.g. ``(request_id, attempt)``; it never becomes a label.
        ``held``: (wall time, KV blocks) when its request had already finished (see
        :meth:`held`)."""
        now = self._clock()
        wall = now if at is None else at
        mono = self._monotonic() - max(0.0, now - wall)
        with self._lock:
            for name in self.to_stages if to_stages is None else to_stages:
                edge = self._edge(name)
                if edge is None or transfer_id in edge.inflight:
                    continue
                if edge.inflight and edge.ordered and wall < next(reversed(edge.inflight.values()))[0]:
                    edge.ordered = False
                edge.inflight[transfer_id] = (wall, mono)
                edge.refresh()
                if held is not None and edge.hold(transfer_id, *held):
                    edge.refresh_held()

    def held(self, transfer_id: Hashable, blocks: int, *, at: float | None = None) -> None:
        """The request of ``transfer_id`` finished (at wall time ``at``, default now) while the
        transfer was unresolved: vLLM keeps its ``blocks`` KV blocks until every edge has
        answered. Each edge it is in flight toward counts it held until that edge resolves it."""
        wall = self._clock() if at is None else at
        with self._lock:
            for edge in self._edges.values():
                if transfer_id in edge.inflight and edge.hold(transfer_id, wall, blocks):
                    edge.refresh_held()

    def resolved(self, transfer_id: Hashable, to_stage: str, outcome: str, *,
                 nbytes: int | None = None, duration_s: float | None = None) -> None:
        """The edge of ``transfer_id`` toward ``to_stage`` resolved with ``outcome`` (acked,
        failed, expired); ``nbytes``: the payload delivered (acked only). Its duration runs
        from :meth:`started` unless ``duration_s`` says otherwise; an edge never started is
        counted with ``duration_s`` only. Call it once per edge and attempt."""
        with self._lock:
            edge = self._edge(to_stage)
            if edge is None or not self._known_outcome(outcome):
                return
            held = len(edge.held)
            begun = edge.forget(transfer_id)
            if begun is not None:
                edge.refresh()
                if len(edge.held) != held:
                    edge.refresh_held()
                if duration_s is None:
                    duration_s = self._monotonic() - begun[1]
            self._count(edge, outcome, duration_s, nbytes)

    def dropped(self, transfer_id: Hashable) -> None:
        """Forget the unresolved edges of ``transfer_id`` without counting them (an attempt
        superseded by a newer one, which :meth:`started` again)."""
        with self._lock:
            for edge in self._edges.values():
                held = len(edge.held)
                if edge.forget(transfer_id) is not None:
                    edge.refresh()
                    if len(edge.held) != held:
                        edge.refresh_held()

    def record(self, to_stage: str, outcome: str, duration_s: float | None,
               nbytes: int | None = None) -> None:
        """One edge's resolution when the data path keeps the transfer's state itself (no
        :meth:`started`): counts it, observes ``duration_s`` (if given) and, for ``acked``,
        ``nbytes``. The in-flight gauges then stay at 0 for that path."""
        with self._lock:
            edge = self._edge(to_stage)
            if edge is not None and self._known_outcome(outcome):
                self._count(edge, outcome, duration_s, nbytes)

    # ------------------------------------------------------------------ batches
    def started_many(self, to_stage: str, started: Iterable[tuple[Hashable, float]]) -> None:
        """:meth:`started` toward one edge for each ``(transfer_id, wall time)`` of
        ``started`` (in start order), with one write per gauge."""
        now = self._clock()
        mono_now = self._monotonic()
        with self._lock:
            edge = self._edge(to_stage)
            if edge is None:
                return
            inflight = edge.inflight
            for transfer_id, wall in started:
                if transfer_id in inflight:
                    continue
                if inflight and edge.ordered and wall < next(reversed(inflight.values()))[0]:
                    edge.ordered = False
                inflight[transfer_id] = (wall, mono_now - max(0.0, now - wall))
            edge.refresh()

    def held_many(self, to_stage: str, held: Iterable[tuple[Hashable, float, int]]) -> None:
        """:meth:`held` toward one edge for each ``(transfer_id, wall time, blocks)`` of
        ``held``, with one write per gauge."""
        with self._lock:
            edge = self._edge(to_stage)
            if edge is None:
                return
            changed = False
            for transfer_id, wall, blocks in held:
                if transfer_id in edge.inflight and edge.hold(transfer_id, wall, blocks):
                    changed = True
            if changed:
                edge.refresh_held()

    def resolved_many(self, to_stage: str,
                      resolved: Iterable[tuple[Hashable, str, float]]) -> None:
        """:meth:`resolved` toward one edge for each ``(transfer_id, outcome, duration_s)`` of
        ``resolved``, with one write per gauge, per counter and per histogram bucket."""
        with self._lock:
            edge = self._edge(to_stage)
            if edge is None:
                return
            held = len(edge.held)
            forget, pop = edge.forget, edge.inflight.pop
            durations: dict[str, list[float]] = {}
            for transfer_id, outcome, duration_s in resolved:
                if not self._known_outcome(outcome):
                    continue
                if held:
                    forget(transfer_id)
                else:  # nothing held on this edge (the common case): a plain pop
                    pop(transfer_id, None)
                values = durations.get(outcome)
                if values is None:
                    values = durations[outcome] = []
                values.append(duration_s if duration_s > 0.0 else 0.0)
            edge.refresh()
            if len(edge.held) != held:
                edge.refresh_held()
            for outcome, values in durations.items():
                edge.resolved[outcome].inc(len(values))
                edge.duration[outcome].observe_many(values)

    # ------------------------------------------------------------------ reading (tests, tools)
    def in_flight(self, to_stage: str) -> int:
        with self._lock:
            edge = self._edges.get(to_stage)
            return len(edge.inflight) if edge is not None else 0

    def held_toward(self, to_stage: str) -> int:
        with self._lock:
            edge = self._edges.get(to_stage)
            return len(edge.held) if edge is not None else 0

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _count(edge: _Edge, outcome: str, duration_s: float | None, nbytes: int | None) -> None:
        edge.resolved[outcome].inc()
        if duration_s is not None:
            edge.duration[outcome].observe(max(0.0, duration_s))
        if nbytes is not None and outcome == "acked":
            edge.bytes.observe(nbytes)

    def _edge(self, name: str) -> _Edge | None:
        edge = self._edges.get(name)
        if edge is None:
            self._warn(f"to_stage {name!r} is not a downstream stage of {self.stage!r} "
                       f"({', '.join(self.to_stages) or 'none'}); not recorded")
        return edge

    def _known_outcome(self, outcome: str) -> bool:
        if outcome in EDGE_OUTCOMES:
            return True
        self._warn(f"edge outcome {outcome!r} is not one of {EDGE_OUTCOMES}; not recorded")
        return False

    def _warn(self, message: str) -> None:
        if message not in self._warned and len(self._warned) < 100:
            self._warned.add(message)
            logger.warning("%s", message)


class LedgerEdgeObserver(WritesOffStep, TransferObserver):
    """Feeds the per-edge families of a stage with exactly one downstream stage from its ledger:
    with one edge, a transfer's hand-off, resolution and outcome are its edge's (the duration
    runs from the hand-off). A stage that fans out needs the data path, which alone knows
    each edge's answer (:func:`data_path_edge_metrics`). Bytes per edge come from the data path
    in either case (the ledger does not see payloads). Batched: one write per gauge, counter
    and histogram bucket per batch (a scheduler step's half), as :class:`TransferMetrics`,
    and with a ``writer_thread`` off the step as it: what is not final when the report is
    made (which handed-off transfers are held and still unresolved) is read on the step; a
    hand-off's attempt and time, and a resolved transfer, are final."""

    batched = True

    def __init__(self, edges: EdgeMetrics, *, writer_thread: WriterThread | None = None) -> None:
        if len(edges.to_stages) != 1:
            raise ValueError("LedgerEdgeObserver feeds a stage with exactly one downstream stage")
        self.edges = edges
        self.to_stage = edges.to_stages[0]
        self._writer_thread = writer_thread

    def on_batch(self, ledger: TransferLedger, batch: Batch) -> None:
        offset = ledger.wall_time(0.0)  # unix time = ledger time + offset
        held = None
        if batch.held or (batch.handed_off and ledger.num_held):
            # Held on the edge: handed off, and its request finished (before or after), and
            # unresolved now (read here: a transfer's outcome changes after the report).
            held = [(t.attempt, t.held_since + offset, t.held_blocks)
                    for t in (*batch.held, *batch.handed_off)
                    if t.held_since is not None and t.handed_off_at is not None
                    and t.outcome is None]
        self._write_in_order(ledger, len(batch.handed_off) + len(batch.resolved) or 1,
                             self._write, batch, held, offset)

    def _write(self, batch: Batch, held: list[tuple[int, float, int]] | None,
               offset: float) -> None:
        """The report's writes (on the writer thread, or on the step)."""
        if batch.handed_off:
            self.edges.started_many(
                self.to_stage, [(t.attempt, t.handed_off_at + offset) for t in batch.handed_off])
        if held:
            self.edges.held_many(self.to_stage, held)
        if not batch.resolved:
            return
        resolved = []
        for t in batch.resolved:
            if t.handed_off_at is None:
                continue  # cancelled (or failed at marking) before any edge was tried
            if t.outcome is Outcome.CANCELLED:
                self.edges.dropped(t.attempt)
                continue
            resolved.append((t.attempt, t.outcome.value, t.resolved_at - t.handed_off_at))
        if resolved:
            self.edges.resolved_many(self.to_stage, resolved)


def data_path_edge_metrics(
    *, stage: str, model_name: str, endpoints: Iterable[str],
    deadline_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
    registry: CollectorRegistry | None = REGISTRY,
) -> EdgeMetrics | None:
    """The :class:`EdgeMetrics` the data path feeds, for the downstream stages named by the
    connector's ``endpoints`` (``{stage: address}``: its keys), or None when the ledger feeds
    them itself (exactly one downstream stage: :class:`LedgerEdgeObserver`, attached by
    :func:`omni_runtime.observability.observers.build_observers`), so nothing is counted twice.
    Per-edge bytes are the data path's in either case: :func:`edge_bytes_observer`."""
    to_stages = list(dict.fromkeys(endpoints))
    if len(to_stages) < 2:
        return None
    return EdgeMetrics(stage=stage, model_name=model_name, to_stages=to_stages,
                       deadline_seconds=deadline_seconds, registry=registry)


def edge_bytes_observer(
    *, stage: str, model_name: str, to_stage: str, registry: CollectorRegistry | None = REGISTRY,
) -> Callable[[int], None]:
    """``observe(num_bytes)`` for ``omni_kv_edge_transfer_bytes{to_stage}``: a payload delivered
    to ``to_stage`` (for the data path of a stage with one downstream stage, whose other edge
    families the ledger feeds; with several, :meth:`EdgeMetrics.resolved` takes ``nbytes``).
    Writes no gauge (safe from another process than the scheduler's)."""
    fams = _families_for(registry, _registered_buckets(registry))
    return fams.bytes.labels(stage, model_name, to_stage).observe


def _registered_buckets(registry: CollectorRegistry | None) -> tuple[float, ...]:
    with _families_lock:
        fams = _families.get(registry) if registry is not None else next(iter(_unregistered.values()), None)
    return fams.buckets if fams is not None else duration_buckets(DEFAULT_TIMEOUT_SECONDS)


def build_registry(*, stage: str = "stage", model_name: str = "model",
                   to_stages: Iterable[str] = ("next",),
                   deadline_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
                   ) -> tuple[CollectorRegistry, EdgeMetrics]:
    """A private registry with every per-edge family (series at zero), for tools that check
    dashboard and alert queries against the real names."""
    registry = CollectorRegistry()
    return registry, EdgeMetrics(stage=stage, model_name=model_name, to_stages=to_stages,
                                 deadline_seconds=deadline_seconds, registry=registry)

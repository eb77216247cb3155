"""Prometheus metrics of one stage's KV transfers, fed by the transfer ledger's observer hook.

The families and their meaning are the metric contract of ARCHITECTURE.md (documented with
PromQL in docs/metrics.md). Design points:

* Every labelled child is bound once, at construction: the hot path (one callback per state
  change) does a handful of ``set``/``inc``/``observe`` calls on pre-bound children, never a
  ``labels()`` lookup. Binding all children up front also makes every series exist (at 0) from
  the first scrape, so ``rate()`` and absence alerts work from the start.
* Gauges are set to absolute values read from the ledger (O(1) properties), never inc/dec'd:
  a missed callback cannot drift them, and it is what the ``mostrecent`` multiprocess modes
  require.
* Written once per batch, not per transfer (the observer is a batched one: the scheduler makes
  each step's half a batch, see ``TransferLedger.begin_batch``): each gauge once (and only if
  its value changed), each counter once per label value, each histogram once per bucket it
  gained observations in plus once for its sum. In multiprocess mode every write is a locked
  mmap write, which per transfer was most of the observer's cost. Outside a batch (a bare
  ledger, an abort between steps) every operation is a batch of its own.
* prometheus_client multiprocess mode (the scheduler runs in vLLM's engine-core process, the
  API server process serves /metrics): gauges use ``livemostrecent``. The restarted engine
  process writes every gauge series at construction, so its values supersede any left by a dead
  one; ``mark_process_dead(pid)`` removes a dead process's gauges outright. Counters and
  histograms are summed over processes, which keeps them monotonic across engine restarts.
  Multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` set (and emptied) before anything
  imports prometheus_client: see :func:`omni_runtime.observability.multiproc.prepare_prometheus_multiproc_dir`.
"""

from __future__ import annotations

import logging
import weakref
from bisect import bisect_left
from collections.abc import Callable, Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from omni_contract.metrics import (
    DURATION,
    HELD_BLOCKS,
    HOLD_DURATION,
    LEDGER_FAMILIES,
    OLDEST_START,
    RESOLVED,
    STAGE_LABELS,
    STARTED,
    TRANSFER_BYTES,
    TRANSFERS,
    Family,
)

from omni_runtime.observability.writer_thread import WriterThread, WritesOffStep
from omni_runtime.transfers.ledger import (
    DEFAULT_TIMEOUT_SECONDS,
    Batch,
    Outcome,
    Transfer,
    TransferLedger,
    TransferObserver,
    Trigger,
)

logger = logging.getLogger(__name__)

#: The only labels every family carries: bounded, set once per stage process.
BASE_LABELS: tuple[str, ...] = STAGE_LABELS
STATES: tuple[str, ...] = ("pending", "active", "held")
TRIGGERS: tuple[str, ...] = tuple(t.value for t in Trigger)
OUTCOMES: tuple[str, ...] = tuple(o.value for o in Outcome)

#: Duration buckets (seconds). 1, 5, 10, 30, 60, 120 and 300 are the alert thresholds the
#: dashboards and alerts use; the configured deadline is added by :func:`duration_buckets`.
BASE_DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)
#: Payload buckets (bytes): 4 KiB to 16 GiB by factors of 4 (one KV block to a long prompt).
BYTES_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4**i) for i in range(12))

GAUGE_MODE = "livemostrecent"


FAMILIES: tuple[Family, ...] = LEDGER_FAMILIES
FAMILIES_BY_NAME = {f.name: f for f in FAMILIES}


def register(family: Family, registry: CollectorRegistry | None,
             buckets: tuple[float, ...] | None = None) -> Gauge | Counter | Histogram:
    """A contract family registered in ``registry`` (None: in none) as its type says: a gauge
    in the ``livemostrecent`` multiprocess mode, a counter under its name without ``_total``
    (prometheus_client appends it), a histogram with ``buckets``."""
    if family.type == "gauge":
        return Gauge(family.name, family.help, family.labels, registry=registry,
                     multiprocess_mode=GAUGE_MODE)
    if family.type == "counter":
        return Counter(family.registered_name, family.help, family.labels, registry=registry)
    if family.type == "histogram":
        return Histogram(family.name, family.help, family.labels, registry=registry,
                         buckets=buckets)
    raise ValueError(f"{family.name}: no metric type {family.type!r}")


def duration_buckets(deadline_seconds: float | None) -> tuple[float, ...]:
    """The duration buckets plus the deadline, so 'expired at the deadline' is its own bucket."""
    buckets = set(BASE_DURATION_BUCKETS)
    if deadline_seconds is not None and deadline_seconds > 0:
        buckets.add(float(deadline_seconds))
    return tuple(sorted(buckets))


class _Families:
    """The registered (unbound) families of one registry."""

    def __init__(self, registry: CollectorRegistry | None, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.registry = registry
        self.transfers = register(TRANSFERS, registry)
        self.held_blocks = register(HELD_BLOCKS, registry)
        self.oldest = register(OLDEST_START, registry)
        self.started = register(STARTED, registry)
        self.resolved = register(RESOLVED, registry)
        self.duration = register(DURATION, registry, buckets)
        self.hold = register(HOLD_DURATION, registry, buckets)
        self.bytes = register(TRANSFER_BYTES, registry, BYTES_BUCKETS)

    def unregister(self) -> None:
        if self.registry is None:
            return
        for collector in (self.transfers, self.held_blocks, self.oldest, self.started,
                          self.resolved, self.duration, self.hold, self.bytes):
            self.registry.unregister(collector)


# Families are process-wide per registry, as Prometheus metrics should be: a second
# TransferMetrics on the same registry (vLLM re-creating an in-process engine, two ledgers in
# one process) reuses them instead of failing with "Duplicated timeseries".
_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_unregistered: dict[tuple[float, ...], _Families] = {}


def _families_for(registry: CollectorRegistry | None, buckets: tuple[float, ...]) -> _Families:
    if registry is None:  # unregistered (multiprocess writers need no registry)
        fams = _unregistered.get(buckets)
        if fams is None:
            fams = _unregistered[buckets] = _Families(None, buckets)
        return fams
    fams = _families.get(registry)
    if fams is not None and fams.buckets != buckets:
        # A new deadline changes the histogram buckets, which a registered family cannot do.
        logger.info("re-registering omni_ KV transfer metrics with buckets %s", buckets)
        fams.unregister()
        fams = None
    if fams is None:
        fams = _families[registry] = _Families(registry, buckets)
    return fams


class _Latest:
    """A bound gauge child that writes only when its value changes.

    In multiprocess mode every write is a locked mmap write (about a microsecond or two); many
    callbacks leave a gauge as it was (the oldest timestamp changes only when the oldest
    transfer leaves; a hand-off batch sets pending to 0 once, not per transfer). Only this
    process writes its gauge file, so skipping an unchanged write loses nothing."""

    __slots__ = ("_write", "_last")

    def __init__(self, child: Gauge) -> None:
        self._write = child.set
        self._last: float | None = None

    def set(self, value: float) -> None:
        if value != self._last:
            self._last = value
            self._write(value)


class _Histogram:
    """A bound histogram child that takes a batch of observations in one write per bucket
    touched plus one for the sum (:meth:`observe_many`), where ``observe`` makes two writes per
    observation. The result is exactly that of observing each value: prometheus_client keeps
    a histogram as one value per bucket (the first upper bound not below the observation) and
    a sum, and cumulates only when it exposes them. It reaches those values through the
    child's ``_upper_bounds``, ``_buckets`` and ``_sum`` (prometheus_client's layout since
    0.4); a child laid out otherwise is observed value by value."""

    __slots__ = ("_child", "_bounds", "_buckets", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        total = getattr(child, "_sum", None)
        if (isinstance(bounds, Sequence) and isinstance(buckets, Sequence) and bounds
                and len(bounds) == len(buckets) and bounds[-1] == float("inf")
                and all(hasattr(b, "inc") for b in buckets) and hasattr(total, "inc")):
            self._bounds: list[float] | None = list(bounds)
            self._buckets = buckets
            self._sum = total
        else:
            self._bounds = None

    def observe(self, value: float) -> None:
        self._child.observe(value)

    def observe_many(self, values: Sequence[float]) -> None:
        """Observe every value (each a number >= 0, as durations are here)."""
        bounds = self._bounds
        if bounds is None or len(values) == 1:
            for value in values:
                self._child.observe(value)
            return
        counts: dict[int, int] = {}
        for value in values:
            i = bisect_left(bounds, value)  # the first bound >= value, as observe() picks
            counts[i] = counts.get(i, 0) + 1
        self._sum.inc(sum(values))
        buckets = self._buckets
        for i, n in counts.items():
            buckets[i].inc(n)


class TransferMetrics(WritesOffStep, TransferObserver):
    """The metric contract's families for one stage, as a (batched) ledger observer.

    ``registry`` defaults to prometheus_client's global one (vLLM serves it, or in
    multiprocess mode the files behind it); tests pass a private ``CollectorRegistry``.
    With a ``writer_thread`` (a stage's: :func:`writer_thread.metrics_thread`) a report's
    writes run there, off the step: the gauges' values are read on the step (the ledger as
    the report left it), the counters and histograms from what the report handed over, whose
    fields are final (a transfer's trigger; a resolved transfer's times and outcome). A
    report the thread refuses is written on the step, after the earlier ones. Without one,
    on the step.
    """

    batched = True

    def __init__(
        self,
        *,
        stage: str,
        model_name: str,
        deadline_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
        registry: CollectorRegistry | None = REGISTRY,
        writer_thread: WriterThread | None = None,
    ) -> None:
        self._writer_thread = writer_thread
        self.stage = stage
        self.model_name = model_name
        self.buckets = duration_buckets(deadline_seconds)
        fams = _families_for(registry, self.buckets)
        base = (stage, model_name)
        # Children bound once; see the module docstring.
        # Keyed by the enums themselves (a str enum hashes as its value): no .value per use.
        self._started = {Trigger(t): fams.started.labels(*base, t) for t in TRIGGERS}
        self._resolved = {Outcome(o): fams.resolved.labels(*base, o) for o in OUTCOMES}
        self._duration = {Outcome(o): _Histogram(fams.duration.labels(*base, o))
                          for o in OUTCOMES}
        self._hold = _Histogram(fams.hold.labels(*base))
        self._bytes = fams.bytes.labels(*base)
        self._pending, self._active, self._held = (
            _Latest(fams.transfers.labels(*base, s)) for s in STATES
        )
        self._oldest_pending, self._oldest_active, self._oldest_held = (
            _Latest(fams.oldest.labels(*base, s)) for s in STATES
        )
        self._held_blocks = _Latest(fams.held_blocks.labels(*base))
        # Start every gauge series at "none" (this also supersedes a dead process's values).
        for gauge in (self._pending, self._active, self._held, self._oldest_pending,
                      self._oldest_active, self._oldest_held, self._held_blocks):
            gauge.set(0.0)

    # ------------------------------------------------------------------ observer hook
    def on_batch(self, ledger: TransferLedger, batch: Batch) -> None:
        gauges = self._gauges(ledger)  # the ledger as this report left it
        self._write_in_order(ledger, len(batch.marked) + len(batch.resolved) or 1,
                             self._write, batch, gauges)

    def _write(self, batch: Batch, gauges: tuple[float, ...]) -> None:
        """The report's writes (on the writer thread, or on the step)."""
        if batch.marked:
            started = self._started
            if len(batch.marked) == 1:
                started[batch.marked[0].trigger].inc()
            else:
                counts: dict[Trigger, int] = {}
                for transfer in batch.marked:
                    counts[transfer.trigger] = counts.get(transfer.trigger, 0) + 1
                for trigger, n in counts.items():
                    started[trigger].inc(n)
        if batch.resolved:
            self._count_resolved(batch.resolved)
        pending, active, held, held_blocks, oldest_pending, oldest_active, oldest_held = gauges
        self._pending.set(pending)
        self._active.set(active)
        self._held.set(held)
        self._held_blocks.set(held_blocks)
        self._oldest_pending.set(oldest_pending)
        self._oldest_active.set(oldest_active)
        self._oldest_held.set(oldest_held)

    def _count_resolved(self, resolved: list[Transfer]) -> None:
        durations: dict[Outcome, list[float]] = {}
        holds: list[float] = []
        for t in resolved:
            took = t.resolved_at - t.marked_at
            bucket = durations.get(t.outcome)
            if bucket is None:
                bucket = durations[t.outcome] = []
            bucket.append(took if took > 0.0 else 0.0)
            if t.held_since is not None:
                held = t.resolved_at - t.held_since
                holds.append(held if held > 0.0 else 0.0)
        for outcome, values in durations.items():
            self._resolved[outcome].inc(len(values))
            self._duration[outcome].observe_many(values)
        if holds:
            self._hold.observe_many(holds)

    @staticmethod
    def _gauges(ledger: TransferLedger) -> tuple[float, ...]:
        """Every gauge's value from the ledger as it is now (O(1) reads): the transfers
        pending, active and held, the held blocks, and the unix times the oldest pending,
        active and held entered their state (0: none). A gauge writes only if it changed."""
        wall = ledger.wall_time
        oldest = [ledger.oldest_entered(phase) for phase in STATES]
        return (ledger.num_pending, ledger.num_active, ledger.num_held, ledger.num_held_blocks,
                *(0.0 if entered is None else wall(entered) for entered in oldest))

    # ------------------------------------------------------------------ worker side
    def observe_transfer_bytes(self, num_bytes: int) -> None:
        """Record a delivered transfer's payload size, from the scheduler's process. Another
        process (worker, connector) uses :func:`transfer_bytes_observer` instead."""
        self._bytes.observe(num_bytes)


def transfer_bytes_observer(
    *, stage: str, model_name: str, registry: CollectorRegistry | None = REGISTRY
) -> Callable[[int], None]:
    """``observe(num_bytes)`` for ``omni_kv_transfer_bytes``, for the process that ships the
    KV (the worker or connector), which is not the scheduler's. Use this there, not a
    TransferMetrics: constructing one writes every gauge at 0, and with ``livemostrecent``
    those newer writes would hide the scheduler process's live values."""
    fams = _families_for(registry, _registered_buckets(registry))
    return fams.bytes.labels(stage, model_name).observe


def _registered_buckets(registry: CollectorRegistry | None) -> tuple[float, ...]:
    """The duration buckets a registry's families already have (so reusing them does not
    re-register), else the default deadline's."""
    fams = _unregistered.get(duration_buckets(DEFAULT_TIMEOUT_SECONDS)) if registry is None \
        else _families.get(registry)
    return fams.buckets if fams is not None else duration_buckets(DEFAULT_TIMEOUT_SECONDS)


def family_names() -> list[str]:
    return [f.name for f in FAMILIES]


def build_registry(
    *,
    stage: str = "stage",
    model_name: str = "model",
    deadline_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
) -> tuple[CollectorRegistry, TransferMetrics]:
    """A private registry holding every omni_ family with one stage's series (at zero), for
    tools that check dashboard and alert queries against the real metric names."""
    registry = CollectorRegistry()
    metrics = TransferMetrics(stage=stage, model_name=model_name,
                              deadline_seconds=deadline_seconds, registry=registry)
    return registry, metrics

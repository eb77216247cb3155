"""The omni KV connector's figures on vLLM's own connector-stats path.

vLLM collects a connector's statistics itself, with no ``omni-stage`` and no
``PROMETHEUS_MULTIPROC_DIR``: each step, the worker's ``get_kv_connector_stats()`` goes out
with the model runner's output (pickled from a worker process), the engine core aggregates
the workers' and the scheduler-side connector's (``KVConnectorStats.aggregate``), sends
``to_dict()`` to the API server (msgpack), where the class's ``build_kv_connector_stats``
rebuilds it for the periodic log line (``reduce()``) and ``build_prom_metrics`` feeds
``/metrics``. This module is that path for our connector:

* :class:`OmniKVConnectorStats`: one record per transfer resolution (outcome, payload bytes,
  hand-off-to-answer seconds, destination stage), and one per stream chunk or stream a
  producer resolved (a streamed edge: :class:`StreamStats` hears them from the scheduler's
  stream ledger), a plain dict of lists like vLLM's NIXL stats, so both serializations carry
  it unchanged;
* :class:`KVStatsRecorder`: the thread-safe recorder the connector's halves call
  (:meth:`KVStatsRecorder.record`) and drain once per step (:meth:`KVStatsRecorder.take`);
* :class:`OmniKVPromMetrics`: the Prometheus families, created through vLLM's metric types
  with vLLM's ``model_name`` and ``engine`` labels;
* :func:`get_kv_connector_stats`, :func:`build_kv_connector_stats`,
  :func:`build_prom_metrics`: the three connector methods' bodies, and
  :class:`OmniKVStatsMixin`, which defines the three methods on a connector class and
  registers the class with vLLM's connector factory by name (vLLM's ``MultiConnector`` looks
  its children's stats classes up by class name; ours is loaded by module path, see
  :func:`register_connector_class`).

Which families, in which mode (docs/metrics.md, "vLLM's connector-stats path"): the contract
names ``omni_kv_transfers_resolved_total`` and ``omni_kv_transfer_bytes`` are registered here
(and, on a stage with streamed edges, ``omni_kv_stream_chunks_total`` and
``omni_kv_streams_resolved_total``) only where the observability layer's copies
(omni_runtime/observability/metrics.py and stream_metrics.py, written in the engine-core and
worker processes) cannot reach this server's ``/metrics``: not in
prometheus_client multiprocess mode (``omni-stage`` sets ``PROMETHEUS_MULTIPROC_DIR``, and the
files of both would merge into one family with two label sets), and not when this process's
registry already holds the name (an in-process engine core's scheduler registered it first).
``omni_kv_handoff_answer_duration_seconds``, which only this path measures, is registered in
every mode.

Imports vLLM; nothing of the KV transport.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from itertools import repeat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import prometheus_client
from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from omni_contract.metrics import (HANDOFF_ANSWER_DURATION, RESOLVED, STREAM_CHUNKS, STREAMS_RESOLVED,
                                   TRANSFER_BYTES)
from omni_runtime.kv.connector_config import connector_settings
from omni_runtime.observability.logs import log_like_vllm
from omni_runtime.observability.metrics import BYTES_BUCKETS, OUTCOMES, duration_buckets
from omni_runtime.observability.multiproc import MULTIPROC_ENV
from omni_runtime.transfers.config import parse_omni_kv_config, raw_omni_kv_config
from omni_runtime.transfers.streams import (Chunk, ChunkOutcome, Stream, StreamObserver,
                                            StreamOutcome)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

#: The fields of one record, each a list in ``OmniKVConnectorStats.data`` (parallel lists: a
#: dict of lists of str/int/float is what pickle and vLLM's msgpack both carry as is).
FIELDS: tuple[str, ...] = ("outcome", "bytes", "duration_s", "to_stage")
#: The fields of one stream record (a producer's chunk or stream resolved), each a list beside
#: those of :data:`FIELDS`: ``stream_record`` is ``chunk`` or ``stream``; ``stream_seconds`` a
#: chunk's sent-to-answer time, a stream's open-to-end time.
STREAM_FIELDS: tuple[str, ...] = ("stream_record", "stream_outcome", "stream_seconds",
                                  "stream_to_stage")
_STREAM_OUTCOMES = {"chunk": frozenset(o.value for o in ChunkOutcome),
                    "stream": frozenset(o.value for o in StreamOutcome)}

#: Families of the metric contract (ARCHITECTURE.md) this path exports where nothing else does.
RESOLVED_FAMILY = RESOLVED.name
BYTES_FAMILY = TRANSFER_BYTES.name
#: Only this path measures it: the contract's omni_kv_transfer_duration_seconds is marking to
#: resolution (the scheduler's ledger); this is hand-off to the connector's answer.
HANDOFF_FAMILY = HANDOFF_ANSWER_DURATION.name
#: The labels this path adds to vLLM's (``model_name``, ``engine``).
EXTRA_LABELS: tuple[str, ...] = ("stage", "to_stage", "outcome")
#: The ``to_stage`` value of a destination the configuration does not name (bounded label).
OTHER_STAGE = "other"
_OUTCOME_SET = frozenset(OUTCOMES)


# ====================================================================== stats
@dataclass
class OmniKVConnectorStats(KVConnectorStats):
    """Transfer resolutions of one interval: ``data`` holds one list per field of
    :data:`FIELDS`, element ``i`` of each list being resolution ``i``."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            missing = [f for f in (*FIELDS, *STREAM_FIELDS) if f not in self.data]
            if missing:
                raise ValueError(f"OmniKVConnectorStats data lacks {missing}")
            for fields in (FIELDS, STREAM_FIELDS):
                if len({len(self.data[f]) for f in fields}) != 1:
                    raise ValueError("OmniKVConnectorStats data lists differ in length")

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {f: [] for f in (*FIELDS, *STREAM_FIELDS)}

    def record(self, outcome: str, nbytes: int, duration_s: float, to_stage: str) -> None:
        """One resolved transfer: its outcome (one of the contract's outcomes), payload
        bytes, seconds from hand-off to answer, destination stage. Not thread-safe: the
        connector records through a :class:`KVStatsRecorder`."""
        self.record_columns((outcome,), (nbytes,), (duration_s,), to_stage)

    def record_columns(self, outcomes: Sequence[str], sizes: Sequence[int],
                       durations: Sequence[float], to_stage: str) -> None:
        """:meth:`record` for each ``(outcomes[i], sizes[i], durations[i], to_stage)``: the
        same checks and conversions, column by column (in C: a step's answers recorded
        without a Python loop), all or nothing (a bad value raises before any is recorded)."""
        if len(sizes) != len(outcomes) or len(durations) != len(outcomes):
            raise ValueError(f"{len(outcomes)} outcomes, {len(sizes)} sizes, "
                             f"{len(durations)} durations: one of each per transfer")
        if not _OUTCOME_SET.issuperset(outcomes):
            bad = next(o for o in outcomes if o not in _OUTCOME_SET)
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {bad!r}")
        # Plain builtins (a numpy scalar would not go through msgpack), negatives (and NaN,
        # and -0.0) as 0 (x if x > 0 else 0, what max(0, x) gives). The columns are checked
        # in C first (min, and a sum that is NaN if any value is NaN, or +inf and -inf meet):
        # a step's values are seldom bad.
        outcomes = list(map(str, outcomes))
        sizes = list(map(int, sizes))
        if sizes and min(sizes) < 0:
            sizes = [n if n > 0 else 0 for n in sizes]
        durations = list(map(float, durations))
        if durations:
            total = sum(durations)
            if total != total or not min(durations) > 0.0:  # zeros too: -0.0 is one
                durations = [d if d > 0.0 else 0.0 for d in durations]
        stage = str(to_stage)
        data = self.data  # nothing below raises: every column grows, or none did
        data["outcome"].extend(outcomes)
        data["bytes"].extend(sizes)
        data["duration_s"].extend(durations)
        data["to_stage"].extend(repeat(stage, len(sizes)))

    def record_stream(self, record: str, outcome: str, seconds: float, to_stage: str) -> None:
        """One chunk (``record`` ``chunk``: acked, failed or expired, ``seconds`` from sent to
        its answer) or stream (``stream``: its outcome, ``seconds`` from open to end) that a
        producer resolved toward ``to_stage``."""
        allowed = _STREAM_OUTCOMES.get(record)
        if allowed is None:
            raise ValueError(f"stream record must be chunk or stream, not {record!r}")
        if outcome not in allowed:
            raise ValueError(f"a {record}'s outcome must be one of {sorted(allowed)}, "
                             f"not {outcome!r}")
        seconds = float(seconds)
        data = self.data
        data["stream_record"].append(record)
        data["stream_outcome"].append(str(outcome))
        data["stream_seconds"].append(seconds if seconds > 0.0 else 0.0)
        data["stream_to_stage"].append(str(to_stage))

    def __len__(self) -> int:
        """Transfer and stream records together."""
        return len(self.data["outcome"]) + len(self.data["stream_record"])

    # Without this, __len__ would make an empty object falsy, and vLLM tests stats with
    # `if stats` / `stats or None` meaning "is there an object" (utils.KVOutputAggregator).
    def __bool__(self) -> bool:
        return True

    def is_empty(self) -> bool:
        return len(self) == 0

    def clone_and_reset(self) -> OmniKVConnectorStats:
        old = copy.copy(self)
        self.reset()
        return old

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, OmniKVConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into OmniKVConnectorStats")
        if not other.is_empty():
            for f in (*FIELDS, *STREAM_FIELDS):
                self.data[f].extend(other.data[f])
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's summary for vLLM's log line ("KV Transfer metrics: ..."). Counts by
        outcome always (a failure-only interval still says so); times and sizes over the
        acked transfers, as the delivered ones are what the throughput means."""
        outcomes = self.data["outcome"]
        counts = {o: 0 for o in OUTCOMES}
        for o in outcomes:
            counts[o] = counts.get(o, 0) + 1
        summary: dict[str, int | float] = {
            "Acked": counts["acked"],
            "Failed": counts["failed"],
            "Expired": counts["expired"],
            "Cancelled": counts["cancelled"],
            **self._reduce_streams(),
        }
        acked = np.fromiter((o == "acked" for o in outcomes), dtype=bool, count=len(outcomes))
        if not acked.any():
            return {**summary, "Avg xfer time (ms)": 0, "P90 xfer time (ms)": 0,
                    "Avg MB per transfer": 0, "Throughput (MB/s)": 0, "MB acked": 0}
        seconds = np.asarray(self.data["duration_s"], dtype=float)[acked]
        mb = np.asarray(self.data["bytes"], dtype=float)[acked] / 2**20
        total_s = float(seconds.sum())
        return {
            **summary,
            "Avg xfer time (ms)": round(float(seconds.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(seconds, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.mean()), 3),
            # Per transfer, hand-off to ack: what one transfer sees, not the link's capacity
            # (transfers overlap).
            "Throughput (MB/s)": round(float(mb.sum()) / total_s, 3) if total_s > 0 else 0,
            "MB acked": round(float(mb.sum()), 3),
        }


    def _reduce_streams(self) -> dict[str, int | float]:
        """The streams' part of the log line, only where there were stream records (a stage
        without streamed edges says nothing of them): chunks by outcome, the acked chunks'
        answer time, streams by outcome."""
        data = self.data
        if not data["stream_record"]:
            return {}
        chunks = {o.value: 0 for o in ChunkOutcome}
        streams = {o.value: 0 for o in StreamOutcome}
        acked_s = []
        for record, outcome, seconds in zip(data["stream_record"], data["stream_outcome"],
                                            data["stream_seconds"]):
            if record == "chunk":
                chunks[outcome] = chunks.get(outcome, 0) + 1
                if outcome == "acked":
                    acked_s.append(seconds)
            else:
                streams[outcome] = streams.get(outcome, 0) + 1
        return {
            "Chunks acked": chunks["acked"], "Chunks failed": chunks["failed"],
            "Chunks expired": chunks["expired"],
            "Avg chunk ack time (ms)": round(float(np.mean(acked_s)) * 1e3, 3) if acked_s else 0,
            "Streams finished": streams["finished"],
            "Streams not finished": sum(n for o, n in streams.items() if o != "finished"),
        }


class KVStatsRecorder:
    """Where a connector half records resolutions, from any thread (the transport's thread
    resolves a transfer while the engine's thread drains the step's stats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = OmniKVConnectorStats()

    def record(self, outcome: str, nbytes: int, duration_s: float, to_stage: str) -> None:
        with self._lock:
            self._stats.record(outcome, nbytes, duration_s, to_stage)

    def record_columns(self, outcomes: Sequence[str], sizes: Sequence[int],
                       durations: Sequence[float], to_stage: str) -> None:
        """:meth:`OmniKVConnectorStats.record_columns`, in one hold of the lock."""
        with self._lock:
            self._stats.record_columns(outcomes, sizes, durations, to_stage)

    def record_stream(self, record: str, outcome: str, seconds: float, to_stage: str) -> None:
        with self._lock:
            self._stats.record_stream(record, outcome, seconds, to_stage)

    def take(self) -> OmniKVConnectorStats | None:
        """The resolutions recorded since the last call, or None when there were none (a
        non-None stats object makes vLLM ship a connector output on every step)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            # Hand over the interval's object and start a new one: what clone_and_reset()
            # gives, without its copy.copy (the object is ours alone until handed over).
            taken, self._stats = self._stats, OmniKVConnectorStats()
            return taken


class StreamStats(StreamObserver):
    """A producer's stream ledger observer recording each chunk and stream it resolves into the
    connector's stats (``recorder()``: the connector's recorder now, None once the engine
    collects no stats)."""

    def __init__(self, recorder: Any) -> None:
        self._recorder = recorder

    def on_chunk(self, end: Any, stream: Stream, chunk: Chunk, outcome: ChunkOutcome,
                 now: float) -> None:
        recorder = self._recorder()
        if recorder is not None and end.side == "producer":
            sent = chunk.sent_at
            recorder.record_stream("chunk", outcome.value, now - sent if sent is not None
                                   else 0.0, stream.peer)

    def on_resolved(self, end: Any, stream: Stream, now: float) -> None:
        recorder = self._recorder()
        if recorder is not None and end.side == "producer" and stream.outcome is not None:
            recorder.record_stream("stream", stream.outcome.value, now - stream.opened_at,
                                   stream.peer)


# ====================================================================== the three methods
def get_kv_connector_stats(recorder: KVStatsRecorder | None) -> OmniKVConnectorStats | None:
    """Body of ``KVConnectorBase_V1.get_kv_connector_stats`` (either role)."""
    return recorder.take() if recorder is not None else None


def build_kv_connector_stats(data: Mapping[str, Any] | None = None) -> OmniKVConnectorStats:
    """Body of the ``build_kv_connector_stats`` classmethod: the stats object from
    ``to_dict()``'s payload as it arrives in the API server (lists copied: vLLM aggregates
    into the first object in place, and the payload dict is also handed to Prometheus)."""
    if not data:
        return OmniKVConnectorStats()
    return OmniKVConnectorStats(data={f: list(data[f]) for f in (*FIELDS, *STREAM_FIELDS)
                                      if f in data})


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> OmniKVPromMetrics:
    """Body of the ``build_prom_metrics`` classmethod. Never None: under ``MultiConnector``
    vLLM asserts that every child whose stats arrive has a metrics object."""
    return OmniKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# ====================================================================== Prometheus
def known_to_stages(vllm_config: Any) -> tuple[str, ...]:
    """The destination stages the connector's configuration names, known at start-up: the
    bounded values of ``to_stage`` (``kv_connector_extra_config.to_stages``, else the keys of
    its ``endpoints``)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    # The connector has refused any key it does not read (a subclass may read more).
    return connector_settings(getattr(ktc, "kv_connector_extra_config", None), also=None).to_stages


def _is_prometheus_client(cls: type) -> bool:
    # vLLM's Ray logger passes wrappers that register with Ray, not prometheus_client.
    return isinstance(cls, type) and issubclass(cls, prometheus_client.metrics.MetricWrapperBase)


#: This module's collectors in prometheus_client's global registry. A new
#: PrometheusStatLogger (vLLM re-creates it when data parallelism scales) replaces them, as it
#: replaces vLLM's own families; vLLM's cleanup (``unregister_vllm_metrics``) drops only
#: ``vllm:`` names, so without this a second build would raise "Duplicated timeseries".
_ours: list[Any] = []
_ours_lock = threading.Lock()


def _unregister_ours() -> None:
    with _ours_lock:
        for collector in _ours:
            try:
                prometheus_client.REGISTRY.unregister(collector)
            except KeyError:
                pass
        _ours.clear()


def _registered_names() -> set[str]:
    """The family and sample names prometheus_client's global registry holds (not ours:
    those were unregistered first), read through its public ``collect()``: once, at the
    build of vLLM's loggers."""
    names: set[str] = set()
    for family in prometheus_client.REGISTRY.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def contract_families_here(metric_types: Mapping[type, type]) -> tuple[bool, str]:
    """Whether this path registers the contract's names in this process, and why."""
    if os.environ.get(MULTIPROC_ENV):
        return False, (f"{MULTIPROC_ENV} is set: the observability layer's copies reach "
                       "/metrics through the multiprocess directory")
    if _is_prometheus_client(metric_types[Counter]):
        taken = _registered_names()
        for name in (RESOLVED_FAMILY, BYTES_FAMILY):
            # A counter's family is named without its _total, its samples with it.
            if name in taken or name.removesuffix("_total") in taken:
                return False, (f"{name} is already registered in this process (an in-process "
                               "engine core's omni scheduler)")
    return True, "nothing else exports them to this server's /metrics"


class OmniKVPromMetrics(KVConnectorPromMetrics):
    """The connector's families on vLLM's Prometheus path (see the module docstring).

    Labels: vLLM's ``model_name`` and ``engine``, then ``stage`` (this stage), ``to_stage``
    (:func:`known_to_stages`, anything else as ``other``) and ``outcome`` where it applies.
    Every series of the configured stages exists from start-up, at 0."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        log_like_vllm()
        cfg = parse_omni_kv_config(raw_omni_kv_config(vllm_config))
        self.stage = cfg.stage_name
        self.to_stages = known_to_stages(vllm_config)
        tracked = _is_prometheus_client(metric_types[Counter])
        if tracked:
            # Before the check below: our own previous copies are not "registered elsewhere".
            _unregister_ours()
        self.contract_families, why = contract_families_here(metric_types)
        logger.info("omni KV connector stats on vLLM's /metrics path: %s, %s %s (%s)",
                    HANDOFF_FAMILY, "with" if self.contract_families else "without",
                    f"{RESOLVED_FAMILY} and {BYTES_FAMILY}", why)
        created: list[Any] = []

        base = list(labelnames) + ["stage", "to_stage"]
        handoff = self._histogram_cls(
            name=HANDOFF_FAMILY,
            documentation=HANDOFF_ANSWER_DURATION.help,
            buckets=list(duration_buckets(cfg.timeout_seconds)),
            # vLLM's own labels, then the contract's others (the edge's, the outcome).
            labelnames=list(labelnames) + [n for n in HANDOFF_ANSWER_DURATION.labels if n not in labelnames],
        )
        created.append(handoff)
        resolved = transfer_bytes = None
        if self.contract_families:
            # prometheus_client appends _total to counter names itself.
            resolved = self._counter_cls(
                name=RESOLVED_FAMILY.removesuffix("_total"),
                documentation="KV transfers resolved, by outcome (omni KV connector's stats).",
                labelnames=base + ["outcome"],
            )
            transfer_bytes = self._histogram_cls(
                name=BYTES_FAMILY,
                documentation="Payload size of delivered KV transfers (omni KV connector's "
                "stats).",
                buckets=list(BYTES_BUCKETS),
                labelnames=base,
            )
            created += [resolved, transfer_bytes]
        #: The streamed edges' consumers (the bounded ``to_stage`` values of the stream
        #: families); the families only where the transfer ones are registered here too.
        self.streamed = tuple(cfg.streams)
        chunks = streams = None
        if self.contract_families and self.streamed:
            edge = base[:-1] + ["from_stage", "to_stage", "outcome"]
            chunks = self._counter_cls(
                name=STREAM_CHUNKS.name.removesuffix("_total"),
                documentation=STREAM_CHUNKS.help + " (omni KV connector's stats, producer)",
                labelnames=edge)
            streams = self._counter_cls(
                name=STREAMS_RESOLVED.name.removesuffix("_total"),
                documentation=STREAMS_RESOLVED.help + " (omni KV connector's stats, producer)",
                labelnames=edge)
            created += [chunks, streams]
        if tracked:
            with _ours_lock:
                _ours.extend(created)

        self._handoff = handoff
        self._resolved = resolved
        self._bytes = transfer_bytes
        self._chunks, self._streams = chunks, streams
        #: {engine: {(record, to_stage, outcome): child}} of the two stream counters.
        self._stream_children: dict[int, dict[tuple[str, str, str], Any]] = {}
        # Bound children, per engine: {engine: {(to_stage, outcome): child}}; bound up front
        # so every series exists at 0 and the hot path does no labels() lookup.
        self._handoff_children: dict[int, dict[tuple[str, str], Any]] = {}
        self._resolved_children: dict[int, dict[tuple[str, str], Any]] = {}
        self._bytes_children: dict[int, dict[str, Any]] = {}
        for engine in per_engine_labelvalues:
            self._handoff_children[engine] = {}
            self._resolved_children[engine] = {}
            self._bytes_children[engine] = {}
            for to_stage in self.to_stages:
                self._bind(engine, to_stage)
            self._stream_children[engine] = {}
            for to_stage in self.streamed:
                self._bind_streams(engine, to_stage)

    def _bind(self, engine: int, to_stage: str) -> None:
        values = [*self.per_engine_labelvalues[engine], self.stage, to_stage]
        for outcome in OUTCOMES:
            self._handoff_children[engine][(to_stage, outcome)] = \
                self._handoff.labels(*values, outcome)
            if self._resolved is not None:
                self._resolved_children[engine][(to_stage, outcome)] = \
                    self._resolved.labels(*values, outcome)
        if self._bytes is not None:
            self._bytes_children[engine][to_stage] = self._bytes.labels(*values)

    def _bind_streams(self, engine: int, to_stage: str) -> None:
        if self._chunks is None:
            return
        values = [*self.per_engine_labelvalues[engine], self.stage, self.stage, to_stage]
        children = self._stream_children[engine]
        for record, family in (("chunk", self._chunks), ("stream", self._streams)):
            for outcome in sorted(_STREAM_OUTCOMES[record]):
                children[(record, to_stage, outcome)] = family.labels(*values, outcome)

    def _label(self, to_stage: str) -> str:
        return to_stage if to_stage in self.to_stages else OTHER_STAGE

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        handoff = self._handoff_children[engine_idx]
        resolved = self._resolved_children[engine_idx]
        sizes = self._bytes_children[engine_idx]
        data = transfer_stats_data
        for outcome, nbytes, seconds, to_stage in zip(
                data["outcome"], data["bytes"], data["duration_s"], data["to_stage"]):
            if outcome not in OUTCOMES:
                continue  # never recorded (record() checks); keeps the label bounded anyway
            to_stage = self._label(to_stage)
            if (to_stage, outcome) not in handoff:
                self._bind(engine_idx, to_stage)  # "other": one more series at most
            handoff[(to_stage, outcome)].observe(seconds)
            if self._resolved is not None:
                resolved[(to_stage, outcome)].inc()
                if outcome == "acked":  # the contract's: payload size of delivered transfers
                    sizes[to_stage].observe(nbytes)
        if self._chunks is None or not data.get("stream_record"):
            return
        children = self._stream_children[engine_idx]
        for record, outcome, to_stage in zip(data["stream_record"], data["stream_outcome"],
                                             data["stream_to_stage"]):
            if to_stage not in self.streamed:
                to_stage = OTHER_STAGE
            key = (record, to_stage, outcome)
            if key not in children:
                if outcome not in _STREAM_OUTCOMES.get(record, ()):
                    continue  # never recorded (record_stream() checks); bounded anyway
                self._bind_streams(engine_idx, to_stage)
            children[key].inc()


# ====================================================================== the connector class
def register_connector_class(cls: type) -> None:
    """Make ``cls`` known to vLLM's connector factory under its class name.

    vLLM's ``MultiConnector`` keys its children's stats by class name and, in the API server,
    finds each child's ``build_kv_connector_stats`` with
    ``KVConnectorFactory.get_connector_class_by_name(name)``, which knows only registered
    connectors; ours is loaded by module path, so without this every stats payload would
    raise there (and with it the API server's output handler). A name already registered
    (this class, re-imported, or one of vLLM's) is left as it is."""
    name = cls.__name__
    if cls.__qualname__ != name:
        # A class defined inside a function (a test's): the factory's loader could not find
        # it by module and name, and vLLM cannot load it by module path either.
        return
    try:
        KVConnectorFactory.register_connector(name, cls.__module__, name)
    except ValueError:
        pass


class OmniKVStatsMixin:
    """The three stats methods for a ``KVConnectorBase_V1`` subclass (list this first among
    the bases), and its registration by name (:func:`register_connector_class`) at class
    creation. Each connector instance (either role) records into ``self.omni_kv_stats`` (None
    where the engine collects no stats: the omni connector's ``stop_stats``)."""

    omni_kv_stats: KVStatsRecorder | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_connector_class(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.omni_kv_stats = KVStatsRecorder()

    def get_kv_connector_stats(self) -> OmniKVConnectorStats | None:
        return get_kv_connector_stats(self.omni_kv_stats)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> OmniKVConnectorStats:
        return build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> OmniKVPromMetrics:
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "OmniKVConnectorStats", "KVStatsRecorder", "OmniKVPromMetrics", "OmniKVStatsMixin",
    "get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics",
    "register_connector_class", "known_to_stages", "contract_families_here",
]

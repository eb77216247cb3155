"""Transfer health of a pipeline's stages: a pure function of what their metrics say.

The operator (on its resync timer, ``reader.py``) and ``omni-pipeline status`` (for a
pipeline run locally) read each stage pod's ``omni_kv_*`` families, from the pod's
``/metrics`` or from Prometheus; this module turns those readings into

- ``status.stages[].transfers``: pending, active, held, heldBlocks, the age of the oldest
  active and held transfer, failed and expired transfers over the last interval, and the same
  per edge (``edges[]``, by ``toStage``) when the stage exports the per-edge families (all but
  pending: a pending transfer is on no edge yet);
- per streamed edge the stage is an end of (``streams[]``, by ``fromStage`` and ``toStage``,
  from the stream families: ``omni_kv_streams`` and the oldest wait's start): streams open,
  held (the producer out of credit), waiting (the consumer waiting for a chunk), and the age
  of the oldest wait;
- the ``TransfersHealthy`` condition (``TransferStuck``, ``StreamStalled``,
  ``TransfersFailing``, ``MetricsUnavailable``) and the printer column's word (``ok``,
  ``stuck 2``, ``stalled 1``, ...).

Nothing here does I/O or reads a clock: the time is the reading's own (``read_at``). Ages are
rounded down to steps (:func:`round_age`) so that a status written every resync does not
change just because time passed; counts over "the last interval" come from counter increases
between two readings (:func:`increase`), where a counter that went down (the pod's process
restarted) counts from zero, as Prometheus' ``increase()`` does, and a pod seen for the first
time (a new or restarted pod, or the operator's own restart) counts nothing yet.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from omni_contract import metrics

from omni_operator.pipeline.model import Pipeline

# The families read (docs/metrics.md; their names are the metric contract's): the ledger's ...
TRANSFERS = metrics.TRANSFERS.name
HELD_BLOCKS = metrics.HELD_BLOCKS.name
OLDEST = metrics.OLDEST_START.name
RESOLVED = metrics.RESOLVED.name
# ... the data path's, per edge (label to_stage) ...
EDGE_ACTIVE = metrics.EDGE_ACTIVE.name
EDGE_OLDEST = metrics.EDGE_OLDEST_ACTIVE.name
EDGE_RESOLVED = metrics.EDGE_RESOLVED.name
EDGE_HELD = metrics.EDGE_HELD.name
EDGE_HELD_BLOCKS = metrics.EDGE_HELD_BLOCKS.name
EDGE_OLDEST_HELD = metrics.EDGE_OLDEST_HELD.name
EDGE_GAUGES = (EDGE_ACTIVE, EDGE_OLDEST, EDGE_HELD, EDGE_HELD_BLOCKS, EDGE_OLDEST_HELD)
# ... a receiving stage's (label from_stage) ...
RECEIVED = metrics.RECEIVED.name
# ... and a streamed edge's, at either end (labels from_stage and to_stage).
STREAMS = metrics.STREAMS.name
STREAM_OLDEST_WAIT = metrics.STREAM_OLDEST_WAIT.name
STREAM_GAUGES = (STREAMS, STREAM_OLDEST_WAIT)
STREAM_STATES = ("open", "held", "waiting")
FAMILIES = (TRANSFERS, HELD_BLOCKS, OLDEST, RESOLVED, *EDGE_GAUGES, EDGE_RESOLVED, RECEIVED, *STREAM_GAUGES)
# vLLM's own request gauges: whether a draining AR pod still runs requests (rollout.py).
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
REQUEST_FAMILIES = (REQUESTS_RUNNING, REQUESTS_WAITING)

TRANSFERS_HEALTHY = "TransfersHealthy"
STUCK, FAILING, UNAVAILABLE = "TransferStuck", "TransfersFailing", "MetricsUnavailable"
STALLED = "StreamStalled"
HEALTHY, NO_TRANSFERS = "TransfersFlowing", "NoSendingStage"
#: Default share of the transfers resolved over an interval that may fail or expire.
DEFAULT_FAILING_RATIO = 0.05
#: Ages are reported rounded down to one of these steps (seconds), then to whole hours.
AGE_STEPS = (0, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 900, 1200, 1800, 3600)


# ------------------------------------------------------------------------------- samples
@dataclass(frozen=True)
class EdgeSample:
    active: float = 0.0
    oldest_active: float = 0.0  # unix time; 0: none
    resolved: Mapping[str, float] = field(default_factory=dict)  # outcome -> counter total
    held: float = 0.0
    held_blocks: float = 0.0
    oldest_held: float = 0.0  # unix time; 0: none


@dataclass(frozen=True)
class StreamSample:
    """One end's streams on one edge, on one pod (gauges only)."""
    open: float = 0.0
    held: float = 0.0
    waiting: float = 0.0
    oldest_wait: float = 0.0  # unix time; 0: none
    #: Which end the pod is: "producer" (its series' stage is the edge's from_stage) or
    #: "consumer".
    end: str = "consumer"

    @property
    def sending(self) -> float:
        """The streams this pod still sends (a producer's open and held ones; 0 at a consumer)."""
        return self.open + self.held if self.end == "producer" else 0.0


#: A streamed edge: (from_stage, to_stage).
EdgeKey = tuple[str, str]


@dataclass(frozen=True)
class Sample:
    """One read of one pod's omni_kv_* families: gauges as they are, counters as totals."""
    states: Mapping[str, float] = field(default_factory=dict)  # pending, active, held
    held_blocks: float = 0.0
    oldest: Mapping[str, float] = field(default_factory=dict)  # state -> unix time; 0: none
    resolved: Mapping[str, float] = field(default_factory=dict)  # outcome -> counter total
    edges: Mapping[str, EdgeSample] = field(default_factory=dict)  # to_stage -> its edge
    received: Mapping[str, float] = field(default_factory=dict)  # outcome -> total (receiver)
    sends: bool = False  # the page has the ledger's families (a stage running the omni scheduler)
    receives: bool = False  # the page has the receiver's families
    requests: float | None = None  # vLLM's requests running and waiting (None: no vLLM on the page)
    streams: Mapping[EdgeKey, StreamSample] = field(default_factory=dict)  # the streamed edges it is an end of


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _parse_line(line: str) -> tuple[str, dict[str, str], float] | None:
    brace = line.find("{")
    if brace >= 0:
        end = line.rfind("}")
        if end < brace:
            return None
        name, labels, rest = line[:brace], dict(_LABEL.findall(line[brace + 1:end])), line[end + 1:]
    else:
        name, _, rest = line.partition(" ")
        labels = {}
    parts = rest.split()
    if not parts:
        return None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return None


def parse_metrics(text: str) -> Sample:
    """The omni_kv_* families of a /metrics page (Prometheus text format); every other line is
    skipped unparsed, so a page full of vLLM's own families costs little."""
    states: dict[str, float] = {}
    oldest: dict[str, float] = {}
    resolved: dict[str, float] = {}
    received: dict[str, float] = {}
    edges: dict[str, dict[str, Any]] = {}
    streams: dict[EdgeKey, dict[str, float]] = {}
    held_blocks = 0.0
    sends = receives = False
    requests: float | None = None
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_"):
            parsed = _parse_line(line)
            if parsed is not None and parsed[0] in REQUEST_FAMILIES and parsed[2] == parsed[2]:
                requests = (requests or 0.0) + parsed[2]
            continue
        if not line.startswith("omni_kv_"):
            continue
        parsed = _parse_line(line)
        if parsed is None:
            continue
        name, labels, value = parsed
        if value != value:  # NaN
            continue
        if name == TRANSFERS:
            sends = True
            state = labels.get("state", "")
            states[state] = states.get(state, 0.0) + value
        elif name == HELD_BLOCKS:
            held_blocks += value
        elif name == OLDEST:
            state = labels.get("state", "")
            if value > 0:  # the oldest over this page's series; 0 is "none"
                oldest[state] = min(oldest.get(state) or value, value)
        elif name == RESOLVED:
            outcome = labels.get("outcome", "")
            resolved[outcome] = resolved.get(outcome, 0.0) + value
        elif name == RECEIVED:
            receives = True
            outcome = labels.get("outcome", "")
            received[outcome] = received.get(outcome, 0.0) + value
        elif (name in EDGE_GAUGES or name == EDGE_RESOLVED) and labels.get("to_stage"):
            add_edge_value(edges, name, labels, value)
        elif name in STREAM_GAUGES and labels.get("from_stage") and labels.get("to_stage"):
            add_stream_value(streams, name, labels, value)
    return Sample(
        states=states, held_blocks=held_blocks, oldest=oldest, resolved=resolved, received=received,
        edges=edge_samples(edges),
        sends=sends, receives=receives, requests=requests, streams=stream_samples(streams),
    )


def add_stream_value(streams: dict[EdgeKey, dict[str, float]], name: str, labels: Mapping[str, str],
                     value: float) -> None:
    """One stream series' value into ``streams`` ({(from_stage, to_stage): figures}): the
    states' counts summed, the oldest wait's start the minimum (0: none)."""
    edge = streams.setdefault((labels["from_stage"], labels["to_stage"]),
                              {"open": 0.0, "held": 0.0, "waiting": 0.0, "oldest_wait": 0.0,
                               "end": "producer" if labels.get("stage") == labels["from_stage"] else "consumer"})
    if name == STREAMS:
        state = labels.get("state", "")
        if state in STREAM_STATES:
            edge[state] += value
    elif value > 0:
        edge["oldest_wait"] = min(edge["oldest_wait"] or value, value)


def stream_samples(streams: Mapping[EdgeKey, Mapping[str, float]]) -> dict[EdgeKey, StreamSample]:
    return {k: StreamSample(v["open"], v["held"], v["waiting"], v["oldest_wait"], v["end"])
            for k, v in streams.items()}


def add_edge_value(edges: dict[str, dict[str, Any]], name: str, labels: Mapping[str, str],
                   value: float) -> None:
    """One per-edge series' value into ``edges`` ({to_stage: figures}), as the pod's page or
    Prometheus gives it: counts and blocks summed, the oldest timestamps' minimum (0: none)."""
    edge = edges.setdefault(labels["to_stage"], {"active": 0.0, "oldest": 0.0, "resolved": {},
                                                 "held": 0.0, "held_blocks": 0.0, "oldest_held": 0.0})
    if name == EDGE_ACTIVE:
        edge["active"] += value
    elif name == EDGE_HELD:
        edge["held"] += value
    elif name == EDGE_HELD_BLOCKS:
        edge["held_blocks"] += value
    elif name in (EDGE_OLDEST, EDGE_OLDEST_HELD):
        key = "oldest" if name == EDGE_OLDEST else "oldest_held"
        if value > 0:
            edge[key] = min(edge[key] or value, value)
    else:
        outcome = labels.get("outcome", "")
        edge["resolved"][outcome] = edge["resolved"].get(outcome, 0.0) + value


def edge_samples(edges: Mapping[str, Mapping[str, Any]]) -> dict[str, EdgeSample]:
    return {k: EdgeSample(v["active"], v["oldest"], v["resolved"], v["held"], v["held_blocks"],
                          v["oldest_held"]) for k, v in edges.items()}


def increase(previous: float | None, current: float) -> float:
    """A counter's increase between two reads: nothing for a counter not seen before (a new
    pod, or the reader's first look), the current value after a reset (it went down: the
    process restarted and counted from zero since), else the difference."""
    if previous is None:
        return 0.0
    if current < previous:
        return current
    return current - previous


def _increases(previous: Mapping[str, float] | None, current: Mapping[str, float]) -> dict[str, float]:
    if previous is None:
        return {k: 0.0 for k in current}
    return {k: increase(previous.get(k, 0.0), v) for k, v in current.items()}


# ------------------------------------------------------------------------------- readings
@dataclass(frozen=True)
class EdgeReading:
    active: float = 0.0
    oldest_active: float = 0.0
    increase: Mapping[str, float] = field(default_factory=dict)  # outcome -> over the interval
    held: float = 0.0
    held_blocks: float = 0.0
    oldest_held: float = 0.0


@dataclass(frozen=True)
class PodReading:
    """One pod's figures: its gauges now and its counters' increase over the last interval."""
    pod: str
    states: Mapping[str, float] = field(default_factory=dict)
    held_blocks: float = 0.0
    oldest: Mapping[str, float] = field(default_factory=dict)
    increase: Mapping[str, float] = field(default_factory=dict)
    edges: Mapping[str, EdgeReading] = field(default_factory=dict)
    received_increase: Mapping[str, float] = field(default_factory=dict)
    sends: bool = False
    receives: bool = False
    requests: float | None = None  # vLLM's requests running and waiting
    streams: Mapping[EdgeKey, StreamSample] = field(default_factory=dict)


def pod_reading(pod: str, previous: Sample | None, current: Sample) -> PodReading:
    """A pod's reading from its previous sample (None: first seen) and its current one."""
    edges = {}
    for name, edge in current.edges.items():
        before = previous.edges.get(name) if previous is not None else None
        edges[name] = EdgeReading(edge.active, edge.oldest_active,
                                  _increases(before.resolved if before is not None else None, edge.resolved),
                                  edge.held, edge.held_blocks, edge.oldest_held)
    return PodReading(
        pod=pod, states=dict(current.states), held_blocks=current.held_blocks, oldest=dict(current.oldest),
        increase=_increases(previous.resolved if previous is not None else None, current.resolved),
        edges=edges,
        received_increase=_increases(previous.received if previous is not None else None, current.received),
        sends=current.sends, receives=current.receives, requests=current.requests,
        streams=dict(current.streams),
    )


@dataclass(frozen=True)
class StageReading:
    pods: tuple[PodReading, ...] = ()
    #: (pod, why) of each pod whose metrics could not be read.
    unreadable: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PipelineReading:
    """Every stage's pods, read at ``read_at`` (unix time), over an interval of ``interval``
    seconds since the previous reading (0 for the first)."""
    read_at: float
    interval: float = 0.0
    stages: Mapping[str, StageReading] = field(default_factory=dict)
    #: Why nothing could be read at all (e.g. the Prometheus query failed), else "".
    error: str = ""
    #: Terminating pods (an old revision draining), by name: read for the rollout's drain,
    #: left out of the stages' figures and of the verdict.
    draining: Mapping[str, PodReading] = field(default_factory=dict)
    #: Each running pod's ``controller.kubernetes.io/pod-deletion-cost`` as listed (None:
    #: absent), by name, for ``deletion_cost.patches``; None where the source lists no pods
    #: (Prometheus).
    deletion_costs: Mapping[str, str | None] | None = None


# ------------------------------------------------------------------------------- status
def round_age(seconds: float) -> int:
    """Rounded down to a step of AGE_STEPS (then whole hours): a status that carries ages
    changes only when an age crosses a step, not at every resync."""
    if seconds <= 0:
        return 0
    if seconds >= AGE_STEPS[-1]:
        return int(seconds // 3600) * 3600
    step = 0
    for s in AGE_STEPS:
        if seconds >= s:
            step = s
    return step


def _age(read_at: float, started: float) -> float:
    return max(0.0, read_at - started) if started > 0 else 0.0


def _count(value: float) -> int:
    return int(round(value))


@dataclass(frozen=True)
class StageHealth:
    """What one stage's reading says, before it becomes status fields."""
    name: str
    sends: bool
    pods: int
    unreadable: tuple[tuple[str, str], ...]
    states: Mapping[str, int]
    held_blocks: int
    oldest_active_age: float
    oldest_held_age: float
    stuck_pods: int
    failed: int
    expired: int
    resolved: int
    rejected: int
    #: toStage, active, held, heldBlocks, oldest active and held ages, failed, expired, stuck
    edges: tuple[dict[str, Any], ...]
    #: The streamed edges this stage's pods are an end of: fromStage, toStage, open, held,
    #: waiting, the oldest wait's age, and how many pods have a wait over the stall threshold.
    streams: tuple[dict[str, Any], ...] = ()


def _stream_health(pods: Iterable[PodReading], read_at: float, stalled_seconds: float) -> tuple[dict[str, Any], ...]:
    out = []
    pods = list(pods)
    for key in dict.fromkeys(k for p in pods for k in p.streams):
        readings = [p.streams[key] for p in pods if key in p.streams]
        ages = [_age(read_at, r.oldest_wait) for r in readings]
        out.append({
            "fromStage": key[0], "toStage": key[1],
            "open": _count(sum(r.open for r in readings)),
            "held": _count(sum(r.held for r in readings)),
            "waiting": _count(sum(r.waiting for r in readings)),
            "oldestWaitAge": max(ages, default=0.0),
            "stalledPods": sum(1 for a in ages if a > stalled_seconds),
            "pods": len(readings),
        })
    return tuple(out)


def stage_health(name: str, reading: StageReading, read_at: float, stuck_seconds: float,
                 downstream: Iterable[str] = (), stalled_seconds: float = float("inf")) -> StageHealth:
    pods = reading.pods
    states = {s: _count(sum(p.states.get(s, 0.0) for p in pods)) for s in ("pending", "active", "held")}
    ages = [_age(read_at, p.oldest.get("active", 0.0)) for p in pods]
    increase = {o: sum(p.increase.get(o, 0.0) for p in pods) for o in ("acked", "failed", "expired", "cancelled")}
    edge_names = list(dict.fromkeys([*downstream, *(e for p in pods for e in p.edges)]))
    edges = []
    for edge in edge_names:
        readings = [p.edges[edge] for p in pods if edge in p.edges]
        if not readings:
            continue
        oldest = max((_age(read_at, e.oldest_active) for e in readings), default=0.0)
        edges.append({
            "toStage": edge,
            "active": _count(sum(e.active for e in readings)),
            "held": _count(sum(e.held for e in readings)),
            "heldBlocks": _count(sum(e.held_blocks for e in readings)),
            "oldestActiveAge": oldest,
            "oldestHeldAge": max((_age(read_at, e.oldest_held) for e in readings), default=0.0),
            "failed": _count(sum(e.increase.get("failed", 0.0) for e in readings)),
            "expired": _count(sum(e.increase.get("expired", 0.0) for e in readings)),
            "stuck": oldest > stuck_seconds,
        })
    return StageHealth(
        name=name,
        sends=any(p.sends for p in pods),
        pods=len(pods),
        unreadable=tuple(reading.unreadable),
        states=states,
        held_blocks=_count(sum(p.held_blocks for p in pods)),
        oldest_active_age=max(ages, default=0.0),
        oldest_held_age=max((_age(read_at, p.oldest.get("held", 0.0)) for p in pods), default=0.0),
        stuck_pods=sum(1 for a in ages if a > stuck_seconds),
        failed=_count(increase["failed"]),
        expired=_count(increase["expired"]),
        resolved=_count(sum(increase.values())),
        rejected=_count(sum(p.received_increase.get("rejected", 0.0) for p in pods)),
        edges=tuple(edges),
        streams=_stream_health(pods, read_at, stalled_seconds),
    )


def stage_transfers_status(health: StageHealth) -> dict[str, Any]:
    """``status.stages[].transfers`` of one stage: integers only, ages rounded (AGE_STEPS)."""
    out: dict[str, Any] = {"pods": health.pods}
    if health.unreadable:
        out["unreadablePods"] = len(health.unreadable)
    if health.sends:
        out.update({
            "pending": health.states["pending"],
            "active": health.states["active"],
            "held": health.states["held"],
            "heldBlocks": health.held_blocks,
            "oldestActiveSeconds": round_age(health.oldest_active_age),
            "oldestHeldSeconds": round_age(health.oldest_held_age),
            "failed": health.failed,
            "expired": health.expired,
        })
        if health.edges:
            out["edges"] = [{
                "toStage": e["toStage"], "active": e["active"], "held": e["held"],
                "heldBlocks": e["heldBlocks"],
                "oldestActiveSeconds": round_age(e["oldestActiveAge"]),
                "oldestHeldSeconds": round_age(e["oldestHeldAge"]),
                "failed": e["failed"], "expired": e["expired"],
            } for e in health.edges]
    if health.rejected:
        out["rejected"] = health.rejected
    if health.streams:  # only where a stage streams: a pipeline without streams keeps its status
        out["streams"] = [{
            "fromStage": e["fromStage"], "toStage": e["toStage"], "open": e["open"], "held": e["held"],
            "waiting": e["waiting"], "oldestWaitSeconds": round_age(e["oldestWaitAge"]),
        } for e in health.streams]
    return out


@dataclass(frozen=True)
class TransfersVerdict:
    """The TransfersHealthy condition's status, reason and message, and the printer column."""
    status: str  # "True", "False", "Unknown"
    reason: str
    message: str
    summary: str  # ok, stuck N, stalled N, failing P%, unknown, none
    stages: Mapping[str, dict[str, Any]] = field(default_factory=dict)  # name -> transfers status
    #: False for a first reading (no interval yet: the reader just started): failures were
    #: not counted, so a previous TransfersFailing stands until the next reading says.
    judged_failing: bool = True

    @property
    def unhealthy(self) -> bool:
        return self.status == "False"


def _fmt_age(seconds: float) -> str:
    """An age for a message or a table. The verdict's messages pass rounded ages
    (``round_age``, ``_about``) so that, like the status fields, they change only when an age
    crosses a step: a pipeline stuck for an hour is not re-written at every resync."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _about(interval: float) -> float:
    """The interval between two readings for a message: to the nearest 10 s from 30 s up, 5 s
    below, so that a resync timer's jitter does not change the message."""
    step = 10 if interval >= 30 else 5
    return max(step, round(interval / step) * step)


def transfers_verdict(pipeline: Pipeline, reading: PipelineReading,
                      failing_ratio: float = DEFAULT_FAILING_RATIO) -> TransfersVerdict:
    """The pipeline's transfer health from one reading of its stages' metrics.

    - ``False/TransferStuck``: a sending stage's pod has had a transfer active for longer than
      ``spec.observability.alerts.stuckTransferSeconds``;
    - else ``False/StreamStalled``: a pod at either end of a streamed edge has had a stream
      waiting (for a chunk, an ack or a credit) for longer than
      ``spec.observability.alerts.stalledStreamSeconds``; the message names the edge;
    - else ``False/TransfersFailing``: over the interval, the share of a sending stage's
      resolved transfers that failed or expired is above ``failing_ratio``;
    - else ``Unknown/MetricsUnavailable``: a pod's metrics could not be read, or a sending
      stage has replicas but no pod to read, or its pods export no transfer metrics;
    - else ``True`` (``NoSendingStage`` when no stage sends KV).
    """
    stuck_seconds = pipeline.observability.stuck_transfer_seconds
    stalled_seconds = pipeline.observability.stalled_stream_seconds
    healths = {s.name: stage_health(s.name, reading.stages.get(s.name, StageReading()), reading.read_at,
                                    stuck_seconds, pipeline.downstream_of(s.name), stalled_seconds)
               for s in pipeline.stages}
    stages = {name: stage_transfers_status(h) for name, h in healths.items()
              if h.pods or h.unreadable}
    sending = [s for s in pipeline.stages if s.kv.send]
    if not sending:
        return TransfersVerdict("True", NO_TRANSFERS, "no stage sends KV", "none", stages)

    stuck, failing, unknown = [], [], []
    stuck_pods = 0
    worst_share = 0.0
    for stage in sending:
        h = healths[stage.name]
        if h.stuck_pods:
            stuck_pods += h.stuck_pods
            edges = [e["toStage"] for e in h.edges if e["stuck"]]
            where = f" toward {', '.join(edges)}" if edges else ""
            stuck.append(f"stage {stage.name}: {h.stuck_pods} of {h.pods} pods hold a transfer active for "
                         f"over {_fmt_age(round_age(h.oldest_active_age))}{where} "
                         f"(threshold {stuck_seconds}s)")
        bad = h.failed + h.expired
        if bad and h.resolved and bad / h.resolved > failing_ratio:
            share = bad / h.resolved
            worst_share = max(worst_share, share)
            edges = [f"{e['toStage']} ({e['failed']} failed, {e['expired']} expired)"
                     for e in h.edges if e["failed"] or e["expired"]]
            where = f"; by edge: {', '.join(edges)}" if edges else ""
            failing.append(f"stage {stage.name}: {bad} of {h.resolved} transfers resolved in the last "
                           f"{_fmt_age(_about(reading.interval))} failed or expired ({h.failed} failed, "
                           f"{h.expired} expired){where}")
    stalled, stalled_pods = _stalls(pipeline, healths, stalled_seconds)
    for stage in pipeline.stages:
        h = healths[stage.name]
        for pod, why in h.unreadable:
            unknown.append(f"stage {stage.name}: pod {pod}: {why}")
        if stage.kv.send and not h.unreadable:
            if not h.pods and stage.replicas > 0:
                unknown.append(f"stage {stage.name}: no running pod to read")
            elif h.pods and not h.sends:
                unknown.append(f"stage {stage.name}: its pods export no {TRANSFERS} "
                               "(not running the omni scheduler, or its metrics are not shared)")
    if reading.error:
        unknown.insert(0, reading.error)

    judged = reading.interval > 0
    if stuck:
        return TransfersVerdict("False", STUCK, "; ".join(stuck), f"stuck {stuck_pods}", stages, judged)
    if stalled:
        return TransfersVerdict("False", STALLED, "; ".join(stalled)[:1000], f"stalled {stalled_pods}", stages,
                                judged)
    if failing:
        return TransfersVerdict("False", FAILING, "; ".join(failing), f"failing {round(worst_share * 100)}%",
                                stages, judged)
    if unknown:
        return TransfersVerdict("Unknown", UNAVAILABLE, "; ".join(unknown)[:1000], "unknown", stages, judged)
    return TransfersVerdict("True", HEALTHY, "no transfer stuck or failing", "ok", stages, judged)


def _stalls(pipeline: Pipeline, healths: Mapping[str, StageHealth], threshold: float) -> tuple[list[str], int]:
    """(a message per stalled streamed edge, the pods with a stalled stream): an edge is
    stalled when a pod at either of its ends has had a stream waiting longer than the
    threshold. The ages are rounded down to a step, as the status's are."""
    messages, pods = [], 0
    for producer, consumer, _ in pipeline.streamed_edges():
        ends = []
        oldest = 0.0
        for stage in (producer, consumer):
            for e in healths[stage].streams if stage in healths else ():
                if (e["fromStage"], e["toStage"]) == (producer, consumer) and e["stalledPods"]:
                    ends.append(f"{stage}: {e['stalledPods']} of {e['pods']} pods")
                    pods += e["stalledPods"]
                    oldest = max(oldest, e["oldestWaitAge"])
        if ends:
            messages.append(f"edge {producer} -> {consumer}: a stream has waited for over "
                            f"{_fmt_age(round_age(oldest))} for a chunk, an ack or a credit (threshold "
                            f"{threshold:g}s; at {', '.join(ends)})")
    return messages, pods


NOT_READ = TransfersVerdict("Unknown", UNAVAILABLE, "the stages' metrics have not been read yet", "unknown")


# ------------------------------------------------------------------------------- table
def render_table(pipeline: Pipeline, verdict: TransfersVerdict) -> str:
    """The per-stage and per-edge table of ``omni-pipeline status`` (the same figures as the
    operator's ``status.stages[].transfers``)."""
    rows = [("STAGE", "PODS", "PENDING", "ACTIVE", "HELD", "HELD BLOCKS", "OLDEST ACTIVE", "OLDEST HELD",
             "FAILED", "EXPIRED")]
    for stage in pipeline.stages:
        t = verdict.stages.get(stage.name)
        if t is None:
            rows.append((stage.name, "0", *["-"] * 8))
            continue
        pods = str(t["pods"]) + (f" ({t['unreadablePods']} unreadable)" if t.get("unreadablePods") else "")
        if "active" not in t:
            rows.append((stage.name, pods, *["-"] * 8))
            continue
        rows.append((stage.name, pods, str(t["pending"]), str(t["active"]), str(t["held"]), str(t["heldBlocks"]),
                     _fmt_age(t["oldestActiveSeconds"]), _fmt_age(t["oldestHeldSeconds"]),
                     str(t["failed"]), str(t["expired"])))
        for edge in t.get("edges", []):
            rows.append((f"  -> {edge['toStage']}", "", "", str(edge["active"]), str(edge.get("held", 0)),
                         str(edge.get("heldBlocks", 0)), _fmt_age(edge["oldestActiveSeconds"]),
                         _fmt_age(edge.get("oldestHeldSeconds", 0)), str(edge["failed"]), str(edge["expired"])))
    head = f"pipeline {pipeline.name}: transfers {verdict.summary} ({verdict.reason}: {verdict.message})"
    streams = [("STREAM", "AT", "OPEN", "HELD", "WAITING", "OLDEST WAIT")]
    for stage in pipeline.stages:
        for e in (verdict.stages.get(stage.name) or {}).get("streams", ()):
            streams.append((f"{e['fromStage']} -> {e['toStage']}", stage.name, str(e["open"]), str(e["held"]),
                            str(e["waiting"]), _fmt_age(e["oldestWaitSeconds"])))
    tables = [_table(rows)] + ([_table(streams)] if len(streams) > 1 else [])
    return "\n".join([head, *(line for table in tables for line in table)])


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]

"""Revisioned rollouts: how many pods each revision's stages have now, a pure function of what
the operator observes.

A pipeline's revision (`model.revision_of`) names its workloads (`naming.revision_name`). When
the spec changes what the stages must agree on, a new revision gets workloads of its own next
to the old ones, and :func:`plan` moves the capacity across, one reconcile at a time, from:

- the spec (the current revision, its stage graph, each stage's target and its
  ``maxSurge``/``maxUnavailable``),
- the stage Deployments of every revision, as listed (their ``spec.replicas``, their ready
  pods, and the annotations that record each revision's graph: an old revision's graph is
  read from its own objects, never from the spec),
- while an old revision remains, the stage pods as listed (which still exist, which are
  terminating and until when), and the last reading of their metrics (``omni_operator.health``): the
  KV transfers each pod has pending, active or held, and the requests it is running.

Nothing is remembered between calls, so an operator restarted at any point resumes the
rollout from the objects, and a spec changed during a rollout starts the next rollout from
wherever the last one stands (an unfinished new revision simply becomes an old one).

The steps, as :func:`plan` takes them:

1. **Receivers first.** A stage of the current revision gets pods only once every stage it
   sends to has a ready pod of the current revision (or is scaled to zero), so a new sender
   never starts without receivers of its own revision to send to.
2. **Within each stage's limits.** A stage's pods, all revisions together, never exceed its
   target plus ``maxSurge``; the new revision grows into that room. An old revision's pods
   go only while the stage keeps ``target - maxUnavailable`` ready pods (the new ones count).
3. **Draining by transfers and streams.** An old revision's stage that receives KV keeps a
   ready pod (and, beyond it, what its floor asks, as in 2) until every stage of that
   revision sending to it has drained: its other pods may go meanwhile, since a receiver that
   is stopping refuses new hand-offs and streams (`stopping`), its senders offer them to
   another replica, and it finishes the streams it holds (docs/operator.md, "Which replica a
   transfer or a stream goes to").
   Drained means: no pods any more, or
   each pod terminating (it stopped taking requests, the runtime's SIGTERM drain) and its last
   reading, taken after it began terminating, shows no request running, no transfer pending,
   active or held, and no stream it produces open or held; or the pod's drain deadline (its
   deletionTimestamp: the grace period, the transfer timeout, or a stream producer's longest
   streamSeconds, plus the stop margins) has passed, in which case the transfers and streams
   it still reported are abandoned and a Warning event says how many.
4. **No order left.** Where a receiving stage of one pod has no surge (a GPU stage's
   default), its new pod needs what its old pod holds, which stays while the old senders
   send, which keep their floor (a stage with no ``maxUnavailable``, a CPU stage's default)
   until new senders are ready, which wait for new receivers. When everything has settled
   and no step moves, the old senders nothing blocks drain below their floor (the
   Progressing message says so): availability gives way where no order keeps it. (With two
   pods or more, 3 leaves the new revision room: an old receiver keeps one pod, not all.)
5. **Cleanup.** An old revision's stage with no pod left loses its Deployment, ConfigMap and
   KV Service.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from omni_operator.pipeline import naming
from omni_operator.pipeline.model import Pipeline
from omni_operator.pipeline.render import KILL_MARGIN_SECONDS, STOP_BEYOND_GRACE_SECONDS

#: A draining pod's grace period is its transfer timeout plus these margins (render.py): its
#: transfers are over (acked, failed or expired) by its deletionTimestamp minus them, when the
#: drain deadline passes; the operator then still has the margins to act before the kubelet
#: kills the pod.
DRAIN_MARGIN_SECONDS = STOP_BEYOND_GRACE_SECONDS + KILL_MARGIN_SECONDS

#: The revision of Deployments made before revisions existed (no revision label).
LEGACY = "legacy"


@dataclass(frozen=True)
class Workload:
    """One revision's Deployment of one stage, as observed."""
    revision: str
    stage: str
    name: str
    replicas: int  # spec.replicas
    ready: int  # status.readyReplicas
    pods: int = 0  # status.replicas: its pods not terminating, as its controller last counted
    inputs: tuple[str, ...] = ()
    sends: bool = False
    created: str = ""  # metadata.creationTimestamp (RFC 3339 sorts as time)


@dataclass(frozen=True)
class StagePod:
    """A stage pod, as listed."""
    name: str
    revision: str
    stage: str
    ready: bool = False
    #: When it began terminating and when its drain is over (its transfers' timeout; unix
    #: seconds), None while it runs.
    drain_started: float | None = None
    deadline: float | None = None

    @property
    def terminating(self) -> bool:
        return self.deadline is not None


@dataclass(frozen=True)
class PodLoad:
    """What a pod's metrics said at ``read_at``: KV transfers pending, active or held, the
    requests it was running or had queued (None: the page has no vLLM figures), and the
    streams it was still sending (open or held, as their producer)."""
    read_at: float
    transfers: float
    requests: float | None = None
    streams: float = 0.0


@dataclass(frozen=True)
class DrainEvent:
    """A Warning event to post once (``key`` makes its name: a restart never posts it twice)."""
    key: str
    reason: str
    message: str


@dataclass
class RevisionState:
    revision: str
    current: bool
    draining: bool
    stages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Plan:
    #: Desired spec.replicas of every workload to keep: (revision, stage) -> replicas.
    replicas: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Old workloads to delete now (Deployment, ConfigMap, KV Service).
    delete: set[tuple[str, str]] = field(default_factory=set)
    events: list[DrainEvent] = field(default_factory=list)
    #: What the rollout waits for, one line per stage that waits (the Progressing message).
    waiting: list[str] = field(default_factory=list)
    revisions: list[RevisionState] = field(default_factory=list)

    @property
    def rolling(self) -> bool:
        return any(not r.current for r in self.revisions)


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def workload_of(deployment: Mapping[str, Any], pipeline: Pipeline) -> Workload | None:
    """The Workload an owned stage Deployment is (None: not a stage Deployment)."""
    meta = deployment.get("metadata") or {}
    labels = meta.get("labels") or {}
    stage = labels.get(naming.STAGE_LABEL)
    if not stage:
        return None
    revision = labels.get(naming.REVISION_LABEL) or LEGACY
    expected = (naming.stage_name(pipeline.name, stage) if revision == LEGACY
                else naming.revision_name(pipeline.name, stage, revision))
    if meta.get("name") != expected:
        return None  # not a revision's workload (a leftover under another name: deleted)
    notes = meta.get("annotations") or {}
    if naming.INPUTS_ANNOTATION in notes:
        inputs = tuple(i for i in notes[naming.INPUTS_ANNOTATION].split(",") if i)
        sends = notes.get(naming.SENDS_ANNOTATION) == "true"
    else:  # made before revisions: its graph was the spec's (the best knowledge left)
        known = next((s for s in pipeline.stages if s.name == stage), None)
        inputs = tuple(known.inputs) if known else ()
        sends = bool(known and known.kv.send)
    status = deployment.get("status") or {}
    return Workload(revision=revision, stage=stage, name=meta.get("name", ""),
                    replicas=int((deployment.get("spec") or {}).get("replicas", 1) or 0),
                    ready=int(status.get("readyReplicas") or 0), pods=int(status.get("replicas") or 0),
                    inputs=inputs, sends=sends,
                    created=meta.get("creationTimestamp") or "")


def pod_of(pod: Mapping[str, Any]) -> StagePod | None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if not labels.get(naming.STAGE_LABEL):
        return None
    killed_at = parse_time(meta.get("deletionTimestamp"))
    grace = meta.get("deletionGracePeriodSeconds")
    started = killed_at - float(grace) if killed_at is not None and isinstance(grace, (int, float)) else killed_at
    deadline = None if killed_at is None else max(started or killed_at, killed_at - DRAIN_MARGIN_SECONDS)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or [])
    return StagePod(name=meta.get("name", ""), revision=labels.get(naming.REVISION_LABEL) or LEGACY,
                    stage=labels[naming.STAGE_LABEL], ready=ready, drain_started=started, deadline=deadline)


def _downstream(stage: str, graph: Mapping[str, tuple[str, ...]]) -> list[str]:
    return [s for s, inputs in graph.items() if stage in inputs]


def plan(pipeline: Pipeline, targets: Mapping[str, int], workloads: Iterable[Workload],
         pods: Iterable[StagePod] = (), loads: Mapping[str, PodLoad] | None = None, *,
         now: float, read_loads: bool = True) -> Plan:
    """The next step of the pipeline's rollout (see the module docstring).

    ``targets``: each current stage's replicas (the spec's, or its autoscaler's).
    ``pods``: the stage pods (needed only while an old revision remains). ``loads``: the
    last reading of each pod's metrics by pod name. ``read_loads=False`` (transfer health
    off): a draining pod counts as drained only once it is gone, or past its deadline.
    """
    current = pipeline.revision
    loads = loads or {}
    result = Plan()
    by_revision: dict[str, dict[str, Workload]] = {}
    for w in workloads:
        by_revision.setdefault(w.revision, {})[w.stage] = w
    mine = by_revision.get(current, {})
    old_revisions = sorted((r for r in by_revision if r != current),
                           key=lambda r: min(w.created for w in by_revision[r].values()))
    pods = list(pods)
    pods_of: dict[tuple[str, str], list[StagePod]] = {}
    for pod in pods:
        pods_of.setdefault((pod.revision, pod.stage), []).append(pod)
    graph = {s.name: tuple(s.inputs) for s in pipeline.stages}
    limits = {s.name: s.rollout for s in pipeline.stages}

    # An old workload's pods: as many as it is told to have, or still has (a scale-down its
    # controller has not acted on yet still holds its pods), as the Deployment controller counts.
    old_replicas = {s: sum(max(by_revision[r][s].replicas, by_revision[r][s].pods)
                           for r in old_revisions if s in by_revision[r])
                    for s in graph}
    # Terminating pods still hold their node's resources (a GPU stage's maxSurge 0 means no
    # spare GPU): they count against the surge until they are gone.
    terminating = {s: sum(1 for p in pods if p.stage == s and p.terminating) for s in graph}

    # 1 + 2: the current revision, receivers first, into the room the stage's surge leaves.
    for stage in graph:
        target = targets[stage]
        have = mine[stage].replicas if stage in mine else 0
        waits_for = [d for d in _downstream(stage, graph)
                     if targets[d] > 0 and (mine[d].ready if d in mine else 0) < 1]
        if waits_for:
            want = min(have, target)
            if want < target:
                result.waiting.append(f"{stage} waits for a ready pod of {', '.join(waits_for)} "
                                      f"(receivers first)")
        else:
            room = target + limits[stage].max_surge - old_replicas[stage] - terminating[stage]
            want = min(target, max(have, room))
            if want < target:
                result.waiting.append(f"{stage}: {max(0, want)}/{target} pods of revision {current}, the "
                                      f"rest once old pods are gone (maxSurge {limits[stage].max_surge})")
        result.replicas[(current, stage)] = max(0, want)

    # 3: old revisions, stage by stage with senders first (so that a receiver sees what its
    # senders were told in this very call); for each stage first which old revisions must
    # keep their pods (their senders still send), then how many pods the others keep: as few
    # as the stage's floor allows, taken from the oldest revision first.
    union: dict[str, tuple[str, ...]] = {}
    for revision in old_revisions:
        for stage, w in by_revision[revision].items():
            union[stage] = tuple(dict.fromkeys(union.get(stage, ()) + w.inputs))
    drained_memo: dict[tuple[str, str], tuple[bool, list[str]]] = {}

    def drained(revision: str, stage: str) -> tuple[bool, list[str]]:
        """Whether (revision, stage) can send nothing any more, and notes on what was abandoned."""
        key = (revision, stage)
        if key not in drained_memo:
            w = by_revision[revision].get(stage)
            if w is not None and (w.replicas > 0 or w.pods > 0 or result.replicas.get(key, 0) > 0):
                # Told to stop (or not yet), not yet seen stopping: its pods may not be listed
                # as terminating yet.
                drained_memo[key] = (False, [])
            else:
                drained_memo[key] = _pods_drained(pods_of.get(key, []), loads, now, read_loads)
        return drained_memo[key]

    for stage in _topological(union):
        target = targets.get(stage, 0)
        unavailable = limits[stage].max_unavailable if stage in limits else 0
        floor = max(0, target - unavailable)
        ready_now = mine[stage].ready if stage in mine else 0
        free: list[Workload] = []
        for revision in old_revisions:
            w = by_revision[revision].get(stage)
            if w is None:
                continue
            blocked = []
            for u in w.inputs:
                if u not in by_revision[revision] and not pods_of.get((revision, u)):
                    continue  # no such sender in that revision (any more)
                if not drained(revision, u)[0]:
                    blocked.append(u)
            if blocked:
                # Its senders still send: a ready pod stays for them, and beyond it what the
                # stage's floor asks, as for any old revision; its other pods may go (3 above).
                keep_ready = max(1, floor - ready_now)
                want = min(w.replicas, keep_ready if keep_ready <= w.ready else w.replicas)
                result.replicas[(revision, stage)] = want
                ready_now += min(w.ready, want)
                result.waiting.append(f"revision {revision} {stage}: {want} "
                                      f"pod{'s' if want != 1 else ''} stay until its senders "
                                      f"{', '.join(blocked)} have drained their KV transfers")
                continue
            free.append(w)
        for w in reversed(free):  # the newest old revision keeps pods first: the oldest goes first
            keep_ready = max(0, floor - ready_now)
            want = min(w.replicas, keep_ready if keep_ready <= w.ready else w.replicas)
            result.replicas[(w.revision, stage)] = want
            ready_now += min(w.ready, want)
            if want > 0:
                result.waiting.append(f"revision {w.revision} {stage}: {want} pods stay until revision "
                                      f"{current} has {floor} ready (maxUnavailable {unavailable})")

    # 4: a rollout no step can move. Where a receiving stage has no surge (a GPU stage by
    # default), its new pods need the resources its old ones hold, which stay while their
    # senders send, which stay for their stage's floor until new senders are ready, which wait
    # for new receivers: no order keeps every floor. Once everything has settled (every pod
    # ready, none terminating) and this step would change nothing, the old revision's senders
    # that nothing blocks are drained below their floor, and the message says so.
    settled = (not any(p.terminating for p in pods)
               and all(w.ready == w.replicas == w.pods for ws in by_revision.values() for w in ws.values()))
    unchanged = all(result.replicas.get((w.revision, w.stage), w.replicas) == w.replicas
                    for ws in by_revision.values() for w in ws.values())
    if old_revisions and settled and unchanged:
        for revision in old_revisions:
            for stage, w in by_revision[revision].items():
                blocked = any(u in by_revision[revision] and not drained(revision, u)[0] for u in w.inputs)
                if w.sends and not blocked and result.replicas[(revision, stage)] > 0:
                    result.replicas[(revision, stage)] = 0
                    result.waiting.append(
                        f"revision {revision} {stage} drains below its floor: the stages it sends to have no "
                        f"maxSurge, and their old pods hold what their new ones need until it has drained")

    for revision in old_revisions:
        for stage, w in by_revision[revision].items():
            if (result.replicas[(revision, stage)] == 0 and w.replicas == 0 and w.pods == 0
                    and not pods_of.get((revision, stage))):
                result.delete.add((revision, stage))
                del result.replicas[(revision, stage)]

    # A draining pod past its drain deadline with transfers still in flight: they are
    # abandoned (its receivers stop waiting for it). One event per pod.
    for pod in pods:
        load = loads.get(pod.name)
        if (pod.revision != current and pod.deadline is not None and now >= pod.deadline
                and load is not None and (load.transfers > 0 or load.streams > 0)):
            in_flight = _in_flight(load)
            result.events.append(DrainEvent(
                key=f"{pod.revision}.{pod.name}", reason="DrainDeadlinePassed",
                message=(f"revision {pod.revision}: pod {pod.name} (stage {pod.stage}) passed its drain deadline "
                         f"with {in_flight} in flight: {int(load.transfers) + int(load.streams)} abandoned; the "
                         "receivers of its revision no longer wait for it")))

    # Status: every revision with workloads, the current one first.
    result.revisions.append(RevisionState(current, True, False, [
        {"name": s, "replicas": result.replicas[(current, s)], "readyReplicas": mine[s].ready if s in mine else 0}
        for s in graph]))
    for revision in reversed(old_revisions):
        kept = [s for s in by_revision[revision] if (revision, s) in result.replicas]
        if kept:
            result.revisions.append(RevisionState(revision, False, True, [
                {"name": s, "replicas": result.replicas[(revision, s)],
                 "readyReplicas": by_revision[revision][s].ready} for s in kept]))
    return result


def _pod_drained(pod: StagePod, load: PodLoad | None, now: float, read_loads: bool) -> str | None:
    """None: the pod may still send. "": it has drained. Else: past its deadline, what it
    abandoned (a note for the event)."""
    if pod.deadline is not None and now >= pod.deadline:
        if load is None:
            return f"pod {pod.name}: not read before its deadline"
        if load.streams > 0:
            return f"pod {pod.name}: {_in_flight(load)} abandoned"
        in_flight = int(load.transfers)
        return f"pod {pod.name}: {in_flight} transfer{'s' if in_flight != 1 else ''} abandoned" if in_flight else ""
    if not pod.terminating or not read_loads or load is None or pod.drain_started is None:
        return None
    if load.read_at <= pod.drain_started:
        return None  # read before it stopped taking requests: it may have started more since
    if load.transfers > 0 or load.streams > 0 or (load.requests or 0) > 0:
        return None
    return ""


def _in_flight(load: PodLoad) -> str:
    """"3 KV transfers", "2 streams", "1 KV transfer and 2 streams": what a pod still had."""
    parts = []
    if load.transfers > 0:
        n = int(load.transfers)
        parts.append(f"{n} KV transfer{'s' if n != 1 else ''}")
    if load.streams > 0:
        n = int(load.streams)
        parts.append(f"{n} stream{'s' if n != 1 else ''}")
    return " and ".join(parts)


def _pods_drained(pods: list[StagePod], loads: Mapping[str, PodLoad], now: float,
                  read_loads: bool) -> tuple[bool, list[str]]:
    """Whether every one of a sender's pods has drained (none left is drained), and what
    those past their deadline abandoned."""
    ok, notes = True, []
    for pod in pods:
        state = _pod_drained(pod, loads.get(pod.name), now, read_loads)
        if state is None:
            ok = False
        elif state:
            notes.append(state)
    return ok, notes


def _topological(graph: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Stages upstream first (an input outside the graph is ignored; a cycle, which the
    operator never renders, falls back to name order)."""
    order: list[str] = []
    done: set[str] = set()
    visiting: set[str] = set()

    def visit(stage: str) -> None:
        if stage in done or stage in visiting:
            return
        visiting.add(stage)
        for u in graph.get(stage, ()):
            if u in graph:
                visit(u)
        visiting.discard(stage)
        done.add(stage)
        order.append(stage)

    for stage in sorted(graph):
        visit(stage)
    return order

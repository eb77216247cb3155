"""One reconcile path for create, update, resume, child events and the resync timer.

Reads the OmniPipeline, checks it (`admission.admit`, the check `omni-pipeline validate`
runs; nothing is written for an invalid spec but its status and one Warning event), renders
the desired children, applies the differences (create, patch, delete), and writes the status
computed from the children, each write only when something differs. Calls for one pipeline
are serialised by a lock, since kopf's handlers, child events and the resync thread may
reconcile it at once.

Errors from the API server on a child write fall in two classes:
- refusals (400 Bad Request, 403 Forbidden, 422 Invalid): the same request would be refused
  again, so they are permanent for the pipeline's generation: the status says
  `Ready=False`, reason `ChildRejected`, with the child's kind, name and the server's
  message, one Warning event is posted, and that generation is not applied again (no retry
  loop; a new generation, or an operator restart, tries again);
- anything else (5xx, 429, timeouts, connection errors) is transient: it propagates and kopf
  retries the handler with backoff.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from omni_operator import API_VERSION, KIND

from omni_operator.pipeline import naming
from omni_operator.check.admission import Admitted, admit
from omni_operator.pipeline.diff import last_applied, merge_patch, without
from omni_operator.pipeline.errors import SpecError
from omni_operator.pipeline.kinds import BY_KIND, CHILD_KINDS, CONFIGMAP, DEPLOYMENT, HPA, PODMONITOR, SCALEDOBJECT, SERVICE, STAGESCALER, Kind
from .children import ChildCache
from .kube import ApiException, Kube
from .metrics import OperatorMetrics
from omni_operator.pipeline.model import Pipeline
from omni_operator.pipeline.render import ClusterSettings
from .rollout import LEGACY, Plan, PodLoad, plan, pod_of, workload_of
from .status import compute_status, invalid_status, refused_status, status_patch
from omni_operator.health.transfers import STALLED, TRANSFERS_HEALTHY

if TYPE_CHECKING:
    from omni_operator.health.reader import TransferHealth

log = logging.getLogger("omni_operator")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


# API server answers that mean "this request will never succeed as it is".
PERMANENT_STATUSES = frozenset({400, 403, 422})


class ChildRejected(Exception):
    """The API server refused a write of a child for good (PERMANENT_STATUSES)."""

    def __init__(self, verb: str, kind: str, name: str, exc: ApiException):
        self.verb, self.kind, self.name, self.status = verb, kind, name, exc.status
        self.server_message = server_message(exc)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return (f"the API server refused to {self.verb} {self.kind} {self.name} "
                f"({self.status}): {self.server_message}")


def server_message(exc: ApiException) -> str:
    """The message of the Status object the API server answered with (else its reason)."""
    try:
        body = json.loads(exc.body) if exc.body else {}
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return str(message or exc.reason or "no message")[:900]


@dataclass
class Outcome:
    result: str  # applied, unchanged, invalid, conflict, rejected, gone
    writes: int = 0
    phase: str | None = None
    changed: list[str] = field(default_factory=list)  # "verb Kind/name" of each child write


@contextlib.contextmanager
def _refusals(verb: str, kind: str, name: str) -> Iterator[None]:
    """Turn a permanent API refusal of a child write into ChildRejected; others propagate."""
    try:
        yield
    except ApiException as exc:
        if exc.status in PERMANENT_STATUSES:
            raise ChildRejected(verb, kind, name, exc) from None
        raise


# The order children are written in, as Helm installs kinds in order and the objects of one
# kind at once: first what other children or their pods refer to (the stage configs, the
# Services, disruption budgets and network policy, the scale targets), then the Deployments
# (their pods mount the configs), then the autoscalers (they target the scalers). Every kind
# not named is in wave 0. The writes of a wave go out together, APPLY_CONCURRENCY at a time:
# a 3-stage pipeline's 15 creates (12, then 3) take four round trips, not 15. A wave that
# finds a name taken by an object not this pipeline's ends the apply there: no workload
# (wave 1) starts for a pipeline whose children cannot all be applied.
_WAVE_OF_KIND = {DEPLOYMENT.kind: 1, HPA.kind: 2, SCALEDOBJECT.kind: 2}
APPLY_CONCURRENCY = 4


def _waves(children: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The children by wave (`_WAVE_OF_KIND`), each wave in the rendered order."""
    waves: list[list[dict[str, Any]]] = [[], [], []]
    for child in children:
        waves[_WAVE_OF_KIND.get(child["kind"], 0)].append(child)
    return [wave for wave in waves if wave]


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"({exc.status}) {server_message(exc)}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def admitted_record(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the status keeps of an admitted spec (``status.admitted``): its generation, the
    metadata admission reads besides the name (the vLLM-version annotation: a user's others,
    kubectl's last-applied copy of the object among them, it does not read) and the spec,
    so that an operator starting while a later spec is refused keeps the children as this one
    made them."""
    meta = body.get("metadata") or {}
    ours = {k: v for k, v in (meta.get("annotations") or {}).items() if k == naming.VLLM_VERSION_ANNOTATION}
    return {"generation": meta.get("generation"), "metadata": {"annotations": ours} if ours else {},
            "spec": body.get("spec")}


def is_owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def is_orphan_of(obj: Mapping[str, Any], pipeline_name: str) -> bool:
    """A child this operator made for a pipeline of this name that no controller owns any
    more (``kubectl delete --cascade=orphan`` of the pipeline, or its reference removed): the
    pipeline of that name adopts it, as Kubernetes' own controllers adopt their orphans."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    return (labels.get(naming.MANAGED_BY_LABEL) == naming.MANAGER and labels.get(naming.PIPELINE_LABEL) == pipeline_name
            and not any(r.get("controller") for r in meta.get("ownerReferences") or []))


def child_selector(pipeline_name: str) -> str:
    return f"{naming.PIPELINE_LABEL}={pipeline_name},{naming.MANAGED_BY_LABEL}={naming.MANAGER}"


class ResyncRound:
    """The namespaces one round of the resync timer has listed into the children's cache:
    each child kind is listed once a round in a namespace, when the first of its pipelines
    that reads its children is reconciled (none for a namespace whose pipelines are all
    refused), not once per pipeline."""

    def __init__(self) -> None:
        self.listed: set[str] = set()


class Reconciler:
    def __init__(self, kube: Kube, metrics: OperatorMetrics | None = None,
                 clock: Callable[[], str] = utc_now, addon_cache_seconds: float = 300.0,
                 health: TransferHealth | None = None, cluster: ClusterSettings = ClusterSettings(),
                 now: Callable[[], float] = time.time, apply_concurrency: int = APPLY_CONCURRENCY,
                 children: ChildCache | None = None):
        self.kube = kube
        # The children as the watches report them (children.py), read by a reconcile an event
        # started; None: every reconcile lists them.
        self.children = children
        # The child writes of one wave in flight at once (1: one after the other), on a
        # pool started at the first wave with two writes and stopped by close().
        self.apply_concurrency = apply_concurrency
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_closed = False
        self._pool_guard = threading.Lock()
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        # Unix time, for the rollout's drain deadlines (pods' deletionTimestamps).
        self.now = now
        # The last reading of the stages' transfer metrics (refreshed by the resync timer);
        # None: the status carries no transfer health.
        self.health = health
        # What the operator is told about its cluster, which the children follow (where its
        # own pods are, for the NetworkPolicy; the PodMonitors' labels).
        self.cluster = cluster
        self.addon_cache_seconds = addon_cache_seconds
        self._locks: dict[tuple[str, str], threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._podmonitors: tuple[float, bool] | None = None
        self._keda: tuple[float, bool] | None = None
        # A current-revision Deployment with the rollout's replicas: (its admitted object,
        # replicas, the copy), so an unchanged one is the same object (not compared again).
        self._replicated: dict[tuple[str, str], tuple[dict[str, Any], int, dict[str, Any]]] = {}
        # What each pipeline's children should look like, as last rendered: lets a child
        # event be ignored cheaply when the child is still as desired.
        self._desired: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        # Children found as desired: (namespace, kind, name) -> (their resourceVersion, the
        # desired object they were compared with). The same version compared with the same
        # (admitted, shared) desired object gives the same empty patch: not diffed again.
        self._in_sync: dict[tuple[str, str, str], tuple[str, dict[str, Any]]] = {}
        # Generations whose child the API server refused: (uid, generation) -> the report.
        # Such a generation is not applied again (it would be refused again).
        self._rejected: dict[tuple[str, str], tuple[str, int, str]] = {}
        # The generation whose admission warnings were posted: (uid, generation).
        self._warned: dict[tuple[str, str], tuple[str, int]] = {}
        # Each pipeline's last admitted spec, and its record in the status (`admitted_record`):
        # while a later one is refused, its children are kept as that one made them (a child
        # deleted or changed by hand restored, a rollout in progress finished), as a Deployment
        # keeps its pods while a new template cannot run. A process that starts on a refused
        # spec reads it from the status.
        self._admitted: dict[tuple[str, str], tuple[Admitted, dict[str, Any]]] = {}

    # -- entry points ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the write pool, once the writes handed to it are done; a reconcile after
        this writes one child after the other."""
        with self._pool_guard:
            pool, self._pool, self._pool_closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)

    def reconcile(self, namespace: str, name: str, fresh: bool | ResyncRound = False) -> Outcome:
        """Bring the pipeline's children and status to what its spec says. ``fresh``: list
        the children rather than read the watches' cache (the repair of what the cache may
        have missed); a ResyncRound: list each child kind once for the namespace in the round,
        into the cache, and read the cache (the resync timer's way)."""
        with self._lock_for(namespace, name):
            started = time.perf_counter()
            try:
                body = self.kube.get_pipeline(namespace, name)
                if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                    self.forget(namespace, name)
                    outcome = Outcome("gone")
                else:
                    outcome = self._reconcile(body, fresh)
            except Exception:
                self.metrics.reconciles.labels("error").inc()
                raise
            finally:
                self.metrics.duration.observe(time.perf_counter() - started)
            self.metrics.reconciles.labels(outcome.result).inc()
            if outcome.phase:
                self.metrics.set_phase(namespace, name, outcome.phase)
            return outcome

    def forget(self, namespace: str, name: str) -> None:
        """The pipeline is gone: drop what is remembered about it (its children are garbage-collected).

        Under the pipeline's lock: a reconcile running meanwhile reads what it stored."""
        with self._lock_for(namespace, name):
            for key in [k for k, (_, want) in list(self._in_sync.items())
                        if k[0] == namespace and (want["metadata"].get("labels") or {}).get(naming.PIPELINE_LABEL) == name]:
                self._in_sync.pop(key, None)
            self._desired.pop((namespace, name), None)
            self._rejected.pop((namespace, name), None)
            self._warned.pop((namespace, name), None)
            self._admitted.pop((namespace, name), None)
            for key in [k for k, (child, _, _) in self._replicated.items()
                        if k[0] == namespace and child["metadata"]["labels"].get(naming.PIPELINE_LABEL) == name]:
                self._replicated.pop(key, None)
            self.metrics.set_phase(namespace, name, None)
            if self.children is not None:
                self.children.forget(namespace, name)
            if self.health is not None:
                self.health.forget(namespace, name)

    def child_needs_reconcile(self, child: Mapping[str, Any], deleted: bool) -> bool:
        """Whether an event about a child should trigger its pipeline's reconcile."""
        meta = child.get("metadata") or {}
        pipeline = (meta.get("labels") or {}).get(naming.PIPELINE_LABEL)
        desired = self._desired.get((meta.get("namespace"), pipeline))
        if desired is None:
            return True  # not reconciled by this process yet
        want = desired.get((child.get("kind"), meta.get("name")))
        if child.get("kind") in (DEPLOYMENT.kind, STAGESCALER.kind):
            # A Deployment of any revision: its rollout state moves the rollout and the status;
            # a scaler: its autoscaler changed the stage's target.
            return True
        if want is None:
            return False  # not a current child (an old revision's, or being deleted by us, or not ours)
        if deleted:
            return True  # re-create it
        return bool(merge_patch(want, child, last_applied(child)))

    # -- the reconcile -----------------------------------------------------------------------
    def _lock_for(self, namespace: str, name: str) -> threading.RLock:
        with self._locks_guard:
            # Re-entrant: a reconcile that finds its pipeline gone forgets it under the lock.
            return self._locks.setdefault((namespace, name), threading.RLock())

    def _podmonitors_served(self) -> bool:
        now = time.monotonic()
        if self._podmonitors is None or now - self._podmonitors[0] > self.addon_cache_seconds:
            self._podmonitors = (now, self.kube.serves(PODMONITOR))
        return self._podmonitors[1]

    def _keda_served(self) -> bool:
        now = time.monotonic()
        if self._keda is None or now - self._keda[0] > self.addon_cache_seconds:
            self._keda = (now, self.kube.serves(SCALEDOBJECT))
        return self._keda[1]

    def _reconcile(self, body: dict[str, Any], fresh: bool | ResyncRound) -> Outcome:
        meta = body["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        try:
            admitted = admit(body, cluster=self.cluster)
        except SpecError as exc:
            return self._keep_admitted(body, exc.summary(), fresh)
        pipeline = admitted.pipeline
        record = admitted_record(body)
        self._admitted[(namespace, name)] = (admitted, record)
        if admitted.warnings and self._warned.get((namespace, name)) != (pipeline.uid, pipeline.generation):
            self._warn(body, admitted)
        rejected = self._rejected.get((namespace, name))
        if rejected is not None and rejected[:2] == (pipeline.uid, pipeline.generation):
            # Refused before for this very generation: report it (a no-op when the status
            # already says so) and do not ask the server again.
            return self._refuse(body, "ChildRejected", rejected[2], pipeline.generation)
        self._rejected.pop((namespace, name), None)
        try:
            return self._apply(body, admitted, fresh, record=record)
        except ChildRejected as exc:
            self._rejected[(namespace, name)] = (pipeline.uid, pipeline.generation, exc.message)
            log.warning("%s/%s: %s", namespace, name, exc.message)
            return self._refuse(body, "ChildRejected", exc.message, pipeline.generation)

    def _keep_admitted(self, body: dict[str, Any], message: str, fresh: bool | ResyncRound) -> Outcome:
        """A spec admission refuses: the pipeline's children are kept as its last admitted spec
        made them (this process's, else the status's `admitted`; none: nothing is applied), and
        the status says the spec is refused (Ready=False, InvalidSpec) and how those stages run."""
        meta = body["metadata"]
        key = (meta.get("namespace") or "default", meta["name"])
        last = self._admitted.get(key)
        if last is None or last[0].pipeline.uid != (meta.get("uid") or ""):
            last = self._admitted_from_status(body)
            if last is None:
                return self._refuse(body, "InvalidSpec", message)
            self._admitted[key] = last
        try:
            return self._apply(body, last[0], fresh, refused=message, record=last[1])
        except ChildRejected:  # reported as the last admitted spec's generation was
            return self._refuse(body, "InvalidSpec", message)

    def _admitted_from_status(self, body: Mapping[str, Any]) -> tuple[Admitted, dict[str, Any]] | None:
        """The last admitted spec as the status records it (`admitted_record`), admitted again
        (this process's checks); None without one, or where it is not admitted now."""
        record = (body.get("status") or {}).get("admitted")
        if not isinstance(record, dict) or not isinstance(record.get("spec"), dict):
            return None
        meta = body["metadata"]
        saved = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
        again = {"apiVersion": API_VERSION, "kind": KIND, "spec": record["spec"],
                 "metadata": {**{k: v for k, v in saved.items() if k == "annotations"},
                              "name": meta["name"], "namespace": meta.get("namespace") or "default",
                              "uid": meta.get("uid") or "", "generation": record.get("generation")}}
        try:
            return admit(again, cluster=self.cluster), record
        except SpecError as exc:
            log.warning("%s/%s: the last admitted spec in the status is not admitted now: %s",
                        meta.get("namespace"), meta["name"], exc.summary())
            return None

    def _apply(self, body: dict[str, Any], admitted: Admitted, fresh: bool | ResyncRound,
               refused: str | None = None, record: dict[str, Any] | None = None) -> Outcome:
        """Apply the children admission rendered (each with its last-applied record): the
        very objects it checked, the current revision's Deployments with the replicas the
        rollout gives them; then the rollout's step for the old revisions. ``refused``: the
        body's own spec was refused, ``admitted`` is the last one admitted (its children are
        kept; the status says why the body's is not applied). ``record``: the admitted spec's
        record, kept in the status."""
        pipeline = admitted.pipeline
        namespace, name = pipeline.namespace, pipeline.name
        podmonitors, keda = self._podmonitors_served(), self._keda_served()
        rendered = admitted.children_for(podmonitor_available=podmonitors, keda_available=keda)
        # A pipeline whose spec never changed (generation 1) and that no reconcile has
        # finished yet (no observedGeneration) can own no child but those rendered from this
        # very spec by an attempt that stopped half-way: creating each child finds those
        # (409: read, compare, patch), and none can be undesired. So nothing is listed.
        first = pipeline.generation <= 1 and not (body.get("status") or {}).get("observedGeneration")
        live = {} if first else self._owned_children(pipeline, podmonitors, keda, fresh)
        workloads = [w for (kind, _), obj in live.items() if kind == DEPLOYMENT.kind
                     for w in [workload_of(obj, pipeline)] if w is not None]
        targets = self._targets(pipeline, live, workloads)
        step = self._plan(pipeline, targets, workloads)
        desired = [self._with_replicas(pipeline, child, step) for child in rendered]
        self._desired[(namespace, name)] = {(c["kind"], c["metadata"]["name"]): c for c in desired}
        outcome = Outcome("unchanged")
        current, conflicts = self._apply_children(pipeline, desired, live, targets, outcome)
        if conflicts:  # the new children are not all there: the old revision's steps wait too
            return self._conflict(body, pipeline, conflicts, outcome)
        wanted = {(c["kind"], c["metadata"]["name"]) for c in desired}
        # An old revision's workload the rollout keeps (its Deployment, ConfigMap, KV Service).
        kept = {key for key, obj in live.items() if key not in wanted
                and _old_workload_key(obj, pipeline) in step.replicas}
        for key in sorted(kept):
            obj = live[key]
            if key[0] == DEPLOYMENT.kind:
                want = step.replicas[_old_workload_key(obj, pipeline)]
                if int((obj.get("spec") or {}).get("replicas", 1)) != want:
                    with _refusals("patch", key[0], key[1]):
                        try:
                            current[key] = self._wrote(self.kube.patch(DEPLOYMENT, namespace, key[1],
                                                                       {"spec": {"replicas": want}}))
                        except ApiException as exc:
                            if exc.status != 404:
                                raise
                            if self.children is not None:  # gone: an old revision is not made again
                                self.children.gone(obj)
                            continue
                    outcome.changed.append(f"scale {key[0]}/{key[1]} to {want}")
                else:
                    current[key] = obj
        for key, obj in live.items():
            if key not in wanted and key not in kept:
                with _refusals("delete", key[0], key[1]):
                    self.kube.delete(BY_KIND[key[0]], namespace, key[1])
                if self.children is not None:
                    self.children.gone(obj)
                outcome.changed.append(f"delete {key[0]}/{key[1]}")
        outcome.writes = len(outcome.changed)
        if outcome.changed:
            outcome.result = "applied"
            log.info("%s/%s: %s", namespace, name, ", ".join(outcome.changed))
        for event in step.events:
            if self._post_event(body, "Warning", event.reason, event.message, name=f"{name}.{event.key}"):
                outcome.writes += 1
        outcome.writes += self._scaler_status(pipeline, current)
        deployments = {stage.name: current.get((DEPLOYMENT.kind,
                                                naming.revision_name(pipeline.name, stage.name, pipeline.revision)))
                       for stage in pipeline.stages}
        verdict = self.health.verdict(pipeline) if self.health is not None else None
        autoscalers = {s.name: ("KEDA" if keda else "HPA") for s in pipeline.stages if s.autoscaling is not None}
        status = compute_status(pipeline, deployments, body.get("status"), self.clock(), transfers=verdict,
                                transfer_health=self.health is not None, targets=targets, rollout=step,
                                autoscalers=autoscalers)
        if record is not None:
            status["admitted"] = record
        if refused is not None:
            outcome.result = "invalid"
            outcome.writes += self._report_refusal(body, "InvalidSpec", refused)
            status = refused_status(status, int(body["metadata"].get("generation") or 0), "InvalidSpec",
                                    refused, body.get("status"), self.clock())
        outcome.phase = status["phase"]
        if self._write_status(body, status):
            outcome.writes += 1
            outcome.writes += self._transfer_events(body, status)
        return outcome

    def _conflict(self, body: dict[str, Any], pipeline: Pipeline, conflicts: list[str], outcome: Outcome) -> Outcome:
        if outcome.changed:
            log.info("%s/%s: %s", pipeline.namespace, pipeline.name, ", ".join(outcome.changed))
        refused = self._refuse(body, "ChildConflict",
                               "objects with the children's names exist and are not owned by this OmniPipeline: "
                               f"{', '.join(conflicts)}; delete or rename them (no workload of this "
                               "pipeline is started or changed until then)", pipeline.generation)
        refused.writes += len(outcome.changed)
        refused.changed = outcome.changed + refused.changed
        return refused

    # -- the rollout ---------------------------------------------------------------------------
    def _targets(self, pipeline: Pipeline, live: Mapping[tuple[str, str], dict[str, Any]],
                 workloads: list[Any]) -> dict[str, int]:
        """Each stage's replicas: the spec's, or for an autoscaled stage its scaler's (the
        autoscaler's), within its bounds. A scaler not created yet starts from the stage's
        count now, so turning autoscaling on scales nothing down."""
        targets = {}
        for stage in pipeline.stages:
            if stage.autoscaling is None:
                targets[stage.name] = stage.replicas
                continue
            scaler = live.get((STAGESCALER.kind, naming.stage_name(pipeline.name, stage.name)))
            replicas = ((scaler or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int):
                running = [w.replicas for w in workloads if w.stage == stage.name and w.revision == pipeline.revision]
                running = running or [w.replicas for w in workloads if w.stage == stage.name]
                replicas = max(running) if running else stage.replicas
            targets[stage.name] = stage.autoscaling.clamp(replicas)
        return targets

    def _plan(self, pipeline: Pipeline, targets: dict[str, int], workloads: list[Any]) -> Plan:
        rolling = any(w.revision != pipeline.revision for w in workloads)
        pods, loads = [], {}
        if rolling:  # the pods (and their last reading) matter only while an old revision drains
            for obj in self.kube.list_pods(pipeline.namespace, child_selector(pipeline.name)):
                pod = pod_of(obj)
                if pod is not None:
                    pods.append(pod)
            reading = self.health.reading(pipeline.namespace, pipeline.name) if self.health is not None else None
            if reading is not None:
                loads = pod_loads(reading)
        return plan(pipeline, targets, workloads, pods, loads, now=self.now(), read_loads=self.health is not None)

    def _with_replicas(self, pipeline: Pipeline, child: dict[str, Any], step: Plan) -> dict[str, Any]:
        """A current-revision Deployment with the replicas the rollout gives it (the same copy
        while they do not change); any other child as admitted."""
        if child["kind"] != DEPLOYMENT.kind:
            return child
        stage = child["metadata"]["labels"][naming.STAGE_LABEL]
        replicas = step.replicas[(pipeline.revision, stage)]
        key = (pipeline.namespace, child["metadata"]["name"])
        known = self._replicated.get(key)
        if known is not None and known[0] is child and known[1] == replicas:
            return known[2]
        copy = {**child, "spec": {**child["spec"], "replicas": replicas}}
        self._replicated[key] = (child, replicas, copy)
        return copy

    def _scaler_status(self, pipeline: Pipeline, current: Mapping[tuple[str, str], dict[str, Any]]) -> int:
        """Each OmniStageScaler's status: the stage's pods (all revisions) and their selector,
        which the scale subresource hands to the autoscaler. Written only when it changed."""
        writes = 0
        for stage in pipeline.stages:
            name = naming.stage_name(pipeline.name, stage.name)
            scaler = current.get((STAGESCALER.kind, name))
            if stage.autoscaling is None or scaler is None:
                continue
            deployments = [o for (kind, _), o in current.items() if kind == DEPLOYMENT.kind
                           and (o["metadata"].get("labels") or {}).get(naming.STAGE_LABEL) == stage.name]
            status = {
                "replicas": sum(int((d.get("status") or {}).get("replicas") or 0) for d in deployments),
                "readyReplicas": sum(int((d.get("status") or {}).get("readyReplicas") or 0) for d in deployments),
                "selector": ",".join(f"{k}={v}" for k, v in naming.selector_labels(pipeline.name, stage.name).items()),
            }
            if (scaler.get("status") or {}) != status:
                try:
                    self._wrote(self.kube.patch_status(STAGESCALER, pipeline.namespace, name, {"status": status}))
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    continue
                writes += 1
        return writes

    def _transfer_events(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> int:
        """One Warning event when TransfersHealthy turns False (or changes reason while False:
        a stream stall beginning is one, reason StreamStalled, naming the edge), one Normal
        event StreamStallEnded when a stall ends (the condition's reason no longer
        StreamStalled), one Normal event when it turns True again; the number posted. Only on
        a change of the condition, so at most a few per transition, never one per resync."""
        def condition(st: Mapping[str, Any] | None) -> Mapping[str, Any]:
            return next((c for c in (st or {}).get("conditions") or [] if c.get("type") == TRANSFERS_HEALTHY), {})

        old, new = condition(body.get("status")), condition(status)
        posted = 0
        if old.get("reason") == STALLED and new.get("reason") != STALLED and new:
            self._post_event(body, "Normal", "StreamStallEnded",
                             f"no stream stalled any more (was: {old.get('message', '')})")
            posted += 1
        if new.get("status") == "False" and (old.get("status") != "False" or old.get("reason") != new.get("reason")):
            log.warning("%s/%s: %s: %s", body["metadata"].get("namespace"), body["metadata"]["name"],
                        new.get("reason"), new.get("message"))
            self._post_event(body, "Warning", new["reason"], new.get("message", ""))
            return posted + 1
        if new.get("status") == "True" and old.get("status") == "False":
            self._post_event(body, "Normal", "TransfersRecovered",
                             f"no transfer stuck or failing any more (was {old.get('reason')}: {old.get('message', '')})")
            return posted + 1
        return posted

    @staticmethod
    def _served_kinds(podmonitors: bool, keda: bool) -> list[Kind]:
        return [kind for kind in CHILD_KINDS
                if not ((kind is PODMONITOR and not podmonitors) or (kind is SCALEDOBJECT and not keda))]

    def _owned_children(self, pipeline: Pipeline, podmonitors: bool, keda: bool,
                        fresh: bool | ResyncRound) -> dict[tuple[str, str], dict[str, Any]]:
        """The children this very resource controls, by (kind, name): from the watches' cache,
        else (``fresh``, or no cache ready) listed, the cache then told what the lists found."""
        kinds = self._served_kinds(podmonitors, keda)
        if isinstance(fresh, ResyncRound):
            if self.children is None or not self.children.ready:
                fresh = True
            else:
                if pipeline.namespace not in fresh.listed:
                    # Every pipeline's children in the namespace, a LIST per kind: the
                    # namespace's entries in the cache become what they found.
                    found = self._list_children(pipeline.namespace, kinds, naming.CHILDREN_SELECTOR)
                    self.children.replace(pipeline.namespace, [kind.kind for kind in kinds], found)
                    fresh.listed.add(pipeline.namespace)
                fresh = False
        cached = None if fresh or self.children is None else self.children.children(pipeline.namespace, pipeline.name)
        if cached is not None:
            served = {kind.kind for kind in kinds}
            labelled = [obj for (kind, _), obj in cached.items() if kind in served]
        else:
            labelled = self._list_children(pipeline.namespace, kinds, child_selector(pipeline.name))
            if self.children is not None:
                self.children.replace(pipeline.namespace, [kind.kind for kind in kinds], labelled,
                                      pipeline=pipeline.name)
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for obj in labelled:
            labels = (obj.get("metadata") or {}).get("labels") or {}
            # Filter again here: only what this very resource controls is ever changed.
            if (labels.get(naming.PIPELINE_LABEL) == pipeline.name and labels.get(naming.MANAGED_BY_LABEL) == naming.MANAGER
                    and is_owned_by(obj, pipeline.uid)):
                found[(obj["kind"], obj["metadata"]["name"])] = obj
        return found

    def _list_children(self, namespace: str, kinds: Iterable[Any], selector: str) -> list[dict[str, Any]]:
        """A LIST per kind in ``namespace`` by ``selector``, each object told its kind."""
        return [{**obj, "kind": kind.kind} for kind in kinds for obj in self.kube.list(kind, namespace, selector)]

    def _wrote(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A child as the API server answered a write of it, told to the cache."""
        if self.children is not None:
            self.children.saw(obj)
        return obj

    def _apply_children(self, pipeline: Pipeline, desired: list[dict[str, Any]],
                        live: Mapping[tuple[str, str], dict[str, Any]], targets: Mapping[str, int],
                        outcome: Outcome) -> tuple[dict[tuple[str, str], dict[str, Any]], list[str]]:
        """Create or patch each desired child that is missing or differs, wave by wave (`_waves`),
        the writes of a wave at once, no further wave once one found a name taken; (the
        children as they are now, the names of those that exist and are not this pipeline's).
        A refused write fails the reconcile once every write of its wave has been answered,
        so nothing is left in flight behind the lock."""
        current: dict[tuple[str, str], dict[str, Any]] = {}
        conflicts: list[str] = []
        for wave in _waves(desired):
            writes: list[tuple[tuple[str, str], Callable[[], tuple[dict[str, Any] | None, str | None]]]] = []
            for child in wave:
                key = (child["kind"], child["metadata"]["name"])
                kind, found = BY_KIND[child["kind"]], live.get(key)
                patch = None if found is None else self._patch_for(kind, pipeline, child, found)
                if found is not None and not patch:
                    current[key] = found
                    continue
                create_as = None
                if found is None and child["kind"] == STAGESCALER.kind:  # its replicas are the autoscaler's after this
                    create_as = {**child, "spec": {**child["spec"], "replicas": targets[child["spec"]["stage"]]}}
                writes.append((key, functools.partial(self._write_child, kind, pipeline, child, found, patch, create_as)))
            for (key, _), (obj, change) in zip(writes, self._all_answered([write for _, write in writes])):
                if change:
                    outcome.changed.append(change)
                if obj is None:
                    conflicts.append(f"{key[0]} {key[1]}")
                else:
                    current[key] = obj
            if conflicts:
                break
        return current, conflicts

    def _all_answered(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Each call's result, in order; at most ``apply_concurrency`` in flight. Once every
        call has returned, a failure is raised: a refusal (ChildRejected: permanent, it
        must be recorded for its generation) before any other, else the first in order;
        the others are logged."""
        with self._pool_guard:  # submitted under the guard: close() waits for them
            if len(calls) <= 1 or self.apply_concurrency <= 1 or self._pool_closed:
                futures = None
            else:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(self.apply_concurrency,
                                                                       thread_name_prefix="omni-apply")
                futures = [self._pool.submit(call) for call in calls]
        if futures is None:
            return [call() for call in calls]
        concurrent.futures.wait(futures)
        failures = [f.exception() for f in futures if f.exception() is not None]
        if failures:
            first = next((e for e in failures if isinstance(e, ChildRejected)), failures[0])
            others = [_one_line(e) for e in failures if e is not first]
            if others:
                log.warning("%d more child writes of the same wave failed: %s", len(others),
                            "; ".join(others[:5]) + ("; ..." if len(others) > 5 else ""))
            raise first
        return [future.result() for future in futures]

    def _patch_for(self, kind: Kind, pipeline: Pipeline, desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
        """The merge patch that makes the live child as desired (empty: it is; then remembered
        with its resourceVersion, so that version is not diffed again)."""
        version = (live.get("metadata") or {}).get("resourceVersion")
        key = (pipeline.namespace, kind.kind, desired["metadata"]["name"])
        known = self._in_sync.get(key)
        if version and known is not None and known[0] == version and known[1] is desired:
            return {}
        # A field set at creation only keeps the live object's value (a Service made before
        # the KV Services were headless keeps its cluster IP: it cannot be patched away).
        patch = without(merge_patch(desired, live, last_applied(live)), kind.create_only)
        if not patch and version:
            self._in_sync[key] = (version, desired)
        return patch

    def _write_child(self, kind: Kind, pipeline: Pipeline, desired: dict[str, Any], live: dict[str, Any] | None,
                     patch: dict[str, Any] | None, create_as: dict[str, Any] | None, again: bool = True
                     ) -> tuple[dict[str, Any] | None, str | None]:
        """Create the child (``live`` None) or apply ``patch`` to it: (the child as written, or
        None when an object of its name exists that this pipeline does not own; the change
        made, "verb Kind/name", or None). ``create_as``: the body to create it with, where that
        holds more than the operator keeps owning (a scaler's initial replicas). A child gone
        when it is patched (deleted since it was read, or the watches' cache not told yet) is
        made again (``again``: once)."""
        name = desired["metadata"]["name"]
        if live is None:
            try:
                return (self._wrote(self.kube.create(kind, pipeline.namespace, create_as or desired)),
                        f"create {kind.kind}/{name}")
            except ApiException as exc:
                if exc.status in PERMANENT_STATUSES:
                    raise ChildRejected("create", kind.kind, name, exc) from None
                if exc.status != 409:
                    raise
            # It exists after all: created concurrently, or someone else's object.
            live = self.kube.get(kind, pipeline.namespace, name)
            if live is not None and self.children is not None:
                self.children.saw(live, kind.kind)
            adopting = live is not None and is_orphan_of(live, pipeline.name)
            if live is None or not (adopting or is_owned_by(live, pipeline.uid)):
                return None, None
            patch = self._patch_for(kind, pipeline, desired, live)
            if adopting:
                # As the Deployment controller adopts a ReplicaSet: its other references kept.
                refs = [r for r in (live.get("metadata") or {}).get("ownerReferences") or []]
                patch.setdefault("metadata", {})["ownerReferences"] = refs + desired["metadata"]["ownerReferences"]
            if not patch:
                return live, None
        with _refusals("patch", kind.kind, name):
            try:
                patched = self.kube.patch(kind, pipeline.namespace, name, patch)
            except ApiException as exc:
                if exc.status != 404 or not again:
                    raise
                patched = None
        if patched is None:
            if self.children is not None:
                self.children.gone({"metadata": {"namespace": pipeline.namespace, "name": name}}, kind.kind)
            return self._write_child(kind, pipeline, desired, None, None, create_as, again=False)
        return self._wrote(patched), f"patch {kind.kind}/{name}"

    def _write_status(self, body: Mapping[str, Any], status: dict[str, Any]) -> bool:
        patch = status_patch(body.get("status"), status)
        if not patch:
            return False
        meta = body["metadata"]
        try:
            self.kube.patch_pipeline_status(meta.get("namespace") or "default", meta["name"], {"status": patch})
        except ApiException as exc:
            if exc.status == 404:  # deleted meanwhile
                return False
            raise
        return True

    def _refuse(self, body: dict[str, Any], reason: str, message: str, generation: int | None = None) -> Outcome:
        """Report a resource that cannot be applied: Ready=False, one Warning event per new message."""
        meta = body["metadata"]
        gen = int(meta.get("generation") or 0) if generation is None else generation
        previous = body.get("status") or {}
        result = {"InvalidSpec": "invalid", "ChildRejected": "rejected"}.get(reason, "conflict")
        outcome = Outcome(result, phase="Failed")
        outcome.writes += self._report_refusal(body, reason, message)
        status = invalid_status(gen, message, previous, self.clock(), reason, self._running_stages(body, previous))
        if self._write_status(body, status):
            outcome.writes += 1
        return outcome

    def _report_refusal(self, body: Mapping[str, Any], reason: str, message: str) -> int:
        """Log and post a refusal once per new reason and message (the status's Ready says the
        last one); the writes made."""
        meta = body["metadata"]
        ready = next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        if ready.get("reason") == reason and ready.get("message") == message:
            return 0
        log.warning("%s/%s: %s: %s", meta.get("namespace"), meta["name"], reason, message)
        self._post_event(body, "Warning", reason, message)
        return 1

    def _running_stages(self, body: Mapping[str, Any], previous: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Deployments of the stages the previous status reports, at its revision, by stage
        (what runs while the spec cannot be applied); None when it reports none."""
        stages = [entry.get("name") for entry in previous.get("stages") or []]
        if not stages:
            return None
        meta = body["metadata"]
        namespace, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid") or ""
        cached = self.children.children(namespace, name) if self.children is not None else None
        if cached is not None:
            found = [obj for (kind, _), obj in cached.items() if kind == DEPLOYMENT.kind]
        else:
            found = self.kube.list(DEPLOYMENT, namespace, child_selector(name))
        revision = previous.get("revision")
        by_name = {obj["metadata"]["name"]: obj for obj in found if is_owned_by(obj, uid)}
        return {stage: by_name.get(naming.revision_name(name, stage, revision) if revision
                                   else naming.stage_name(name, stage)) for stage in stages}

    def _warn(self, body: dict[str, Any], admitted: Admitted) -> None:
        """What admission warns of (the stages would run, but the user should know): logged,
        and one Warning event per generation, named for it, so another operator or a restart
        posts it no more than once."""
        pipeline = admitted.pipeline
        message = "; ".join(str(w) for w in admitted.warnings)
        log.warning("%s/%s: %s", pipeline.namespace, pipeline.name, message)
        self._post_event(body, "Warning", "SpecWarning", message,
                         name=f"{pipeline.name}.spec-warning.{pipeline.uid[:8] or 'local'}.{pipeline.generation}")
        self._warned[(pipeline.namespace, pipeline.name)] = (pipeline.uid, pipeline.generation)

    def _post_event(self, body: Mapping[str, Any], event_type: str, reason: str, message: str,
                    name: str | None = None) -> bool:
        """Post an event (best effort); ``name``: a fixed name, so that an event about one
        fact is posted once however often (and by however many operators) it is seen. Whether
        one was posted."""
        meta = body["metadata"]
        now = self.clock()
        namespace = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": ({"name": name[:253]} if name else {"generateName": f"{meta['name']}."}) | {"namespace": namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": namespace, "uid": meta.get("uid", "")},
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": naming.MANAGER},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.kube.create_event(namespace, event)
        except ApiException as exc:  # an event is best effort; the condition carries the news
            if exc.status != 409:  # 409: that very event was posted before
                log.warning("could not post event for %s/%s: %s", namespace, meta["name"], exc.status)
            return False
        return True


def _old_workload_key(obj: Mapping[str, Any], pipeline: Pipeline) -> tuple[str, str] | None:
    """(revision, stage) of an old revision's Deployment, ConfigMap or KV Service, named as the
    operator names them (an object made before revisions counts as revision "legacy"); None
    for any other child."""
    if obj.get("kind") not in (DEPLOYMENT.kind, CONFIGMAP.kind, SERVICE.kind):
        return None
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    stage = labels.get(naming.STAGE_LABEL)
    revision = labels.get(naming.REVISION_LABEL) or LEGACY
    if not stage or revision == pipeline.revision:
        return None
    expected = (naming.stage_name(pipeline.name, stage) if revision == LEGACY
                else naming.revision_name(pipeline.name, stage, revision))
    return (revision, stage) if meta.get("name") == expected else None


def pod_loads(reading: Any) -> dict[str, PodLoad]:
    """What the last reading says of each pod, by name: transfers unresolved (pending or
    active; held ones are among them), requests running or queued, and the streams it still
    sends (open or held at the producer's end)."""
    loads = {}
    pods = [p for stage in reading.stages.values() for p in stage.pods]
    for pod in pods + list(getattr(reading, "draining", {}).values()):
        loads[pod.pod] = PodLoad(reading.read_at, pod.states.get("pending", 0.0) + pod.states.get("active", 0.0),
                                 pod.requests, sum(s.sending for s in pod.streams.values()))
    return loads

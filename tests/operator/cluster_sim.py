"""A cluster's controllers and kubelets for the rollout tests, against the API emulator.

There is no kube-controller-manager or kubelet here, so this stands in for them (a mock, and
only where no real part can run), in steps the test drives (``tick``), on a clock the test
advances:

- the Deployment controller: each stage Deployment gets pod objects up to its
  ``spec.replicas`` (labelled as its template says; a new pod is ready one tick later) and
  loses the surplus (not-ready pods first, then the newest), and its status counts them;
- the garbage collector: the pods of a deleted Deployment terminate;
- the kubelet: a terminating pod gets ``deletionTimestamp`` (now plus its grace period, as
  the API server sets it) and stays (a finalizer stands for the running container) until
  its process exits: a sending stage's pod exits once its KV transfers in flight have
  drained (one per tick; a ``stuck`` pod never drains), and any pod at its deletionTimestamp
  (SIGKILL);
- each pod's ``/metrics``: a small HTTP server (metrics_pages.PageServer) per pod, serving
  the omni_kv_* families and vLLM's request gauges a stage serves, so that the operator reads
  them with its real reader (health.PodMetricsSource).

A running sending pod has ``load`` KV transfers in flight (steady traffic); when it starts
terminating it stops taking requests and its transfers drain. The simulation keeps the
ground truth (``SimPod.in_flight``) the invariants are checked against.
"""
from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from typing import Any

from metrics_pages import PageServer, ar_page
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import DEPLOYMENT

FINALIZER = "sim.omnipipeline.dev/running-container"


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Clock:
    """The test's time (unix seconds), advanced by hand."""

    def __init__(self, start: float):
        self.t = float(int(start))

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class SimPod:
    name: str
    deployment: str
    stage: str
    revision: str
    sends: bool
    inputs: tuple[str, ...]
    grace: int
    page: PageServer
    ready: bool = False
    terminating: bool = False
    started_terminating: float = 0.0
    kill_at: float = 0.0
    in_flight: int = 0
    stuck: bool = False
    created: int = 0

    @property
    def drain_deadline(self) -> float:
        from omni_operator.controller.rollout import DRAIN_MARGIN_SECONDS

        return max(self.started_terminating, self.kill_at - DRAIN_MARGIN_SECONDS)


@dataclass
class SimCluster:
    kube: Any
    namespace: str
    clock: Clock
    #: Transfers a running sending pod has in flight (steady traffic).
    load: int = 2
    pods: dict[str, SimPod] = field(default_factory=dict)
    gone: list[SimPod] = field(default_factory=list)
    #: Pods killed at their deadline with transfers in flight (transfers abandoned).
    abandoned: list[tuple[str, int]] = field(default_factory=list)
    _seq: Any = field(default_factory=itertools.count)

    def close(self) -> None:
        for pod in list(self.pods.values()) + self.gone:
            pod.page.stop()

    # -- the controllers ---------------------------------------------------------------------
    def tick(self) -> None:
        deployments = {d["metadata"]["name"]: d for d in self.kube.list(DEPLOYMENT, self.namespace, naming.PIPELINE_LABEL)}
        now = self.clock()
        for pod in list(self.pods.values()):
            if not pod.terminating and pod.deployment not in deployments:
                self._terminate(pod, now)  # the garbage collector
        for name, dep in sorted(deployments.items()):
            live = [p for p in self.pods.values() if p.deployment == name and not p.terminating]
            for pod in live:
                if not pod.ready:
                    pod.ready = True
                    self._write_pod_status(pod)
            want = int(dep["spec"].get("replicas", 1))
            if len(live) < want:
                for _ in range(want - len(live)):
                    live.append(self._create_pod(dep))
            elif len(live) > want:
                victims = sorted(live, key=lambda p: (p.ready, p.created))[:len(live) - want]
                for pod in victims:
                    self._terminate(pod, now)
                live = [p for p in live if not p.terminating]
            ready = sum(1 for p in live if p.ready)
            status = {"observedGeneration": dep["metadata"]["generation"], "replicas": len(live),
                      "readyReplicas": ready, "updatedReplicas": len(live), "availableReplicas": ready}
            if {k: (dep.get("status") or {}).get(k) for k in status} != status:
                self.kube.request("patch", "Deployment", "PATCH",
                                  DEPLOYMENT.object_path(self.namespace, name) + "/status",
                                  body={"status": status}, content_type="application/merge-patch+json")
        for pod in list(self.pods.values()):  # the kubelets
            if not pod.terminating:
                continue
            if now >= pod.kill_at:
                if pod.in_flight:
                    self.abandoned.append((pod.name, pod.in_flight))
                self._remove(pod)
            elif pod.in_flight == 0:
                self._remove(pod)  # drained: the process exits
            elif not pod.stuck:
                pod.in_flight -= 1
                self._serve(pod)

    def _create_pod(self, dep: dict[str, Any]) -> SimPod:
        template = dep["spec"]["template"]
        labels = dict(template["metadata"]["labels"])
        notes = dep["metadata"].get("annotations") or {}
        seq = next(self._seq)
        sends = notes.get(naming.SENDS_ANNOTATION) == "true"
        pod = SimPod(name=f"{dep['metadata']['name']}-{seq:04d}", deployment=dep["metadata"]["name"],
                     stage=labels[naming.STAGE_LABEL], revision=labels.get(naming.REVISION_LABEL, ""),
                     sends=sends, inputs=tuple(i for i in notes.get(naming.INPUTS_ANNOTATION, "").split(",") if i),
                     grace=int(template["spec"].get("terminationGracePeriodSeconds", 30)), page=PageServer(),
                     created=seq, in_flight=self.load if sends else 0)
        self.pods[pod.name] = pod
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": self.namespace, "labels": labels},
            "spec": {"containers": [{"name": "stage", "image": "omni-stage:test",
                                     "ports": [{"name": "http", "containerPort": pod.page.port, "protocol": "TCP"},
                                               {"name": "kv", "containerPort": naming.KV_PORT, "protocol": "TCP"}]}]},
        }
        self.kube.request("create", "Pod", "POST", f"/api/v1/namespaces/{self.namespace}/pods", body=body)
        self._serve(pod)
        self._write_pod_status(pod)
        return pod

    def _terminate(self, pod: SimPod, now: float) -> None:
        pod.terminating, pod.ready = True, False
        pod.started_terminating, pod.kill_at = now, now + pod.grace
        self.kube.request("patch", "Pod", "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{pod.name}",
                          body={"metadata": {"deletionTimestamp": rfc3339(pod.kill_at),
                                             "deletionGracePeriodSeconds": pod.grace, "finalizers": [FINALIZER]}},
                          content_type="application/merge-patch+json")
        self._write_pod_status(pod)
        self._serve(pod)

    def _remove(self, pod: SimPod) -> None:
        self.kube.request("patch", "Pod", "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{pod.name}",
                          body={"metadata": {"finalizers": None}}, content_type="application/merge-patch+json")
        del self.pods[pod.name]
        self.gone.append(pod)
        pod.page.stop()

    def _write_pod_status(self, pod: SimPod) -> None:
        status = {"phase": "Running", "podIP": "127.0.0.1",
                  "conditions": [{"type": "Ready", "status": "True" if pod.ready else "False"}]}
        self.kube.request("patch", "Pod", "PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{pod.name}/status",
                          body={"status": status}, content_type="application/merge-patch+json")

    def _serve(self, pod: SimPod) -> None:
        """The pod's /metrics: its transfers in flight (active), and vLLM's requests (one
        running per transfer in flight while it serves; none once it drains)."""
        if pod.sends:
            running = 0 if pod.terminating else pod.in_flight
            pod.page.page = (ar_page(pod.stage, active=pod.in_flight, held=0,
                                     oldest_active=self.clock() - 1 if pod.in_flight else 0.0)
                             + f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {float(running)}\n'
                             + 'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0\n')
        else:
            pod.page.page = f'omni_kv_received_total{{stage="{pod.stage}",model_name="tiny",from_stage="x",outcome="delivered"}} 0.0\n'

    # -- what the invariants read -----------------------------------------------------------
    def of(self, revision: str, stage: str) -> list[SimPod]:
        return [p for p in self.pods.values() if p.revision == revision and p.stage == stage]

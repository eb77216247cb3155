"""Helpers of the operator tests (a module of its own: test files must not import conftest)."""
from __future__ import annotations

import copy
import io
import threading
import time
from pathlib import Path
from typing import Any, Callable

import kubernetes

from omni_operator.local import cli
from omni_operator.controller import main as operator_main
from omni_operator.pipeline import naming
from omni_operator.check.documents import load_documents
from omni_operator.pipeline.kinds import DEPLOYMENT
from omni_operator.controller.children import ChildCache
from omni_operator.controller.kube import Kube
from omni_operator.controller.metrics import OperatorMetrics
from omni_operator.pipeline.model import parse_pipeline
from procs import free_port

NAMESPACE = "team-a"
PIPELINES = "/apis/omnipipeline.dev/v1alpha1/namespaces/{ns}/omnipipelines"


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll a condition until it holds (a wait on state, with a deadline; not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def validate_text(tmp_path: Path, text: str) -> tuple[int, list[str]]:
    """`omni-pipeline validate` on a file holding this text: (exit code, the lines it prints)."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    out = io.StringIO()
    code = cli.cmd_validate([path], out)
    return code, out.getvalue().splitlines()


def body_of(text: str) -> dict:
    """The one document of a YAML text, read as kubectl reads it."""
    (doc,) = load_documents(text)
    assert doc.error is None, doc.error
    return doc.value


def pipeline_body(name: str = "tiny", namespace: str = NAMESPACE, stages: list[dict] | None = None, **spec: Any) -> dict:
    body = {
        "apiVersion": "omnipipeline.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "image": "ghcr.io/example/omni-stage:0.1.0",
            "model": {"name": "tiny-qwen2"},
            "stages": stages if stages is not None else [
                {"name": "thinker", "role": "ar", "gpus": 1, "kvTransfer": {"send": True}},
                {"name": "talker", "role": "ar", "inputs": ["thinker"], "kvTransfer": {"send": True}},
                {"name": "code2wav", "role": "generation", "gpus": 0, "inputs": ["talker"]},
            ],
        },
    }
    body["spec"].update(spec)
    return body


# Bearer tokens that tell the emulator's audit log who made a call (no authentication is done).
OPERATOR_TOKEN = "omni-operator-test-token"


def make_kube(url: str, token: str | None = None) -> Kube:
    config = kubernetes.client.Configuration()
    config.host = url
    if token is not None:  # as load_kube_config / load_incluster_config set a token
        config.api_key = {"BearerToken": token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
    return Kube(kubernetes.client.ApiClient(config))


def create_pipeline(kube: Kube, body: dict) -> dict:
    ns = body["metadata"]["namespace"]
    return kube.request("create", "OmniPipeline", "POST", PIPELINES.format(ns=ns), body=copy.deepcopy(body))


def patch_pipeline(kube: Kube, name: str, patch: dict, namespace: str = NAMESPACE) -> dict:
    return kube.request("patch", "OmniPipeline", "PATCH", PIPELINES.format(ns=namespace) + f"/{name}",
                        body=patch, content_type="application/merge-patch+json")


def status(kube: Kube, name: str = "tiny", namespace: str = NAMESPACE) -> dict:
    return (kube.get_pipeline(namespace, name) or {}).get("status") or {}


def revision(body: dict | None = None) -> str:
    """The revision of a pipeline body (pipeline_body() by default)."""
    return parse_pipeline(copy.deepcopy(body or pipeline_body())).revision


def workload(stage: str, body: dict | None = None) -> str:
    """The name of a stage's workload (Deployment, ConfigMap, KV Service) of a body's revision."""
    body = body or pipeline_body()
    return naming.revision_name(body["metadata"]["name"], stage, revision(body))


def complete_rollout(kube: Kube, stage: str, pipeline: str = "tiny", namespace: str = NAMESPACE) -> int:
    """Stand in for the Deployment controller (no kube-controller-manager here): every
    Deployment of the stage (any revision) has all its pods ready. How many it reported."""
    deployments = kube.list(DEPLOYMENT, namespace, f"{naming.PIPELINE_LABEL}={pipeline},{naming.STAGE_LABEL}={stage}")
    changed = 0
    for dep in deployments:
        replicas = int(dep["spec"].get("replicas", 1))
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": replicas,
                  "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}
        if {k: (dep.get("status") or {}).get(k) for k in status} != status:
            kube.request("patch", "Deployment", "PATCH", DEPLOYMENT.object_path(namespace, dep["metadata"]["name"]) + "/status",
                         body={"status": status}, content_type="application/merge-patch+json")
            changed += 1
    return changed


def complete_all(kube: Kube, stages: tuple[str, ...] = ("thinker", "talker", "code2wav"), pipeline: str = "tiny",
                 namespace: str = NAMESPACE, reconcile: Callable[[], Any] | None = None, timeout: float = 20.0,
                 until: Callable[[], bool] | None = None) -> None:
    """Stand in for the Deployment controller until ``until`` holds (default: every
    Deployment of the pipeline has all its pods, at least one, ready): report each
    Deployment's pods ready, and let the operator act on it (``reconcile``; else the running
    operator's own watch): receivers first takes a round per stage, an old revision's drain
    one per step."""
    deadline = time.monotonic() + timeout

    def all_ready() -> bool:
        return all(int((d.get("status") or {}).get("readyReplicas") or 0) == int(d["spec"].get("replicas", 1))
                   and int(d["spec"].get("replicas", 1)) > 0
                   for d in kube.list(DEPLOYMENT, namespace, f"{naming.PIPELINE_LABEL}={pipeline}"))

    while True:
        changed = sum(complete_rollout(kube, stage, pipeline, namespace) for stage in stages)
        if reconcile is not None:
            reconcile()
        if not changed and (until or all_ready)():
            return
        if time.monotonic() > deadline:
            raise AssertionError("the stages did not all become ready")
        if reconcile is None:
            time.sleep(0.05)  # the running operator reacts to the Deployment events; poll again


class RunningOperator:
    """The real operator (kopf, the handlers, the reconciler) in a thread, stopped at teardown."""

    def __init__(self, url: str, namespaces: list[str], resync_seconds: float = 3600.0):
        self.metrics = OperatorMetrics()
        # The operator's own credentials: kopf's watches log in with them too (handlers.login).
        self.kube = make_kube(url, OPERATOR_TOKEN)
        self.kube._on_call = self.metrics.api_call
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.options = operator_main.Options(
            namespaces=namespaces, metrics_host="127.0.0.1", metrics_port=self.metrics_port,
            liveness_host="127.0.0.1", liveness_port=self.liveness_port, resync_seconds=resync_seconds)
        # The reconciler's cache of the children, which the operator's watches feed.
        self.children = ChildCache()
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="omni-operator", daemon=True)

    def _run(self) -> None:
        try:
            operator_main.run(self.options, kube=self.kube, metrics=self.metrics,
                              stop_flag=self.stop_flag, ready_flag=self.ready_flag, children=self.children)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def start(self) -> "RunningOperator":
        self._thread.start()
        wait_for(lambda: self.ready_flag.is_set() or self.error, 30, "the operator to start")
        if self.error:
            raise self.error
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the operator did not stop"
        self.kube.close()
        if self.error:
            raise self.error

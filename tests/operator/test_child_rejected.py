"""The API server refusing a child: permanent refusals end in ChildRejected (no retry loop),
transient errors propagate for kopf's backoff. The refusals come from the emulator's
`refuse` hook, standing in for the server's validation and admission (no real API server
runs here)."""
from __future__ import annotations

import pytest

from k8s_emulator import ApiCall
from omnip_support import (NAMESPACE, OPERATOR_TOKEN, create_pipeline, patch_pipeline, pipeline_body, status,
                           wait_for, workload)
from omni_operator.pipeline.kinds import CONFIGMAP, DEPLOYMENT
from omni_operator.controller.kube import ApiException

INVALID = 'Deployment.apps "tiny-thinker" is invalid: spec.template.spec.containers[0].image: Required value'


def refuse_deployment_creates(status_code: int, message: str = INVALID):
    def refuse(call: ApiCall) -> tuple[int, str] | None:
        if call.verb == "create" and call.resource == "deployments":
            return status_code, message
        return None
    return refuse


def ready(kube) -> dict:
    return next((c for c in status(kube).get("conditions", []) if c["type"] == "Ready"), {})


def events(kube, reason: str) -> list[dict]:
    items = kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
    return [e for e in items if e["reason"] == reason]


def deployment_creates(emulator, user: str | None = None) -> int:
    return sum(1 for c in emulator.calls(user) if c.verb == "create" and c.resource == "deployments")


@pytest.mark.parametrize("code", [400, 403, 422])
def test_a_refused_child_is_reported_once_and_not_retried(kube, reconciler, emulator, code):
    emulator.emulator.refuse = refuse_deployment_creates(code)
    create_pipeline(kube, pipeline_body())
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "rejected" and outcome.phase == "Failed"
    condition = ready(kube)
    assert (condition["status"], condition["reason"]) == ("False", "ChildRejected")
    assert f"create Deployment {workload('thinker')} ({code})" in condition["message"]
    assert INVALID in condition["message"]  # the server's own words
    assert status(kube)["phase"] == "Failed"
    assert len(events(kube, "ChildRejected")) == 1
    creates = deployment_creates(emulator)
    writes = reconciler.kube.writes
    for _ in range(5):  # resync rounds and child events of the same generation
        assert reconciler.reconcile(NAMESPACE, "tiny").result == "rejected"
    # The Deployments are written together (one wave): each asked once, never again.
    assert deployment_creates(emulator) == creates == len(pipeline_body()["spec"]["stages"])
    assert reconciler.kube.writes == writes  # no status rewrite, no second event
    assert len(events(kube, "ChildRejected")) == 1


def test_a_new_generation_is_tried_again(kube, reconciler, emulator):
    emulator.emulator.refuse = refuse_deployment_creates(422)
    create_pipeline(kube, pipeline_body())
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "rejected"
    emulator.emulator.refuse = None  # the user fixes what was refused ...
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "rejected"  # ... same generation: not retried
    stages = pipeline_body()["spec"]["stages"]
    stages[2]["replicas"] = 2
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})  # ... and changes the spec
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "applied"
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav"))["spec"]["replicas"] == 2
    assert ready(kube)["reason"] == "StagesNotReady"


def test_a_refused_patch_is_rejected_too(kube, reconciler, emulator):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    kube.patch(CONFIGMAP, NAMESPACE, workload("talker"), {"data": {"stage.yaml": "edited: by hand\n"}})
    emulator.emulator.refuse = lambda call: (
        (422, f'ConfigMap "{workload("talker")}" is invalid: data: Too long')
        if call.verb == "patch" and call.resource == "configmaps" else None)
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "rejected"
    assert f"patch ConfigMap {workload('talker')} (422)" in ready(kube)["message"]


@pytest.mark.parametrize("code", [429, 500, 503])
def test_transient_errors_propagate_for_backoff(kube, reconciler, emulator, code):
    emulator.emulator.refuse = refuse_deployment_creates(code, "try again later")
    create_pipeline(kube, pipeline_body())
    with pytest.raises(ApiException) as info:
        reconciler.reconcile(NAMESPACE, "tiny")
    assert info.value.status == code
    assert ready(kube).get("reason") != "ChildRejected" and events(kube, "ChildRejected") == []
    emulator.emulator.refuse = None
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "applied"  # the retry succeeds


def test_running_operator_reports_a_422_once_with_bounded_calls(kube, start_operator, emulator):
    """The whole operator (kopf handlers, child watches, resync timer): a Deployment creation
    refused with 422 gives ChildRejected and one Warning event, and time passing adds no writes
    and a bounded number of reads. Time is compressed: the resync timer runs every 50 ms, so
    each round stands for one minute of the default 60 s resync."""
    emulator.emulator.refuse = refuse_deployment_creates(422)
    op = start_operator(resync_seconds=0.05)
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: ready(kube).get("reason") == "ChildRejected", what="ChildRejected in the status")
    # kopf records the handled spec on the object once its handler returns (its own write).
    wait_for(lambda: (kube.get_pipeline(NAMESPACE, "tiny")["metadata"].get("annotations") or {})
             .get("kopf.zalando.org/last-handled-configuration"), what="kopf to record the handled spec")
    rejected = op.metrics.reconciles.labels("rejected")
    start_rounds = rejected._value.get()
    start_calls = len(emulator.calls(OPERATOR_TOKEN))
    # Wait (bounded) for 20 more reconciles of the refused generation.
    wait_for(lambda: rejected._value.get() >= start_rounds + 20, timeout=30, what="20 more reconciles")
    rounds = rejected._value.get() - start_rounds
    later = emulator.calls(OPERATOR_TOKEN)[start_calls:]
    assert [c for c in later if c.verb in ("create", "patch", "update", "delete")] == []
    # Reads: a resync round lists the pipelines and gets the one it reconciles.
    assert len([c for c in later if c.verb in ("get", "list")]) <= 3 * (rounds + 2), later[:10]
    # Once per Deployment (one wave of writes), never again.
    assert deployment_creates(emulator, OPERATOR_TOKEN) == len(pipeline_body()["spec"]["stages"])
    assert len(events(kube, "ChildRejected")) == 1
    condition = ready(kube)
    assert f"Deployment {workload('thinker')}" in condition["message"] and "is invalid" in condition["message"]
    assert status(kube)["observedGeneration"] == 1


def test_a_refusal_is_reported_before_a_transient_error_of_the_same_wave(kube, reconciler, emulator):
    """The ConfigMaps' creates fail for now (503) and the Services' are refused (422), in
    one wave: the refusal is what the reconcile reports (recorded for the generation, not
    asked again), not the transient error that came first in rendered order."""
    def refuse(call: ApiCall) -> tuple[int, str] | None:
        if call.verb == "create" and call.resource == "configmaps":
            return 503, "the server is busy"
        if call.verb == "create" and call.resource == "services":
            return 422, 'Service "tiny-thinker" is invalid: spec.ports[0].port: Invalid value'
        return None

    emulator.emulator.refuse = refuse
    create_pipeline(kube, pipeline_body())
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "rejected"
    assert "create Service" in ready(kube)["message"] and "(422)" in ready(kube)["message"]
    services = sum(1 for c in emulator.calls() if c.verb == "create" and c.resource == "services")
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "rejected"
    assert sum(1 for c in emulator.calls() if c.verb == "create" and c.resource == "services") == services

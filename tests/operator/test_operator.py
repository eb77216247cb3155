"""The running operator (kopf, handlers, reconciler, resync) against the API emulator."""
from __future__ import annotations

import urllib.request

from omnip_support import (NAMESPACE, OPERATOR_TOKEN, complete_all, create_pipeline, make_kube, patch_pipeline,
                           pipeline_body, workload, status, wait_for)
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CHILD_KINDS, CONFIGMAP, DEPLOYMENT, PDB, SERVICE
from omni_operator.controller.reconcile import Reconciler
from omni_operator.controller.resync import Resync

STAGES = ("thinker", "talker", "code2wav")
PIPELINE_PATH = f"/apis/omnipipeline.dev/v1alpha1/namespaces/{NAMESPACE}/omnipipelines/tiny"




def children(kube, kind):
    return {o["metadata"]["name"]: o for o in kube.list(kind, NAMESPACE, "")}


def versions(kube):
    return {(kind.kind, name): o["metadata"]["resourceVersion"]
            for kind in (CONFIGMAP, SERVICE, DEPLOYMENT, PDB) for name, o in children(kube, kind).items()}


def ready_condition(kube):
    return next((c for c in status(kube).get("conditions", []) if c["type"] == "Ready"), {})


def test_create_status_metrics_and_liveness(kube, start_operator):
    op = start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    assert sorted(children(kube, DEPLOYMENT)) == sorted(workload(s) for s in STAGES)
    # Deployment events bring the status up to date without waiting for the resync timer, and
    # start each sender once its receivers are ready.
    complete_all(kube)
    wait_for(lambda: status(kube).get("phase") == "Ready", what="phase Ready")
    assert ready_condition(kube)["status"] == "True"
    body = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5).read().decode()
    # The create, then talker started once code2wav was ready, then thinker once talker was.
    assert 'omni_operator_reconciles_total{result="applied"} 3.0' in body
    assert 'omni_operator_pipelines{phase="Ready"} 1.0' in body
    assert "omni_operator_reconcile_duration_seconds_count" in body
    with urllib.request.urlopen(f"http://127.0.0.1:{op.liveness_port}/healthz", timeout=5) as response:
        assert response.status == 200


def test_update_one_stage_touches_only_its_children(kube, start_operator):
    start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    before = versions(kube)
    stages = pipeline_body()["spec"]["stages"]
    stages[2]["replicas"] = 3
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    wait_for(lambda: status(kube).get("observedGeneration") == 2, what="generation 2 observed")
    assert children(kube, DEPLOYMENT)[workload("code2wav")]["spec"]["replicas"] == 3
    after = versions(kube)
    assert {key for key in before if before[key] != after[key]} == {("Deployment", workload("code2wav"))}


def test_hand_edit_and_delete_of_a_child_are_repaired(kube, start_operator):
    start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    kube.patch(DEPLOYMENT, NAMESPACE, workload("code2wav"), {"spec": {"replicas": 7}})
    wait_for(lambda: kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav"))["spec"]["replicas"] == 1,
             what="replicas put back")
    kube.delete(SERVICE, NAMESPACE, "tiny-thinker")
    wait_for(lambda: kube.get(SERVICE, NAMESPACE, "tiny-thinker"), what="the Service re-created")
    kube.patch(CONFIGMAP, NAMESPACE, workload("code2wav"), {"data": {"stage.yaml": "stage: evil\n"}})
    wait_for(lambda: "stage: code2wav" in kube.get(CONFIGMAP, NAMESPACE, workload("code2wav"))["data"]["stage.yaml"],
             what="the stage config put back")


def test_removed_stage_is_cleaned_up(kube, start_operator):
    start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    complete_all(kube)
    stages = pipeline_body()["spec"]["stages"]
    stages[2]["inputs"] = ["thinker"]
    del stages[1]  # drop the talker; code2wav now receives from the thinker
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    new = pipeline_body(stages=stages)
    # The new revision comes up and the old one (talker's workload with it) drains away.
    complete_all(kube, STAGES, until=lambda: sorted(children(kube, DEPLOYMENT)) == sorted(
        workload(s, new) for s in ("code2wav", "thinker")))
    for kind in (CONFIGMAP, SERVICE, PDB):
        assert not [n for n in children(kube, kind) if n.startswith("tiny-talker")]
    wait_for(lambda: status(kube).get("stagesReady") == "2/2", what="status of two stages")
    thinker = children(kube, CONFIGMAP)[workload("thinker", new)]["data"]["stage.yaml"]
    assert f"{workload('code2wav', new)}.team-a.svc:9600" in thinker


def test_invalid_spec_sets_condition_and_event_and_applies_nothing(kube, start_operator):
    start_operator()
    body = pipeline_body()
    body["spec"]["stages"][0]["inputs"] = ["code2wav"]
    create_pipeline(kube, body)
    wait_for(lambda: ready_condition(kube).get("reason") == "InvalidSpec", what="InvalidSpec")
    assert "cycle" in ready_condition(kube)["message"] and status(kube)["phase"] == "Failed"
    events = kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
    assert any(e["type"] == "Warning" and e["reason"] == "InvalidSpec" for e in events)
    assert children(kube, DEPLOYMENT) == children(kube, CONFIGMAP) == {}


def test_restart_makes_no_duplicates_and_no_writes(kube, start_operator, emulator):
    first = start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    wait_for(lambda: (kube.get_pipeline(NAMESPACE, "tiny")["metadata"].get("annotations") or {})
             .get("kopf.zalando.org/last-handled-configuration"), what="kopf to record the handled spec")
    first.stop()
    before = versions(kube)
    second = start_operator()
    # The resume handler runs once for the existing pipeline; wait until it has.
    wait_for(lambda: second.metrics.reconciles.labels("unchanged")._value.get() >= 1, what="the resume reconcile")
    assert versions(kube) == before
    assert second.kube.writes == 0
    assert len(children(kube, DEPLOYMENT)) == 3


def test_the_operator_lists_and_watches_its_children_alone(kube, start_operator, emulator):
    """All namespaces (the chart's default): the children's lists and watches carry the
    children's label selector, so the API server sends the operator no other ConfigMap,
    Service or Deployment of the cluster (kopf's handler filters are applied client-side)."""
    kube.request("create", "Namespace", "POST", "/api/v1/namespaces",
                 body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "monitoring"}})
    kube.create(CONFIGMAP, "monitoring", {"apiVersion": "v1", "kind": "ConfigMap",
                                          "metadata": {"name": "a-dashboard"}, "data": {"x": "y"}})
    start_operator(namespaces=[])
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    plurals = {kind.plural for kind in CHILD_KINDS}
    reads = [c for c in emulator.calls(OPERATOR_TOKEN) if c.verb in ("list", "watch") and c.resource in plurals]
    assert {c.resource for c in reads if c.verb == "watch"} >= {"configmaps", "services", "deployments"}
    unfiltered = [c.path for c in reads if naming.CHILDREN_SELECTOR.split(",")[0] not in (c.label_selector or "")
                  or naming.PIPELINE_LABEL not in (c.label_selector or "")]
    assert not unfiltered


def test_deleted_pipeline_is_not_resurrected(kube, start_operator):
    op = start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    deployments = children(kube, DEPLOYMENT)
    kube.request("delete", "OmniPipeline", "DELETE", PIPELINE_PATH)
    wait_for(lambda: op.metrics.pipelines.labels("Progressing")._value.get() == 0, what="the pipeline forgotten")
    # No garbage collector runs here; the children carry the owner reference the real one follows.
    for dep in deployments.values():
        assert dep["metadata"]["ownerReferences"][0]["kind"] == "OmniPipeline"
    writes = op.kube.writes
    kube.delete(DEPLOYMENT, NAMESPACE, workload("thinker"))  # as the garbage collector would
    wait_for(lambda: kube.get(DEPLOYMENT, NAMESPACE, workload("thinker")) is None, what="the deletion")
    assert kube.get_pipeline(NAMESPACE, "tiny") is None
    assert op.kube.writes == writes  # nothing re-created for a pipeline that is gone


def test_resync_timer_reconciles_every_pipeline(kube, emulator):
    create_pipeline(kube, pipeline_body())
    create_pipeline(kube, pipeline_body(name="other"))
    client = make_kube(emulator.url)
    resync = Resync(Reconciler(client), [NAMESPACE], interval=0.05)
    resync.start()
    try:
        wait_for(lambda: len(children(kube, DEPLOYMENT)) == 6, what="both pipelines applied by the timer")
        wait_for(lambda: resync.rounds >= 2, what="a second round")
    finally:
        resync.stop()
        client.close()
    assert status(kube)["stagesReady"] == "0/3"

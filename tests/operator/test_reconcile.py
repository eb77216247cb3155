"""The reconciler against the API emulator: the idempotent apply path, write by write."""
from __future__ import annotations

import json
import threading

import pytest

from omnip_support import (NAMESPACE, OPERATOR_TOKEN, complete_all, create_pipeline, make_kube, patch_pipeline, pipeline_body,
                           workload)
from k8s_emulator import EmulatorThread
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CONFIGMAP, DEPLOYMENT, NETWORKPOLICY, PDB, PODMONITOR, SERVICE
from omni_operator.controller.reconcile import Reconciler

STAGES = ("thinker", "talker", "code2wav")


def names(kube, kind):
    return sorted(o["metadata"]["name"] for o in kube.list(kind, NAMESPACE, ""))


def writes_of(kube):
    return {key: n for key, n in kube.calls.items() if key[0] in ("create", "patch", "delete")}


def test_create_then_noop(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    first = reconciler.reconcile(NAMESPACE, "tiny")
    assert first.result == "applied"
    assert names(kube, DEPLOYMENT) == names(kube, CONFIGMAP) == sorted(workload(s) for s in STAGES)
    assert names(kube, PDB) == ["tiny-code2wav", "tiny-talker", "tiny-thinker"]
    # The stable Services, and a KV Service of the revision for each receiving stage.
    assert names(kube, SERVICE) == sorted(names(kube, PDB) + [workload("code2wav"), workload("talker")])
    assert names(kube, NETWORKPOLICY) == ["tiny"]
    before = dict(reconciler.kube.calls)
    second = reconciler.reconcile(NAMESPACE, "tiny")
    assert (second.result, second.writes) == ("unchanged", 0)
    new_calls = {k: n - before.get(k, 0) for k, n in reconciler.kube.calls.items() if n != before.get(k, 0)}
    assert all(verb in ("get", "list") for verb, _ in new_calls), new_calls
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    assert status["phase"] == "Progressing" and status["stagesReady"] == "0/3" and status["observedGeneration"] == 1
    # Receivers first: only the last stage has pods until its senders' receivers are ready.
    assert {d["metadata"]["name"]: d["spec"]["replicas"] for d in kube.list(DEPLOYMENT, NAMESPACE, "")} == \
        {workload("thinker"): 0, workload("talker"): 0, workload("code2wav"): 1}


def test_scaling_a_stage_touches_only_its_deployment(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    before = writes_of(reconciler.kube)
    spec = pipeline_body()["spec"]
    spec["stages"][1]["replicas"] = 3
    patch_pipeline(kube, "tiny", {"spec": {"stages": spec["stages"]}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.changed == [f"patch Deployment/{workload('talker')}"]  # the same revision: no rollout
    delta = {k: n - before.get(k, 0) for k, n in writes_of(reconciler.kube).items() if n != before.get(k, 0)}
    assert delta == {("patch", "Deployment"): 1, ("patch", "OmniPipeline"): 1}
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("talker"))["spec"]["replicas"] == 3
    assert kube.get_pipeline(NAMESPACE, "tiny")["status"]["observedGeneration"] == 2


def test_a_template_change_makes_a_new_revision_next_to_the_old_one(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    old = pipeline_body()
    spec = pipeline_body()["spec"]
    spec["stages"][1]["engineArgs"] = {"max-model-len": 2048}
    patch_pipeline(kube, "tiny", {"spec": {"stages": spec["stages"]}})
    new = pipeline_body(stages=spec["stages"])
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    # Every stage gets a workload of the new revision (the revision is the whole pipeline's);
    # nothing of the old one is deleted yet.
    assert sorted(c for c in outcome.changed if c.startswith("create Deployment")) == \
        sorted(f"create Deployment/{workload(s, new)}" for s in STAGES)
    assert not [c for c in outcome.changed if c.startswith("delete")]
    # The GPU thinker (maxSurge 0, maxUnavailable 1) gives its GPU up first: it drains;
    # talker, its receiver, stays until it has; code2wav (CPU: maxUnavailable 0) stays until
    # its new pod is ready.
    assert {s: kube.get(DEPLOYMENT, NAMESPACE, workload(s, old))["spec"]["replicas"] for s in STAGES} == \
        {"thinker": 0, "talker": 1, "code2wav": 1}
    assert {s: kube.get(DEPLOYMENT, NAMESPACE, workload(s, new))["spec"]["replicas"] for s in STAGES} == \
        {"thinker": 0, "talker": 0, "code2wav": 1}
    config = kube.get(CONFIGMAP, NAMESPACE, workload("talker", new))["data"]["stage.yaml"]
    assert "max-model-len: 2048" in config and f"tiny-code2wav-{workload('code2wav', new).rsplit('-', 1)[1]}" in config
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    assert status["observedGeneration"] == 2 and status["revision"] == workload("talker", new).rsplit("-", 1)[1]
    assert [(r["revision"], r["current"], r["draining"]) for r in status["revisions"]] == [
        (status["revision"], True, False), (workload("talker", old).rsplit("-", 1)[1], False, True)]


def test_hand_edited_and_deleted_children_are_put_back(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    kube.patch(DEPLOYMENT, NAMESPACE, workload("thinker"), {"spec": {"replicas": 5}})
    kube.patch(SERVICE, NAMESPACE, "tiny-talker", {"spec": {"selector": {"app": "other"}}})
    kube.patch(CONFIGMAP, NAMESPACE, workload("code2wav"), {"metadata": {"labels": {"team": "a"}}})  # not an owned field
    kube.delete(PDB, NAMESPACE, "tiny-talker")
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert sorted(outcome.changed) == ["create PodDisruptionBudget/tiny-talker", f"patch Deployment/{workload('thinker')}",
                                       "patch Service/tiny-talker"]
    # Put back to what it was before the edit: the receivers-first gate never starts more
    # senders, and never stops ones that run (1 is the stage's target).
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("thinker"))["spec"]["replicas"] == 1
    assert kube.get(SERVICE, NAMESPACE, "tiny-talker")["spec"]["selector"] == naming.selector_labels("tiny", "talker")
    assert kube.get(CONFIGMAP, NAMESPACE, workload("code2wav"))["metadata"]["labels"]["team"] == "a"


def test_the_kv_services_are_headless_and_one_made_with_a_cluster_ip_is_left_as_it_is(kube, reconciler):
    """A receiving stage's KV Service resolves to its pods (a sender spreads requests over
    them). One made before they were headless has a cluster IP, which the API server never
    lets a patch change (spec.clusterIP is immutable): it is left as it is, not patched at
    every reconcile and refused. (The emulator lets a user's patch set one, as a Service
    made then had it.)"""
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    for stage in ("talker", "code2wav"):
        assert kube.get(SERVICE, NAMESPACE, workload(stage))["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in kube.get(SERVICE, NAMESPACE, "tiny-talker")["spec"]
    kube.patch(SERVICE, NAMESPACE, workload("talker"), {"spec": {"clusterIP": "10.96.0.10"}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert (outcome.result, outcome.writes) == ("unchanged", 0), outcome.changed
    assert kube.get(SERVICE, NAMESPACE, workload("talker"))["spec"]["clusterIP"] == "10.96.0.10"


def test_removed_stage_children_are_deleted(kube, reconciler):
    """Removing a stage changes the graph: a new revision. Once it is up, the old revision
    drains and goes, the removed stage's workload with it; its stable children go at once."""
    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    stages = pipeline_body()["spec"]["stages"][:2]
    stages[1]["kvTransfer"] = {"send": False}  # nothing downstream of talker any more
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert sorted(c for c in outcome.changed if c.startswith("delete")) == [
        "delete PodDisruptionBudget/tiny-code2wav", "delete Service/tiny-code2wav"]
    new = pipeline_body(stages=stages)
    # talker no longer sends to a downstream stage: its new revision's config says so.
    talker = kube.get(CONFIGMAP, NAMESPACE, workload("talker", new))["data"]["stage.yaml"]
    assert "downstream: []" in talker
    # The new revision comes up; the old one drains (its pods go: none is left here, as no
    # pod objects exist without a kubelet) and is deleted, code2wav's workload with it.
    complete_all(kube, ("thinker", "talker", "code2wav"), reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"),
                 until=lambda: len(names(kube, DEPLOYMENT)) == 2)
    assert names(kube, DEPLOYMENT) == sorted(workload(s, new) for s in ("thinker", "talker"))
    assert names(kube, CONFIGMAP) == names(kube, DEPLOYMENT)
    assert names(kube, SERVICE) == sorted(["tiny-talker", "tiny-thinker", workload("talker", new)])


def test_invalid_spec_applies_nothing_and_warns_once(kube, reconciler):
    body = pipeline_body()
    body["spec"]["stages"][0]["inputs"] = ["code2wav"]  # a cycle
    create_pipeline(kube, body)
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "invalid"
    assert names(kube, DEPLOYMENT) == names(kube, CONFIGMAP) == names(kube, SERVICE) == []
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (status["phase"], ready["status"], ready["reason"]) == ("Failed", "False", "InvalidSpec")
    assert "cycle: thinker -> talker -> code2wav -> thinker" in ready["message"]
    events = kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
    assert [(e["type"], e["reason"], e["involvedObject"]["name"]) for e in events] == [("Warning", "InvalidSpec", "tiny")]
    again = reconciler.reconcile(NAMESPACE, "tiny")
    assert again.writes == 0  # the same problem is not reported again
    assert len(kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]) == 1


def test_a_spec_with_many_problems_says_the_first_ones_and_how_many_more(kube, reconciler):
    """A spec with hundreds of problems put every one in the Ready condition and again in
    Degraded (222 KB of status from 1,024 problems: an outside review); a condition says the
    first ones and how many more, as the Event does."""
    body = pipeline_body()
    body["spec"]["stages"][0]["env"] = [{"name": f"OMNI_{i}", "value": "x"} for i in range(60)]
    create_pipeline(kube, body)
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "invalid"
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    for kind in ("Ready", "Degraded"):
        message = next(c for c in status["conditions"] if c["type"] == kind)["message"]
        assert message.startswith("spec.stages[0].env[0].name:") and len(message) <= 4200, message
        assert message.endswith("more (omni-pipeline validate lists every one)"), message
    assert len(json.dumps(status)) < 16_000
    [event] = kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
    assert event["message"].startswith("spec.stages[0].env[0].name:")


def test_while_the_spec_is_invalid_the_status_follows_the_stages_that_run(kube, reconciler):
    """An invalid update applies nothing, but the stages of the revision that runs are still
    observed: a stage losing its pods shows in stagesReady and its counts (they stayed at
    what the last valid reconcile saw: kubectl get omnip said 3/3 ready while one stage had
    no pod ready)."""
    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    assert kube.get_pipeline(NAMESPACE, "tiny")["status"]["stagesReady"] == "3/3"
    stages = pipeline_body()["spec"]["stages"]
    stages[0]["inputs"] = ["code2wav"]  # a cycle
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "invalid"
    kube.request("patch", "Deployment", "PATCH", DEPLOYMENT.object_path(NAMESPACE, workload("code2wav")) + "/status",
                 body={"status": {"readyReplicas": 0}}, content_type="application/merge-patch+json")
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "invalid"
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    assert status["phase"] == "Failed" and status["stagesReady"] == "2/3"
    assert {s["name"]: s["readyReplicas"] for s in status["stages"]} == {"thinker": 1, "talker": 1, "code2wav": 0}
    assert reconciler.reconcile(NAMESPACE, "tiny").writes == 0  # nothing new: nothing written


def test_while_the_spec_is_refused_its_last_admitted_childrens_are_kept_and_repaired(kube, reconciler):
    """A refused update (an engineArgs typo) stopped every repair: a Deployment deleted or
    scaled to 0 by hand stayed so for as long as the spec was refused (an outside review). The
    children are kept as the last admitted spec made them, while the status says the spec
    is refused, once."""
    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    before = names(kube, DEPLOYMENT)
    stages = pipeline_body()["spec"]["stages"]
    stages[1]["engineArgs"] = {"max-num-seqz": 8}
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "invalid"
    kube.delete(DEPLOYMENT, NAMESPACE, workload("talker"))
    kube.patch(DEPLOYMENT, NAMESPACE, workload("code2wav"), {"spec": {"replicas": 0}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "invalid" and sorted(outcome.changed) == [
        f"create Deployment/{workload('talker')}", f"patch Deployment/{workload('code2wav')}"], outcome.changed
    assert names(kube, DEPLOYMENT) == before
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav"))["spec"]["replicas"] == 1
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (status["phase"], status["observedGeneration"], ready["reason"]) == ("Failed", 2, "InvalidSpec")
    assert "max-num-seqz" in ready["message"]
    events = kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
    assert [e["reason"] for e in events if e["type"] == "Warning"] == ["InvalidSpec"]
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    assert reconciler.reconcile(NAMESPACE, "tiny").writes == 0


def test_an_operator_starting_on_a_refused_spec_keeps_the_last_admitted_from_the_status(kube, reconciler, emulator):
    """The last admitted spec is in the status (`status.admitted`): an operator started (or
    restarted) while a later spec is refused repairs the children as that one made them."""
    from omni_operator.controller.reconcile import Reconciler

    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    admitted = kube.get_pipeline(NAMESPACE, "tiny")["status"]["admitted"]
    assert admitted["generation"] == 1 and admitted["spec"]["stages"][0]["name"] == "thinker"
    stages = pipeline_body()["spec"]["stages"]
    stages[1]["engineArgs"] = {"max-num-seqz": 8}
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    kube.delete(DEPLOYMENT, NAMESPACE, workload("talker"))
    client = make_kube(emulator.url)
    restarted = Reconciler(client)
    try:
        outcome = restarted.reconcile(NAMESPACE, "tiny")
        assert outcome.result == "invalid" and f"create Deployment/{workload('talker')}" in outcome.changed
        status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
        assert status["admitted"] == admitted, "the last admitted is kept, not the refused"
        assert next(c for c in status["conditions"] if c["type"] == "Ready")["reason"] == "InvalidSpec"
    finally:
        restarted.close()
        client.close()


def test_a_rollout_under_way_when_the_spec_is_refused_finishes(kube, reconciler):
    """An update refused mid-rollout left both revisions side by side (a GPU stage a pod short)
    for as long as it was refused (an outside review): the rollout to the last admitted spec
    goes on to its end, and fixing the spec rolls on from there."""
    create_pipeline(kube, pipeline_body())
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    stages = pipeline_body()["spec"]["stages"]
    stages[1]["engineArgs"] = {"max-model-len": 2048}  # a new revision
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    reconciler.reconcile(NAMESPACE, "tiny")
    new = pipeline_body(stages=stages)
    assert len(names(kube, DEPLOYMENT)) > 3, "both revisions side by side"
    refused = [dict(s) for s in stages]
    refused[0]["engineArgs"] = {"max-num-seqz": 8}
    patch_pipeline(kube, "tiny", {"spec": {"stages": refused}})
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"),
                 until=lambda: len(names(kube, DEPLOYMENT)) == 3)
    assert names(kube, DEPLOYMENT) == sorted(workload(s, new) for s in ("thinker", "talker", "code2wav"))
    ready = next(c for c in kube.get_pipeline(NAMESPACE, "tiny")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec"
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    assert reconciler.reconcile(NAMESPACE, "tiny").result in ("applied", "unchanged")
    ready = next(c for c in kube.get_pipeline(NAMESPACE, "tiny")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] != "InvalidSpec"


def test_fixing_an_invalid_spec_applies_it(kube, reconciler):
    body = pipeline_body()
    body["spec"]["stages"][1]["inputs"] = ["nobody"]
    create_pipeline(kube, body)
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "invalid"
    patch_pipeline(kube, "tiny", {"spec": {"stages": pipeline_body()["spec"]["stages"]}})
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "applied"
    ready = next(c for c in kube.get_pipeline(NAMESPACE, "tiny")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "StagesNotReady"


def test_someone_elses_object_is_never_taken_over(kube, reconciler):
    kube.create(CONFIGMAP, NAMESPACE, {"apiVersion": "v1", "kind": "ConfigMap",
                                       "metadata": {"name": workload("talker"), "namespace": NAMESPACE},
                                       "data": {"mine": "yes"}})
    create_pipeline(kube, pipeline_body())
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "conflict"
    assert kube.get(CONFIGMAP, NAMESPACE, workload("talker"))["data"] == {"mine": "yes"}
    ready = next(c for c in kube.get_pipeline(NAMESPACE, "tiny")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ChildConflict" and f"ConfigMap {workload('talker')}" in ready["message"]
    # No workload starts for a pipeline whose children cannot all be applied (GPU pods of a
    # pipeline reported Failed, without its disruption budget or stable Service, before).
    assert names(kube, DEPLOYMENT) == []
    assert "no workload of this pipeline is started" in ready["message"]
    kube.delete(CONFIGMAP, NAMESPACE, workload("talker"))
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "applied"
    assert len(names(kube, DEPLOYMENT)) == 3


def test_its_orphaned_children_are_adopted_and_anothers_are_not(kube, reconciler):
    """Children of a pipeline of this name that no controller owns any more (the pipeline
    deleted with --cascade=orphan and applied again, or a reference removed) are adopted, as
    Kubernetes' controllers adopt their orphans (an outside review: they were ChildConflict
    for good); one that another pipeline owns, or that carries no pipeline label, is not."""
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    name = workload("talker")
    orphaned = {"metadata": {"ownerReferences": None}}
    kube.patch(CONFIGMAP, NAMESPACE, name, orphaned)
    kube.patch(PDB, NAMESPACE, "tiny-talker", orphaned)
    # Applied again: a new pipeline object (a new uid) of the same name.
    kube.request("delete", "OmniPipeline", "DELETE", f"/apis/omnipipeline.dev/v1alpha1/namespaces/{NAMESPACE}/omnipipelines/tiny")
    reconciler.forget(NAMESPACE, "tiny")
    create_pipeline(kube, pipeline_body())
    uid = kube.get_pipeline(NAMESPACE, "tiny")["metadata"]["uid"]
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert {f"patch ConfigMap/{name}", "patch PodDisruptionBudget/tiny-talker"} <= set(outcome.changed)
    for kind, child in ((CONFIGMAP, name), (PDB, "tiny-talker")):
        refs = kube.get(kind, NAMESPACE, child)["metadata"]["ownerReferences"]
        assert [(r["uid"], r["controller"]) for r in refs] == [(uid, True)], (kind, refs)
    # The others are still the old pipeline's (the emulator has no garbage collector): not
    # taken, named.
    assert outcome.result == "conflict"
    ready = next(c for c in kube.get_pipeline(NAMESPACE, "tiny")["status"]["conditions"] if c["type"] == "Ready")
    assert f"ConfigMap {workload('thinker')}" in ready["message"] and f"ConfigMap {name}" not in ready["message"]
    other = kube.get(CONFIGMAP, NAMESPACE, workload("thinker"))
    assert uid not in [r["uid"] for r in other["metadata"]["ownerReferences"]]


def test_status_follows_the_deployments(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    # Stand in for the Deployment controller: report every rollout complete (receivers first:
    # a reconcile starts each sender once its receivers are ready).
    complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"))
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.phase == "Ready" and outcome.writes == 0  # the status was written as it became so
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    assert status["stagesReady"] == "3/3"
    assert reconciler.metrics.pipelines.labels("Ready")._value.get() == 1


def test_last_applied_annotation_has_no_secrets(kube, reconciler):
    body = pipeline_body(model={"name": "org/m", "hubTokenSecretRef": {"name": "hf-token"}})
    create_pipeline(kube, body)
    reconciler.reconcile(NAMESPACE, "tiny")
    cm = kube.get(CONFIGMAP, NAMESPACE, workload("thinker", body))
    recorded = json.loads(cm["metadata"]["annotations"][naming.LAST_APPLIED_ANNOTATION])
    assert recorded["data"] == cm["data"]
    assert "HF_TOKEN" not in cm["data"]["stage.yaml"]


def test_podmonitor_created_when_the_prometheus_operator_is_installed():
    with EmulatorThread(podmonitors=True) as emu:
        client = make_kube(emu.url)
        create_pipeline(client, pipeline_body())
        reconciler = Reconciler(client)
        reconciler.reconcile(NAMESPACE, "tiny")
        monitor = client.get(PODMONITOR, NAMESPACE, "tiny")
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert {k: endpoint[k] for k in ("port", "path", "interval", "honorLabels")} == \
            {"port": "http", "path": "/metrics", "interval": "15s", "honorLabels": True}
        assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"namespace", "pod", "pipeline", "stage", "revision"}
        # A second reconcile finds the stored PodMonitor (lists of relabelings included) as desired.
        assert reconciler.reconcile(NAMESPACE, "tiny").writes == 0
        patch_pipeline(client, "tiny", {"spec": {"observability": {"metrics": False}}})
        assert "delete PodMonitor/tiny" in reconciler.reconcile(NAMESPACE, "tiny").changed
        assert client.get(PODMONITOR, NAMESPACE, "tiny") is None
        client.close()


def test_deleted_pipeline_is_forgotten(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    kube.request("delete", "OmniPipeline", "DELETE", f"/apis/omnipipeline.dev/v1alpha1/namespaces/{NAMESPACE}/omnipipelines/tiny")
    before = reconciler.kube.writes
    assert reconciler.reconcile(NAMESPACE, "tiny").result == "gone"
    assert reconciler.kube.writes == before
    assert reconciler.metrics.pipelines.labels("Progressing")._value.get() == 0


def test_each_step_once_per_reconcile(kube, reconciler, monkeypatch):
    """One reconcile parses, defaults and renders once: what admission checked is what is
    applied; an unchanged spec is neither checked nor rendered again."""
    from omni_operator.check import admission
    from omni_operator.pipeline import crd

    counts = {"defaults": 0, "render": 0}
    real_defaults, real_render = crd._default_in_place, admission.render_children

    def count_defaults(schema, value):  # recursive: count the calls on a whole pipeline body
        counts["defaults"] += 1 if isinstance(value, dict) and "spec" in value and "metadata" in value else 0
        return real_defaults(schema, value)

    def count_render(pipeline, **kwargs):
        counts["render"] += 1
        return real_render(pipeline, **kwargs)

    monkeypatch.setattr(crd, "_default_in_place", count_defaults)
    monkeypatch.setattr(admission, "render_children", count_render)
    created = create_pipeline(kube, pipeline_body(name="once"))
    reconciler.reconcile(NAMESPACE, "once")
    assert counts == {"defaults": 1, "render": 1}
    admitted = admission.admit(kube.get_pipeline(NAMESPACE, "once"))
    assert admitted.pipeline.uid == created["metadata"]["uid"]
    for child in admitted.children_for(podmonitor_available=False):
        kind = {"ConfigMap": CONFIGMAP, "Deployment": DEPLOYMENT, "Service": SERVICE, "PodDisruptionBudget": PDB,
                "NetworkPolicy": NETWORKPOLICY}[child["kind"]]
        live = kube.get(kind, NAMESPACE, child["metadata"]["name"])
        # The object written is the admitted one, last-applied record and all.
        assert live["metadata"]["annotations"] == child["metadata"]["annotations"]
    reconciler.reconcile(NAMESPACE, "once")
    assert counts == {"defaults": 1, "render": 1}, "an unchanged spec is not checked or rendered again"
    patch_pipeline(kube, "once", {"spec": {"stages": [dict(s, replicas=2) for s in pipeline_body()["spec"]["stages"]]}})
    reconciler.reconcile(NAMESPACE, "once")
    assert counts == {"defaults": 2, "render": 2}
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", pipeline_body(name="once")))["spec"]["replicas"] == 2


def test_a_first_reconcile_lists_nothing_and_a_half_done_one_is_finished(kube, emulator, reconciler, monkeypatch):
    """A new pipeline's children are created without listing (none can exist but its own);
    an attempt that stopped after some creates is completed by the next, without duplicates
    and with the children as desired."""
    create_pipeline(kube, pipeline_body())
    calls = len(emulator.calls())
    broken = Reconciler(make_kube(emulator.url))
    made = []
    real_create = broken.kube.create

    def create_then_stop(kind, namespace, body):
        if len(made) >= 5:  # creates run together (a wave): any past the fifth fails
            raise RuntimeError("the operator stopped here")
        made.append(body["metadata"]["name"])
        return real_create(kind, namespace, body)

    monkeypatch.setattr(broken.kube, "create", create_then_stop)
    with pytest.raises(RuntimeError):
        broken.reconcile(NAMESPACE, "tiny")
    broken.close()
    broken.kube.close()
    assert not [c for c in emulator.calls()[calls:] if c.verb == "list"]
    kube.patch(CONFIGMAP, NAMESPACE, workload("thinker"), {"data": {"stage.yaml": "edited meanwhile"}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "applied"
    assert f"patch ConfigMap/{workload('thinker')}" in outcome.changed
    assert names(kube, DEPLOYMENT) == sorted(workload(s) for s in STAGES)
    assert "edited meanwhile" not in kube.get(CONFIGMAP, NAMESPACE, workload("thinker"))["data"]["stage.yaml"]
    assert kube.get_pipeline(NAMESPACE, "tiny")["status"]["observedGeneration"] == 1
    assert (reconciler.reconcile(NAMESPACE, "tiny").writes) == 0


def test_a_child_changed_since_it_was_found_in_sync_is_compared_again(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    assert reconciler.reconcile(NAMESPACE, "tiny").writes == 0  # now remembered in sync
    kube.patch(DEPLOYMENT, NAMESPACE, workload("talker"), {"spec": {"replicas": 3}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.changed == [f"patch Deployment/{workload('talker')}"]
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("talker"))["spec"]["replicas"] == 1


def test_a_pipelines_children_are_written_in_waves_each_wave_at_once(kube, emulator):
    """What the pods or other children refer to is created first (configs, Services,
    budgets, policy), then the Deployments; the writes of one wave are in flight together."""
    create_pipeline(kube, pipeline_body())
    reconciler = Reconciler(make_kube(emulator.url, OPERATOR_TOKEN))
    guard, in_flight, most, started, overlap = threading.Lock(), [0], [0], [False], threading.Event()
    real_create = reconciler.kube.create

    def create(kind, namespace, body):
        with guard:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            first, started[0] = not started[0], True
            if in_flight[0] >= 2:
                overlap.set()
        try:
            if first:  # waits (bounded) for a second write: one after the other, none comes
                overlap.wait(10)
            return real_create(kind, namespace, body)
        finally:
            with guard:
                in_flight[0] -= 1

    reconciler.kube.create = create
    try:
        outcome = reconciler.reconcile(NAMESPACE, "tiny")
    finally:
        reconciler.close()
        reconciler.kube.close()
    assert outcome.result == "applied" and len(outcome.changed) == 15
    assert 2 <= most[0] <= reconciler.apply_concurrency
    created = [c.resource for c in emulator.calls(OPERATOR_TOKEN) if c.verb == "create"]
    assert created.count("deployments") == 3 and len(created) == 15
    first_deployment = created.index("deployments")
    assert created[first_deployment:] == ["deployments"] * 3, created
    # Reported wave by wave in the rendered order, whatever order the answers came in.
    assert outcome.changed[:2] == [f"create ConfigMap/{workload('thinker')}", "create Service/tiny-thinker"]
    assert outcome.changed[-3:] == [f"create Deployment/{workload(s)}" for s in STAGES]

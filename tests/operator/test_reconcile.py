"""The reconciler against the API emulator: the idempotent apply path, write by write."""
from __future__ import annotations

import json

import pytest

from omnip_support import NAMESPACE, create_pipeline, make_kube, patch_pipeline, pipeline_body
from k8s_emulator import EmulatorThread
from omni_operator import naming
from omni_operator.kinds import CONFIGMAP, DEPLOYMENT, NETWORKPOLICY, PDB, PODMONITOR, SERVICE
from omni_operator.reconcile import Reconciler

STAGES = ("thinker", "talker", "code2wav")


def names(kube, kind):
    return sorted(o["metadata"]["name"] for o in kube.list(kind, NAMESPACE, ""))


def writes_of(kube):
    return {key: n for key, n in kube.calls.items() if key[0] in ("create", "patch", "delete")}


@pytest.fixture
def reconciler(emulator):
    client = make_kube(emulator.url)
    yield Reconciler(client)
    client.close()


def test_create_then_noop(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    first = reconciler.reconcile(NAMESPACE, "tiny")
    assert first.result == "applied"
    assert names(kube, DEPLOYMENT) == ["tiny-code2wav", "tiny-talker", "tiny-thinker"]
    assert names(kube, SERVICE) == names(kube, CONFIGMAP) == names(kube, PDB) == names(kube, DEPLOYMENT)
    assert names(kube, NETWORKPOLICY) == ["tiny"]
    before = dict(reconciler.kube.calls)
    second = reconciler.reconcile(NAMESPACE, "tiny")
    assert (second.result, second.writes) == ("unchanged", 0)
    new_calls = {k: n - before.get(k, 0) for k, n in reconciler.kube.calls.items() if n != before.get(k, 0)}
    assert all(verb in ("get", "list") for verb, _ in new_calls), new_calls
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    assert status["phase"] == "Progressing" and status["stagesReady"] == "0/3" and status["observedGeneration"] == 1


def test_one_stage_update_touches_only_that_stage(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    before = writes_of(reconciler.kube)
    spec = pipeline_body()["spec"]
    spec["stages"][1]["engineArgs"] = {"max-model-len": 2048}
    patch_pipeline(kube, "tiny", {"spec": {"stages": spec["stages"]}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert sorted(outcome.changed) == ["patch ConfigMap/tiny-talker", "patch Deployment/tiny-talker"]
    delta = {k: n - before.get(k, 0) for k, n in writes_of(reconciler.kube).items() if n != before.get(k, 0)}
    assert delta == {("patch", "ConfigMap"): 1, ("patch", "Deployment"): 1, ("patch", "OmniPipeline"): 1}
    config = kube.get(CONFIGMAP, NAMESPACE, "tiny-talker")["data"]["stage.yaml"]
    assert "max-model-len: 2048" in config
    assert kube.get_pipeline(NAMESPACE, "tiny")["status"]["observedGeneration"] == 2


def test_hand_edited_and_deleted_children_are_put_back(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    kube.patch(DEPLOYMENT, NAMESPACE, "tiny-thinker", {"spec": {"replicas": 5}})
    kube.patch(SERVICE, NAMESPACE, "tiny-talker", {"spec": {"selector": {"app": "other"}}})
    kube.patch(CONFIGMAP, NAMESPACE, "tiny-code2wav", {"metadata": {"labels": {"team": "a"}}})  # not an owned field
    kube.delete(PDB, NAMESPACE, "tiny-talker")
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert sorted(outcome.changed) == ["create PodDisruptionBudget/tiny-talker", "patch Deployment/tiny-thinker",
                                       "patch Service/tiny-talker"]
    assert kube.get(DEPLOYMENT, NAMESPACE, "tiny-thinker")["spec"]["replicas"] == 1
    assert kube.get(SERVICE, NAMESPACE, "tiny-talker")["spec"]["selector"] == naming.selector_labels("tiny", "talker")
    assert kube.get(CONFIGMAP, NAMESPACE, "tiny-code2wav")["metadata"]["labels"]["team"] == "a"


def test_removed_stage_children_are_deleted(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    stages = pipeline_body()["spec"]["stages"][:2]
    stages[1]["kvTransfer"] = {"send": False}  # nothing downstream of talker any more
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert sorted(outcome.changed) == ["delete ConfigMap/tiny-code2wav", "delete Deployment/tiny-code2wav",
                                       "delete PodDisruptionBudget/tiny-code2wav", "delete Service/tiny-code2wav",
                                       "patch ConfigMap/tiny-talker", "patch Deployment/tiny-talker"]
    assert names(kube, DEPLOYMENT) == ["tiny-talker", "tiny-thinker"]
    # talker no longer sends to a downstream stage: its config says so (hence the two patches above).
    talker = kube.get(CONFIGMAP, NAMESPACE, "tiny-talker")["data"]["stage.yaml"]
    assert "downstream: []" in talker


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
                                       "metadata": {"name": "tiny-talker", "namespace": NAMESPACE}, "data": {"mine": "yes"}})
    create_pipeline(kube, pipeline_body())
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "conflict"
    assert kube.get(CONFIGMAP, NAMESPACE, "tiny-talker")["data"] == {"mine": "yes"}
    ready = next(c for c in kube.get_pipeline(NAMESPACE, "tiny")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ChildConflict" and "ConfigMap tiny-talker" in ready["message"]


def test_status_follows_the_deployments(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    # Stand in for the Deployment controller: report every rollout complete.
    for stage in STAGES:
        dep = kube.get(DEPLOYMENT, NAMESPACE, f"tiny-{stage}")
        kube.request("patch", "Deployment", "PATCH", DEPLOYMENT.object_path(NAMESPACE, f"tiny-{stage}") + "/status",
                     body={"status": {"observedGeneration": dep["metadata"]["generation"], "replicas": 1,
                                      "readyReplicas": 1, "updatedReplicas": 1, "availableReplicas": 1}},
                     content_type="application/merge-patch+json")
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.phase == "Ready" and outcome.writes == 1  # the status only
    status = kube.get_pipeline(NAMESPACE, "tiny")["status"]
    assert status["stagesReady"] == "3/3"
    assert reconciler.metrics.pipelines.labels("Ready")._value.get() == 1


def test_last_applied_annotation_has_no_secrets(kube, reconciler):
    create_pipeline(kube, pipeline_body(model={"name": "org/m", "hubTokenSecretRef": {"name": "hf-token"}}))
    reconciler.reconcile(NAMESPACE, "tiny")
    cm = kube.get(CONFIGMAP, NAMESPACE, "tiny-thinker")
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
        assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"namespace", "pod", "pipeline", "stage"}
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
    from omni_operator import admission, crd

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
    assert kube.get(DEPLOYMENT, NAMESPACE, "once-thinker")["spec"]["replicas"] == 2


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
        if len(made) == 5:
            raise RuntimeError("the operator stopped here")
        made.append(body["metadata"]["name"])
        return real_create(kind, namespace, body)

    monkeypatch.setattr(broken.kube, "create", create_then_stop)
    with pytest.raises(RuntimeError):
        broken.reconcile(NAMESPACE, "tiny")
    broken.kube.close()
    assert not [c for c in emulator.calls()[calls:] if c.verb == "list"]
    kube.patch(CONFIGMAP, NAMESPACE, "tiny-thinker", {"data": {"stage.yaml": "edited meanwhile"}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.result == "applied"
    assert "patch ConfigMap/tiny-thinker" in outcome.changed
    assert names(kube, DEPLOYMENT) == ["tiny-code2wav", "tiny-talker", "tiny-thinker"]
    assert "edited meanwhile" not in kube.get(CONFIGMAP, NAMESPACE, "tiny-thinker")["data"]["stage.yaml"]
    assert kube.get_pipeline(NAMESPACE, "tiny")["status"]["observedGeneration"] == 1
    assert (reconciler.reconcile(NAMESPACE, "tiny").writes) == 0


def test_a_child_changed_since_it_was_found_in_sync_is_compared_again(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    assert reconciler.reconcile(NAMESPACE, "tiny").writes == 0  # now remembered in sync
    kube.patch(DEPLOYMENT, NAMESPACE, "tiny-talker", {"spec": {"replicas": 3}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert outcome.changed == ["patch Deployment/tiny-talker"]
    assert kube.get(DEPLOYMENT, NAMESPACE, "tiny-talker")["spec"]["replicas"] == 1

"""Per-stage autoscaling against the API emulator: the autoscaler (an HPA or a KEDA
ScaledObject; neither controller runs here, so the test writes what they would: the
OmniStageScaler's spec.replicas, as the scale subresource does) owns each autoscaled stage's
replica count; the operator renders it, reads it and never overwrites it."""
from __future__ import annotations

from cluster_sim import Clock, SimCluster
from k8s_emulator import EmulatorThread
from omnip_support import (NAMESPACE, complete_all, create_pipeline, make_kube, patch_pipeline, pipeline_body, revision,
                           status, workload)
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import DEPLOYMENT, HPA, SCALEDOBJECT, STAGESCALER
from omni_operator.controller.reconcile import Reconciler
from test_rollout import Invariants, Rig, settled, step, with_engine_args

AUTOSCALING = {"minReplicas": 1, "maxReplicas": 6, "metrics": [{"signal": "incomingTransfers", "target": 2}]}


def autoscaled_body(replicas: int = 2, **autoscaling) -> dict:
    body = pipeline_body()
    body["spec"]["stages"][2].update(replicas=replicas, autoscaling={**AUTOSCALING, **autoscaling})
    return body


def set_autoscaler_replicas(kube, replicas: int, stage: str = "code2wav") -> None:
    """What the HPA or KEDA does through the scale subresource: spec.replicas of the target."""
    kube.patch(STAGESCALER, NAMESPACE, f"tiny-{stage}", {"spec": {"replicas": replicas}})


def test_an_autoscaled_stage_follows_its_autoscaler_and_the_operator_never_writes_its_count(kube, reconciler):
    create_pipeline(kube, autoscaled_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    scaler = kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")
    assert scaler["spec"] == {"pipeline": "tiny", "stage": "code2wav", "replicas": 2}  # the stage's count to start
    hpa = kube.get(HPA, NAMESPACE, "tiny-code2wav")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniStageScaler",
                                             "name": "tiny-code2wav"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    assert kube.get(SCALEDOBJECT, NAMESPACE, "tiny-code2wav") is None  # no KEDA here
    set_autoscaler_replicas(kube, 5)
    reconciler.reconcile(NAMESPACE, "tiny")
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", autoscaled_body()))["spec"]["replicas"] == 5
    version = kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")["metadata"]["resourceVersion"]
    for _ in range(3):
        reconciler.reconcile(NAMESPACE, "tiny")
    scaler = kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")
    assert scaler["spec"]["replicas"] == 5 and scaler["metadata"]["resourceVersion"] == version
    # Its status tells the autoscaler what the scale subresource reads: the pods and their selector.
    assert scaler["status"]["selector"] == f"{naming.PIPELINE_LABEL}=tiny,{naming.STAGE_LABEL}=code2wav"
    stage = next(s for s in status(kube)["stages"] if s["name"] == "code2wav")
    assert (stage["replicas"], stage["autoscaler"]) == (5, "HPA")
    # The autoscaler's count stays within the stage's bounds.
    set_autoscaler_replicas(kube, 40)
    reconciler.reconcile(NAMESPACE, "tiny")
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", autoscaled_body()))["spec"]["replicas"] == 6


def test_the_running_operator_follows_the_autoscaler_and_never_writes_its_count(emulator, kube, start_operator):
    """The whole operator (kopf's watches, the resync timer): the autoscaler's count, written
    through the scale subresource, reaches the stage's Deployment through the OmniStageScaler's
    watch, and the operator never writes the scaler's spec after creating it, whatever resyncs
    and events follow."""
    from omnip_support import OPERATOR_TOKEN, wait_for

    start_operator(resync_seconds=0.2)
    body = autoscaled_body()
    create_pipeline(kube, body)
    deployment = workload("code2wav", body)
    wait_for(lambda: (kube.get(DEPLOYMENT, NAMESPACE, deployment) or {}).get("spec", {}).get("replicas") == 2,
             30, "the autoscaled stage's Deployment at its starting count")
    # The reconcile writes the stage's children one after another: the autoscaler's objects
    # may land after the Deployment.
    wait_for(lambda: kube.get(HPA, NAMESPACE, "tiny-code2wav") is not None
             and kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav") is not None,
             30, "the stage's HorizontalPodAutoscaler and OmniStageScaler")
    assert kube.get(HPA, NAMESPACE, "tiny-code2wav")["spec"]["scaleTargetRef"]["name"] == "tiny-code2wav"

    def scaler_spec_writes() -> list:
        return [c for c in emulator.calls(OPERATOR_TOKEN)
                if c.resource == "omnistagescalers" and c.verb in ("patch", "update", "create")]

    created = scaler_spec_writes()
    assert [c.verb for c in created] == ["create"]
    set_autoscaler_replicas(kube, 5)
    wait_for(lambda: kube.get(DEPLOYMENT, NAMESPACE, deployment)["spec"]["replicas"] == 5, 30,
             "the Deployment to follow the autoscaler")
    resyncs = len([c for c in emulator.calls(OPERATOR_TOKEN) if c.resource == "pods"])
    wait_for(lambda: len([c for c in emulator.calls(OPERATOR_TOKEN) if c.resource == "pods"]) >= resyncs + 3, 30,
             "three more resync rounds")
    assert kube.get(DEPLOYMENT, NAMESPACE, deployment)["spec"]["replicas"] == 5
    assert kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")["spec"]["replicas"] == 5
    assert scaler_spec_writes() == created, "the operator wrote the autoscaler's object"


def test_turning_autoscaling_on_scales_nothing_down(kube, reconciler):
    body = pipeline_body()
    body["spec"]["stages"][2]["replicas"] = 3
    create_pipeline(kube, body)
    reconciler.reconcile(NAMESPACE, "tiny")
    # The user turns autoscaling on (and writes replicas: 1, which autoscaling ignores).
    stages = body["spec"]["stages"]
    stages[2].update(replicas=1, autoscaling=AUTOSCALING)
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")["spec"]["replicas"] == 3
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", body))["spec"]["replicas"] == 3
    assert not [c for c in outcome.changed if c.startswith("patch Deployment")]
    # Turning it off again: the spec's replicas rule, and the autoscaler's objects go.
    del stages[2]["autoscaling"]
    patch_pipeline(kube, "tiny", {"spec": {"stages": stages}})
    outcome = reconciler.reconcile(NAMESPACE, "tiny")
    assert sorted(c for c in outcome.changed if c.startswith("delete")) == [
        "delete HorizontalPodAutoscaler/tiny-code2wav", "delete OmniStageScaler/tiny-code2wav"]
    assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", body))["spec"]["replicas"] == 1


def test_with_keda_a_scaledobject_and_scale_to_zero():
    with EmulatorThread(keda=True) as emu:
        kube = make_kube(emu.url)
        kube.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        body = autoscaled_body(minReplicas=0)
        create_pipeline(kube, body)
        reconciler = Reconciler(make_kube(emu.url))
        reconciler.reconcile(NAMESPACE, "tiny")
        so = kube.get(SCALEDOBJECT, NAMESPACE, "tiny-code2wav")
        assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["scaleTargetRef"]["name"] == "tiny-code2wav"
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "2"
        assert trigger["metadata"]["query"] == \
            'sum(omni_kv_edge_transfers_active{namespace="team-a",pipeline="tiny",to_stage="code2wav"})'
        assert kube.get(HPA, NAMESPACE, "tiny-code2wav") is None
        # KEDA scales the vocoder to zero: its senders are not held back (receivers first
        # waits only for stages that should have pods).
        set_autoscaler_replicas(kube, 0)
        complete_all(kube, reconcile=lambda: reconciler.reconcile(NAMESPACE, "tiny"),
                     until=lambda: kube.get(DEPLOYMENT, NAMESPACE, workload("talker", body))["spec"]["replicas"] == 1)
        assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", body))["spec"]["replicas"] == 0
        assert next(s for s in status(kube)["stages"] if s["name"] == "code2wav")["autoscaler"] == "KEDA"
        reconciler.kube.close()
        kube.close()


def test_a_rollout_while_the_autoscaler_raises_the_target(emulator, kube):
    """The autoscaler raises code2wav from 2 to 4 in the middle of a rollout: the new
    revision's target becomes 4 (its old pods drain as before); the scaler, the autoscaler's
    stable target, is never replaced nor written by the rollout."""
    clock = Clock(1_800_000_000)
    sim = SimCluster(kube, NAMESPACE, clock)
    rig = Rig(kube, emulator.url, clock, sim)
    try:
        op, inv = rig.start_operator(), Invariants(rig)
        body = autoscaled_body()
        create_pipeline(kube, body)
        for n in range(40):
            if settled(rig, body):
                break
            step(rig, op, inv, n)
        assert settled(rig, body)
        inv.baseline(body["spec"]["stages"])
        scaler_uid = kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")["metadata"]["uid"]
        new_body = with_engine_args(body, 1, {"max-model-len": 2048})
        patch_pipeline(kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
        for n in range(40, 44):
            step(rig, op, inv, n)
        assert len(status(kube)["revisions"]) == 2
        set_autoscaler_replicas(kube, 4)
        # The surge follows the new target (4 + 1); the floor stays the 2 ready pods it had (new
        # pods are not ready at once, as the Deployment controller counts it too).
        inv.floors["code2wav"] = (4, 1, 2)
        target = pipeline_body(stages=new_body["spec"]["stages"])
        target["spec"]["stages"][2]["replicas"] = 4
        for n in range(44, 200):
            if settled(rig, target):
                break
            step(rig, op, inv, n)
        assert settled(rig, target)
        assert len(sim.of(revision(new_body), "code2wav")) == 4
        scaler = kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")
        assert scaler["metadata"]["uid"] == scaler_uid and scaler["spec"]["replicas"] == 4
        assert sim.abandoned == []
    finally:
        sim.close()
        for op in rig.operators:
            op.close()


def test_keda_installed_later_replaces_the_hpa_and_keeps_the_count():
    """The cluster starts serving KEDA's ScaledObject (found at the next discovery): the stage's
    HPA gives way to a ScaledObject on the same OmniStageScaler, whose count (the autoscaler's)
    is kept."""
    with EmulatorThread() as emu:
        kube = make_kube(emu.url)
        kube.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        create_pipeline(kube, autoscaled_body())
        reconciler = Reconciler(make_kube(emu.url), addon_cache_seconds=0)  # discover at every reconcile
        reconciler.reconcile(NAMESPACE, "tiny")
        assert kube.get(HPA, NAMESPACE, "tiny-code2wav") is not None
        set_autoscaler_replicas(kube, 4)
        emu.emulator.serve_keda()
        outcome = reconciler.reconcile(NAMESPACE, "tiny")
        assert "create ScaledObject/tiny-code2wav" in outcome.changed
        assert "delete HorizontalPodAutoscaler/tiny-code2wav" in outcome.changed
        assert kube.get(STAGESCALER, NAMESPACE, "tiny-code2wav")["spec"]["replicas"] == 4
        assert kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav", autoscaled_body()))["spec"]["replicas"] == 4
        reconciler.kube.close()
        kube.close()

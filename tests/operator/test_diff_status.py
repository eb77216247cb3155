"""The apply diff and the status function, as pure functions."""
from __future__ import annotations

import copy

from hypothesis import given, settings, strategies as st

from omnip_support import pipeline_body
from omni_operator.pipeline.diff import merge_patch, without
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.pipeline.quantities import parse_quantity
from omni_operator.controller.status import compute_status, status_patch

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def test_server_added_fields_are_not_differences():
    desired = {"spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}}
    live = {"spec": {"replicas": 1, "progressDeadlineSeconds": 600,
                     "template": {"spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicy": "IfNotPresent"}],
                                           "dnsPolicy": "ClusterFirst"}}},
            "status": {"readyReplicas": 1}, "metadata": {"resourceVersion": "7"}}
    assert merge_patch(desired, live) == {}


def test_zero_values_equal_absent_and_quantities_compare_as_numbers():
    desired = {"spec": {"readOnly": False, "env": "", "containers": [{"resources": {"limits": {"cpu": "1000m", "memory": "1Gi"}}}]}}
    live = {"spec": {"containers": [{"resources": {"limits": {"cpu": "1", "memory": "1024Mi"}}}]}}
    assert merge_patch(desired, live) == {}
    assert parse_quantity("1.5Gi") == parse_quantity(1610612736)


def test_changed_scalar_and_list_are_patched_whole():
    desired = {"spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000}]}}
    live = {"spec": {"replicas": 1, "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}}
    assert merge_patch(desired, live) == {"spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000}]}}


def test_field_no_longer_desired_is_removed():
    last = {"spec": {"nodeSelector": {"gpu": "a100"}, "replicas": 1}}
    live = {"spec": {"nodeSelector": {"gpu": "a100"}, "replicas": 1}}
    assert merge_patch({"spec": {"replicas": 1}}, live, last) == {"spec": {"nodeSelector": None}}
    # A key the operator never set (someone else's) is left alone.
    assert merge_patch({"spec": {"replicas": 1}}, live, {"spec": {"replicas": 1}}) == {}


def test_list_element_field_dropped_since_last_apply_rewrites_the_list():
    last = {"env": [{"name": "A", "value": "1", "valueFrom": None}]}
    desired = {"env": [{"name": "A"}]}
    live = {"env": [{"name": "A", "value": "1"}]}
    assert merge_patch(desired, live, last) == {"env": [{"name": "A"}]}


def test_a_create_only_field_leaves_the_patch_and_the_maps_it_empties():
    patch = {"spec": {"clusterIP": "None", "ports": [1]}, "metadata": {"labels": {"a": "b"}}}
    assert without(patch, (("spec", "clusterIP"),)) == {"spec": {"ports": [1]},
                                                        "metadata": {"labels": {"a": "b"}}}
    assert without({"spec": {"clusterIP": "None"}}, (("spec", "clusterIP"),)) == {}
    assert without({"spec": 3}, (("spec", "clusterIP"),)) == {"spec": 3}
    assert without({}, (("spec", "clusterIP"),)) == {}


def test_apiversion_and_kind_are_identity_not_content():
    assert merge_patch({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"replicas": 1}}, {"spec": {"replicas": 1}}) == {}


json_scalars = st.one_of(st.booleans(), st.integers(-5, 5), st.text(max_size=3))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(min_size=1, max_size=3), inner, max_size=3)), max_leaves=12)


def _apply(live, patch):
    out = copy.deepcopy(live)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _apply(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@settings(deadline=None, max_examples=150)
@given(st.dictionaries(st.text(min_size=1, max_size=3), json_values, max_size=4),
       st.dictionaries(st.text(min_size=1, max_size=3), json_values, max_size=4))
def test_applying_the_patch_converges(desired, live):
    # After applying the computed merge patch, there is nothing left to write.
    patched = _apply(live, merge_patch(desired, live))
    assert merge_patch(desired, patched) == {}


def _pipeline():
    body = pipeline_body()
    body["metadata"].update(uid="u", generation=4)
    return parse_pipeline(body)


def _deployment(replicas=1, ready=1, updated=1, generation=2, observed=2, conditions=()):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "conditions": list(conditions)}}


def test_all_ready():
    pipeline = _pipeline()
    status = compute_status(pipeline, {s.name: _deployment() for s in pipeline.stages}, None, NOW)
    assert status["phase"] == "Ready" and status["stagesReady"] == "3/3" and status["observedGeneration"] == 4
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "AllStagesReady"
    assert conds["Progressing"]["status"] == "False" and conds["Degraded"]["status"] == "False"
    assert status["stages"][0] == {"name": "thinker", "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}


def test_missing_and_unready_stages_are_progressing():
    pipeline = _pipeline()
    status = compute_status(pipeline, {"thinker": _deployment(), "talker": _deployment(ready=0)}, None, NOW)
    assert status["phase"] == "Progressing" and status["stagesReady"] == "1/3"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "talker: 0/1 replicas ready" in ready["message"]
    assert "code2wav: Deployment not created yet" in ready["message"]


def test_unobserved_rollout_is_not_ready():
    pipeline = _pipeline()
    deployments = {s.name: _deployment() for s in pipeline.stages}
    deployments["talker"] = _deployment(generation=3, observed=2)
    assert compute_status(pipeline, deployments, None, NOW)["phase"] == "Progressing"


def test_deadline_exceeded_is_degraded():
    pipeline = _pipeline()
    deployments = {s.name: _deployment() for s in pipeline.stages}
    deployments["thinker"] = _deployment(ready=0, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out"}])
    status = compute_status(pipeline, deployments, None, NOW)
    assert status["phase"] == "Degraded"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "StageFailing" and "thinker" in degraded["message"]


def test_transition_time_kept_while_status_unchanged():
    pipeline = _pipeline()
    deployments = {s.name: _deployment() for s in pipeline.stages}
    first = compute_status(pipeline, deployments, None, NOW)
    second = compute_status(pipeline, deployments, first, LATER)
    assert second == first and status_patch(first, second) == {}
    deployments["talker"] = _deployment(ready=0)
    third = compute_status(pipeline, deployments, second, LATER)
    ready = next(c for c in third["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == LATER
    assert set(status_patch(second, third)) == {"phase", "stagesReady", "stages", "conditions"}


def test_the_phase_gauge_counts_pipelines_as_their_phases_change():
    """The gauge is kept by counting changes (not by a recount at each reconcile): it still
    says how many pipelines are in each phase as they move, repeat and go away."""
    from omni_operator.controller.metrics import OperatorMetrics

    metrics = OperatorMetrics()

    def gauge() -> dict[str, float]:
        return {p: metrics.registry.get_sample_value("omni_operator_pipelines", {"phase": p})
                for p in ("Progressing", "Ready", "Degraded", "Failed")}

    for name in ("a", "b", "c"):
        metrics.set_phase("ns", name, "Progressing")
    metrics.set_phase("ns", "a", "Ready")
    metrics.set_phase("ns", "a", "Ready")
    metrics.set_phase("other", "a", "Failed")
    metrics.set_phase("ns", "b", None)
    metrics.set_phase("ns", "gone-before-it-came", None)
    assert gauge() == {"Progressing": 1, "Ready": 1, "Degraded": 0, "Failed": 1}

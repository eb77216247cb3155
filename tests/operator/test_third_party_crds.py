"""What the operator renders for third-party kinds (the Prometheus Operator's PodMonitor, KEDA's
ScaledObject) and its own OmniStageScaler, checked against the real CustomResourceDefinitions:
the upstream files kept as reference data next to the project (../shared/reference/crds/, not
copied into it; their sources and commits are in its README), read with the operator's own
schema and CEL evaluation (`omni-pipeline crd-check`, crd_check.py). The chart's ServiceMonitor
and PrometheusRule get the same check in tests/monitoring/test_chart_crds.py."""
from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import yaml

from omnip_support import pipeline_body
from omni_operator.local import cli
from omni_operator.check import crd_check
from omni_operator.pipeline.render import SIGNALS

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = REPO.parent / "shared" / "reference" / "crds"
OURS = REPO / "operator" / "omni_operator" / "crd"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

pytestmark = pytest.mark.skipif(not UPSTREAM.is_dir(), reason=f"the upstream CRDs are not at {UPSTREAM}")


def every_signal() -> dict:
    """A pipeline using every autoscaling signal (each where the CRD allows it)."""
    body = pipeline_body()
    stages = body["spec"]["stages"]
    stages[0]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4, "metrics": [
        {"signal": s, "target": t} for s, t in (("queuedRequests", 8), ("kvCacheUsage", "0.8"),
                                              ("pendingTransfers", 4), ("heldTransfers", 16),
                                              ("oldestPendingTransferSeconds", 5))]}
    stages[1]["streams"] = [{"stage": "thinker"}]  # a stage fed by a stream scales on its open streams
    stages[1]["autoscaling"] = {"maxReplicas": 3, "metrics": [{"signal": "incomingTransfers", "target": 2},
                                                               {"signal": "openStreams", "target": 16}]}
    stages[2]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 6, "metrics": [{"signal": "incomingTransfers", "target": "1.5"}]}
    return body


def rendered(body: dict) -> list[dict]:
    return crd_check.rendered_children(copy.deepcopy(body))


@pytest.fixture(scope="module")
def upstream() -> crd_check.CRDSet:
    return crd_check.CRDSet(UPSTREAM)


@pytest.fixture(scope="module")
def ours() -> crd_check.CRDSet:
    return crd_check.CRDSet(OURS)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_s_podmonitor_and_scaledobjects_pass_the_upstream_crds(upstream, ours, example):
    kids = rendered(yaml.safe_load(example.read_text()))
    third_party = [c for c in kids if c["kind"] in ("PodMonitor", "ScaledObject")]
    assert any(c["kind"] == "PodMonitor" for c in third_party)
    for child in third_party:
        assert upstream.check(child) == [], child["metadata"]["name"]
    for child in (c for c in kids if c["kind"] == "OmniStageScaler"):
        assert ours.check(child) == []


def test_every_signal_renders_a_scaledobject_keda_accepts(upstream, ours):
    kids = rendered(every_signal())
    scaled = [c for c in kids if c["kind"] == "ScaledObject"]
    assert len(scaled) == 3
    assert {t["name"] for so in scaled for t in so["spec"]["triggers"]} == {
        "queued-requests", "kv-cache-usage", "pending-transfers", "held-transfers",
        "oldest-pending-transfer-seconds", "incoming-transfers", "open-streams"}
    for so in scaled:
        assert upstream.check(so) == []
        assert so["spec"]["scaleTargetRef"]["kind"] == "OmniStageScaler"
    # The scale target each one names is one the operator renders, valid for its own CRD.
    scalers = {c["metadata"]["name"]: c for c in kids if c["kind"] == "OmniStageScaler"}
    assert {so["spec"]["scaleTargetRef"]["name"] for so in scaled} == set(scalers)
    assert all(ours.check(s) == [] for s in scalers.values())
    assert set(SIGNALS) == {m["signal"] for s in every_signal()["spec"]["stages"] for m in s["autoscaling"]["metrics"]}


def test_the_check_has_teeth(upstream):
    """What KEDA's and the Prometheus Operator's CRDs refuse is refused here, with the field."""
    kids = rendered(every_signal())
    so = copy.deepcopy(next(c for c in kids if c["kind"] == "ScaledObject"))
    so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"] = 5, 2  # the CRD's CEL rule
    assert any("minReplicaCount must be less than or equal to maxReplicaCount" in p for p in upstream.check(so))
    so = copy.deepcopy(next(c for c in kids if c["kind"] == "ScaledObject"))
    del so["spec"]["triggers"][0]["type"]
    assert any("spec.triggers[0]" in p and "'type' is a required property" in p for p in upstream.check(so))
    monitor = copy.deepcopy(next(c for c in kids if c["kind"] == "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["action"] = "rename"
    assert any("relabelings[0].action" in p for p in upstream.check(monitor))


def test_crd_check_reports_each_object_and_exits_nonzero_on_a_refusal(tmp_path):
    out = io.StringIO()
    assert cli.main.__module__  # the console script's module
    code = crd_check.run(UPSTREAM, [REPO / "examples"], out)
    lines = out.getvalue().splitlines()
    assert code == 0 and any("renders ScaledObject qwen-omni-code2wav: accepted by keda.sh_scaledobjects.yaml" in l
                             for l in lines), lines
    assert lines[-1].startswith("not checked (no CRD in")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                                   "metadata": {"name": "x"}, "spec": {"scaleTargetRef": {"name": "y"}}}))
    out = io.StringIO()
    assert crd_check.run(UPSTREAM, [bad], out) == 1
    assert "refused by keda.sh_scaledobjects.yaml: spec: 'triggers' is a required property" in out.getvalue()


def test_the_console_script_runs_it(capsys):
    assert cli.main(["crd-check", "--crds", str(UPSTREAM), str(EXAMPLES[0])]) == 0
    assert "accepted by monitoring.coreos.com_podmonitors.yaml" in capsys.readouterr().out

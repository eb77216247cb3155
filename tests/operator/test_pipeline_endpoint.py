"""One endpoint per pipeline (issue 49): the address a client uses for the whole pipeline is
in the status and the ENDPOINT column of `kubectl get omnip`, and it is what the entry
stage's Service serves."""
from __future__ import annotations

from omni_operator.pipeline import crd, naming
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.controller.status import compute_status
from omnip_support import NAMESPACE, create_pipeline, pipeline_body, status
from test_render import children

T0 = "2026-01-01T00:00:00Z"


def test_the_status_names_the_pipelines_one_endpoint_and_the_entry_service_serves_it():
    body = pipeline_body()
    body["metadata"]["uid"] = "u"
    pipeline = parse_pipeline(body)
    endpoint = compute_status(pipeline, {}, None, T0)["endpoint"]
    assert endpoint == f"http://tiny-thinker.{NAMESPACE}.svc:{naming.ENDPOINT_PORT}"
    service = children(body)[("Service", "tiny-thinker")]
    assert {"name": "endpoint", "port": naming.ENDPOINT_PORT, "targetPort": "endpoint",
            "protocol": "TCP"} in service["spec"]["ports"]
    (column,) = [c for c in crd.crd()["spec"]["versions"][0]["additionalPrinterColumns"] if c["name"] == "Endpoint"]
    assert column["jsonPath"] == ".status.endpoint"


def test_a_pipeline_of_another_shape_has_no_endpoint():
    body = pipeline_body(stages=[
        {"name": "thinker", "role": "ar", "kvTransfer": {"send": True}},
        {"name": "vocoder", "role": "generation", "inputs": ["thinker"]},
        {"name": "painter", "role": "generation", "inputs": ["thinker"]},  # two last stages
    ])
    body["metadata"]["uid"] = "u"
    assert "endpoint" not in compute_status(parse_pipeline(body), {}, None, T0)


def test_the_reconcile_writes_it_once(kube, reconciler):
    create_pipeline(kube, pipeline_body())
    reconciler.reconcile(NAMESPACE, "tiny")
    assert status(kube)["endpoint"] == f"http://tiny-thinker.{NAMESPACE}.svc:8080"
    assert reconciler.reconcile(NAMESPACE, "tiny").writes == 0

"""End to end: the running operator sees a real stage's transfers get stuck and recover.

- A real AR stage (`omni-stage`: vLLM, the omni scheduler and KV connector, tiny model) on
  127.0.0.1, whose receiving stage is not running at first: its transfers are handed off and
  never acknowledged (the deadline is 600 s), so they stay active.
- The real operator (kopf, handlers, reconciler, resync timer every 0.5 s) against the API
  emulator, whose Pod objects point at that stage's `http` port: the pipeline's status turns
  `TransfersHealthy=False/TransferStuck`, the `Transfers` column says `stuck 1`, one Warning
  event is posted; when the receiving stage comes up, the transfer is delivered and acked,
  and the pipeline recovers, with one Normal event.
- `omni-pipeline status` prints the same from the stages directly, and the Prometheus-backed
  reader gets the same verdict from a real Prometheus scraping the stages.
"""
from __future__ import annotations

import copy
import json

import pytest
import requests

from metrics_pages import create_pod, set_pod_status
from omni_operator.local import cli
from omni_operator.pipeline.crd import crd
from omni_operator.health.reader import PrometheusSource, TransferHealth
from omni_operator.pipeline.kinds import EVENT
from omni_operator.local.run import local_stage_configs
from omni_operator.local.status import forget_endpoints, record_endpoints
from omni_operator.pipeline.model import parse_pipeline
from omnip_support import NAMESPACE, OPERATOR_TOKEN, create_pipeline, status, wait_for
from procs import PrometheusServer, StageProcess, free_port

pytestmark = pytest.mark.engine

PIPELINE, MODEL, STUCK_SECONDS = "tiny", "tiny-qwen2", 2


def pipeline_body() -> dict:
    from omni_runtime.devtools.tiny_model import ensure_tiny_model

    return {
        "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": PIPELINE, "namespace": NAMESPACE},
        "spec": {
            "image": "omni-stage:test",
            "model": {"name": MODEL, "path": str(ensure_tiny_model())},
            "observability": {"alerts": {"stuckTransferSeconds": STUCK_SECONDS}},
            "stages": [
                {"name": "ar", "role": "ar", "gpus": 0,
                 "engineArgs": {"dtype": "float32", "max-model-len": 512,
                                "kv-cache-memory-bytes": 64 << 20, "enforce-eager": True},
                 # Far deadline: a transfer to the absent receiver stays active, never expires.
                 "kvTransfer": {"send": True, "criteria": {"type": "prefill_finished"}, "timeoutSeconds": 600}},
                {"name": "receiver", "role": "generation", "gpus": 0, "inputs": ["ar"]},
            ],
        },
    }


def parsed() -> object:
    body = copy.deepcopy(pipeline_body())
    body["metadata"].update(uid="u-1", generation=1)
    return parse_pipeline(body)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pipeline")
    ports = {name: {"http": free_port(), "kv": free_port()} for name in ("ar", "receiver")}
    configs = local_stage_configs(parsed(), ports)
    ar = StageProcess(configs["ar"], workdir, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    receiver = StageProcess(configs["receiver"], workdir)  # started by the test, later
    try:
        ar.start(timeout=300)
        yield {"ar": ar, "receiver": receiver}
    finally:
        ar.stop()
        receiver.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, stages):
    targets = [{"targets": [f"127.0.0.1:{proc.http_port}"],
                "labels": {"namespace": NAMESPACE, "pipeline": PIPELINE, "stage": name, "pod": f"{PIPELINE}-{name}-0"}}
               for name, proc in stages.items()]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "omni-stages", "honor_labels": True, "static_configs": targets}]}
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), json.dumps(config))
    yield server
    server.stop()


def transfers_condition(kube) -> dict:
    return next((c for c in status(kube).get("conditions", []) if c["type"] == "TransfersHealthy"), {})


def events(kube, reason: str) -> list[dict]:
    items = kube.request("list", "Event", "GET", EVENT.collection_path(NAMESPACE))["items"]
    return [e for e in items if e["reason"] == reason]


def printer_column(kube, name: str) -> str:
    """What `kubectl get omnip` shows in a column: the CRD's jsonPath on the object."""
    (version,) = [v for v in crd()["spec"]["versions"] if v.get("served")]
    (column,) = [c for c in version["additionalPrinterColumns"] if c["name"] == name]
    value = kube.get_pipeline(NAMESPACE, PIPELINE)
    for part in column["jsonPath"].strip(".").split("."):
        value = (value or {}).get(part)
    return value


def prometheus_verdict(url: str):
    health = TransferHealth(PrometheusSource(url, window_seconds=60))
    health.refresh([pipeline_body()])
    return health.verdict(parsed())


def test_stuck_transfer_is_seen_reported_once_and_recovers(stages, prometheus, kube, emulator, start_operator,
                                                           tmp_path, capsys):
    ar, receiver = stages["ar"], stages["receiver"]
    start_operator(resync_seconds=0.5)
    create_pipeline(kube, pipeline_body())
    create_pod(kube, PIPELINE, "ar", f"{PIPELINE}-ar-0", ar.http_port)
    # The receiving stage's pod exists but is not running its server yet (not ready).
    create_pod(kube, PIPELINE, "receiver", f"{PIPELINE}-receiver-0", receiver.http_port, ready=False)
    wait_for(lambda: printer_column(kube, "Transfers") == "ok", 60, "the first reading: ok")

    r = requests.post(f"{ar.url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Hello world", "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    wait_for(lambda: printer_column(kube, "Transfers") == "stuck 1", 60, "the Transfers column to say stuck")
    cond = transfers_condition(kube)
    assert (cond["status"], cond["reason"]) == ("False", "TransferStuck")
    assert "stage ar: 1 of 1 pods hold a transfer active" in cond["message"] and "toward receiver" in cond["message"]
    ar_status = status(kube)["stages"][0]
    assert ar_status["name"] == "ar" and ar_status["transfers"]["active"] == 1
    assert ar_status["transfers"]["oldestActiveSeconds"] >= STUCK_SECONDS
    (edge,) = ar_status["transfers"]["edges"]
    assert edge["toStage"] == "receiver" and edge["active"] == 1
    # The request has finished: its blocks are held, for the one edge that has not answered.
    assert ar_status["transfers"]["held"] == edge["held"] == 1
    assert ar_status["transfers"]["heldBlocks"] == edge["heldBlocks"] > 0
    # The event is posted after the status it reports is written: wait for it, not assume it.
    wait_for(lambda: events(kube, "TransferStuck"), 30, "the TransferStuck event")
    (warning,) = events(kube, "TransferStuck")
    assert warning["type"] == "Warning" and warning["involvedObject"]["name"] == PIPELINE
    # Several resync rounds later, still one event.
    lists = len([c for c in emulator.calls(OPERATOR_TOKEN) if c.resource == "pods"])
    wait_for(lambda: len([c for c in emulator.calls(OPERATOR_TOKEN) if c.resource == "pods"]) >= lists + 3, 30,
             "three more resync rounds")
    assert len(events(kube, "TransferStuck")) == 1

    # `omni-pipeline status`: the same verdict and table, read from the stages themselves.
    pipeline_file = tmp_path / "pipeline.yaml"
    pipeline_file.write_text(json.dumps(pipeline_body()))
    workdir = tmp_path / "up"
    workdir.mkdir()
    record_endpoints(parsed(), workdir, {"ar": ar.url, "receiver": receiver.url})
    try:
        capsys.readouterr()
        rc = cli.main(["status", str(pipeline_file), "--workdir", str(workdir), "--interval", "0"])
        table = capsys.readouterr().out
    finally:
        forget_endpoints(parsed(), workdir)
    assert rc == 1, table
    assert "transfers stuck 1 (TransferStuck" in table
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:] if line.strip()}
    assert rows["ar"][1:4] == ["1", "0", "1"]  # pods, pending, active
    # The edge toward the receiver: 1 active, 1 held with the stage's held blocks.
    assert rows["->"][1:5] == ["receiver", "1", "1", rows["ar"][5]], table

    # Prometheus-backed: the same verdict from a real Prometheus scraping the stages.
    verdict = wait_for(lambda: (lambda v: v if v.reason == "TransferStuck" else None)(prometheus_verdict(prometheus.url)),
                       30, "Prometheus to see the stuck transfer")
    assert verdict.summary == "stuck 1" and verdict.stages["ar"]["edges"][0]["active"] == 1

    # The receiving stage comes up: the transfer is delivered, acked, and the pipeline recovers.
    receiver.start(timeout=60)
    set_pod_status(kube, f"{PIPELINE}-receiver-0", ready=True)
    wait_for(lambda: printer_column(kube, "Transfers") == "ok", 60, "the Transfers column back to ok")
    assert transfers_condition(kube)["status"] == "True"
    wait_for(lambda: events(kube, "TransfersRecovered"), 30, "the TransfersRecovered event")
    (recovered,) = events(kube, "TransfersRecovered")
    assert recovered["type"] == "Normal" and "was TransferStuck" in recovered["message"]
    assert status(kube)["stages"][0]["transfers"]["active"] == 0
    assert status(kube)["stages"][1]["transfers"]["pods"] == 1  # the receiver is read too now
    verdict = wait_for(lambda: (lambda v: v if v.summary == "ok" else None)(prometheus_verdict(prometheus.url)),
                       30, "Prometheus to see the recovery")
    assert verdict.status == "True"

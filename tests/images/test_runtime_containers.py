"""The tiny pipeline as two containers of the runtime image, each started as the operator's
pod would start it: the pod spec and the stage ConfigMap the operator renders for
examples/tiny-pipeline.yaml (translated to `podman run` by pods.py), plus a read-only root
file system. A directory holding the tiny model stands in for the model cache PVC, mounted read-only.

A real OpenAI client (the `openai` SDK) talks to the AR container; every request's KV arrives
in the receiving container; SIGTERM drains the AR container, which exits 0 within its grace.
The AR stage's pod also holds the pipeline's endpoint, a second container reaching the stage
through the pod's own network: the one-container translation (pods.py) leaves it out; the
endpoint runs as a process in the e2e tests (tests/runtime/test_pipeline_chain.py,
test_local_up.py).
"""
from __future__ import annotations

import copy
import shutil

import openai
import pytest
import yaml
from imagesupport import ROOT, RUNTIME_IMAGE
from pods import PodContainer, podman, start_pod
from procs import http_get, metric_value, wait_until

from omni_operator.pipeline import naming
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.pipeline.render import render_children
from omni_runtime.devtools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

NAMESPACE = "team-a"
MODELS_CLAIM = "models"
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    # More than one KV block (128 tokens on the CPU backend), within the example's max-model-len.
    " ".join(["Kubernetes reconciles the desired state of every pipeline."] * 14),
]


def tiny_pipeline(model_dir_name: str) -> dict:
    """examples/tiny-pipeline.yaml with its model on a (read-only) model cache volume, as the
    example's comment says to run it on a cluster."""
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    body["metadata"]["namespace"] = NAMESPACE
    body["spec"]["model"]["path"] = f"/models/{model_dir_name}"
    body["spec"]["model"]["cache"] = {"pvc": {"claimName": MODELS_CLAIM, "readOnly": True}, "mountPath": "/models"}
    return body


def transfer_counts(ar: PodContainer) -> dict[str, float]:
    status, body, _ = http_get(ar.url("http") + "/metrics")
    assert status == 200
    text = body.decode()
    counts = {o: metric_value(text, "omni_kv_transfers_resolved_total", outcome=o)
              for o in ("acked", "failed", "expired", "cancelled")}
    for state in ("pending", "active", "held"):
        counts[state] = metric_value(text, "omni_kv_transfers", state=state)
    counts["held_blocks"] = metric_value(text, "omni_kv_held_blocks")
    return counts


def received(receiver: PodContainer) -> list[dict]:
    status, body, _ = http_get(receiver.url("http") + "/v1/kv")
    assert status == 200
    return yaml.safe_load(body)["payloads"]


@pytest.fixture(scope="module")
def pipeline(images, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("containers")
    # The model cache volume: a copy of the tiny model readable by the pods' user (the build
    # cache's directories are private to root).
    models = workdir / "models"
    shutil.copytree(ensure_tiny_model(), models / "tiny-qwen2")
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    body = tiny_pipeline("tiny-qwen2")
    assert body["spec"]["image"] == RUNTIME_IMAGE
    children = render_children(parse_pipeline(copy.deepcopy(body)), podmonitor_available=False)
    config_maps = {o["metadata"]["name"]: o["data"] for o in children if o["kind"] == "ConfigMap"}
    deployments = {o["metadata"]["name"]: o for o in children if o["kind"] == "Deployment"}
    started: dict[str, PodContainer] = {}

    revision = parse_pipeline(copy.deepcopy(body)).revision

    def start(stage: str, hosts: dict[str, str] | None = None) -> PodContainer:
        name = naming.revision_name("tiny", stage, revision)  # the revision's Deployment and ConfigMap
        started[stage] = start_pod(
            deployments[name]["spec"]["template"]["spec"], pod_name=f"{name}-0", namespace=NAMESPACE,
            config_maps=config_maps, claims={MODELS_CLAIM: models}, hosts=hosts,
            workdir=workdir, container_name="stage")
        return started[stage]

    def wait_healthy(container: PodContainer, timeout: float, what: str) -> None:
        def state():
            if not container.running():
                return "exited"
            return http_get(container.url("http") + "/health", timeout=2)[0] == 200 and "healthy"

        assert wait_until(state, timeout, what) == "healthy", f"{what}: it exited\n{container.logs()[-4000:]}"

    try:
        receiver = start("receiver")
        wait_healthy(receiver, 120, "the receiver container to be healthy")
        # The AR stage reaches the receiver by its revision's KV Service's DNS name, as in the cluster.
        service = naming.kv_endpoint("tiny", "receiver", NAMESPACE, revision).rsplit(":", 1)[0]
        ar = start("ar", hosts={service: receiver.ip()})
        wait_healthy(ar, 420, "the AR container (vLLM) to be healthy")
        yield {"ar": ar, "receiver": receiver,
               "deployments": {naming.stage_name("tiny", s): deployments[naming.revision_name("tiny", s, revision)]
                               for s in ("ar", "receiver")}}
    finally:
        for container in started.values():
            container.remove()


def test_containers_run_as_the_restricted_pod(pipeline):
    for stage in ("ar", "receiver"):
        container = pipeline[stage]
        info = container.inspect()
        assert info["Config"]["User"] == "1000:1000"
        assert info["HostConfig"]["ReadonlyRootfs"] is True
        assert info["HostConfig"]["CapDrop"], "no capabilities"
        mounts = {m["Destination"]: m for m in info["Mounts"]}
        assert not mounts[naming.CONFIG_DIR]["RW"] and not mounts["/models"]["RW"]
        assert "/tmp" in info["HostConfig"]["Tmpfs"]
        published = {p.split("/")[0] for p in info["HostConfig"]["PortBindings"]}
        assert published == {str(naming.HTTP_PORT), str(naming.KV_PORT)}, "only the http and kv ports"
        probe = podman("exec", container.name, "python3", "-c",
                       "import os, sys; print(os.getuid()); open('/opt/probe', 'w')", check=False)
        assert probe.stdout.strip() == "1000"
        assert "Read-only file system" in probe.stderr


def test_every_request_kv_arrives_in_the_receiving_container(pipeline):
    ar, receiver = pipeline["ar"], pipeline["receiver"]
    client = openai.OpenAI(base_url=ar.url("http") + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = {p["request_id"] for p in received(receiver)}
    prompt_tokens = []
    for prompt in PROMPTS:
        completion = client.completions.create(model="tiny-qwen2", prompt=prompt, max_tokens=4, temperature=0)
        assert completion.choices[0].text is not None
        prompt_tokens.append(completion.usage.prompt_tokens)
    arrived = wait_until(
        lambda: (new := [p for p in received(receiver) if p["request_id"] not in before])
        and len(new) >= len(PROMPTS) and new,
        60, "every request's KV in the receiving container")
    assert sorted(p["seq_len"] for p in arrived) == sorted(prompt_tokens)
    assert max(prompt_tokens) > 128, "one payload spans several KV blocks"


def test_ar_metrics_show_every_transfer_acked_and_nothing_held(pipeline):
    ar = pipeline["ar"]

    def settled():
        c = transfer_counts(ar)
        return c if c["acked"] >= len(PROMPTS) and c["pending"] + c["active"] + c["held"] == 0 else None

    counts = wait_until(settled, 60, "the AR container's transfers acked, none in flight")
    assert counts["held_blocks"] == 0
    assert counts["failed"] == counts["expired"] == counts["cancelled"] == 0


def test_sigterm_drains_the_ar_container_which_exits_0_within_its_grace(pipeline):
    """The receiver frozen (`podman pause`), a new request's transfer stays active; SIGTERM
    makes the AR stage wait for it (its grace: the transfer timeout), then stop vLLM and exit
    0 before the pod's terminationGracePeriodSeconds. Runs last: it stops the AR container."""
    ar, receiver = pipeline["ar"], pipeline["receiver"]
    client = openai.OpenAI(base_url=ar.url("http") + "/v1", api_key="unused", max_retries=0, timeout=120)
    podman("pause", receiver.name)
    try:
        client.completions.create(model="tiny-qwen2", prompt="a transfer nobody answers", max_tokens=2)
        wait_until(lambda: transfer_counts(ar)["active"] + transfer_counts(ar)["pending"] >= 1, 30,
                   "a transfer in flight")
        code, seconds = ar.terminate()
    finally:
        podman("unpause", receiver.name, check=False)
    grace = pipeline["deployments"]["tiny-ar"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    log = ar.logs()
    assert code == 0, log[-4000:]
    assert seconds < grace, (seconds, grace)
    assert "stopping vLLM: it drains requests and KV transfers" in log

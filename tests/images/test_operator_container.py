"""The operator image as containers: `omni-pipeline validate` of every example, and the
operator started from the chart's own Deployment (its args, user, read-only root file system,
/tmp volume, memory limit) against the Kubernetes API emulator on 127.0.0.1, reconciling the
tiny OmniPipeline into its children.

The container shares the machine's network (the emulator listens on 127.0.0.1 only, and the
chart's ports are set free ones); a kubeconfig mounted read-only stands in for the service
account token the kubelet would mount (the emulator speaks plain HTTP, which in-cluster
configuration does not).
"""
from __future__ import annotations

import copy

import json
from pathlib import Path

import pytest
import yaml
from imagesupport import OPERATOR_IMAGE, ROOT, RUNTIME_IMAGE, chart_operator_deployment
from k8s_emulator import EmulatorThread
from omnip_support import NAMESPACE, OPERATOR_TOKEN, create_pipeline, make_kube, wait_for
from pods import PodContainer, podman, start_pod
from procs import free_port, http_get, wait_until

from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CONFIGMAP, DEPLOYMENT, SERVICE
from omni_operator.pipeline.model import parse_pipeline

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBECONFIG_DIR = "/var/run/omni-test"


def readable_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
    return path


def validate_in_image(files: dict[str, Path]) -> tuple[int, str]:
    """`omni-pipeline validate` in the operator image, as the chart's user, read-only."""
    mounts = [arg for name, path in files.items() for arg in ("--volume", f"{path}:/pipelines/{name}:ro")]
    result = podman("run", "--rm", "--read-only", "--user", "10001:10001", *mounts,
                    "--entrypoint", "omni-pipeline", OPERATOR_IMAGE,
                    "validate", *[f"/pipelines/{name}" for name in files], check=False)
    return result.returncode, result.stdout + result.stderr


def test_every_example_validates_in_the_operator_image(images):
    code, out = validate_in_image({p.name: p for p in EXAMPLES})
    assert code == 0, out
    for example in EXAMPLES:
        name = yaml.safe_load(example.read_text())["metadata"]["name"]
        (line,) = [line for line in out.splitlines() if line.startswith(f"/pipelines/{example.name}:")]
        assert name in line and "valid (" in line, out


def test_an_invalid_pipeline_fails_validation_in_the_image_naming_the_field(images, tmp_path):
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    del body["spec"]["image"]
    bad = readable_dir(tmp_path / "in") / "bad.yaml"
    bad.write_text(yaml.safe_dump(body))
    bad.chmod(0o644)
    code, out = validate_in_image({"bad.yaml": bad})
    assert code != 0
    (line,) = [line for line in out.splitlines() if line.startswith("/pipelines/bad.yaml:")]
    assert "tiny" in line and "spec: 'image' is a required property" in line, out


@pytest.fixture
def operator_container(images, tmp_path):
    """The emulator on 127.0.0.1, and the operator container from the chart's Deployment."""
    with EmulatorThread() as emulator:
        kube = make_kube(emulator.url)
        kube.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        ports = {"liveness": free_port(), "metrics": free_port()}
        deployment = chart_operator_deployment({
            "watch": {"namespaces": [NAMESPACE]},
            "liveness": {"port": ports["liveness"]},
            "metrics": {"port": ports["metrics"]},
            "extraEnv": [{"name": "KUBECONFIG", "value": f"{KUBECONFIG_DIR}/config"}],
        })
        pod = deployment["spec"]["template"]["spec"]
        # The API credentials, where the kubelet would mount the service account's.
        pod["volumes"].append({"name": "api-credentials", "configMap": {"name": "api-credentials"}})
        pod["containers"][0]["volumeMounts"].append(
            {"name": "api-credentials", "mountPath": KUBECONFIG_DIR, "readOnly": True})
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": emulator.url}}],
            "users": [{"name": "omni-operator", "user": {"token": OPERATOR_TOKEN}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "omni-operator"}}],
        }
        container = start_pod(pod, pod_name="omni-pipeline-operator-0", namespace="omni-system",
                              config_maps={"api-credentials": {"config": json.dumps(kubeconfig)}},
                              host_network=True, workdir=readable_dir(tmp_path / "pod"))
        try:
            yield container, emulator, kube
        finally:
            container.remove()
            kube.close()


def test_operator_container_reconciles_a_pipeline_into_its_children(operator_container):
    container, emulator, kube = operator_container

    def live():
        if not container.running():
            return "exited"
        return http_get(container.url("healthz") + "/healthz", timeout=2)[0] == 200 and "live"

    state = wait_until(live, 60, "the operator container's /healthz")
    assert state == "live", container.logs()[-4000:]
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    body["metadata"]["namespace"] = NAMESPACE
    create_pipeline(kube, body)

    stages = [s["name"] for s in body["spec"]["stages"]]
    revision = parse_pipeline(copy.deepcopy(body)).revision
    names = [naming.revision_name("tiny", s, revision) for s in stages]  # the revision's workloads
    deployments = wait_for(lambda: all(kube.get(DEPLOYMENT, NAMESPACE, n) for n in names)
                           and [kube.get(DEPLOYMENT, NAMESPACE, n) for n in names], 60,
                           "the stage Deployments, created by the operator container")
    for deployment in deployments:
        stage_container, *endpoint = deployment["spec"]["template"]["spec"]["containers"]
        assert stage_container["image"] == RUNTIME_IMAGE
        assert stage_container["command"] == ["omni-stage", "--config", naming.CONFIG_PATH]
        for beside in endpoint:  # the pipeline's endpoint, beside its entry stage
            assert beside["name"] == "endpoint" and beside["image"] == RUNTIME_IMAGE
    for stage, name in zip(stages, names):
        assert kube.get(SERVICE, NAMESPACE, naming.stage_name("tiny", stage))
        config_map = kube.get(CONFIGMAP, NAMESPACE, name)
        assert yaml.safe_load(config_map["data"][naming.CONFIG_KEY])["pipeline"] == "tiny"
    status = wait_for(lambda: (kube.get_pipeline(NAMESPACE, "tiny") or {}).get("status", {}).get("observedGeneration"),
                      30, "the pipeline's status")
    assert status == 1
    writes = {(c.verb, c.resource) for c in emulator.calls(OPERATOR_TOKEN) if c.verb in ("create", "patch")}
    assert ("create", "deployments") in writes, "the operator's own credentials made the children"
    metrics = http_get(container.url("metrics") + "/metrics")
    assert metrics[0] == 200

    code, seconds = container.terminate()
    assert code == 0, container.logs()[-4000:]
    assert seconds < container.grace_seconds

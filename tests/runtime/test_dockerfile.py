"""The GPU build of the runtime image cannot be made here (its base, vLLM's CUDA image, is not
reachable and would need a GPU to run): check statically what the container tests of the CPU
build (tests/images) cannot. The rest (user, entrypoint, command, caches, ports, the
project's install) is the same Dockerfile, built and run there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Continuation lines joined: one instruction a line.
DOCKERFILE = re.sub(r"\\\n", " ", (ROOT / "omni_runtime" / "Dockerfile").read_text())


def _directives(name: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", DOCKERFILE, re.M)]


def _tested_vllm() -> str:
    return re.search(r"^VLLM_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_the_default_base_is_the_vllm_openai_server_of_the_tested_version():
    tested = _tested_vllm()
    args = dict(a.split("=", 1) for a in _directives("ARG") if "=" in a)
    assert args["VLLM_VERSION"] == tested
    assert args["BASE"] == "vllm/vllm-openai:v${VLLM_VERSION}"
    assert args["TARGET_DEVICE"] == "cuda", "a plain `docker build` makes the GPU image"
    assert _directives("FROM") == ["${BASE}"]
    import vllm

    assert vllm.__version__.split(".")[:2] == tested.split(".")[:2], "the venv's vLLM is the tested one"


def test_the_gpu_build_keeps_the_bases_vllm_and_checks_its_version():
    """On `cuda` nothing is installed over the base's vLLM and torch (the project does not
    depend on vllm, so its pip install leaves them alone), and the build fails unless the
    base's vLLM is the tested version."""
    import tomllib

    (install,) = [r for r in _directives("RUN") if "case \"$TARGET_DEVICE\"" in r]
    cuda_branch = re.search(r"cuda\)\s*(.*?);;", install).group(1).strip()
    assert cuda_branch == "", "the GPU build installs nothing over vLLM's image"
    assert "vllm.__version__" in install and "${VLLM_VERSION}" in install
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if re.match(r"(vllm|torch)\b", d)]

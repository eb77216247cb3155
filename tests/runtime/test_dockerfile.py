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


def test_both_builds_carry_nixl_and_the_cpu_build_keeps_its_torch():
    """The KV data plane needs NIXL: the build fails unless it loads (GPU: vLLM's image's own),
    and the CPU build installs it without its dependencies, which would pull a CUDA torch over
    the CPU one, at the version the Makefile's set-up pins."""
    (install,) = [r for r in _directives("RUN") if "case \"$TARGET_DEVICE\"" in r]
    cpu_branch = re.search(r"cpu\)\s*(.*?);;", install).group(1)
    assert re.search(r'pip install -q --no-deps "nixl==\$\{NIXL_VERSION\}" '
                     r'"nixl-cu12==\$\{NIXL_VERSION\}"', cpu_branch)
    assert "from nixl._api import nixl_agent" in install.split("esac", 1)[1], \
        "checked after the case: in both builds"
    args = dict(a.split("=", 1) for a in _directives("ARG") if "=" in a)
    pinned = re.search(r"^NIXL_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert args["NIXL_VERSION"] == pinned

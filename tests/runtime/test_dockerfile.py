"""The runtime image cannot be built here (no container engine): check that its Dockerfile
agrees with the project — base image of the tested vLLM version, the package it installs,
the entrypoint the operator runs, the user the operator's pods run as."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "omni_runtime" / "Dockerfile").read_text()


def _directives(name: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", DOCKERFILE, re.M)]


def test_base_image_is_the_vllm_openai_server_of_the_tested_version():
    tested = re.search(r"^VLLM_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    (arg,) = [a for a in _directives("ARG") if a.startswith("VLLM_VERSION=")]
    assert arg == f"VLLM_VERSION={tested}"
    assert _directives("FROM") == ["vllm/vllm-openai:v${VLLM_VERSION}"]
    import vllm

    assert vllm.__version__.split(".")[:2] == tested.split(".")[:2], "the venv's vLLM is the tested one"


def test_it_installs_this_project_and_its_entrypoint_is_omni_stage():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["omni-stage"] == "omni_runtime.stages.main:main"
    assert _directives("ENTRYPOINT") == ['["omni-stage"]']
    assert any("pip install --no-cache-dir ." in r for r in _directives("RUN"))
    copied = " ".join(_directives("COPY"))
    for path in ("pyproject.toml", "omni_runtime", "operator/omni_operator"):
        assert path in copied and (ROOT / path).exists()
    assert "vllm" not in " ".join(project["dependencies"]), "the image's own vLLM must stay"


def test_it_runs_as_the_user_the_operator_pods_use():
    from omni_operator.render import RUN_AS_USER

    assert _directives("USER") == [str(RUN_AS_USER)]
    assert "--uid 1000" in DOCKERFILE and RUN_AS_USER == 1000


def test_the_operator_runs_the_image_with_the_default_config_path():
    from omni_operator import naming

    assert _directives("CMD") == [f'["--config", "{naming.CONFIG_PATH}"]']

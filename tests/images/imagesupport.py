"""The image names `make images` gives and how to read an image's configuration (a module of
its own: test files must not import conftest)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import helm_python as helm
import yaml

from pods import podman

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "omni-pipeline"


def makefile_variable(name: str) -> str:
    """A variable of the Makefile as make expands it (`make print-NAME`)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", f"print-{name}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.strip()


RUNTIME_IMAGE = makefile_variable("RUNTIME_IMAGE")
OPERATOR_IMAGE = makefile_variable("OPERATOR_IMAGE")


def image_config(image: str) -> dict:
    return json.loads(podman("image", "inspect", image).stdout)[0]


def chart_objects(values: dict | None = None) -> list[dict]:
    """The objects the chart renders with these values (the real Helm engine)."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name="omni-pipeline", namespace="omni-system", is_install=True)
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def chart_operator_deployment(values: dict | None = None) -> dict:
    (deployment,) = [o for o in chart_objects(values) if o["kind"] == "Deployment"]
    return deployment

"""The image names `make images` gives and how to read an image's configuration (a module of
its own: test files must not import conftest)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from pods import podman

ROOT = Path(__file__).resolve().parents[2]


def makefile_variable(name: str) -> str:
    """A variable of the Makefile as make expands it (`make print-NAME`)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", f"print-{name}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.strip()


RUNTIME_IMAGE = makefile_variable("RUNTIME_IMAGE")
OPERATOR_IMAGE = makefile_variable("OPERATOR_IMAGE")


def image_config(image: str) -> dict:
    return json.loads(podman("image", "inspect", image).stdout)[0]

"""The images as containers: `make test` builds them first (`make images`), with podman and
the project's own containers.conf/storage.conf; these tests run them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Helpers next to these tests (pods, imagesupport) and the operator tests' API emulator
# (k8s_emulator, omnip_support) import by name.
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "operator"))

from imagesupport import OPERATOR_IMAGE, RUNTIME_IMAGE  # noqa: E402
from pods import podman, podman_available  # noqa: E402


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """The two images, built by `make images` (which `make test` runs first)."""
    if not podman_available():
        pytest.fail("podman not found: `make images` (or `make test`) installs it", pytrace=False)
    missing = [i for i in (RUNTIME_IMAGE, OPERATOR_IMAGE) if podman("image", "exists", i, check=False).returncode]
    if missing:
        pytest.fail(f"images not built: {missing}; run `make images` (`make test` does)", pytrace=False)
    return {"runtime": RUNTIME_IMAGE, "operator": OPERATOR_IMAGE}

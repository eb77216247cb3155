"""Rendering charts/omni-pipeline with the real Helm engine (helm-python-sdk, Helm's Go SDK)."""
from __future__ import annotations

from typing import Any

import helm_python as helm
import yaml

from .conftest import CHART

RELEASE, NAMESPACE = "omni-pipeline", "omni-system"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart's templates produce (CRDs are not templates: see crds())."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE,
                                 is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def crds() -> list[dict[str, str]]:
    with helm.Chart.load(CHART) as chart:
        return chart.crds


def by_kind(objects, kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects, kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, (kind, [o["metadata"]["name"] for o in found])
    return found[0]

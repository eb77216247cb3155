"""The OmniPipeline CRD as data: its file, its openAPIV3Schema and schema defaulting.

The CRD YAML is the single source of truth for defaults; the operator applies them itself
(as the API server would) so that it behaves the same whether or not the server defaulted.
"""
from __future__ import annotations

import copy
import functools
from importlib import resources
from typing import Any

import yaml

CRD_FILE = "omnipipelines.omnipipeline.dev.yaml"


def crd_text() -> str:
    return resources.files("omni_operator").joinpath("crd", CRD_FILE).read_text(encoding="utf-8")


@functools.cache
def _crd() -> dict[str, Any]:
    return yaml.safe_load(crd_text())


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest (a fresh copy)."""
    return copy.deepcopy(_crd())


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the served version (a fresh copy)."""
    (version,) = [v for v in _crd()["spec"]["versions"] if v.get("storage")]
    return copy.deepcopy(version["schema"]["openAPIV3Schema"])


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Return a copy of value with the schema's defaults filled in, as the API server does.

    Defaults apply to absent properties of objects that are present; a defaulted object is
    itself defaulted further (so `kvTransfer: {}` gains `send: false`).
    """
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in schema.get("properties", {}):
                    _default_in_place(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(schema["items"], item)

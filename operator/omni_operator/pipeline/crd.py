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
#: The second CRD the operator needs: an autoscaled stage's scale target (OmniStageScaler).
SCALER_CRD_FILE = "omnistagescalers.omnipipeline.dev.yaml"


def crd_text(file: str = CRD_FILE) -> str:
    return resources.files("omni_operator").joinpath("crd", file).read_text(encoding="utf-8")


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


def server_view(schema: dict[str, Any], value: Any) -> Any:
    """A copy of value as the API server holds it before validating it: nulls it drops
    pruned, then the schema's defaults filled in (apiextensions-apiserver's
    PruneNonNullableNullsWithoutDefaults and Default, in that order)."""
    value = copy.deepcopy(value)
    _prune_nulls(schema, value)
    _default_in_place(schema, value)
    return value


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Return a copy of value with the schema's defaults filled in, as the API server does.

    Defaults apply to absent properties of objects that are present, and to a null where the
    schema does not allow null; a defaulted object is itself defaulted further (so
    `kvTransfer: {}` gains `send: false`).
    """
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _field_schema(schema: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    if schema is None:
        return None
    properties = schema.get("properties") or {}
    if name in properties:
        return properties[name]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _prune_nulls(schema: dict[str, Any] | None, value: Any) -> None:
    """Remove the nulls of fields whose schema neither allows null nor has a default (the
    server drops them: `replicas: null` is an absent `replicas`)."""
    if isinstance(value, dict):
        for name in list(value):
            sub = _field_schema(schema, name)
            if value[name] is None and sub is not None and not sub.get("nullable") and "default" not in sub:
                del value[name]
            else:
                _prune_nulls(sub, value[name])
    elif isinstance(value, list):
        items = schema.get("items") if schema is not None else None
        for item in value:
            _prune_nulls(items if isinstance(items, dict) else None, item)


def _is_non_nullable_null(value: Any, schema: dict[str, Any] | None) -> bool:
    return value is None and schema is not None and not schema.get("nullable")


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        for name, sub in properties.items():
            if "default" in sub and (name not in value or _is_non_nullable_null(value[name], sub)):
                value[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for name in value:
            if name in properties:
                _default_in_place(properties[name], value[name])
            elif isinstance(extra, dict):
                if _is_non_nullable_null(value[name], extra) and "default" in extra:
                    value[name] = copy.deepcopy(extra["default"])
                _default_in_place(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        for i, item in enumerate(value):
            if _is_non_nullable_null(item, items) and "default" in items:
                value[i] = copy.deepcopy(items["default"])
            _default_in_place(items, value[i])

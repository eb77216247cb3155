"""Kubernetes' own schemas, for the fields a pipeline passes through to its pods and for every
object the operator renders.

The schemas are the upstream OpenAPI definitions of the CRD's minimum server version, as
bundled (converted to JSON Schema, unknown fields refused) by the kubernetes-validate
package; nothing here restates a Kubernetes type by hand. A value that passes is one the API
server's schema would take: its type, its required fields, no unknown field, and an integer
within its format.
"""
from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import Any, Iterable

import jsonschema
import referencing
import referencing.jsonschema

from .schema_errors import describe

MIN_KUBERNETES = "1.30"  # the CRD's minimum server version (charts/omni-pipeline/README.md)
_SCHEMA_DIR = f"kubernetes-json-schema/v{MIN_KUBERNETES}.0-local-strict"
_DEFS_URI = "https://kubernetes.io/api/_definitions.json"
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}

# Where each pass-through field of a stage lands in the pod, and its Kubernetes type.
TOLERATION = "io.k8s.api.core.v1.Toleration"
ENV_VAR = "io.k8s.api.core.v1.EnvVar"
RESOURCES = "io.k8s.api.core.v1.ResourceRequirements"
POD_SPEC = "io.k8s.api.core.v1.PodSpec"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def _read(name: str) -> dict[str, Any]:
    return json.loads(resources.files("kubernetes_validate").joinpath(f"{_SCHEMA_DIR}/{name}").read_text(encoding="utf-8"))


@functools.cache
def _registry() -> referencing.Registry:
    definitions = _read("_definitions.json")
    _bound_integers(definitions)
    return referencing.Registry().with_resource(_DEFS_URI, referencing.Resource.from_contents(definitions))


def _bound_integers(node: Any) -> None:
    """An int32 field holds no more than 32 bits: the server's decoder refuses a larger value,
    which the JSON Schema form leaves to `format` (not asserted by JSON Schema)."""
    if isinstance(node, dict):
        types = node.get("type")
        if isinstance(node.get("format"), str) and node["format"] in _INT_RANGES and (types == "integer" or (isinstance(types, list) and "integer" in types)):
            node.setdefault("minimum", _INT_RANGES[node["format"]][0])
            node.setdefault("maximum", _INT_RANGES[node["format"]][1])
        for value in node.values():
            _bound_integers(value)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value)


def definition(name: str) -> dict[str, Any]:
    """One upstream definition (e.g. io.k8s.api.core.v1.Toleration), as JSON Schema."""
    return _registry().contents(_DEFS_URI)["$defs"][name]


@functools.cache
def _definition_validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"{_DEFS_URI}#/$defs/{name}"}, registry=_registry())


@functools.cache
def _kind_validator(kind: str, api_version: str) -> jsonschema.Draft202012Validator | None:
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = _read(f"{kind.lower()}-{group_version}.json")
    except FileNotFoundError:
        return None  # not a built-in kind (a PodMonitor): its CRD is not known here
    # The kind schemas reference /api/_definitions.json relative to their own $id.
    schema = json.loads(json.dumps(schema).replace('"/api/_definitions.json#', f'"{_DEFS_URI}#'))
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def check_value(type_name: str, value: Any, field: str) -> list[tuple[str, str]]:
    """(field, message) for each way value is not a valid `type_name` (empty: valid)."""
    return _errors(_definition_validator(type_name), value, field)


def check_pod_spec_field(name: str, value: Any, field: str) -> list[tuple[str, str]]:
    """A single PodSpec field (nodeSelector, ...) against PodSpec's schema for it."""
    validator = jsonschema.Draft202012Validator(definition(POD_SPEC)["properties"][name], registry=_registry())
    return _errors(validator, value, field)


def check_object(obj: dict[str, Any]) -> list[tuple[str, str]] | None:
    """A whole rendered object against the schema of its kind; None when the kind is not built in."""
    validator = _kind_validator(str(obj.get("kind")), str(obj.get("apiVersion")))
    if validator is None:
        return None
    return _errors(validator, obj, "")


def _errors(validator: jsonschema.Draft202012Validator, value: Any, field: str) -> list[tuple[str, str]]:
    out = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(map(str, e.absolute_path))):
        out.append((_join(field, error.absolute_path), _message(error)))
    return list(dict.fromkeys(out))


def _join(field: str, parts: Iterable[Any]) -> str:
    out = field
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.match(r"^[A-Za-z_][A-Za-z0-9_-]*$", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{str(part)!r}]"
    return out


def _message(error: jsonschema.ValidationError) -> str:
    text = describe(error)
    if error.validator == "additionalProperties" and isinstance(error.schema, dict):
        allowed = sorted((error.schema.get("properties") or {}).keys())
        if allowed and len(allowed) <= 20:
            text += f"; the Kubernetes fields here are {', '.join(allowed)}"
    elif error.validator == "type":
        text += " (Kubernetes' schema)"
    return text

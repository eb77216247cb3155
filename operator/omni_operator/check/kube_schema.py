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

from .gopattern import SchemaValidator
from .schema_errors import describe, key_path

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
    return SchemaValidator({"$ref": f"{_DEFS_URI}#/$defs/{name}"}, registry=_registry())


@functools.cache
def _kind_validator(kind: str, api_version: str) -> jsonschema.Draft202012Validator | None:
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = _read(f"{kind.lower()}-{group_version}.json")
    except FileNotFoundError:
        return None  # not a built-in kind (a PodMonitor): its CRD is not known here
    # The kind schemas reference /api/_definitions.json relative to their own $id.
    schema = json.loads(json.dumps(schema).replace('"/api/_definitions.json#', f'"{_DEFS_URI}#'))
    return SchemaValidator(schema, registry=_registry())


def check_value(type_name: str, value: Any, field: str) -> list[tuple[str, str]]:
    """(field, message) for each way value is not a valid `type_name` (empty: valid)."""
    return _errors(_definition_validator(type_name), value, field)


def check_pod_spec_field(name: str, value: Any, field: str) -> list[tuple[str, str]]:
    """A single PodSpec field (nodeSelector, ...) against PodSpec's schema for it."""
    validator = SchemaValidator(definition(POD_SPEC)["properties"][name], registry=_registry())
    return _errors(validator, value, field)


def check_object(obj: dict[str, Any]) -> list[tuple[str, str]] | None:
    """A whole rendered object against the schema of its kind; None when the kind is not built in.

    Rendered objects of one shape (the same fields, numbers and booleans, strings that differ
    only where the schema does not look at their content: names, labels, config text) are
    valid or not alike, so a valid shape is remembered; an invalid one is checked afresh
    each time, for messages that quote its own values."""
    kind, api_version = str(obj.get("kind")), str(obj.get("apiVersion"))
    validator = _kind_validator(kind, api_version)
    if validator is None:
        return None
    constrained = _content_constrained(kind, api_version)
    key = None
    if constrained is not None:
        key = (kind, api_version, json.dumps(_shape(obj, "", constrained), sort_keys=True))
        if key in _VALID_SHAPES:
            return []
    errors = _errors(validator, obj, "")
    if not errors and key is not None:
        if len(_VALID_SHAPES) > 4096:
            _VALID_SHAPES.clear()
        _VALID_SHAPES.add(key)
    return errors


_VALID_SHAPES: set[tuple[str, str, str]] = set()
#: Keywords that look only at a value's structure, never at a string's content (formats are
#: not asserted: jsonschema checks them only with a format checker, which is not used).
_STRUCTURAL = {"type", "properties", "additionalProperties", "items", "required", "$ref", "description", "format",
               "default", "minimum", "maximum", "minItems", "maxItems", "minProperties", "maxProperties",
               "oneOf", "anyOf", "allOf", "title", "$schema", "$id"}


@functools.cache
def _content_constrained(kind: str, api_version: str) -> frozenset[str] | None:
    """The property names under which the kind's schema looks at a string's content (enum,
    pattern, lengths, uniqueness, anything not in _STRUCTURAL); None when some map's values
    are so constrained (then no shape is remembered for the kind)."""
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = json.loads(json.dumps(_read(f"{kind.lower()}-{group_version}.json"))
                        .replace('"/api/_definitions.json#', f'"{_DEFS_URI}#'))
    definitions = _registry().contents(_DEFS_URI)["$defs"]
    found: set[str] = set()
    seen: set[tuple[int, str]] = set()

    def walk(node: Any, prop: str) -> None:
        while isinstance(node, dict) and "$ref" in node:
            node = definitions[node["$ref"].rsplit("/", 1)[1]]
        if not isinstance(node, dict) or (id(node), prop) in seen:
            return
        seen.add((id(node), prop))
        if any(k not in _STRUCTURAL and not k.startswith("x-kubernetes-") for k in node):
            found.add(prop)
        for branch in [*node.get("oneOf", []), *node.get("anyOf", []), *node.get("allOf", [])]:
            walk(branch, prop)
        for name, sub in (node.get("properties") or {}).items():
            walk(sub, name)
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], "*")
        if isinstance(node.get("items"), dict):
            walk(node["items"], prop)

    walk(schema, "")
    return None if "*" in found or "" in found else frozenset(found)


def _shape(value: Any, prop: str, constrained: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v, k, constrained) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v, prop, constrained) for v in value]
    if isinstance(value, str) and prop not in constrained:
        return ""
    return value


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
        else:
            out = key_path(out, str(part))
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

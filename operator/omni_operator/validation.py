"""Validate an object against a CRD's openAPIV3Schema as the API server would.

Used by ``omni-pipeline validate`` (and the tests) to check a file before it is applied.

JSON Schema (jsonschema) does the structural part once the Kubernetes extensions are
translated: x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields, nullable,
strict unknown-field rejection, list-type set/map. cel-python evaluates the
x-kubernetes-validations rules at each node. Defaults are applied first, as the server does.
"""
from __future__ import annotations

from typing import Any

import celpy
import jsonschema

from omni_operator.crd import apply_defaults, openapi_schema

_PASSTHROUGH = ("type", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
                "minItems", "maxItems", "required", "description", "default", "minProperties", "maxProperties")


def to_jsonschema(node: dict[str, Any], *, root: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {k: node[k] for k in _PASSTHROUGH if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: to_jsonschema(v) for k, v in node["properties"].items()}
    if "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
        out["additionalProperties"] = to_jsonschema(node["additionalProperties"])
    elif node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields") and "properties" in node:
        out["additionalProperties"] = False  # kubectl's default strict field validation
    if "items" in node:
        out["items"] = to_jsonschema(node["items"])
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if root:  # metadata is ObjectMeta, validated by the server itself
        out.setdefault("properties", {})["metadata"] = {"type": "object"}
    return out


_env = celpy.Environment()
_programs: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _programs:
        _programs[rule] = _env.program(_env.compile(rule))
    return _programs[rule]


def _cel_errors(node: dict[str, Any], value: Any, path: str) -> list[str]:
    errors: list[str] = []
    if value is None:
        return errors
    for rule in node.get("x-kubernetes-validations", []):
        result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    if node.get("x-kubernetes-list-type") == "map" and isinstance(value, list):
        keys = node.get("x-kubernetes-list-map-keys", [])
        seen = set()
        for i, item in enumerate(value):
            key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else None
            if key in seen:
                errors.append(f"{path}[{i}]: Duplicate value: {dict(zip(keys, key))}")
            seen.add(key)
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value:
                errors += _cel_errors(sub, value[name], f"{path}.{name}" if path else name)
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(node["items"], item, f"{path}[{i}]")
    return errors


def _path(parts) -> str:
    """spec.stages[1].role: the field paths the operator's own errors use."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Every error the API server would report for obj (empty: accepted)."""
    obj = apply_defaults(schema, obj)
    validator = jsonschema.Draft202012Validator(to_jsonschema(schema, root=True))
    errors = [f"{_path(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    if errors:
        return errors  # the server stops at structural errors before running CEL
    return _cel_errors(schema, obj, "")


def validate_resource(obj: dict[str, Any]) -> list[str]:
    """Every error the API server would report for an OmniPipeline (schema and CEL rules)."""
    return validate(openapi_schema(), obj)

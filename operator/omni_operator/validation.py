"""Validate an object against a CRD's openAPIV3Schema as the API server would.

Used by the shared admission check (`admission.py`: `omni-pipeline validate` and the
operator before it renders) and by the tests.

JSON Schema (jsonschema) does the structural part once the Kubernetes extensions are
translated: x-kubernetes-int-or-string, x-kubernetes-preserve-unknown-fields, nullable,
strict unknown-field rejection, list-type set/map, and the integer formats (an int32 field
holds no more than 32 bits). cel-python evaluates the x-kubernetes-validations rules at
each node, with the Kubernetes quantity library (`isQuantity`, `quantity`, and the
Quantity member functions) that the CRD's minimum server version has. Defaults are applied
first, as the server does.

Nothing here raises on any JSON-like input: a rule that cannot be evaluated is reported as
failed, naming its field, as the API server reports it.
"""
from __future__ import annotations

import functools
import re
from decimal import Decimal
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from omni_operator.crd import apply_defaults, openapi_schema
from omni_operator.quantities import parse_quantity

_PASSTHROUGH = ("type", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
                "minItems", "maxItems", "required", "description", "default", "minProperties", "maxProperties")
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
MAX_MESSAGE = 300  # a message quotes the bad value; a huge value is cut, not printed whole

# ObjectMeta as the server checks it before any CRD rule: a name is required (kubectl apply
# needs one), labels and annotations are maps of strings.
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "namespace": {"type": "string", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def to_jsonschema(node: dict[str, Any], *, root: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {k: node[k] for k in _PASSTHROUGH if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("type") == "integer" and node.get("format") in INT_RANGES:
        low, high = INT_RANGES[node["format"]]
        out["minimum"] = max(out.get("minimum", low), low)
        out["maximum"] = min(out.get("maximum", high), high)
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
        out.setdefault("properties", {})["metadata"] = _METADATA
        out["required"] = sorted(set(out.get("required", [])) | {"metadata"})
    return out


# -- the Kubernetes quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go) -------------


class Quantity:
    """A CEL Quantity value: an exact decimal."""

    def __init__(self, value: Decimal):
        self.value = value


class CELQuantityError(ValueError):
    pass


def _quantity(text: Any) -> Quantity:
    try:
        return Quantity(parse_quantity(str(text)) if isinstance(text, celtypes.StringType) else parse_quantity(text))
    except ValueError as exc:
        raise CELQuantityError(f"quantities must match the regular expression: {exc}") from None


def _is_quantity(text: Any) -> celtypes.BoolType:
    if not isinstance(text, str):
        return celtypes.BoolType(False)
    try:
        parse_quantity(str(text))
    except ValueError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _cmp(a: Quantity, b: Quantity) -> int:
    return (a.value > b.value) - (a.value < b.value)


def _as_integer(q: Quantity) -> celtypes.IntType:
    if q.value != q.value.to_integral_value() or abs(q.value) > 2**63 - 1:
        raise CELQuantityError("cannot convert value to integer")
    return celtypes.IntType(int(q.value))


QUANTITY_FUNCTIONS = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "sign": lambda q: celtypes.IntType((q.value > 0) - (q.value < 0)),
    "compareTo": lambda a, b: celtypes.IntType(_cmp(a, b)),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_cmp(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_cmp(a, b) < 0),
    "isInteger": lambda q: celtypes.BoolType(q.value == q.value.to_integral_value() and abs(q.value) <= 2**63 - 1),
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(q.value)),
}

_env = celpy.Environment()


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    return _env.program(_env.compile(rule), functions=QUANTITY_FUNCTIONS)


def to_cel(value: Any) -> Any:
    """A JSON value as CEL sees it in the API server: an integer beyond int64 arrives as a
    double (the server's JSON decoder makes a float64 of it), never an overflow."""
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value) if -(2**63) <= value < 2**63 else celtypes.DoubleType(float(value))
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if value is None:
        return None
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v) for v in value])
    if isinstance(value, dict):
        return celtypes.MapType({celtypes.StringType(str(k)): to_cel(v) for k, v in value.items()})
    return celtypes.StringType(str(value))


def _rule_holds(rule: str, value: Any) -> tuple[bool, str | None]:
    """(holds, why it could not be evaluated)."""
    try:
        result = _program(rule).evaluate({"self": to_cel(value)})
    except Exception as exc:  # noqa: BLE001 - any evaluation failure is the rule failing
        return False, _short(str(exc.args[0] if getattr(exc, "args", None) else exc))
    if isinstance(result, Exception):
        return False, _short(str(result.args[0] if result.args else result))
    return bool(result), None


def _with_field_path(path: str, field_path: str | None) -> str:
    if not field_path:
        return path
    return path + field_path if path else field_path.lstrip(".")


def _cel_errors(node: dict[str, Any], value: Any, path: str) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if value is None:
        return errors
    for rule in node.get("x-kubernetes-validations", []):
        holds, why = _rule_holds(rule["rule"], value)
        if not holds:
            where = _with_field_path(path, rule.get("fieldPath")) or "<root>"
            message = rule.get("message", rule["rule"])
            errors.append((where, message + (f" (the rule could not be evaluated: {why})" if why else "")))
    if node.get("x-kubernetes-list-type") == "map" and isinstance(value, list):
        keys = node.get("x-kubernetes-list-map-keys", [])
        seen = set()
        for i, item in enumerate(value):
            key = tuple(repr(item.get(k)) for k in keys) if isinstance(item, dict) else None
            if key in seen:
                errors.append((f"{path}[{i}]", f"Duplicate value: {dict(zip(keys, (item.get(k) for k in keys)))}"))
            seen.add(key)
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value:
                errors += _cel_errors(sub, value[name], f"{path}.{name}" if path else name)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in (node.get("properties") or {}):
                    errors += _cel_errors(extra, item, _key_path(path, name))
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(node["items"], item, f"{path}[{i}]")
    return errors


_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _key_path(path: str, key: str) -> str:
    """A map key in a field path: `.memory`, or `['nvidia.com/gpu']` when it has dots or slashes,
    so that a path never reads as a deeper field."""
    if _PLAIN.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _path(parts) -> str:
    """spec.stages[1].role: the field paths the operator's own errors use."""
    out = ""
    for part in parts:
        out = f"{out}[{part}]" if isinstance(part, int) else _key_path(out, str(part))
    return out


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."


@functools.cache
def _crd_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(to_jsonschema(openapi_schema(), root=True))


def validate(schema: dict[str, Any], obj: Any, validator: jsonschema.Draft202012Validator | None = None) -> list[str]:
    """Every error the API server would report for obj (empty: accepted), as "field: message"."""
    return [f"{field}: {message}" for field, message in problems(schema, obj, validator)]


def problems(schema: dict[str, Any], obj: Any,
             validator: jsonschema.Draft202012Validator | None = None) -> list[tuple[str, str]]:
    """Every error the API server would report for obj, as (field, message); never raises."""
    if not isinstance(obj, dict):
        return [("<root>", f"must be an object (a map of apiVersion, kind, metadata, spec), not {_json_type(obj)}")]
    obj = apply_defaults(schema, obj)
    validator = validator or jsonschema.Draft202012Validator(to_jsonschema(schema, root=True))
    errors = []
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        errors.append((_path(e.absolute_path) or "<root>", _short(_message(e))))
    if errors:
        return errors  # the server stops at structural errors before running CEL
    return _cel_errors(schema, obj, "")


def _message(error: jsonschema.ValidationError) -> str:
    if error.validator == "pattern" and isinstance(error.schema, dict) and error.schema.get("description"):
        # The description says in words what the regular expression says in symbols.
        return f"{_short(repr(error.instance))} does not match: {error.schema['description']}"
    if error.validator == "type":
        return f"must be {' or '.join(_a(t) for t in _types(error.validator_value))}, not {_json_type(error.instance)}"
    return error.message


def _types(value: Any) -> list[str]:
    return list(value) if isinstance(value, list) else [value]


def _a(json_type: str) -> str:
    return {"object": "an object", "array": "a list", "integer": "an integer", "string": "a string",
            "boolean": "true or false", "number": "a number", "null": "null"}.get(json_type, json_type)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {_short(str(value))}" if len(str(value)) < 40 else "a very large integer"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {_short(repr(value))}"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def validate_resource(obj: Any) -> list[str]:
    """Every error the API server would report for an OmniPipeline (schema and CEL rules)."""
    return validate(_crd_schema(), obj, _crd_validator())


def resource_problems(obj: Any) -> list[tuple[str, str]]:
    """validate_resource's errors as (field, message)."""
    return problems(_crd_schema(), obj, _crd_validator())


@functools.cache
def _crd_schema() -> dict[str, Any]:
    return openapi_schema()

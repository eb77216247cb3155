"""Validate an OmniPipeline as the API server would: its metadata, then the CRD's
openAPIV3Schema and CEL rules.

Used by the shared admission check (`admission.py`: `omni-pipeline validate` and the
operator before it renders) and by the tests.

In the server's order: the object as the server holds it (`crd.server_view`: nulls it drops
pruned, defaults applied, once); the metadata's shape by Kubernetes' ObjectMeta definition
(`objectmeta.py`) and the structure by the CRD's schema, with JSON Schema (jsonschema) once
the Kubernetes extensions are translated: x-kubernetes-int-or-string,
x-kubernetes-preserve-unknown-fields, nullable, strict unknown-field rejection, list-type
set/map, and the integer formats (an int32 field holds no more than 32 bits). Then, when
the structure holds, apimachinery's ObjectMeta rules and the x-kubernetes-validations rules
at each node, evaluated by cel-python with the Kubernetes quantity library (`isQuantity`,
`quantity`, and the Quantity member functions, on apimachinery's parser: `quantities.py`)
that the CRD's minimum server version has, and `matches()` and every `pattern` on Go's regexp
(`gopattern.py`); a rule's `messageExpression` gives its message, as on the server.

Nothing here raises on any JSON-like input: a rule that cannot be evaluated is reported as
failed, naming its field, as the API server reports it.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from omni_operator.pipeline import crd
from omni_operator.check.gopattern import PatternError, SchemaValidator, matches
from omni_operator.check.objectmeta import metadata_problems, metadata_shape_problems
from omni_operator.pipeline.quantities import Quantity, QuantityError, is_quantity, parse
from omni_operator.check.schema_errors import describe, json_type, key_path, short, shown

_PASSTHROUGH = ("type", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
                "minItems", "maxItems", "required", "description", "default", "minProperties", "maxProperties")
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def to_jsonschema(node: dict[str, Any], *, root: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {k: node[k] for k in _PASSTHROUGH if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("exclusiveMinimum") is True and "minimum" in node:
        # OpenAPI v3.0's boolean form (the CRD's) is JSON Schema 2020-12's number form.
        out["exclusiveMinimum"] = out.pop("minimum")
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
    if root:  # metadata is ObjectMeta: its shape and rules are the server's own (objectmeta.py);
        # a CRD may only restrict its name (and generateName), which is kept.
        metadata = out.setdefault("properties", {}).get("metadata") or {}
        out["properties"]["metadata"] = {"type": "object", "properties": {
            k: v for k, v in (metadata.get("properties") or {}).items() if k in ("name", "generateName")}}
        out["required"] = sorted(set(out.get("required", [])) | {"metadata"})
    return out


# -- the Kubernetes quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go) -------------


class CELQuantityError(ValueError):
    pass


def _quantity(text: Any) -> Quantity:
    """`quantity(string)`: apimachinery's ParseQuantity (`quantities.parse`)."""
    if not isinstance(text, str):
        raise CELQuantityError("quantity() takes a string")
    try:
        return parse(str(text))
    except QuantityError as exc:
        raise CELQuantityError(str(exc)) from None


def _is_quantity(text: Any) -> celtypes.BoolType:
    return celtypes.BoolType(isinstance(text, str) and is_quantity(str(text)))


def _cmp(a: Quantity, b: Quantity) -> int:
    return (a.value > b.value) - (a.value < b.value)


def _as_integer(q: Quantity) -> celtypes.IntType:
    value = q.as_int64()
    if value is None:
        raise CELQuantityError("cannot convert value to integer")
    return celtypes.IntType(value)


QUANTITY_FUNCTIONS = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "sign": lambda q: celtypes.IntType(q.sign()),
    "compareTo": lambda a, b: celtypes.IntType(_cmp(a, b)),
    "isGreaterThan": lambda a, b: celtypes.BoolType(_cmp(a, b) > 0),
    "isLessThan": lambda a, b: celtypes.BoolType(_cmp(a, b) < 0),
    "isInteger": lambda q: celtypes.BoolType(q.as_int64() is not None),
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(q.value)),
}

# -- the few functions of Kubernetes' list and strings libraries the CRD's messages use -------


def _join(items: Any, separator: Any = "") -> celtypes.StringType:
    """`list(string).join([separator])` (cel-go's strings extension)."""
    if not all(isinstance(item, str) for item in items):
        raise CELQuantityError("join: every element must be a string")
    return celtypes.StringType(str(separator).join(str(item) for item in items))


def _index_of(target: Any, item: Any) -> celtypes.IntType:
    """`list.indexOf(item)` (Kubernetes' list library) and `string.indexOf(substring)`."""
    if isinstance(target, str):
        return celtypes.IntType(str(target).find(str(item)))
    for i, element in enumerate(target):
        if element == item:
            return celtypes.IntType(i)
    return celtypes.IntType(-1)


def _matches(text: Any, pattern: Any) -> Any:
    """`string.matches(pattern)`: Go's regexp (RE2), as the API server evaluates it."""
    try:
        return celtypes.BoolType(matches(str(pattern), str(text)))
    except PatternError as exc:
        raise CELQuantityError(str(exc)) from None


CEL_FUNCTIONS = {**QUANTITY_FUNCTIONS, "join": _join, "indexOf": _index_of, "matches": _matches}

_env = celpy.Environment()


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    return _env.program(_env.compile(rule), functions=CEL_FUNCTIONS)


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


def _evaluate(expression: str, value: Any) -> tuple[Any, str | None]:
    """(the result, why it could not be evaluated)."""
    try:
        result = _program(expression).evaluate({"self": to_cel(value)})
    except Exception as exc:  # noqa: BLE001 - any evaluation failure is the rule failing
        return None, _why(exc)
    if isinstance(result, Exception):
        return None, _why(result)
    return result, None


def _why(exc: BaseException) -> str:
    text = str(exc.args[0] if getattr(exc, "args", None) else exc)
    return short(text.replace("None", "null"))


@functools.lru_cache(maxsize=4096)
def _rule_on_json(rule: str, message_expression: str | None, value_json: str) -> tuple[bool, str | None, str | None]:
    value = json.loads(value_json)
    result, why = _evaluate(rule, value)
    holds = why is None and isinstance(result, (bool, celtypes.BoolType)) and bool(result)
    message = None
    if not holds and message_expression:
        text, failed = _evaluate(message_expression, value)
        if failed is None and isinstance(text, str) and text.strip():
            message = short(str(text))
    return holds, why, message


def _value_json(value: Any) -> str | None:
    """The value's JSON, the key of the rules' memo (None: not JSON, evaluated afresh)."""
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None


def _rule_result(rule: dict[str, Any], value: Any, value_json: str | None) -> tuple[bool, str | None, str | None]:
    """(holds, why it could not be evaluated, the messageExpression's message). Memoised on
    the value's JSON (``value_json``, made once for all the rules of a node): a rule is a pure
    function of `self`, and the same stage or map is checked again in every pipeline that
    holds it."""
    if value_json is None:
        result, why = _evaluate(rule["rule"], value)
        return why is None and bool(result), why, None
    return _rule_on_json(rule["rule"], rule.get("messageExpression"), value_json)


def _with_field_path(path: str, field_path: str | None) -> str:
    if not field_path:
        return path
    return path + field_path if path else field_path.lstrip(".")


def _cel_errors(node: dict[str, Any], value: Any, path: str) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if value is None:
        return errors
    rules = node.get("x-kubernetes-validations", [])
    value_json = _value_json(value) if rules else None
    for rule in rules:
        holds, why, evaluated = _rule_result(rule, value, value_json)
        if not holds:
            where = _with_field_path(path, rule.get("fieldPath")) or "<root>"
            message = evaluated or rule.get("message") or f"failed rule: {rule['rule']}"
            errors.append((where, message + (f" (the rule could not be evaluated: {why})" if why else "")))
    if node.get("x-kubernetes-list-type") == "map" and isinstance(value, list):
        keys = node.get("x-kubernetes-list-map-keys", [])
        seen: dict[Any, int] = {}
        for i, item in enumerate(value):
            key = tuple(json.dumps(item.get(k), sort_keys=True) for k in keys) if isinstance(item, dict) else None
            if key in seen:
                named = ", ".join(f"{k} {shown(item.get(k))}" for k in keys)
                errors.append((f"{path}[{i}]", f"Duplicate value: the same {named} as {path}[{seen[key]}]; "
                                               "each may appear once"))
            else:
                seen[key] = i
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value:
                errors += _cel_errors(sub, value[name], f"{path}.{name}" if path else name)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in (node.get("properties") or {}):
                    errors += _cel_errors(extra, item, key_path(path, name))
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            errors += _cel_errors(node["items"], item, f"{path}[{i}]")
    return errors


def _path(parts) -> str:
    """spec.stages[1].role: the field paths the operator's own errors use."""
    out = ""
    for part in parts:
        out = f"{out}[{part}]" if isinstance(part, int) else key_path(out, str(part))
    return out


@functools.cache
def _crd_validator() -> jsonschema.Draft202012Validator:
    return SchemaValidator(to_jsonschema(crd.openapi_schema(), root=True))


def validate(schema: dict[str, Any], obj: Any, validator: jsonschema.Draft202012Validator | None = None) -> list[str]:
    """Every error the API server would report for obj (empty: accepted), as "field: message"."""
    return [f"{field}: {message}" for field, message in problems(schema, obj, validator)]


def problems(schema: dict[str, Any], obj: Any,
             validator: jsonschema.Draft202012Validator | None = None) -> list[tuple[str, str]]:
    """Every error the API server would report for obj, as (field, message); never raises."""
    if not isinstance(obj, dict):
        return [("<root>", f"must be an object (a map of apiVersion, kind, metadata, spec), not {json_type(obj)}")]
    return view_problems(schema, crd.server_view(schema, obj), validator)


def view_problems(schema: dict[str, Any], view: dict[str, Any],
                  validator: jsonschema.Draft202012Validator | None = None) -> list[tuple[str, str]]:
    """problems() of an object already as the server holds it (`crd.server_view`)."""
    validator = validator or SchemaValidator(to_jsonschema(schema, root=True))
    errors = metadata_shape_problems(view.get("metadata"))
    for e in sorted(validator.iter_errors(view), key=lambda e: list(map(str, e.absolute_path))):
        errors.append((_path(e.absolute_path) or "<root>", describe(e)))
    if errors:
        return errors  # the server stops at structural errors before running CEL
    return metadata_problems(view["metadata"]) + _cel_errors(schema, view, "")


def server_view(obj: dict[str, Any]) -> dict[str, Any]:
    """An OmniPipeline as the API server holds it before validating: nulls pruned, the CRD's
    defaults applied (a copy)."""
    return crd.server_view(_crd_schema(), obj)


def resource_problems(obj: Any) -> list[tuple[str, str]]:
    """Every error the API server would report for an OmniPipeline (metadata, schema and CEL
    rules), as (field, message)."""
    return problems(_crd_schema(), obj, _crd_validator())


def pipeline_view_problems(view: dict[str, Any]) -> list[tuple[str, str]]:
    """resource_problems() of a body already in its server view (`server_view`)."""
    return view_problems(_crd_schema(), view, _crd_validator())


@functools.cache
def _crd_schema() -> dict[str, Any]:
    return crd.openapi_schema()

"""One wording for JSON Schema errors, whichever schema found them (the CRD's, Kubernetes'
own): the field's problem in words, its bound where there is one ("at most 16 stages"), the
value shown short, never a dump of a list, a Python `None` or "is not valid under any of the
given schemas"."""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

#: A map key shown as `.key` in a field path; any other is shown quoted, `['nvidia.com/gpu']`.
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def key_path(path: str, key: str) -> str:
    """A map key in a field path: `.memory`, or `['nvidia.com/gpu']` when it has dots, slashes
    or anything but letters, digits, '-' and '_' (a newline included), so that a path never
    reads as a deeper field and stays one printable line."""
    if _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


MAX_MESSAGE = 300  # a message quotes the bad value; a huge value is cut, not printed whole
MAX_SHOWN = 80

#: What a list field holds, for "at most 16 stages"; others say "items".
_NOUNS = {"stages": "stages", "inputs": "inputs", "env": "environment variables", "tolerations": "tolerations",
          "imagePullSecrets": "image pull secrets", "finalizers": "finalizers", "ownerReferences": "owner references",
          "requests": "resources", "limits": "resources", "nodeSelector": "labels"}


def describe(error: jsonschema.ValidationError) -> str:
    """The message for one jsonschema error, in the operator's words."""
    v, value, bound = error.validator, error.instance, error.validator_value
    noun = _noun(error)
    if v == "type":
        text = f"must be {' or '.join(_a(t) for t in _types(bound))}, not {json_type(value)}"
    elif v in ("anyOf", "oneOf") and _branch_types(bound):
        text = f"must be {' or '.join(_a(t) for t in _branch_types(bound))}, not {json_type(value)}"
    elif v in ("anyOf", "oneOf"):
        best = jsonschema.exceptions.best_match(error.context or [])
        text = describe(best) if best is not None else "is not a valid value here"
    elif v == "maxItems":
        text = f"has {len(value)} {noun}: at most {bound} {noun} are allowed"
    elif v == "minItems":
        text = f"needs at least {bound} {noun if bound != 1 else noun.rstrip('s') or 'item'}" + \
            ("" if value else " (the list is empty)")
    elif v == "maxProperties":
        text = f"has {len(value)} entries: at most {bound} are allowed"
    elif v == "minProperties":
        text = f"needs at least {bound} entr{'y' if bound == 1 else 'ies'}"
    elif v == "maxLength":
        text = f"is {len(value)} characters long: at most {bound} are allowed"
    elif v == "minLength":
        text = "must not be empty" if bound == 1 else f"must be at least {bound} characters long"
    elif v == "uniqueItems":
        seen, dup = [], None
        for item in value:
            if item in seen:
                dup = item
                break
            seen.append(item)
        text = f"lists {shown(dup)} more than once; each entry may appear once"
    elif v == "pattern" and isinstance(error.schema, dict) and error.schema.get("description"):
        # The description says in words what the regular expression says in symbols.
        text = f"{shown(value)} does not match: {error.schema['description']}"
    elif v == "pattern":
        text = f"{shown(value)} does not match {shown(bound)}"
    elif v == "enum":
        text = f"{shown(value)} is not one of {', '.join(shown(b) for b in bound)}"
    elif v == "maximum":
        text = f"{shown(value)} is greater than the maximum of {bound}"
    elif v == "minimum":
        text = f"{shown(value)} is less than the minimum of {bound}"
    elif v == "exclusiveMinimum":
        text = f"{shown(value)} must be greater than {bound}"
    elif v == "required":
        missing = next((name for name in bound if isinstance(value, dict) and name not in value), bound[0])
        text = f"'{missing}' is a required property"
    elif v == "additionalProperties":
        extra = [k for k in value if k not in (error.schema.get("properties") or {})] if isinstance(value, dict) else []
        names = ", ".join(shown(k) for k in extra[:5]) + (", ..." if len(extra) > 5 else "")
        text = f"Additional properties are not allowed ({names} {'was' if len(extra) == 1 else 'were'} unexpected): " \
               "unknown field"
    elif v == "const":
        text = f"must be {shown(bound)}, not {shown(value)}"
    else:
        text = error.message.replace("None", "null")
    return short(text)


def _noun(error: jsonschema.ValidationError) -> str:
    path = [p for p in error.absolute_path if isinstance(p, str)]
    return _NOUNS.get(path[-1], "items") if path else "items"


def _types(value: Any) -> list[str]:
    types = list(value) if isinstance(value, list) else [value]
    # Kubernetes' schemas allow null for every optional field (Go's zero value): never a fix.
    return [t for t in types if t != "null"] or types


def _branch_types(branches: Any) -> list[str]:
    if not isinstance(branches, list) or not all(isinstance(b, dict) and set(b) == {"type"} for b in branches):
        return []
    return [t for b in branches for t in _types(b["type"])]


def _a(json_type: str) -> str:
    return {"object": "an object", "array": "a list", "integer": "an integer", "string": "a string",
            "boolean": "true or false", "number": "a number", "null": "null"}.get(json_type, json_type)


def json_type(value: Any) -> str:
    """A value's JSON type in words, with the value itself when it is short."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {short(str(value))}" if len(str(value)) < 40 else "a very large integer"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {shown(value)}"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def shown(value: Any) -> str:
    """A value as a message quotes it: strings in quotes, the rest as JSON; cut when long."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, sort_keys=True, default=str)
        except (TypeError, ValueError):
            text = type(value).__name__
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."

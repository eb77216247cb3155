"""Desired-versus-live comparison on the fields the operator owns, as a JSON merge patch.

`merge_patch(desired, live, last_applied)` is empty when the live object already has every
owned field as desired; otherwise it holds exactly the fields to write. Three rules keep it
from writing forever on objects the API server has touched:

- fields the server adds (defaults, status, metadata) are not owned and are ignored;
- an absent field equals its zero value (false, 0, "", {}, []): the server omits those;
- quantities compare as numbers ("1000m" == "1").

Lists are written whole (merge-patch semantics), when an element differs from the live one
or when the list differs from what was last applied (so an element field that the operator
stopped setting goes away too). A field that was last applied and is no longer desired is
deleted with null. A few maps (selectors, ConfigMap data) are owned whole.
"""
from __future__ import annotations

import json
from typing import Any

from . import naming
from .quantities import quantities_equal

_MISSING = object()
QUANTITY_KEYS = frozenset({"limits", "requests", "sizeLimit"})
IDENTITY_KEYS = frozenset({"apiVersion", "kind"})
# Maps the operator owns whole: a key someone adds changes behaviour (a selector that matches
# no pod, a node selector that schedules nowhere), so it is removed, not tolerated.
WHOLE_MAPS = frozenset({"selector", "matchLabels", "nodeSelector", "data"})


def with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    """The desired object as it is written: plus an annotation recording it, for the next
    three-way diff (`merge_patch`'s last_applied)."""
    record = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    meta = dict(desired["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), naming.LAST_APPLIED_ANNOTATION: record}
    return {**desired, "metadata": meta}


def last_applied(live: dict[str, Any]) -> dict[str, Any]:
    """What was last applied to a live object (its record annotation); {} when none."""
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(naming.LAST_APPLIED_ANNOTATION)
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def is_zero(value: Any) -> bool:
    if value is _MISSING or value is None:
        return True
    if isinstance(value, (bool, int, float, str, dict, list)):
        return not value
    return False


def matches(want: Any, have: Any, *, quantity: bool = False) -> bool:
    """Whether `have` (live) satisfies `want` (desired): a recursive subset comparison.

    Plain loops rather than all() over generators: it runs on every field of every child at
    each reconcile, and the generators cost about as much as the comparisons."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return is_zero(have) and all(is_zero(v) for v in want.values())
        for key, value in want.items():
            if not matches(value, have.get(key, _MISSING), quantity=quantity or key in QUANTITY_KEYS):
                return False
        return True
    if isinstance(want, list):
        if not isinstance(have, list):
            return not want and is_zero(have)
        if len(want) != len(have):
            return False
        for w, h in zip(want, have):
            if not matches(w, h, quantity=quantity):
                return False
        return True
    if have is _MISSING or have is None:
        return is_zero(want)
    if quantity and not isinstance(want, bool):
        return quantities_equal(want, have)
    return type(want) is type(have) and want == have or (is_zero(want) and is_zero(have))


def without(patch: dict[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """``patch`` less the fields at ``paths`` (and the maps they leave empty)."""
    for path in paths:
        trail, node = [], patch
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                break
            trail.append((node, key))
            node = node[key]
        else:
            node.pop(path[-1], None)
            for parent, key in reversed(trail):
                if parent[key]:
                    break
                del parent[key]
    return patch


def merge_patch(desired: dict[str, Any], live: dict[str, Any], last_applied: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON merge patch that makes `live` match `desired` on the owned fields.

    apiVersion and kind identify the object rather than describe it (list items omit them).
    """
    desired = {k: v for k, v in desired.items() if k not in IDENTITY_KEYS}
    last = {k: v for k, v in (last_applied or {}).items() if k not in IDENTITY_KEYS} if isinstance(last_applied, dict) else {}
    return _diff(desired, live, last, quantity=False)


def _diff(want: dict[str, Any], have: dict[str, Any], last: dict[str, Any], *, quantity: bool) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in want.items():
        live_value = have.get(key, _MISSING)
        last_value = last.get(key, _MISSING)
        q = quantity or key in QUANTITY_KEYS
        if isinstance(value, dict) and isinstance(live_value, dict):
            sub = _diff(value, live_value, last_value if isinstance(last_value, dict) else {}, quantity=q)
            if key in WHOLE_MAPS:
                sub.update({k: None for k in live_value if k not in value})
            if sub:
                patch[key] = sub
        elif not matches(value, live_value, quantity=q):
            patch[key] = value
        elif isinstance(value, list) and last_value is not _MISSING and last_value != value:
            patch[key] = value
    for key in last:
        if key not in want and not is_zero(have.get(key, _MISSING)):
            patch[key] = None
    return patch

"""The Kubernetes permissions the operator needs, derived from its code.

Two sources make every API call the operator makes:
- its Kube layer (omni_operator.controller.kube.Kube), whose methods the reconciler and the resync call;
  the generic child methods (get, list, create, patch, delete) are applied to every kind
  in omni_operator.pipeline.kinds.CHILD_KINDS, because the reconciler's apply path loops over them;
- kopf, for the handlers in omni_operator.controller.handlers.build_registry(): it lists and watches
  every resource it has a handler for, and for change handlers (create/update/resume)
  patches the object and its status (handler progress, last-handled configuration).
A Kube method that is called but not known here fails the derivation, so a new kind of API
call in the operator forces a look at the chart's RBAC.
"""
from __future__ import annotations

import ast
from pathlib import Path

import omni_operator
from omni_operator import GROUP, PLURAL
from omni_operator.controller.handlers import build_registry
from omni_operator.pipeline.kinds import CHILD_KINDS

Permission = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# Kube methods that act on whichever child kind they are given -> verb.
CHILD_METHODS = {"get": "get", "list": "list", "create": "create", "patch": "patch", "delete": "delete"}
# Kube methods with a fixed target.
FIXED_METHODS: dict[str, set[Permission]] = {
    "get_pipeline": {(GROUP, PLURAL, "get")},
    "list_pipelines": {(GROUP, PLURAL, "list")},
    "patch_pipeline_status": {(GROUP, f"{PLURAL}/status", "patch")},
    "create_event": {("", "events", "create")},
    # The stage pods: their /metrics (transfer health), and which remain while a revision drains.
    "list_pods": {("", "pods", "list")},
    # Their deletion cost from their open streams (deletion_cost.py), on the resync timer.
    "patch_pod": {("", "pods", "patch")},
    # An autoscaled stage's OmniStageScaler status (its pods and selector, for the autoscaler).
    "patch_status": {(GROUP, "omnistagescalers/status", "patch")},
    "serves": set(),  # API discovery (GET /apis/<group>/<version>): open to every account
}
# kopf posts Kubernetes events for handler warnings and errors.
KOPF_ALWAYS: set[Permission] = {("", "events", "create")}
# Cluster-scoped, kopf's observation of the cluster (kopf/_core/reactor/observation.py): it
# watches CRDs to notice resources appearing later (PodMonitor), and, for listed namespaces,
# lists and watches Namespaces to notice them appear. Refused, it retries each call for
# about a minute before falling back, handling no events meanwhile (test_rbac_measured.py).
KOPF_CRDS: set[Permission] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}
KOPF_NAMESPACES: set[Permission] = {("", "namespaces", "list"), ("", "namespaces", "watch")}


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def kube_methods_called() -> set[str]:
    """Names of Kube methods the operator's modules call (`<something>.kube.<method>(...)`)."""
    called: set[str] = set()
    for path in Path(omni_operator.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "kube"):
                called.add(node.func.attr)
    return called


def operator_calls() -> set[Permission]:
    perms: set[Permission] = set()
    for method in kube_methods_called():
        if method in CHILD_METHODS:
            perms |= {(_group(k.api_version), k.plural, CHILD_METHODS[method]) for k in CHILD_KINDS}
        elif method in FIXED_METHODS:
            perms |= FIXED_METHODS[method]
        else:
            raise AssertionError(f"Kube.{method} is called but its permission is unknown here")
    return perms


def kopf_calls() -> set[Permission]:
    registry = build_registry()
    perms = set(KOPF_ALWAYS)
    for handler in registry._watching._handlers + registry._changing._handlers:
        sel = handler.selector
        perms |= {(sel.group, sel.any_name, "list"), (sel.group, sel.any_name, "watch")}
    for handler in registry._changing._handlers:
        sel = handler.selector
        perms |= {(sel.group, sel.any_name, "patch"), (sel.group, f"{sel.any_name}/status", "patch")}
    return perms


def required_namespaced() -> set[Permission]:
    """What the operator calls on the resources in the namespaces it watches."""
    return operator_calls() | kopf_calls()


def required_cluster_scoped(clusterwide: bool) -> set[Permission]:
    """What kopf calls on cluster-scoped resources."""
    return KOPF_CRDS | (set() if clusterwide else KOPF_NAMESPACES)


def required(clusterwide: bool) -> set[Permission]:
    return required_namespaced() | required_cluster_scoped(clusterwide)


def granted(rules: list[dict]) -> set[Permission]:
    """Flatten RBAC rules; wildcards are refused (least privilege)."""
    out: set[Permission] = set()
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), f"wildcard in {rule}"
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out

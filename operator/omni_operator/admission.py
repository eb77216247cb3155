"""The one check an OmniPipeline passes before anything is rendered from it.

`omni-pipeline validate` and the operator (before each render) both call `admit`; it
refuses, naming each field and the fix, whatever the API server or a kubelet would refuse
for the pipeline or for any object the operator renders from it:

1. the document is an `omnipipeline.dev/v1alpha1` `OmniPipeline`;
2. the CRD's schema and CEL rules, evaluated as the API server does (`validation.py`): an
   old CRD on the cluster, or none (a local file), changes nothing;
3. the rules the schema cannot state (`model.parse_pipeline`: cycles, reserved names, ...);
4. the fields a stage passes through to its pod (resources, nodeSelector, tolerations, env),
   against Kubernetes' own schema for their type (`kube_schema.py`), plus what the API
   server's pod validation adds for extended resources;
5. every rendered child against the Kubernetes schema of its kind: a last guard, so a gap
   in 1-4 shows here as a refused pipeline rather than as a child the server refuses.

Pure and deterministic; the operator memoises the result per spec.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Mapping

from . import API_VERSION, KIND
from .errors import Problem, SpecError
from .kube_schema import ENV_VAR, RESOURCES, TOLERATION, check_object, check_pod_spec_field, check_value
from .model import Pipeline, Stage, parse_pipeline
from .quantities import parse_quantity
from .render import render_children
from .validation import resource_problems


def admit(body: Any) -> Pipeline:
    """The pipeline, typed and checked; SpecError listing every problem otherwise."""
    problems = problems_of(body)
    if problems:
        raise SpecError(problems)
    return parse_pipeline(body)


def problems_of(body: Any) -> list[Problem]:
    """Every problem (empty: the pipeline is admitted). Never raises on any JSON value."""
    if not isinstance(body, dict):
        return [Problem("<root>", "must be an OmniPipeline object (apiVersion, kind, metadata, spec)")]
    identity = _identity(body)
    if identity:
        return identity
    key = _cache_key(body)
    return list(_cached_problems(key)) if key is not None else _problems(body)


def _identity(body: Mapping[str, Any]) -> list[Problem]:
    problems = []
    if body.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND} (got {_shown(body.get('kind'))}); this file is not an OmniPipeline"))
    if body.get("apiVersion") != API_VERSION:
        problems.append(Problem("apiVersion", f"must be {API_VERSION} (got {_shown(body.get('apiVersion'))})"))
    return problems


def _cache_key(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    if not isinstance(meta, dict):
        return None
    try:
        # Only what the checks read: the server's own metadata (uid, resourceVersion, managed
        # fields) changes on every write and would defeat the memo.
        kept = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}
        return json.dumps({"metadata": kept, "spec": body.get("spec")}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def _cached_problems(key: str) -> tuple[Problem, ...]:
    parts = json.loads(key)
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": parts["metadata"]}
    if parts["spec"] is not None:
        body["spec"] = parts["spec"]
    return tuple(_problems(body))


def _problems(body: dict[str, Any]) -> list[Problem]:
    crd_errors = resource_problems(body)
    if crd_errors:
        return [Problem(field, message) for field, message in crd_errors]
    try:
        pipeline = parse_pipeline(body)
    except SpecError as exc:
        return list(exc.problems)
    problems: list[Problem] = []
    for i, stage in enumerate(pipeline.stages):
        problems += _stage_pod_fields(f"spec.stages[{i}]", stage)
    if problems:
        return problems
    return _rendered_children(pipeline)


def _stage_pod_fields(where: str, stage: Stage) -> list[Problem]:
    found: list[tuple[str, str]] = []
    for j, toleration in enumerate(stage.tolerations):
        found += check_value(TOLERATION, dict(toleration), f"{where}.tolerations[{j}]")
    for j, env in enumerate(stage.env):
        found += check_value(ENV_VAR, dict(env), f"{where}.env[{j}]")
    found += check_value(RESOURCES, {k: dict(v) for k, v in stage.resources.items()}, f"{where}.resources")
    found += check_pod_spec_field("nodeSelector", dict(stage.node_selector), f"{where}.nodeSelector")
    problems = [Problem(field, message) for field, message in found]
    problems += _extended_resources(where, stage)
    return problems


def _extended_resources(where: str, stage: Stage) -> list[Problem]:
    """What the API server's container validation adds for extended (domain-prefixed)
    resources: whole numbers, and a request equal to the limit (they cannot be overcommitted)."""
    problems = []
    requests = stage.resources.get("requests") or {}
    limits = stage.resources.get("limits") or {}
    for section, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            if "/" not in name or name.startswith("hugepages-"):
                continue
            try:
                number = parse_quantity(value)
            except ValueError:
                continue  # reported by the CRD rules
            if number != number.to_integral_value():
                problems.append(Problem(f"{where}.resources.{section}[{name!r}]",
                                        f"an extended resource is counted in whole units (got {value!r})"))
    for name in requests:
        if "/" in name and name in limits:
            try:
                same = parse_quantity(requests[name]) == parse_quantity(limits[name])
            except ValueError:
                continue
            if not same:
                problems.append(Problem(f"{where}.resources.requests[{name!r}]",
                                        "an extended resource cannot be overcommitted: its request must equal its limit"))
    return problems


def _rendered_children(pipeline: Pipeline) -> list[Problem]:
    stage_of = {f"{pipeline.name}-{s.name}": i for i, s in enumerate(pipeline.stages)}
    problems = []
    for child in render_children(pipeline, podmonitor_available=True):
        errors = check_object(child)
        name = child["metadata"]["name"]
        for path, message in errors or []:
            field = f"spec.stages[{stage_of[name]}]" if name in stage_of else "spec"
            problems.append(Problem(field, f"renders {child['kind']} {name}, which Kubernetes would refuse: {path}: {message}"))
    return problems


def _shown(value: Any) -> str:
    if value is None:
        return "nothing"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else type(value).__name__
    return text if len(text) <= 80 else text[:80] + "..."

"""The one check an OmniPipeline passes before anything is rendered from it.

`omni-pipeline validate` and the operator (at each reconcile) both call `admit`; it refuses,
naming each field and the fix, whatever the API server or a kubelet would refuse for the
pipeline or for any object the operator renders from it, each step once:

1. the document is an `omnipipeline.dev/v1alpha1` `OmniPipeline`;
2. the API server's view of it: nulls it drops pruned, the CRD's defaults applied (once);
3. what the API server checks for the resource (`validation.py`): its metadata (ObjectMeta's
   shape and apimachinery's rules), the CRD's schema and CEL rules, evaluated as the server
   does: an old CRD on the cluster, or none (a local file), changes nothing;
4. the streamed edges' settings by the contract (`model.stream_problems`,
   `omni_contract.edges`), the typed view of that body (`model.pipeline_view`) and the rules
   no schema can state (`model.graph_problems`: cycles, a sender with no receiver, CPU-list
   order, a stream's chunk an engine at either end cannot hold, the stage
   contract's engineArgs rules, shared with `omni-stage`, against the table of the vLLM the
   stage's image runs; what it only warns of is kept in `Admitted.warnings`);
5. the fields a stage passes through to its pod (resources, nodeSelector, tolerations, env),
   against Kubernetes' own schema for their type (`kube_schema.py`), plus what the API
   server's pod validation adds (`pod_rules.py`);
6. every child rendered from it (`render.py`), as it would be written (with its last-applied
   record), against the Kubernetes schema of its kind and the server's object rules
   (ObjectMeta, a ConfigMap's size): a last guard, so a gap in 1-5 shows here as a refused
   pipeline rather than as a child the server refuses.

`admit` returns the typed pipeline and those children, so that a reconcile applies what was
checked, without parsing or rendering again. Pure and deterministic; memoised per spec.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Mapping

from omni_operator import API_VERSION, KIND

from omni_operator.pipeline import naming
from omni_operator.pipeline.diff import with_last_applied
from omni_operator.pipeline.errors import Problem, SpecError
from omni_operator.pipeline.kinds import CONFIGMAP, HPA, PODMONITOR, SCALEDOBJECT
from .kube_schema import ENV_VAR, RESOURCES, TOLERATION, check_object, check_pod_spec_field, check_value
from omni_operator.pipeline.model import Pipeline, Stage, graph_report, pipeline_view, stream_problems
from .objectmeta import metadata_problems
from .pod_rules import stage_problems
from omni_operator.pipeline.render import ClusterSettings, operator_env, render_children
from .schema_errors import shown
from .validation import pipeline_view_problems, server_view

#: ValidateConfigMap: the data of a ConfigMap is at most 1 MiB (core.MaxSecretSize).
MAX_CONFIGMAP_DATA = 1024 * 1024
#: The metadata the checks read: the server's own (resourceVersion, managedFields, status)
#: changes on every write and would defeat the memo.
_KEY_METADATA = ("name", "namespace", "uid", "generation", "labels", "annotations", "finalizers",
                 "ownerReferences", "generateName")


@dataclass(frozen=True)
class Admitted:
    """A pipeline that passed every check, and its children as they are written: every child
    the pipeline should have, a PodMonitor included (a reconcile leaves it out where the
    cluster does not serve PodMonitors), each with its last-applied record. Shared between
    reconciles of an unchanged spec: never modify them."""
    pipeline: Pipeline
    children: tuple[dict[str, Any], ...]
    #: What the stages would run with but the user should know (`model.graph_report`): the
    #: operator posts them as one Warning event, `omni-pipeline validate` prints them.
    warnings: tuple[Problem, ...] = ()

    def children_for(self, *, podmonitor_available: bool, keda_available: bool = False) -> list[dict[str, Any]]:
        """The children to apply where the cluster serves (or not) PodMonitors and KEDA's
        ScaledObjects: an autoscaled stage gets a ScaledObject with KEDA, else an HPA."""
        skip = {HPA.kind if keda_available else SCALEDOBJECT.kind}
        if not podmonitor_available:
            skip.add(PODMONITOR.kind)
        return [c for c in self.children if c["kind"] not in skip]


def admit(body: Any, *, cluster: ClusterSettings = ClusterSettings()) -> Admitted:
    """The pipeline, typed and checked, and its rendered children; SpecError listing every
    problem otherwise. ``cluster``: what the operator is told about its cluster (where its
    own pods are, the PodMonitors' labels: `render.ClusterSettings`), settings of the
    operator, not of the pipeline, checked here with the children they shape."""
    result = _admission(body, cluster)
    if isinstance(result, Admitted):
        return result
    raise SpecError(list(result))


def problems_of(body: Any) -> list[Problem]:
    """Every problem (empty: the pipeline is admitted). Never raises on any JSON value."""
    return report_of(body)[0]


def report_of(body: Any) -> tuple[list[Problem], list[Problem]]:
    """(every problem, the warnings of a pipeline admitted). Never raises on any JSON value."""
    result = _admission(body, ClusterSettings())
    return ([], list(result.warnings)) if isinstance(result, Admitted) else (list(result), [])


def _admission(body: Any, cluster: ClusterSettings) -> Admitted | tuple[Problem, ...]:
    if not isinstance(body, dict):
        return (Problem("<root>", "must be an OmniPipeline object (apiVersion, kind, metadata, spec)"),)
    identity = _identity(body)
    if identity:
        return tuple(identity)
    key = _cache_key(body)
    return _cached(key, cluster) if key is not None else _check(body, cluster)


def _identity(body: Mapping[str, Any]) -> list[Problem]:
    problems = []
    if body.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND} (got {_shown(body.get('kind'))}); this document is not an OmniPipeline"))
    if body.get("apiVersion") != API_VERSION:
        problems.append(Problem("apiVersion", f"must be {API_VERSION} (got {_shown(body.get('apiVersion'))})"))
    return problems


#: The top-level fields of an OmniPipeline the cache key stands for (any other is checked
#: afresh: the key leaves it out, and the check refuses it as an unknown field).
_ROOT_FIELDS = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})


def _cache_key(body: Mapping[str, Any]) -> str | None:
    meta = body.get("metadata")
    if not isinstance(meta, dict) or not body.keys() <= _ROOT_FIELDS:
        return None
    try:
        kept = {k: meta[k] for k in _KEY_METADATA if k in meta}
        if set(meta) - set(_KEY_METADATA) - {"resourceVersion", "managedFields", "creationTimestamp", "selfLink",
                                             "deletionTimestamp", "deletionGracePeriodSeconds"}:
            return None  # an unknown metadata field: checked afresh, reported
        return json.dumps({"metadata": kept, "spec": body.get("spec")}, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=512)
def _cached(key: str, cluster: ClusterSettings) -> Admitted | tuple[Problem, ...]:
    parts = json.loads(key)
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": parts["metadata"]}
    if parts["spec"] is not None:
        body["spec"] = parts["spec"]
    return _check(body, cluster)


def _check(body: dict[str, Any], cluster: ClusterSettings) -> Admitted | tuple[Problem, ...]:
    view = server_view(body)
    found = pipeline_view_problems(view)
    if found:
        return tuple(Problem(field, message) for field, message in found)
    problems = stream_problems(view)
    if problems:
        return tuple(problems)
    pipeline = pipeline_view(view)
    problems, warnings = graph_report(pipeline)
    if problems:
        return tuple(problems)
    for i, stage in enumerate(pipeline.stages):
        problems += _stage_pod_fields(f"spec.stages[{i}]", stage)
        problems += _operator_env_names(f"spec.stages[{i}].env", pipeline, stage)
    if problems:
        return tuple(problems)
    children = tuple(with_last_applied(child) for child in render_children(
        pipeline, podmonitor_available=True, cluster=cluster))
    problems = _rendered_children(pipeline, children)
    if problems:
        return tuple(problems)
    return Admitted(pipeline, children, tuple(warnings))


def _stage_pod_fields(where: str, stage: Stage) -> list[Problem]:
    found: list[tuple[str, str]] = []
    for j, toleration in enumerate(stage.tolerations):
        found += check_value(TOLERATION, dict(toleration), f"{where}.tolerations[{j}]")
    for j, env in enumerate(stage.env):
        found += check_value(ENV_VAR, dict(env), f"{where}.env[{j}]")
    found += check_value(RESOURCES, {k: dict(v) for k, v in stage.resources.items()}, f"{where}.resources")
    found += check_pod_spec_field("nodeSelector", dict(stage.node_selector), f"{where}.nodeSelector")
    return [Problem(field, message) for field, message in found] + stage_problems(where, stage)


def _operator_env_names(where: str, pipeline: Pipeline, stage: Stage) -> list[Problem]:
    """A stage's ``env`` may not set a name the operator sets for it (`render.operator_env`):
    Kubernetes keeps a name's last entry, so the user's would silently replace the operator's
    (a plain HF_TOKEN the Secret of spec.model.hubTokenSecretRef, say)."""
    if not stage.env:
        return []
    ours = {item["name"]: item for item in operator_env(pipeline, stage)}
    problems = []
    for j, item in enumerate(stage.env):
        mine = ours.get(item.get("name"))
        if mine is not None:
            problems.append(Problem(f"{where}[{j}].name", f"{item['name']} is set by the operator for this "
                                                          f"stage ({_env_source(mine)}); remove it here, where it "
                                                          "would replace the operator's value"))
    return problems


def _env_source(item: Mapping[str, Any]) -> str:
    if "value" in item:
        return f"to {item['value']!r}"
    source = item.get("valueFrom") or {}
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        return f"from key {ref.get('key')!r} of Secret {ref.get('name')!r}: spec.model.hubTokenSecretRef"
    if "fieldRef" in source:
        return f"from the pod's {source['fieldRef'].get('fieldPath')}"
    return "from a reference"


def _rendered_children(pipeline: Pipeline, children: tuple[dict[str, Any], ...]) -> list[Problem]:
    stage_of = {f"{pipeline.name}-{s.name}": i for i, s in enumerate(pipeline.stages)}
    stage_of.update({naming.revision_name(pipeline.name, s.name, pipeline.revision): i
                     for i, s in enumerate(pipeline.stages)})
    stage_of.update({naming.scaledobject_name(pipeline.name, s.name): i for i, s in enumerate(pipeline.stages)})
    problems = []
    for child in children:
        name = child["metadata"]["name"]
        field = f"spec.stages[{stage_of[name]}]" if name in stage_of else "spec"
        found = list(check_object(child) or [])
        # Its owner reference names the pipeline's uid, which the server gives the pipeline.
        found += metadata_problems({k: v for k, v in child["metadata"].items() if k != "ownerReferences"})
        if child["kind"] == CONFIGMAP.kind:
            size = sum(len(str(v).encode()) for v in (child.get("data") or {}).values())
            if size > MAX_CONFIGMAP_DATA:
                found.append(("data", f"holds {size} bytes: the API server takes at most {MAX_CONFIGMAP_DATA} (1 MiB)"))
        for path, message in found:
            problems.append(Problem(field, f"renders {child['kind']} {name}, which Kubernetes would refuse: "
                                           f"{path}: {message}{_fix(path)}"))
    return problems


def _fix(path: str) -> str:
    """What in the spec makes a rendered child too large, and so the fix."""
    if path.startswith("metadata.annotations") or path == "data":
        return ("; the stage's engineArgs and env make it too large (it is recorded whole for the next "
                "update): make them smaller")
    return ""


def _shown(value: Any) -> str:
    return "nothing" if value is None else shown(value)

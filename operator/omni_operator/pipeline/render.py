"""The desired children of an OmniPipeline: a pure function of the validated spec.

Rendered objects hold only the fields the operator owns. They omit empty values, because the
API server drops them too and a difference that can never go away would mean a write on
every reconcile.

Two lifetimes:
- the current revision's workload of each stage (``P-S-REV``: ConfigMap, Deployment and, for
  a receiving stage, its KV Service), which only that revision's senders reach. The
  Deployment is rendered without ``replicas``: how many pods each revision has at each step
  of a rollout is the rollout's (``rollout.py``), not the spec's;
- the stable children, whatever the revision: the stage's Service ``P-S`` (its API) and
  PodDisruptionBudget, the pipeline's NetworkPolicy and PodMonitor, and for an autoscaled
  stage its OmniStageScaler ``P-S`` (the autoscaler's scale target) with the autoscaler
  itself, a KEDA ScaledObject or a HorizontalPodAutoscaler (both are rendered; the reconcile
  applies the one the cluster serves).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from omni_contract import edges
from omni_contract.metrics import EDGE_ACTIVE, OLDEST_START, STREAMS, TRANSFERS

from omni_operator import API_VERSION, KIND

from . import naming
from .kinds import CONFIGMAP, DEPLOYMENT, HPA, NETWORKPOLICY, PDB, PODMONITOR, SCALEDOBJECT, SERVICE, STAGESCALER
from .model import GPU_RESOURCE, Metric, Pipeline, Stage
from .stage_config import config_hash, dump_stage_config, render_endpoint_config, render_stage_config

RUN_AS_USER = 1000  # the restricted Pod Security profile asks for a non-root user
STARTUP_BUDGET_SECONDS = 1800  # loading a large model from a cold cache can take many minutes
#: On SIGTERM omni-stage drains for the transfer deadline (its grace period), then gives vLLM
#: this long to tear down before it kills it (omni_runtime/stages/ar.py STOP_TIMEOUT_S) ...
STOP_BEYOND_GRACE_SECONDS = 30
#: ... and the kubelet's SIGKILL comes this much later still, so it never cuts that short.
KILL_MARGIN_SECONDS = 15


def owner_reference(pipeline: Pipeline) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": pipeline.name,
        "uid": pipeline.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(pipeline: Pipeline, name: str, stage: str | None, revision: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pipeline.namespace,
        "labels": naming.common_labels(pipeline.name, stage, revision),
        "ownerReferences": [owner_reference(pipeline)],
    }


@dataclass(frozen=True)
class ClusterSettings:
    """What the operator is told about its cluster, which the rendering follows besides the
    spec (hashable: admission memoises on it)."""

    #: Where the operator's own pods are (both or neither): the pipelines' NetworkPolicy lets
    #: them reach the stages' http port, whose /metrics transfer health reads.
    operator_namespace: str | None = None
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    #: Labels every PodMonitor carries besides the operator's own, for a Prometheus that
    #: selects PodMonitors by label (kube-prometheus-stack's: ``release: <its release>``).
    podmonitor_labels: tuple[tuple[str, str], ...] = ()


def render_children(pipeline: Pipeline, *, podmonitor_available: bool,
                    cluster: ClusterSettings = ClusterSettings(),
                    keda_available: bool | None = None) -> list[dict[str, Any]]:
    """Every child the pipeline should have, in apply order. ``cluster``: what the operator
    is told about its cluster (ClusterSettings). ``keda_available``: which autoscaler an
    autoscaled stage gets (None: both, as admission checks them; the reconcile keeps the one
    the cluster serves)."""
    children: list[dict[str, Any]] = []
    shape = pipeline.endpoint_stages
    entry = shape[0].name if shape is not None else None
    for stage in pipeline.stages:
        config_text = dump_stage_config(render_stage_config(pipeline, stage.name))
        endpoint_text = None
        if stage.name == entry:
            # The pipeline's endpoint, beside its entry stage: it reaches that stage in its
            # own pod, and each stage reaches it at the pod's address.
            endpoint_text = dump_stage_config(render_endpoint_config(
                pipeline, f"http://127.0.0.1:{naming.HTTP_PORT}",
                f"http://${{{naming.POD_IP_ENV}}}:{naming.ENDPOINT_PORT}"))
        children.append(render_configmap(pipeline, stage, config_text, endpoint_text))
        children.append(render_service(pipeline, stage))
        if stage.inputs:  # a receiving stage: its revision's KV Service
            children.append(render_kv_service(pipeline, stage))
        text_hash = config_hash(config_text + (endpoint_text or ""))
        children.append(render_deployment(pipeline, stage, text_hash))
        children.append(render_pdb(pipeline, stage))
    children.append(render_networkpolicy(pipeline, cluster))
    if podmonitor_available and pipeline.observability.metrics:
        children.append(render_podmonitor(pipeline, cluster))
    for stage in pipeline.stages:
        if stage.autoscaling is not None:
            children.append(render_stage_scaler(pipeline, stage))
            if keda_available is not False:
                children.append(render_scaledobject(pipeline, stage))
            if keda_available is not True:
                children.append(render_hpa(pipeline, stage))
    return children


def render_configmap(pipeline: Pipeline, stage: Stage, config_text: str,
                     endpoint_text: str | None = None) -> dict[str, Any]:
    data = {naming.CONFIG_KEY: config_text}
    if endpoint_text is not None:
        data[naming.ENDPOINT_CONFIG_KEY] = endpoint_text
    return {
        "apiVersion": CONFIGMAP.api_version,
        "kind": CONFIGMAP.kind,
        "metadata": _metadata(pipeline, naming.revision_name(pipeline.name, stage.name, pipeline.revision),
                              stage.name, pipeline.revision),
        "data": data,
    }


def render_service(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    """The stage's stable Service: its API (``http``) on the stage's ready pods of every
    revision, so clients keep one address across rollouts. Its ``kv`` port is what KV
    endpoints named before revisions existed; the current ones name a revision's KV Service."""
    return {
        "apiVersion": SERVICE.api_version,
        "kind": SERVICE.kind,
        "metadata": _metadata(pipeline, naming.stage_name(pipeline.name, stage.name), stage.name),
        "spec": {
            "type": "ClusterIP",
            "selector": naming.selector_labels(pipeline.name, stage.name),
            "ports": [
                {"name": "http", "port": naming.HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "kv", "port": naming.KV_PORT, "targetPort": "kv", "protocol": "TCP"},
                *([{"name": "endpoint", "port": naming.ENDPOINT_PORT, "targetPort": "endpoint",
                    "protocol": "TCP"}] if _is_entry(pipeline, stage) else []),
            ],
        },
    }


def _is_entry(pipeline: Pipeline, stage: Stage) -> bool:
    """Whether the pipeline's endpoint runs beside this stage (its entry stage)."""
    shape = pipeline.endpoint_stages
    return shape is not None and shape[0].name == stage.name


def render_kv_service(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    """A receiving stage's KV Service for one revision: the senders of that revision name it
    in their stage config, so they only ever reach receivers of their own revision. Headless:
    its name resolves to every ready pod, and a sender spreads the stage's requests over
    them (a ClusterIP Service would balance connections, so one sender rank's requests would
    all go to one replica)."""
    return {
        "apiVersion": SERVICE.api_version,
        "kind": SERVICE.kind,
        "metadata": _metadata(pipeline, naming.revision_name(pipeline.name, stage.name, pipeline.revision),
                              stage.name, pipeline.revision),
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "None",
            "selector": naming.selector_labels(pipeline.name, stage.name, pipeline.revision),
            "ports": [{"name": "kv", "port": naming.KV_PORT, "targetPort": "kv", "protocol": "TCP"}],
        },
    }


def render_pdb(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    # maxUnavailable (not minAvailable) so a single-replica stage still lets nodes drain.
    return {
        "apiVersion": PDB.api_version,
        "kind": PDB.kind,
        "metadata": _metadata(pipeline, naming.stage_name(pipeline.name, stage.name), stage.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": naming.selector_labels(pipeline.name, stage.name)},
        },
    }


def render_networkpolicy(pipeline: Pipeline, cluster: ClusterSettings = ClusterSettings()) -> dict[str, Any]:
    pods = {"matchLabels": naming.selector_labels(pipeline.name)}
    ingress: list[dict[str, Any]] = [
        # KV caches are only accepted from the pipeline's own stages.
        {"from": [{"podSelector": pods}], "ports": [{"protocol": "TCP", "port": naming.KV_PORT}]},
        # The KV bytes themselves, and the control after the handshake: a receiving stage's
        # NIXL agent reads the sender's registered memory, and the two agents notify each other
        # (both ways), over UCX, which (on TCP) listens in this range only (UCX_TCP_PORT_RANGE,
        # set on every stage container): the pipeline's own pods alone may reach it.
        {"from": [{"podSelector": pods}],
         "ports": [{"protocol": "TCP", "port": naming.KV_DATA_PORTS[0], "endPort": naming.KV_DATA_PORTS[1]}]},
        # The HTTP API and /metrics stay reachable for clients and Prometheus, and so does the
        # pipeline's endpoint (clients; the stages' links to it).
        {"ports": [{"protocol": "TCP", "port": naming.HTTP_PORT},
                   {"protocol": "TCP", "port": naming.ENDPOINT_PORT}]},
    ]
    if cluster.operator_namespace and cluster.operator_pod_labels:
        # The operator reads each stage pod's /metrics on the http port (transfer health):
        # stated on its own, so that it still holds where the rule above is narrowed, and
        # no other port (the kv port stays the stages' alone).
        ingress.append({
            "from": [{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": cluster.operator_namespace}},
                "podSelector": {"matchLabels": dict(cluster.operator_pod_labels)},
            }],
            "ports": [{"protocol": "TCP", "port": naming.HTTP_PORT}],
        })
    return {
        "apiVersion": NETWORKPOLICY.api_version,
        "kind": NETWORKPOLICY.kind,
        "metadata": _metadata(pipeline, pipeline.name, None),
        "spec": {
            "podSelector": pods,
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def prometheus_label_name(name: str) -> str:
    """A Kubernetes label key as Prometheus' service discovery spells it in `__meta_*` labels
    (every character other than a letter, digit or underscore becomes an underscore)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def pod_label_meta(label: str) -> str:
    """The `__meta_kubernetes_pod_label_*` source label of a pod label."""
    return f"__meta_kubernetes_pod_label_{prometheus_label_name(label)}"


# Target labels each stage's series get, and where they come from. The alerts and dashboards
# identify a stage by namespace, pipeline and stage (and pod); the Prometheus Operator adds
# namespace and pod by default, stated here too so the PodMonitor does not depend on it.
PODMONITOR_TARGET_LABELS = {
    "namespace": "__meta_kubernetes_namespace",
    "pod": "__meta_kubernetes_pod_name",
    "pipeline": pod_label_meta(naming.PIPELINE_LABEL),
    "stage": pod_label_meta(naming.STAGE_LABEL),
    "revision": pod_label_meta(naming.REVISION_LABEL),
}


def render_podmonitor(pipeline: Pipeline, cluster: ClusterSettings = ClusterSettings()) -> dict[str, Any]:
    endpoint = {
        "port": "http",
        "path": "/metrics",
        "interval": "15s",
        # The runtime's omni_kv_* series carry their own `stage` (the same value as the pod
        # label): keep it, rather than have Prometheus rename it to `exported_stage`.
        "honorLabels": True,
        "relabelings": [
            {"action": "replace", "sourceLabels": [source], "targetLabel": target}
            for target, source in PODMONITOR_TARGET_LABELS.items()
        ],
    }
    return {
        "apiVersion": PODMONITOR.api_version,
        "kind": PODMONITOR.kind,
        "metadata": _podmonitor_metadata(pipeline, cluster),
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(pipeline.name)},
            "podMetricsEndpoints": [endpoint],
        },
    }



def _podmonitor_metadata(pipeline: Pipeline, cluster: ClusterSettings) -> dict[str, Any]:
    metadata = _metadata(pipeline, pipeline.name, None)
    if cluster.podmonitor_labels:  # the operator's own labels are never replaced (refused at its start)
        metadata["labels"] = dict(cluster.podmonitor_labels) | metadata["labels"]
    return metadata

def _env(pipeline: Pipeline, stage: Stage) -> list[dict[str, Any]]:
    return operator_env(pipeline, stage) + [dict(item) for item in stage.env]


def operator_env(pipeline: Pipeline, stage: Stage) -> list[dict[str, Any]]:
    """The environment the operator gives a stage's container, before the stage's own
    ``env``: a name here is the operator's (the check refuses it in ``env``, where it would
    replace this value: Kubernetes keeps a name's last entry)."""
    downstream = [naming.kv_endpoint(pipeline.name, s, pipeline.namespace, pipeline.revision)
                  for s in pipeline.downstream_of(stage.name)]
    env: list[dict[str, Any]] = [
        {"name": "OMNI_PIPELINE", "value": pipeline.name},
        {"name": "OMNI_STAGE", "value": stage.name},
        {"name": "OMNI_REVISION", "value": pipeline.revision},
        {"name": "OMNI_STAGE_ROLE", "value": stage.role},
        {"name": "OMNI_STAGE_CONFIG", "value": naming.CONFIG_PATH},
        {"name": "OMNI_DOWNSTREAM_ENDPOINTS", "value": ",".join(downstream)},
        {"name": "OMNI_POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
        {"name": "OMNI_POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
        # The pods run as a non-root user with no home directory; caches go to the /tmp volume.
        {"name": "HOME", "value": "/tmp"},
        # UCX (under NIXL) listens for KV reads only where the NetworkPolicy lets the
        # pipeline's pods in; the CRD refuses the name in stages[].env.
        {"name": naming.KV_DATA_PORT_RANGE_ENV, "value": naming.KV_DATA_PORT_RANGE},
    ]
    if pipeline.model.cache_claim:
        env.append({"name": "HF_HOME", "value": f"{pipeline.model.cache_mount_path}/huggingface"})
    if pipeline.model.hub_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": pipeline.model.hub_token_secret, "key": pipeline.model.hub_token_key}}})
    if pipeline.observability.otlp_endpoint:
        env += [
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": pipeline.observability.otlp_endpoint},
            {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": "http/protobuf"},
            {"name": "OTEL_SERVICE_NAME", "value": naming.stage_name(pipeline.name, stage.name)},
            {"name": "OTEL_RESOURCE_ATTRIBUTES",
             "value": f"omni.pipeline={pipeline.name},omni.stage={stage.name},omni.revision={pipeline.revision},"
                      f"k8s.namespace.name={pipeline.namespace}"},
        ]
    return env


def _resources(stage: Stage) -> dict[str, Any]:
    resources = {section: dict(values) for section, values in stage.resources.items() if values}
    if stage.gpus > 0:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(stage.gpus)
        if "requests" in resources:  # extended resources need requests == limits when both are set
            resources["requests"][GPU_RESOURCE] = str(stage.gpus)
    return resources


def _probe(period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
        "successThreshold": 1,
    }


def render_deployment(pipeline: Pipeline, stage: Stage, stage_config_hash: str) -> dict[str, Any]:
    """The stage's workload of the current revision, without ``replicas`` (the rollout's)."""
    name = naming.revision_name(pipeline.name, stage.name, pipeline.revision)
    container: dict[str, Any] = {
        "name": "stage",
        "image": stage.image,
        "imagePullPolicy": pipeline.image_pull_policy,
        "command": ["omni-stage", "--config", naming.CONFIG_PATH],
        "ports": [
            {"name": "http", "containerPort": naming.HTTP_PORT, "protocol": "TCP"},
            {"name": "kv", "containerPort": naming.KV_PORT, "protocol": "TCP"},
        ],
        "env": _env(pipeline, stage),
        "resources": _resources(stage),
        "startupProbe": _probe(10, STARTUP_BUDGET_SECONDS // 10, 5),
        "readinessProbe": _probe(10, 3, 5),
        "livenessProbe": _probe(20, 6, 10),
        "volumeMounts": [
            {"name": "stage-config", "mountPath": naming.CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            # Everything the stage writes goes to /tmp and /dev/shm (emptyDirs above); the
            # image keeps every cache there (tests/images runs it exactly so).
            "readOnlyRootFilesystem": True,
        },
    }
    volumes: list[dict[str, Any]] = [
        {"name": "stage-config", "configMap": {"name": name}},  # the revision's ConfigMap
        # vLLM and NCCL need a large shared-memory segment; the container default is 64Mi.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": stage.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if pipeline.model.cache_claim:
        container["volumeMounts"].append({"name": "model-cache", "mountPath": pipeline.model.cache_mount_path,
                                          "readOnly": pipeline.model.cache_read_only})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {
            "claimName": pipeline.model.cache_claim, "readOnly": pipeline.model.cache_read_only}})
    tolerations = [dict(t) for t in stage.tolerations]
    if stage.gpus > 0 and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule.
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    containers = [container]
    if _is_entry(pipeline, stage):
        containers.append(_endpoint_container(pipeline, stage, container))
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        # No API access needed by a stage; no service-link variables (VLLM_PORT-like names
        # injected for Services break vLLM's own environment parsing).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": drain_seconds(pipeline, stage) + STOP_BEYOND_GRACE_SECONDS
        + KILL_MARGIN_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if stage.node_selector:
        pod_spec["nodeSelector"] = dict(stage.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if pipeline.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in pipeline.image_pull_secrets]
    if pipeline.service_account:
        pod_spec["serviceAccountName"] = pipeline.service_account
    # The stage's own limits also bound a pod template change within a revision (GPUs are
    # scarce: a GPU stage is replaced in place rather than surging onto GPUs that may not exist).
    rolling = {"maxSurge": stage.rollout.max_surge, "maxUnavailable": stage.rollout.max_unavailable}
    metadata = _metadata(pipeline, name, stage.name, pipeline.revision)
    # The revision's graph, read back from its own objects while it drains (rollout.py).
    metadata["annotations"] = {naming.INPUTS_ANNOTATION: ",".join(stage.inputs),
                               naming.SENDS_ANNOTATION: "true" if stage.kv.send else "false"}
    return {
        "apiVersion": DEPLOYMENT.api_version,
        "kind": DEPLOYMENT.kind,
        "metadata": metadata,
        "spec": {
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": STARTUP_BUDGET_SECONDS,
            "selector": {"matchLabels": naming.selector_labels(pipeline.name, stage.name, pipeline.revision)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": {
                "metadata": {
                    "labels": naming.common_labels(pipeline.name, stage.name, pipeline.revision),
                    "annotations": {
                        # A changed stage config changes the pod template, so the pods roll.
                        naming.CONFIG_HASH_ANNOTATION: stage_config_hash,
                        "kubectl.kubernetes.io/default-container": "stage",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def drain_seconds(pipeline: Pipeline, stage: Stage) -> int:
    """How long a stopping pod of the stage may drain: its transfers' deadline, or, at either
    end of a streamed edge, the longest whole-stream deadline of its streamed edges if longer
    (a stream open when SIGTERM comes, or when a scale-in picks the pod, may run that long; the
    kubelet never cuts the drain short of it)."""
    streams = [pipeline.stage(d).edge_from(stage.name).stream for d in pipeline.downstream_of(stage.name)]
    streams += [edge.stream for edge in stage.streams]
    return math.ceil(edges.drain_seconds(stage.kv.timeout_seconds, streams))


def _endpoint_container(pipeline: Pipeline, stage: Stage, stage_container: Mapping[str, Any]
                        ) -> dict[str, Any]:
    """The pipeline's endpoint beside its entry stage (runtime: omni_runtime/pipeline/
    endpoint.py): a small asyncio server, the stage's image and security."""
    probe = {"httpGet": {"path": "/health", "port": "endpoint", "scheme": "HTTP"},
             "timeoutSeconds": 5, "successThreshold": 1}
    otel = [e for e in _env(pipeline, stage) if e["name"].startswith("OTEL_")]
    for item in otel:
        if item["name"] == "OTEL_SERVICE_NAME":
            item["value"] = f"{pipeline.name}-endpoint"
    return {
        "name": "endpoint",
        "image": stage.image,
        "imagePullPolicy": pipeline.image_pull_policy,
        "command": ["omni-stage", "--config", f"{naming.CONFIG_DIR}/{naming.ENDPOINT_CONFIG_KEY}"],
        "ports": [{"name": "endpoint", "containerPort": naming.ENDPOINT_PORT, "protocol": "TCP"}],
        "env": [
            {"name": naming.POD_IP_ENV, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
            {"name": "HOME", "value": "/tmp"},
            *otel,
        ],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 6},
        "volumeMounts": [m for m in stage_container["volumeMounts"]
                         if m["name"] in ("stage-config", "tmp")],
        "securityContext": dict(stage_container["securityContext"]),
    }


# ---------------------------------------------------------------------------- autoscaling
#: Each signal: the PromQL KEDA's trigger runs (labels as the operator's PodMonitor sets them;
#: ``{sel}`` the stage's series, ``{to}`` the series of the stages sending to it, ``{streams}``
#: the series its stream producers report for their streams toward it), the external
#: metric name an HPA asks the metrics adapter for (docs/operator.md gives the adapter's rules),
#: and the target type: the total over the stage's pods divided by the target is the replicas
#: (AverageValue), or, for an age, the value itself against the target (Value).
SIGNALS: dict[str, tuple[str, str, str]] = {
    "queuedRequests": ("sum(vllm:num_requests_waiting{{{sel}}})", "omni_stage_queued_requests", "AverageValue"),
    "kvCacheUsage": ("sum(vllm:kv_cache_usage_perc{{{sel}}})", "omni_stage_kv_cache_usage", "AverageValue"),
    "pendingTransfers": ("sum(" + TRANSFERS.name + '{{{sel},state="pending"}})', "omni_stage_pending_transfers",
                         "AverageValue"),
    "heldTransfers": ("sum(" + TRANSFERS.name + '{{{sel},state="held"}})', "omni_stage_held_transfers",
                      "AverageValue"),
    "oldestPendingTransferSeconds": (
        "max(time() - (" + OLDEST_START.name + '{{{sel},state="pending"}} > 0)) or vector(0)',
        "omni_stage_oldest_pending_transfer_seconds", "Value"),
    "incomingTransfers": ("sum(" + EDGE_ACTIVE.name + "{{{to}}})", "omni_stage_incoming_transfers",
                          "AverageValue"),
    # The producers' own series (stage == from_stage): a stream counted once, at the end that
    # sends it, whatever the consumer's end reports.
    "openStreams": ("sum(" + STREAMS.name + '{{{streams},state="open"}})', "omni_stage_open_streams",
                    "AverageValue"),
}


def signal_query(pipeline: Pipeline, stage: Stage, signal: str) -> str:
    """The PromQL of one autoscaling signal of one stage."""
    where = f'namespace="{pipeline.namespace}",pipeline="{pipeline.name}"'
    producers = "|".join(edge.stage for edge in stage.streams)  # stage names: nothing special in a regex
    return SIGNALS[signal][0].format(sel=f'{where},stage="{stage.name}"', to=f'{where},to_stage="{stage.name}"',
                                     streams=f'{where},to_stage="{stage.name}",stage=~"{producers}"')


def _number(value: float) -> str:
    """A target as a plain decimal (KEDA parses a float; Kubernetes a quantity: both take it)."""
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text or "0"


def _scale_target(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    return {"apiVersion": STAGESCALER.api_version, "kind": STAGESCALER.kind,
            "name": naming.stage_name(pipeline.name, stage.name)}


def render_stage_scaler(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    """The stable scale target of the stage's autoscaler. ``spec.replicas`` is not rendered:
    the autoscaler owns it (the reconcile sets it once, when it creates the object)."""
    return {
        "apiVersion": STAGESCALER.api_version,
        "kind": STAGESCALER.kind,
        "metadata": _metadata(pipeline, naming.stage_name(pipeline.name, stage.name), stage.name),
        "spec": {"pipeline": pipeline.name, "stage": stage.name},
    }


def render_hpa(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    """An autoscaling/v2 HorizontalPodAutoscaler on the stage's OmniStageScaler, its signals
    as External metrics (a metrics adapter serves them from Prometheus). An HPA cannot scale
    to zero (without the alpha HPAScaleToZero gate): its minReplicas is at least 1."""
    assert stage.autoscaling is not None
    metrics = []
    for metric in stage.autoscaling.metrics:
        _, name, target_type = SIGNALS[metric.signal]
        target = ({"type": "AverageValue", "averageValue": _number(metric.target)} if target_type == "AverageValue"
                  else {"type": "Value", "value": _number(metric.target)})
        metrics.append({"type": "External", "external": {
            "metric": {"name": name, "selector": {"matchLabels": {"pipeline": pipeline.name, "stage": stage.name}}},
            "target": target}})
    return {
        "apiVersion": HPA.api_version,
        "kind": HPA.kind,
        "metadata": _metadata(pipeline, naming.stage_name(pipeline.name, stage.name), stage.name),
        "spec": {
            "scaleTargetRef": _scale_target(pipeline, stage),
            "minReplicas": max(1, stage.autoscaling.min_replicas),
            "maxReplicas": stage.autoscaling.max_replicas,
            "metrics": metrics,
        },
    }


def render_scaledobject(pipeline: Pipeline, stage: Stage) -> dict[str, Any]:
    """A KEDA ScaledObject on the stage's OmniStageScaler, one Prometheus trigger per signal;
    minReplicas 0 scales a generation stage to zero (KEDA activates it when a signal rises)."""
    assert stage.autoscaling is not None
    triggers = []
    for metric in stage.autoscaling.metrics:
        triggers.append({
            "type": "prometheus",
            "name": _trigger_name(metric),
            "metricType": SIGNALS[metric.signal][2],
            "metadata": {"serverAddress": pipeline.observability.prometheus_url,
                         "query": signal_query(pipeline, stage, metric.signal),
                         "threshold": _number(metric.target)},
        })
    return {
        "apiVersion": SCALEDOBJECT.api_version,
        "kind": SCALEDOBJECT.kind,
        "metadata": _metadata(pipeline, naming.scaledobject_name(pipeline.name, stage.name), stage.name),
        "spec": {
            "scaleTargetRef": _scale_target(pipeline, stage),
            "minReplicaCount": stage.autoscaling.min_replicas,
            "maxReplicaCount": stage.autoscaling.max_replicas,
            "triggers": triggers,
        },
    }


def _trigger_name(metric: Metric) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", metric.signal).lower()

"""Names and labels of the children, in one place so every module agrees on them."""
from __future__ import annotations

import hashlib

from omni_contract.ports import ENDPOINT_PORT, HTTP_PORT, KV_PORT

#: The pipeline's endpoint runs as a container beside the entry stage's, on ENDPOINT_PORT,
#: with its config under this key of the entry stage's ConfigMap.
ENDPOINT_CONFIG_KEY = "endpoint.yaml"
#: The endpoint container's own address (the downward API's status.podIP), which its config
#: names as ``${POD_IP}`` for the stages' links to reach that replica.
POD_IP_ENV = "POD_IP"
#: The KV data plane's ports (inclusive): NIXL reads the KV blocks over UCX, and over TCP (no
#: RDMA) UCX listens on ports of its own, which UCX_TCP_PORT_RANGE confines to this range
#: (measured: about 2 ports per NIXL agent, one agent per tensor-parallel rank). Every stage
#: container gets the variable; the pipeline's NetworkPolicy opens the range to its own pods.
KV_DATA_PORTS = (9700, 9731)
KV_DATA_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"
#: The variable's value, UCX's syntax: "FIRST-LAST".
KV_DATA_PORT_RANGE = f"{KV_DATA_PORTS[0]}-{KV_DATA_PORTS[1]}"
CONFIG_DIR = "/etc/omni"
CONFIG_KEY = "stage.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"

MANAGER = "omni-operator"
#: The label that says the operator made an object (with MANAGER): its children carry it.
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
PIPELINE_LABEL = "omnipipeline.dev/pipeline"
STAGE_LABEL = "omnipipeline.dev/stage"
REVISION_LABEL = "omnipipeline.dev/revision"
CONFIG_HASH_ANNOTATION = "omnipipeline.dev/config-hash"
LAST_APPLIED_ANNOTATION = "omnipipeline.dev/last-applied"
#: On a revision's Deployment: the stage's upstream stages and whether it sends KV, so that an
#: old revision's graph is read from its own objects (the spec only tells the current one's).
INPUTS_ANNOTATION = "omnipipeline.dev/inputs"
SENDS_ANNOTATION = "omnipipeline.dev/sends-kv"
#: On an OmniPipeline (set by its user): the vLLM version its stages' images run, where an
#: image's tag does not name it (`model.stage_vllm_version`).
VLLM_VERSION_ANNOTATION = "omnipipeline.dev/vllm-version"
#: A Kubernetes object name (a DNS-1035 label, as a Service name must be) is at most this long.
MAX_NAME = 63
#: A KEDA ScaledObject's name: KEDA names its HPA ``keda-hpa-NAME`` (and labels it with NAME),
#: so newer KEDA's webhook refuses a name longer than 63 - len("keda-hpa-").
MAX_SCALEDOBJECT_NAME = MAX_NAME - len("keda-hpa-")


def stage_name(pipeline: str, stage: str) -> str:
    """Name of a stage's Deployment, Service, ConfigMap and PodDisruptionBudget."""
    return f"{pipeline}-{stage}"


def _fitted(base: str, limit: int, tail: str = "") -> str:
    """``base-tail`` (or ``base``) within ``limit`` characters: where it passes, ``base`` is
    cut and a hash of it keeps two names apart (``base-HASH6-tail``)."""
    ending = f"-{tail}" if tail else ""
    if len(base) + len(ending) <= limit:
        return base + ending
    digest = hashlib.sha256(base.encode()).hexdigest()[:6]
    keep = limit - len(ending) - len(digest) - 1
    return f"{base[:keep].rstrip('-')}-{digest}{ending}"


def revision_name(pipeline: str, stage: str, revision: str) -> str:
    """Name of one revision's workload of a stage (its Deployment, ConfigMap and KV Service):
    ``P-S-REVISION``; where that passes 63 characters, ``P-S`` is cut and a hash of it keeps
    two stages apart (``P-S`` itself always fits: the CRD refuses longer)."""
    return _fitted(stage_name(pipeline, stage), MAX_NAME, revision)


def scaledobject_name(pipeline: str, stage: str) -> str:
    """Name of a stage's KEDA ScaledObject: ``P-S``, cut as revision names are cut where it
    passes 54 characters (``P-S`` cut, then a hash of it), so that KEDA's HPA name
    ``keda-hpa-NAME`` fits 63."""
    return _fitted(stage_name(pipeline, stage), MAX_SCALEDOBJECT_NAME)


def pipeline_endpoint(pipeline: str, entry: str, namespace: str) -> str:
    """The URL a client uses for the whole pipeline: the endpoint's port on the entry stage's
    stable Service (its pods run the endpoint beside the stage)."""
    return f"http://{stage_name(pipeline, entry)}.{namespace}.svc:{ENDPOINT_PORT}"


def kv_endpoint(pipeline: str, stage: str, namespace: str, revision: str | None = None) -> str:
    """host:port of a stage's KV receiver: through its revision's KV Service (a sender only
    ever reaches receivers of its own revision), or the stage's stable Service."""
    name = revision_name(pipeline, stage, revision) if revision else stage_name(pipeline, stage)
    return f"{name}.{namespace}.svc:{KV_PORT}"


def selector_labels(pipeline: str, stage: str | None = None, revision: str | None = None) -> dict[str, str]:
    """Labels that select a pipeline's pods (all of them, one stage's, or one stage's of one
    revision)."""
    labels = {PIPELINE_LABEL: pipeline}
    if stage is not None:
        labels[STAGE_LABEL] = stage
    if revision is not None:
        labels[REVISION_LABEL] = revision
    return labels


#: Every child of every pipeline (whatever its pipeline): what the children's watches and the
#: resync's lists ask the API server for, so that no other object of the cluster is listed.
CHILDREN_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGER},{PIPELINE_LABEL}"


def common_labels(pipeline: str, stage: str | None = None, revision: str | None = None) -> dict[str, str]:
    """The standard app.kubernetes.io labels plus the selector labels."""
    labels = {
        "app.kubernetes.io/name": "omni-stage",
        "app.kubernetes.io/instance": pipeline,
        "app.kubernetes.io/part-of": "omni-pipeline",
        MANAGED_BY_LABEL: MANAGER,
    }
    if stage is not None:
        labels["app.kubernetes.io/component"] = stage
    labels.update(selector_labels(pipeline, stage, revision))
    return labels

#: The pod annotation by which a ReplicaSet scaling in removes the pods of lowest cost first
#: (Kubernetes 1.22+, beta, on by default); the operator sets it on stage pods from their open
#: streams (deletion_cost.py).
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

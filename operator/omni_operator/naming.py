"""Names and labels of the children, in one place so every module agrees on them."""
from __future__ import annotations

HTTP_PORT = 8000
KV_PORT = 9600
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
PIPELINE_LABEL = "omnipipeline.dev/pipeline"
STAGE_LABEL = "omnipipeline.dev/stage"
CONFIG_HASH_ANNOTATION = "omnipipeline.dev/config-hash"
LAST_APPLIED_ANNOTATION = "omnipipeline.dev/last-applied"


def stage_name(pipeline: str, stage: str) -> str:
    """Name of a stage's Deployment, Service, ConfigMap and PodDisruptionBudget."""
    return f"{pipeline}-{stage}"


def kv_endpoint(pipeline: str, stage: str, namespace: str) -> str:
    """host:port of a stage's KV receiver, through its Service."""
    return f"{stage_name(pipeline, stage)}.{namespace}.svc:{KV_PORT}"


def selector_labels(pipeline: str, stage: str | None = None) -> dict[str, str]:
    """Labels that select a pipeline's pods (all of them, or one stage's)."""
    labels = {PIPELINE_LABEL: pipeline}
    if stage is not None:
        labels[STAGE_LABEL] = stage
    return labels


def common_labels(pipeline: str, stage: str | None = None) -> dict[str, str]:
    """The standard app.kubernetes.io labels plus the selector labels."""
    labels = {
        "app.kubernetes.io/name": "omni-stage",
        "app.kubernetes.io/instance": pipeline,
        "app.kubernetes.io/part-of": "omni-pipeline",
        "app.kubernetes.io/managed-by": MANAGER,
    }
    if stage is not None:
        labels["app.kubernetes.io/component"] = stage
    labels.update(selector_labels(pipeline, stage))
    return labels

"""The kinds of child objects the operator manages, and where their API lives."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    kind: str
    api_version: str  # "v1", "apps/v1", ...
    plural: str
    optional: bool = False  # served only when an add-on's CRDs are installed
    #: Fields the API server takes at creation only (immutable after): a live object keeps
    #: its own, and a patch never asks to change them.
    create_only: tuple[tuple[str, ...], ...] = ()

    @property
    def group(self) -> str:
        """The API group ("" for the core group)."""
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def base_path(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"

    def collection_path(self, namespace: str) -> str:
        return f"{self.base_path}/namespaces/{namespace}/{self.plural}"

    def object_path(self, namespace: str, name: str) -> str:
        return f"{self.collection_path(namespace)}/{name}"


CONFIGMAP = Kind("ConfigMap", "v1", "configmaps")
SERVICE = Kind("Service", "v1", "services", create_only=(("spec", "clusterIP"),))
DEPLOYMENT = Kind("Deployment", "apps/v1", "deployments")
PDB = Kind("PodDisruptionBudget", "policy/v1", "poddisruptionbudgets")
NETWORKPOLICY = Kind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies")
PODMONITOR = Kind("PodMonitor", "monitoring.coreos.com/v1", "podmonitors", optional=True)
#: An autoscaled stage's replica count: the stable scale target of its autoscaler (our CRD).
STAGESCALER = Kind("OmniStageScaler", "omnipipeline.dev/v1alpha1", "omnistagescalers")
HPA = Kind("HorizontalPodAutoscaler", "autoscaling/v2", "horizontalpodautoscalers")
SCALEDOBJECT = Kind("ScaledObject", "keda.sh/v1alpha1", "scaledobjects", optional=True)
EVENT = Kind("Event", "v1", "events")
POD = Kind("Pod", "v1", "pods")

# Apply order: a stage's ConfigMap before the Deployment that mounts it; a scaler before the
# autoscaler that targets it.
CHILD_KINDS = (CONFIGMAP, SERVICE, DEPLOYMENT, PDB, NETWORKPOLICY, PODMONITOR, STAGESCALER, HPA, SCALEDOBJECT)
BY_KIND = {k.kind: k for k in CHILD_KINDS}

"""A small generic REST layer over the official `kubernetes` client.

It speaks raw JSON (no model classes): the apply path compares dicts field by field, and a
typed round trip would drop or reshape fields. Authentication, TLS and configuration stay
with `kubernetes.client.ApiClient`. Every call is counted by verb and kind.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Any, Callable
from urllib.parse import urlencode

import kubernetes

from omni_operator import API_VERSION, PLURAL
from omni_operator.pipeline.kinds import Kind

ApiException = kubernetes.client.exceptions.ApiException
MERGE_PATCH = "application/merge-patch+json"
PIPELINE_BASE = f"/apis/{API_VERSION}"
#: (connect, read) seconds for every call: an API server that hangs fails the call (the
#: reconcile errs and kopf retries it) instead of holding one of the writes in flight forever.
REQUEST_TIMEOUT = (5.0, 30.0)


def load_configuration() -> kubernetes.client.Configuration:
    """In-cluster service account when running in a pod, else the kubeconfig ($KUBECONFIG)."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=configuration)
    return configuration


class Kube:
    """Raw-JSON Kubernetes calls; thread-safe (kopf runs sync handlers in a thread pool)."""

    def __init__(self, api_client: kubernetes.client.ApiClient, on_call: Callable[[str, str], None] | None = None,
                 request_timeout: tuple[float, float] = REQUEST_TIMEOUT):
        self.api_client = api_client
        self._on_call = on_call
        self.request_timeout = request_timeout
        self._lock = threading.Lock()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    @classmethod
    def from_environment(cls, **kwargs: Any) -> "Kube":
        return cls(kubernetes.client.ApiClient(load_configuration()), **kwargs)

    @property
    def writes(self) -> int:
        with self._lock:
            return sum(n for (verb, _), n in self.calls.items() if verb in ("create", "patch", "delete"))

    def close(self) -> None:
        self.api_client.close()

    def request(self, verb: str, kind: str, method: str, path: str, *, query: dict[str, str] | None = None,
                body: Any = None, content_type: str | None = None) -> Any:
        with self._lock:
            self.calls[(verb, kind)] += 1
        if self._on_call is not None:
            self._on_call(verb, kind)
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        if query:
            path = f"{path}?{urlencode(query)}"
        method, url, headers, _, _ = self.api_client.param_serialize(
            method=method, resource_path=path, header_params=headers, auth_settings=["BearerToken"],
        )
        # The body is already JSON-ready (plain dicts): the REST client serialises it as it is,
        # without the generated client's per-value sanitising walk.
        response = self.api_client.call_api(method, url, headers, body, _request_timeout=self.request_timeout)
        response.read()
        if not 200 <= response.status < 300:
            raise ApiException(http_resp=response)
        return json.loads(response.data) if response.data else None

    # Children -------------------------------------------------------------------------------
    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("get", kind.kind, "GET", kind.object_path(namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: Kind, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = self.request("list", kind.kind, "GET", kind.collection_path(namespace),
                              query={"labelSelector": label_selector})
        return list(result.get("items") or [])

    def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("create", kind.kind, "POST", kind.collection_path(namespace), body=body)

    def patch(self, kind: Kind, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("patch", kind.kind, "PATCH", kind.object_path(namespace, name),
                            body=patch, content_type=MERGE_PATCH)

    def patch_status(self, kind: Kind, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Patch the status subresource of a child (an OmniStageScaler's)."""
        return self.request("patch", kind.kind, "PATCH", kind.object_path(namespace, name) + "/status",
                            body=patch, content_type=MERGE_PATCH)

    def delete(self, kind: Kind, namespace: str, name: str) -> None:
        try:
            # Background: the Deployment goes at once, the garbage collector removes its pods.
            self.request("delete", kind.kind, "DELETE", kind.object_path(namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiException as exc:
            if exc.status != 404:
                raise

    def serves(self, kind: Kind) -> bool:
        """Whether the API server serves this kind (for add-ons such as the Prometheus Operator)."""
        try:
            result = self.request("discover", kind.kind, "GET", kind.base_path)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == kind.plural for r in (result or {}).get("resources", []))

    # The OmniPipeline itself ---------------------------------------------------------------
    def get_pipeline(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("get", "OmniPipeline", "GET", f"{PIPELINE_BASE}/namespaces/{namespace}/{PLURAL}/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_pipelines(self, namespace: str | None) -> list[dict[str, Any]]:
        path = f"{PIPELINE_BASE}/namespaces/{namespace}/{PLURAL}" if namespace else f"{PIPELINE_BASE}/{PLURAL}"
        return list((self.request("list", "OmniPipeline", "GET", path) or {}).get("items") or [])

    def patch_pipeline_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("patch", "OmniPipeline", "PATCH",
                            f"{PIPELINE_BASE}/namespaces/{namespace}/{PLURAL}/{name}/status",
                            body=patch, content_type=MERGE_PATCH)

    # Stage pods (read on the resync timer, for their metrics' addresses) ---------------------
    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        result = self.request("list", "Pod", "GET", f"/api/v1/namespaces/{namespace}/pods",
                              query={"labelSelector": label_selector})
        return list((result or {}).get("items") or [])

    def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A stage pod's annotations (its deletion cost: deletion_cost.py), by merge patch."""
        return self.request("patch", "Pod", "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}",
                            body=patch, content_type=MERGE_PATCH)

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("create", "Event", "POST", f"/api/v1/namespaces/{namespace}/events", body=body)

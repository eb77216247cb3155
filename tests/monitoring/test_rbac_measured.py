"""The chart's RBAC, measured: the real operator (kopf, its handlers, the reconciler, the
resync timer) runs a scripted session against the operator tests' API emulator, which
answers every call the chart's rendered ClusterRole or Roles do not allow with 403, as
Kubernetes' RBAC authorizer would, and records every call (its audit log).

The session must succeed under those rules with no call refused (so they cover every call
the operator makes), and its calls must use every rule the chart grants (so it grants
nothing the operator does not use). The upper bound, that the rules equal the permissions
the operator's code can ask for, is test_chart.py::test_rbac_grants_exactly_what_the_operator_calls;
the two sets are also compared here.

A refused call matters even where kopf tolerates it: refused the Namespace and CRD watches
of its cluster observation, kopf retries each for about a minute before falling back, and
handles no events meanwhile (a namespaced install ran on the resync timer alone).
"""
from __future__ import annotations

import contextlib
import copy

import pytest

from k8s_emulator import ApiCall, EmulatorThread
from metrics_pages import PageServer, ar_page, create_pod
from omnip_support import (NAMESPACE, OPERATOR_TOKEN, RunningOperator, complete_rollout, create_pipeline,
                           make_kube, patch_pipeline, pipeline_body, status, wait_for, workload)
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import BY_KIND, CHILD_KINDS, DEPLOYMENT, EVENT, SCALEDOBJECT, STAGESCALER
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.pipeline.render import render_children

from . import operator_permissions
from .chart import NAMESPACE as RELEASE_NAMESPACE
from .chart import by_kind, one, render

Permission = operator_permissions.Permission


class ChartAuthorizer:
    """RBAC over the chart's rendered objects, for the operator's service account."""

    def __init__(self, objects: list[dict]):
        sa = one(objects, "ServiceAccount")["metadata"]["name"]
        subject = {"kind": "ServiceAccount", "name": sa, "namespace": RELEASE_NAMESPACE}

        def bound(kind: str, name: str, namespace: str | None) -> bool:
            binding = "ClusterRoleBinding" if kind == "ClusterRole" else "RoleBinding"
            return any(b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}
                       and subject in b["subjects"] and b["metadata"].get("namespace") == namespace
                       for b in by_kind(objects, binding))

        self.cluster: set[Permission] = set()
        for role in by_kind(objects, "ClusterRole"):
            if bound("ClusterRole", role["metadata"]["name"], None):
                self.cluster |= operator_permissions.granted(role["rules"])
        self.namespaced: dict[str, set[Permission]] = {}
        for role in by_kind(objects, "Role"):
            ns = role["metadata"]["namespace"]
            if bound("Role", role["metadata"]["name"], ns):
                self.namespaced.setdefault(ns, set()).update(operator_permissions.granted(role["rules"]))
        self.granted = self.cluster | set().union(*self.namespaced.values())

    def __call__(self, call: ApiCall) -> bool:
        if call.user != OPERATOR_TOKEN:
            return True  # the test's own client: a cluster admin
        if call.verb is None:
            return True  # discovery (/api, /apis/<group>/<version>): system:discovery, every account
        perm = (call.group, call.resource, call.verb)
        if perm in self.cluster:
            return True
        return call.namespace is not None and perm in self.namespaced.get(call.namespace, set())


def permission(call: ApiCall) -> Permission:
    return (call.group, call.resource, call.verb)


def scripted_session(authorize: ChartAuthorizer, clusterwide: bool, keda: bool) -> list[ApiCall]:
    """Create, adopt, update, break, repair and delete a pipeline with an autoscaled stage (its
    autoscaler a KEDA ScaledObject where ``keda``, else an HPA); the operator's calls."""
    # the Prometheus Operator's CRDs are served, and KEDA's in one of the two sessions
    page = PageServer(ar_page("talker", streams={("thinker", "talker"): {"open": 3}}))
    with EmulatorThread(podmonitors=True, keda=keda) as emu, _stopping(page):
        emu.emulator.authorize = authorize
        user = make_kube(emu.url, "cluster-admin")
        user.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        # The pipeline exists before the operator starts (it resumes it), with children left
        # by an earlier operator: under old names (no longer wanted: deleted), and one stage's
        # and the pipeline's own children without the managed-by label (the operator's list
        # misses them; its create conflicts, it reads them and adopts them with a patch).
        body = pipeline_body()
        body["spec"]["stages"][2]["autoscaling"] = {"maxReplicas": 3, "metrics": [{"signal": "incomingTransfers",
                                                                                   "target": 2}]}
        created = create_pipeline(user, body)
        thinker = workload("thinker", body)
        adopt = {thinker, "tiny", "tiny-code2wav"}
        for child in render_children(parse_pipeline(created), podmonitor_available=True, keda_available=keda):
            kind = BY_KIND[child["kind"]]
            leftover = copy.deepcopy(child)
            leftover["metadata"]["name"] += "-old"
            user.create(kind, NAMESPACE, leftover)
            if child["metadata"]["name"] in adopt:
                unlabelled = copy.deepcopy(child)
                del unlabelled["metadata"]["labels"]["app.kubernetes.io/managed-by"]
                user.create(kind, NAMESPACE, unlabelled)
        op = RunningOperator(emu.url, [] if clusterwide else [NAMESPACE], resync_seconds=0.5).start()
        try:
            wait_for(lambda: status(user).get("stagesReady") == "0/3", what="the first status")
            wait_for(lambda: not [o for k in CHILD_KINDS if k is not SCALEDOBJECT or keda
                                  for o in user.list(k, NAMESPACE, "") if o["metadata"]["name"].endswith("-old")],
                     what="the leftovers deleted")
            adopted = user.get(DEPLOYMENT, NAMESPACE, thinker)
            assert adopted["metadata"]["labels"]["app.kubernetes.io/managed-by"] == naming.MANAGER
            # The autoscaled stage's scaler: created with the stage's count, its status written.
            wait_for(lambda: (user.get(STAGESCALER, NAMESPACE, "tiny-code2wav").get("status") or {}).get("selector"),
                     what="the scaler's status")
            # The Deployment controller's part: a rollout completes; the status follows.
            complete_rollout(user, "code2wav")
            wait_for(lambda: status(user).get("stagesReady") == "1/3", what="one stage ready")
            # Update one stage; then an invalid spec (a cycle): Ready=False and a Warning event.
            stages = copy.deepcopy(body["spec"]["stages"])
            stages[1]["replicas"] = 2
            patch_pipeline(user, "tiny", {"spec": {"stages": stages}})
            wait_for(lambda: user.get(DEPLOYMENT, NAMESPACE, workload("talker", body))["spec"]["replicas"] == 2,
                     what="the update applied")
            stages[0]["inputs"] = ["code2wav"]
            patch_pipeline(user, "tiny", {"spec": {"stages": stages}})
            wait_for(lambda: status(user).get("phase") == "Failed", what="the invalid spec reported")
            events = user.request("list", "Event", "GET", EVENT.collection_path(NAMESPACE))["items"]
            assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in events)
            # A hand edit is put back; then the pipeline goes.
            del stages[0]["inputs"]
            patch_pipeline(user, "tiny", {"spec": {"stages": stages}})
            wait_for(lambda: status(user).get("phase") == "Progressing", what="the spec valid again")
            # A resync round with the pipeline present reads its stage pods' metrics (list pods),
            # and sets the deletion cost of a pod with streams open (patch pods).
            create_pod(user, "tiny", "talker", "tiny-talker-busy", page.port)
            wait_for(lambda: any(c.verb == "list" and c.resource == "pods" for c in emu.calls(OPERATOR_TOKEN)),
                     what="a resync round's list of the stage pods")
            wait_for(lambda: any(c.verb == "patch" and c.resource == "pods" for c in emu.calls(OPERATOR_TOKEN)),
                     what="a resync round's deletion cost of the busy pod")
            user.patch(DEPLOYMENT, NAMESPACE, workload("talker", body), {"spec": {"replicas": 5}})
            wait_for(lambda: user.get(DEPLOYMENT, NAMESPACE, workload("talker", body))["spec"]["replicas"] == 2,
                     what="the hand edit reverted")
            user.request("delete", "OmniPipeline", "DELETE",
                         f"/apis/omnipipeline.dev/v1alpha1/namespaces/{NAMESPACE}/omnipipelines/tiny")
            wait_for(lambda: op.metrics.pipelines.labels("Progressing")._value.get() == 0,
                     what="the pipeline forgotten")
            # The resync timer has had its turn too (a list of the watched pipelines).
            wait_for(lambda: any(c.verb == "list" and c.resource == "omnipipelines"
                                 for c in emu.calls(OPERATOR_TOKEN)), what="a resync round")
        finally:
            op.stop()  # raises what the operator's thread raised
            user.close()
        # Under enough permission nothing fails: a refusal would count as a reconcile error
        # (and shows in the audit log, asserted below).
        assert op.metrics.reconciles.labels("error")._value.get() == 0
        return emu.calls(OPERATOR_TOKEN)


@contextlib.contextmanager
def _stopping(server: PageServer):
    try:
        yield server
    finally:
        server.stop()


MODES = {"cluster-wide": (True, {}), "namespaced": (False, {"watch": {"namespaces": [NAMESPACE]}})}


@pytest.fixture(scope="module", params=list(MODES), ids=list(MODES))
def measured(request):
    clusterwide, values = MODES[request.param]
    authorize = ChartAuthorizer(render(values))
    # Without KEDA an autoscaled stage gets an HPA, with it a ScaledObject: both sessions' calls.
    calls = scripted_session(authorize, clusterwide, keda=False) + scripted_session(authorize, clusterwide, keda=True)
    return clusterwide, authorize, calls


def test_the_operator_works_under_the_charts_rbac_and_uses_all_of_it(measured):
    clusterwide, authorize, calls = measured
    resource_calls = [c for c in calls if c.verb is not None]
    assert resource_calls, "the session recorded no calls"
    assert [c for c in resource_calls if not c.allowed] == []
    used = {permission(c) for c in resource_calls if c.allowed}
    # Every call made is covered (tautological given the 403s, which the session survived),
    # and every rule granted was used: nothing beyond what the operator calls.
    assert used <= authorize.granted
    assert authorize.granted - used == set()
    if not clusterwide:  # only kopf's observation leaves the watched namespace
        assert {c.namespace for c in resource_calls if permission(c) in authorize.cluster} == {None}
        assert {c.namespace for c in resource_calls if permission(c) not in authorize.cluster} == {NAMESPACE}


def test_the_measured_rules_equal_the_code_derived_ones(measured):
    clusterwide, authorize, calls = measured
    used = {permission(c) for c in calls if c.verb is not None and c.allowed}
    assert used == operator_permissions.required(clusterwide)


def test_the_authorizer_refuses_what_the_chart_does_not_grant():
    """The 403s above have teeth: a call outside the rules is refused, one inside is not."""
    cluster, namespaced = ChartAuthorizer(render()), ChartAuthorizer(render(MODES["namespaced"][1]))
    secrets = ApiCall(OPERATOR_TOKEN, "get", "", "secrets", NAMESPACE)
    deployments = ApiCall(OPERATOR_TOKEN, "patch", "apps", "deployments", NAMESPACE)
    elsewhere = ApiCall(OPERATOR_TOKEN, "patch", "apps", "deployments", "kube-system")
    all_namespaces = ApiCall(OPERATOR_TOKEN, "list", "apps", "deployments", None)
    assert not cluster(secrets) and cluster(deployments) and cluster(elsewhere) and cluster(all_namespaces)
    assert not namespaced(secrets) and namespaced(deployments)
    assert not namespaced(elsewhere) and not namespaced(all_namespaces)

"""The reconciler's cache of the children (controller/children.py): what the watches and the
writes report goes in, newer over older; a reconcile an event started reads it instead of
listing; the resync timer's fresh lists repair what it missed."""
from __future__ import annotations

import copy
import random

import pytest

from omnip_support import (NAMESPACE, OPERATOR_TOKEN, create_pipeline, make_kube, pipeline_body, status, wait_for,
                           workload)
from omni_operator.controller.children import ChildCache
from omni_operator.controller.kube import ApiException
from omni_operator.controller.reconcile import Reconciler
from omni_operator.controller.resync import Resync
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CHILD_KINDS, CONFIGMAP, DEPLOYMENT, PDB, SERVICE


def child(name: str, version: str, pipeline: str | None = "p", kind: str = "Service", **extra) -> dict:
    labels = {naming.MANAGED_BY_LABEL: naming.MANAGER}
    if pipeline is not None:
        labels[naming.PIPELINE_LABEL] = pipeline
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "resourceVersion": version,
                                       "labels": labels}, **extra}


def test_nothing_is_read_before_the_first_listing_is_in():
    cache = ChildCache()
    cache.saw(child("a", "1"))
    assert cache.children("ns", "p") is None
    cache.mark_ready()
    assert list(cache.children("ns", "p")) == [("Service", "a")]


def test_a_newer_report_replaces_an_older_one_and_never_the_other_way_round():
    cache = ChildCache()
    cache.mark_ready()
    cache.saw(child("a", "5", spec={"v": "written"}))  # the reconciler's write, answered
    cache.saw(child("a", "4", spec={"v": "trailing event"}))  # the watch's event before it
    assert cache.children("ns", "p")[("Service", "a")]["spec"] == {"v": "written"}
    cache.saw(child("a", "6", spec={"v": "edited"}))
    assert cache.children("ns", "p")[("Service", "a")]["spec"] == {"v": "edited"}


def test_the_deletion_of_an_older_object_leaves_the_one_made_since():
    cache = ChildCache()
    cache.mark_ready()
    cache.saw(child("a", "10"))  # made again after a deletion whose event trails
    cache.gone(child("a", "7"))
    assert ("Service", "a") in cache.children("ns", "p")
    cache.gone(child("a", "10"))
    assert cache.children("ns", "p") == {}
    # The reconciler's own delete carries no version: whatever is stored goes.
    cache.saw(child("b", "11"))
    cache.gone({"metadata": {"name": "b", "namespace": "ns"}}, "Service")
    assert cache.children("ns", "p") == {} and len(cache) == 0


def test_a_child_relabelled_moves_and_one_unlabelled_leaves():
    cache = ChildCache()
    cache.mark_ready()
    cache.saw(child("a", "1"))
    cache.saw(child("a", "2", pipeline="q"))
    assert cache.children("ns", "p") == {} and list(cache.children("ns", "q")) == [("Service", "a")]
    cache.saw(child("a", "3", pipeline=None))
    assert cache.children("ns", "q") == {} and len(cache) == 0


def test_the_servers_field_ownership_records_are_not_kept():
    cache = ChildCache()
    cache.mark_ready()
    reported = child("a", "1")
    reported["metadata"]["managedFields"] = [{"manager": "omni-operator", "fieldsV1": {"f:spec": {}}}]
    cache.saw(reported)
    kept = cache.children("ns", "p")[("Service", "a")]
    assert "managedFields" not in kept["metadata"] and kept["metadata"]["resourceVersion"] == "1"
    assert "managedFields" in reported["metadata"]  # the report itself is left as it was


def test_fresh_lists_replace_what_was_filed_for_their_kinds_alone():
    cache = ChildCache()
    cache.mark_ready()
    cache.saw(child("ghost", "1"))
    cache.saw(child("d", "2", kind="Deployment"))
    listed = child("s", "3")
    del listed["kind"]  # a list's items do not say their kind
    cache.replace("ns", ["Service"], [{"kind": "Service", **listed}], pipeline="p")
    assert sorted(cache.children("ns", "p")) == [("Deployment", "d"), ("Service", "s")]
    cache.forget("ns", "p")
    assert cache.children("ns", "p") == {} and len(cache) == 0


def test_a_namespaces_fresh_lists_replace_every_pipelines_entries_there_and_no_others():
    cache = ChildCache()
    cache.mark_ready()
    cache.saw(child("ghost", "1"))
    cache.saw(child("kept", "2", pipeline="q", kind="Deployment"))
    elsewhere = child("other-ns", "3")
    elsewhere["metadata"]["namespace"] = "ns2"
    cache.saw(elsewhere)
    cache.replace("ns", ["Service"], [child("s", "4", pipeline="q")])
    assert cache.children("ns", "p") == {}
    assert sorted(cache.children("ns", "q")) == [("Deployment", "kept"), ("Service", "s")]
    assert list(cache.children("ns2", "p")) == [("Service", "other-ns")]


@pytest.fixture
def cached(kube, emulator):
    """A reconciler with a ready cache and nothing to feed it (no kopf: a test of the
    reconciler alone), and the pipeline it reconciles, created."""
    create_pipeline(kube, pipeline_body())
    client = make_kube(emulator.url, OPERATOR_TOKEN)
    cache = ChildCache()
    cache.mark_ready()
    reconciler = Reconciler(client, children=cache)
    yield reconciler
    reconciler.close()
    client.close()


def test_a_reconcile_reads_the_cache_and_the_fresh_one_repairs_what_it_missed(kube, emulator, cached):
    """Without kopf (a test of the reconciler alone): the cache is told what the reconciler
    wrote and what its fresh lists found, nothing else; a child deleted behind its back is
    what a watch gap would leave in it."""
    assert cached.reconcile(NAMESPACE, "tiny").result == "applied"
    assert len(cached.children.children(NAMESPACE, "tiny")) == 15  # each create's answer went in
    mark = len(emulator.calls(OPERATOR_TOKEN))
    assert cached.reconcile(NAMESPACE, "tiny").result == "unchanged"
    calls = emulator.calls(OPERATOR_TOKEN)[mark:]
    assert [(c.verb, c.resource) for c in calls] == [("get", "omnipipelines")]

    kube.delete(SERVICE, NAMESPACE, "tiny-thinker")  # no watch tells the cache
    assert cached.reconcile(NAMESPACE, "tiny").result == "unchanged"
    assert kube.get(SERVICE, NAMESPACE, "tiny-thinker") is None
    mark = len(emulator.calls(OPERATOR_TOKEN))
    outcome = cached.reconcile(NAMESPACE, "tiny", fresh=True)
    assert outcome.changed == ["create Service/tiny-thinker"]
    lists = [c.resource for c in emulator.calls(OPERATOR_TOKEN)[mark:] if c.verb == "list"]
    assert len(lists) == len(CHILD_KINDS) - 2  # no PodMonitor or ScaledObject served here
    assert kube.get(SERVICE, NAMESPACE, "tiny-thinker") is not None
    assert cached.reconcile(NAMESPACE, "tiny").result == "unchanged"


def test_the_resync_lists_each_kind_once_for_a_namespace_and_repairs_what_the_cache_missed(kube, emulator, cached):
    """The resync timer's round with the cache: one LIST per child kind for the namespace (not
    per kind and pipeline), the cache's entries replaced with it, then every pipeline
    reconciled from the cache: a child deleted behind its back is made again."""
    for name in ("second", "third"):
        create_pipeline(kube, pipeline_body(name=name))
    for name in ("tiny", "second", "third"):
        assert cached.reconcile(NAMESPACE, name).result == "applied"
    kube.delete(SERVICE, NAMESPACE, "third-thinker")  # no watch tells the cache
    assert cached.reconcile(NAMESPACE, "third").result == "unchanged"  # it does not know
    mark = len(emulator.calls(OPERATOR_TOKEN))
    Resync(cached, [NAMESPACE], interval=3600).run_once()
    calls = emulator.calls(OPERATOR_TOKEN)[mark:]
    lists = sorted(c.resource for c in calls if c.verb == "list")
    served = sorted(kind.plural for kind in CHILD_KINDS if kind.kind not in ("PodMonitor", "ScaledObject"))
    assert lists == sorted(served + ["omnipipelines"]), lists
    assert kube.get(SERVICE, NAMESPACE, "third-thinker") is not None
    assert [(c.verb, c.resource) for c in calls if c.verb in ("create", "patch", "delete")] == [
        ("create", "services")]


def test_a_child_the_cache_still_holds_but_the_server_lost_is_made_again(kube, cached):
    """A patch of a child gone since the cache last heard of it (its deletion's event not in
    yet) answers 404: the reconcile makes the child again instead of failing (a reconcile an
    event started is not retried before the resync timer's)."""
    cached.reconcile(NAMESPACE, "tiny")
    service = kube.get(SERVICE, NAMESPACE, "tiny-thinker")
    kube.delete(SERVICE, NAMESPACE, "tiny-thinker")
    # What the watch said just before the deletion: an edit the reconcile will undo.
    edited = copy.deepcopy(service)
    edited["metadata"]["resourceVersion"] = str(int(service["metadata"]["resourceVersion"]) + 1)
    edited["spec"]["selector"] = {"edited": "yes"}
    cached.children.saw(edited, "Service")
    outcome = cached.reconcile(NAMESPACE, "tiny")
    assert outcome.changed == ["create Service/tiny-thinker"], outcome
    assert kube.get(SERVICE, NAMESPACE, "tiny-thinker")["spec"] == service["spec"]
    assert cached.reconcile(NAMESPACE, "tiny").result == "unchanged"


def test_the_running_operator_repairs_a_child_from_its_watches_without_listing(kube, start_operator, emulator):
    start_operator()
    create_pipeline(kube, pipeline_body())
    wait_for(lambda: status(kube).get("stagesReady") == "0/3", what="the first status")
    mark = len(emulator.calls(OPERATOR_TOKEN))
    kube.patch(DEPLOYMENT, NAMESPACE, workload("code2wav"), {"spec": {"replicas": 7}})
    wait_for(lambda: kube.get(DEPLOYMENT, NAMESPACE, workload("code2wav"))["spec"]["replicas"] == 1,
             what="replicas put back")
    kube.delete(SERVICE, NAMESPACE, "tiny-thinker")
    wait_for(lambda: kube.get(SERVICE, NAMESPACE, "tiny-thinker"), what="the Service re-created")
    calls = emulator.calls(OPERATOR_TOKEN)[mark:]
    assert [c for c in calls if c.verb in ("patch", "create") and c.resource in ("deployments", "services")]
    assert not [c for c in calls if c.verb == "list"], "a reconcile an event started listed children"


def _state(kube, pipeline: str) -> dict:
    """What the operator owns of a pipeline's children, as a user sees it: each child's name
    and the part of it the operator sets (a Deployment's spec but its replicas, a Service's
    spec, a ConfigMap's data, a budget's spec)."""
    seen = {}
    for kind in (CONFIGMAP, DEPLOYMENT, PDB, SERVICE):
        for obj in kube.list(kind, NAMESPACE, f"{naming.PIPELINE_LABEL}={pipeline}"):
            part = obj.get("data") if kind is CONFIGMAP else dict(obj.get("spec") or {})
            if kind is DEPLOYMENT:
                # A sender held at 0 until its receivers are ready counts as started once it
                # has replicas (an edit to them starts it): the rollout's to say, which the
                # fresh reconcile at the end checks.
                part.pop("replicas", None)
            seen[(kind.kind, obj["metadata"]["name"])] = part
    return seen


def test_a_burst_of_edits_and_deletions_behind_its_back_converges_to_what_a_fresh_reconcile_keeps(
        kube, start_operator, emulator):
    """Edits and deletions of children of two pipelines, 40 in a burst with no wait between
    them (the watches' events trail them, the cache is behind): the running operator ends
    with every child back as it made it, and a reconcile from fresh lists then finds nothing
    to change (the cache's view and the server's agree)."""
    start_operator()
    pipelines = ("tiny", "other")
    for name in pipelines:
        create_pipeline(kube, pipeline_body(name=name))
    for name in pipelines:
        wait_for(lambda: status(kube, name).get("stagesReady") == "0/3", what=f"{name}'s first status")
    made = {name: _state(kube, name) for name in pipelines}
    assert all(len(state) >= 10 for state in made.values()), made
    rng = random.Random(20261207)
    for _ in range(40):
        name = rng.choice(pipelines)
        kind_name, _ = rng.choice(sorted(made[name].items()))
        kind = {k.kind: k for k in (CONFIGMAP, DEPLOYMENT, PDB, SERVICE)}[kind_name[0]]
        action = rng.choice(("edit", "edit", "delete"))
        try:
            if action == "delete":
                kube.delete(kind, NAMESPACE, kind_name[1])
            elif kind is DEPLOYMENT:
                kube.patch(kind, NAMESPACE, kind_name[1], {"spec": {"replicas": rng.randint(2, 9)}})
            elif kind is CONFIGMAP:
                kube.patch(kind, NAMESPACE, kind_name[1], {"data": {"stage.yaml": "stage: edited\n"}})
            else:
                kube.patch(kind, NAMESPACE, kind_name[1], {"spec": {"selector": {"edited": "yes"}}})
        except ApiException as exc:
            assert exc.status == 404  # deleted a moment ago, not re-created yet
    for name in pipelines:
        try:
            wait_for(lambda: _state(kube, name) == made[name], timeout=60, what=f"{name}'s children put back")
        except AssertionError:
            now = _state(kube, name)
            raise AssertionError({k: (made[name].get(k), now.get(k)) for k in set(now) | set(made[name])
                                  if now.get(k) != made[name].get(k)})
    client = make_kube(emulator.url, OPERATOR_TOKEN)
    oracle = Reconciler(client)
    try:
        for name in pipelines:
            outcome = oracle.reconcile(NAMESPACE, name, fresh=True)
            assert outcome.changed == [], outcome
    finally:
        oracle.close()
        client.close()

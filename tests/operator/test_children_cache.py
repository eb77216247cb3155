"""The reconciler's cache of the children (controller/children.py): what the watches and the
writes report goes in, newer over older; a reconcile an event started reads it instead of
listing; the resync timer's fresh lists repair what it missed."""
from __future__ import annotations

from omnip_support import (NAMESPACE, OPERATOR_TOKEN, create_pipeline, make_kube, pipeline_body, status, wait_for,
                           workload)
from omni_operator.controller.children import ChildCache
from omni_operator.controller.reconcile import Reconciler
from omni_operator.pipeline import naming
from omni_operator.pipeline.kinds import CHILD_KINDS, DEPLOYMENT, SERVICE


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


def test_fresh_lists_replace_what_was_filed_for_their_kinds_alone():
    cache = ChildCache()
    cache.mark_ready()
    cache.saw(child("ghost", "1"))
    cache.saw(child("d", "2", kind="Deployment"))
    listed = child("s", "3")
    del listed["kind"]  # a list's items do not say their kind
    cache.replace("ns", "p", ["Service"], [{"kind": "Service", **listed}])
    assert sorted(cache.children("ns", "p")) == [("Deployment", "d"), ("Service", "s")]
    cache.forget("ns", "p")
    assert cache.children("ns", "p") == {} and len(cache) == 0


def test_a_reconcile_reads_the_cache_and_the_fresh_one_repairs_what_it_missed(kube, emulator):
    """Without kopf (a test of the reconciler alone): the cache is told what the reconciler
    wrote and what its fresh lists found, nothing else; a child deleted behind its back is
    what a watch gap would leave in it."""
    create_pipeline(kube, pipeline_body())
    client = make_kube(emulator.url, OPERATOR_TOKEN)
    cache = ChildCache()
    cache.mark_ready()
    reconciler = Reconciler(client, children=cache)
    try:
        assert reconciler.reconcile(NAMESPACE, "tiny").result == "applied"
        assert len(cache.children(NAMESPACE, "tiny")) == 15  # each create's answer went in
        mark = len(emulator.calls(OPERATOR_TOKEN))
        assert reconciler.reconcile(NAMESPACE, "tiny").result == "unchanged"
        calls = emulator.calls(OPERATOR_TOKEN)[mark:]
        assert [(c.verb, c.resource) for c in calls] == [("get", "omnipipelines")]

        kube.delete(SERVICE, NAMESPACE, "tiny-thinker")  # no watch tells the cache
        assert reconciler.reconcile(NAMESPACE, "tiny").result == "unchanged"
        assert kube.get(SERVICE, NAMESPACE, "tiny-thinker") is None
        mark = len(emulator.calls(OPERATOR_TOKEN))
        outcome = reconciler.reconcile(NAMESPACE, "tiny", fresh=True)
        assert outcome.changed == ["create Service/tiny-thinker"]
        lists = [c.resource for c in emulator.calls(OPERATOR_TOKEN)[mark:] if c.verb == "list"]
        assert len(lists) == len(CHILD_KINDS) - 2  # no PodMonitor or ScaledObject served here
        assert kube.get(SERVICE, NAMESPACE, "tiny-thinker") is not None
        assert reconciler.reconcile(NAMESPACE, "tiny").result == "unchanged"
    finally:
        reconciler.close()
        client.close()


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

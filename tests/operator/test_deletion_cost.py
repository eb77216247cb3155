"""Scale-in removes idle replicas first (issue 49): each stage pod's
``controller.kubernetes.io/pod-deletion-cost`` from the streams open at it, set on the resync
timer where it changed, pure from the reading and then against the API emulator with pods
whose /metrics are PageServers."""
from __future__ import annotations

import dataclasses

import pytest

from metrics_pages import PageServer, ar_page, create_pod
from omni_operator.controller import deletion_cost
from omni_operator.health.reader import PodMetricsSource, TransferHealth
from omni_operator.pipeline.naming import POD_DELETION_COST
from omni_operator.controller.reconcile import Reconciler
from omni_operator.controller.resync import Resync
from omnip_support import NAMESPACE, make_kube
from test_stream_health import EDGE, streamed_body
from test_transfers import reading

from omnip_support import create_pipeline


@pytest.mark.parametrize("open_streams, cost", [
    (0, 0), (0.5, 0), (1, 1), (2, 2), (4, 2), (5, 5), (9, 5), (10, 10), (64, 50), (999, 500),
    (10 ** 6, 10000)])
def test_the_cost_is_the_open_streams_rounded_down_to_a_step(open_streams, cost):
    assert deletion_cost.cost(open_streams) == cost


def talker_pages(**open_by_pod: float) -> dict[str, dict[str, str]]:
    return {"talker": {pod: ar_page("talker", streams={EDGE: {"open": n, "waiting": 0}})
                       for pod, n in open_by_pod.items()}}


def with_costs(r, **current):
    return dataclasses.replace(r, deletion_costs=current)


def test_pods_with_open_streams_get_their_cost_and_idle_ones_none():
    r = with_costs(reading(talker_pages(**{"talker-0": 3, "talker-1": 0, "talker-2": 12})),
                   **{"talker-0": None, "talker-1": None, "talker-2": "5"})
    assert deletion_cost.desired(r) == {"talker-0": 2, "talker-1": 0, "talker-2": 10}
    assert deletion_cost.patches(r) == {
        "talker-0": {"metadata": {"annotations": {POD_DELETION_COST: "2"}}},
        "talker-2": {"metadata": {"annotations": {POD_DELETION_COST: "10"}}}}


def test_nothing_is_written_while_a_pods_load_stays_within_its_step():
    r = with_costs(reading(talker_pages(**{"talker-0": 7, "talker-1": 0})),
                   **{"talker-0": "5", "talker-1": None})
    assert deletion_cost.patches(r) == {}


def test_a_pod_whose_streams_ended_loses_its_cost_and_an_unread_one_counts_as_idle():
    r = with_costs(reading(talker_pages(**{"talker-0": 0})),
                   **{"talker-0": "5", "talker-1": "2"})  # talker-1: listed, not read
    assert deletion_cost.patches(r) == {
        "talker-0": {"metadata": {"annotations": {POD_DELETION_COST: None}}},
        "talker-1": {"metadata": {"annotations": {POD_DELETION_COST: None}}}}


def test_both_ends_count_and_without_a_pod_list_nothing_is_written():
    both = {"talker": {"talker-0": ar_page("talker", streams={
        EDGE: {"open": 1}, ("talker", "code2wav"): {"open": 1}})}}
    assert deletion_cost.desired(with_costs(reading(both), **{"talker-0": None})) == {"talker-0": 2}
    assert deletion_cost.patches(reading(both)) == {}  # the Prometheus reader lists no pods


# -- at the emulator -----------------------------------------------------------------------------

@pytest.fixture
def servers():
    made: list[PageServer] = []
    yield made
    for server in made:
        server.stop()


def pod_cost(kube, name: str) -> str | None:
    pod = kube.request("get", "Pod", "GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    return (pod["metadata"].get("annotations") or {}).get(POD_DELETION_COST)


def test_the_resync_sets_the_cost_of_busy_consumers_once_and_clears_it(kube, emulator, servers):
    create_pipeline(kube, streamed_body())
    pages = {"talker-0": ar_page("talker", streams={EDGE: {"open": 6}}),
             "talker-1": ar_page("talker", streams={EDGE: {"open": 0}}),
             "thinker-0": ar_page("thinker", streams={EDGE: {"open": 6}})}
    by_pod = {}
    for pod, page in pages.items():
        by_pod[pod] = PageServer(page)
        servers.append(by_pod[pod])
        create_pod(kube, "tiny", pod.rsplit("-", 1)[0], f"tiny-{pod}", by_pod[pod].port)
    client = make_kube(emulator.url)
    health = TransferHealth(PodMetricsSource(client, timeout=2.0))
    resync = Resync(Reconciler(client, health=health), [NAMESPACE], interval=3600)
    try:
        resync.run_once()
        # The busy consumer and its producer get a cost; the idle replica none: a scale-in of
        # the talker removes tiny-talker-1 first.
        assert pod_cost(kube, "tiny-talker-0") == "5" and pod_cost(kube, "tiny-thinker-0") == "5"
        assert pod_cost(kube, "tiny-talker-1") is None
        # Nothing changed: nothing written.
        writes = client.writes
        resync.run_once()
        assert client.writes == writes
        # Its streams ended: the cost goes; the other replica's load rose.
        by_pod["talker-0"].page = ar_page("talker", streams={EDGE: {"open": 0}})
        by_pod["talker-1"].page = ar_page("talker", streams={EDGE: {"open": 1}})
        resync.run_once()
        assert pod_cost(kube, "tiny-talker-0") is None and pod_cost(kube, "tiny-talker-1") == "1"
    finally:
        health.close()
        client.close()
